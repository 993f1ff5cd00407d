//! The FP8 separate path's prefill chunks: each chunk's requests have their
//! whole KV (context + query) gathered and up-converted into a BF16
//! workspace of `workspace_rows` rows before the BF16 prefill kernel runs.

use std::ops::Range;

use crate::error::{PlanError, Result};

/// One prefill request of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillRequest {
    /// New tokens this step.
    pub query_len: u64,
    /// Tokens already in the KV cache before this step.
    pub context_len: u64,
}

impl PrefillRequest {
    /// KV rows the request's last query token can attend to.
    pub fn seq_len(&self) -> u64 {
        self.context_len + self.query_len
    }
}

/// One gather into the workspace and the prefill launch(es) that read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatherChunk {
    /// Whole requests `[start, end)`, their KV rows laid end to end.
    Requests { requests: Range<usize>, rows: u64 },
    /// Part of one request too long for the workspace: its query rows
    /// `query` (relative to the request's first new token) attend to the
    /// KV window `keys` only. The launches of one query range cover its keys
    /// in consecutive windows; their outputs are merged by log-sum-exp.
    Split { request: usize, query: Range<u64>, keys: Range<u64> },
}

impl GatherChunk {
    /// Rows this chunk gathers into the workspace.
    pub fn rows(&self) -> u64 {
        match self {
            GatherChunk::Requests { rows, .. } => *rows,
            GatherChunk::Split { keys, .. } => keys.end - keys.start,
        }
    }
}

fn check_workspace(workspace_rows: u64) -> Result<()> {
    if workspace_rows == 0 {
        return Err(PlanError::InvalidArgument {
            what: "workspace_rows",
            rule: "at least 1",
            got: "0".into(),
        });
    }
    Ok(())
}

/// Greedy runs of contiguous requests whose rows fit the workspace, one
/// request at least per run: vLLM's `split_prefill_chunks` contract. A
/// request longer than the workspace ends up alone in its run.
fn greedy_runs(seq_lens: &[u64], workspace_rows: u64) -> Vec<(Range<usize>, u64)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < seq_lens.len() {
        let (start, mut rows) = (i, 0u64);
        while i < seq_lens.len() && rows.saturating_add(seq_lens[i]) <= workspace_rows {
            rows += seq_lens[i];
            i += 1;
        }
        if i == start {
            // Oversize: vLLM asserts here; the caller decides.
            rows = seq_lens[i];
            i += 1;
        }
        runs.push((start..i, rows));
    }
    runs
}

/// vLLM's `split_prefill_chunks`: the same request ranges wherever vLLM's
/// assertion (every request fits the workspace) holds; an error naming the
/// request where it does not.
pub fn split_prefill_chunks(seq_lens: &[u64], workspace_rows: u64) -> Result<Vec<Range<usize>>> {
    check_workspace(workspace_rows)?;
    if let Some(request) = seq_lens.iter().position(|&s| s > workspace_rows) {
        return Err(PlanError::WorkspaceTooSmall {
            request,
            what: "the gather workspace",
            needed: seq_lens[request],
            available: workspace_rows,
            hint: "pass the query lengths (plan_gather_chunks) so the request is split instead".into(),
        });
    }
    Ok(greedy_runs(seq_lens, workspace_rows).into_iter().map(|(r, _)| r).collect())
}

/// Gather chunks for a prefill set: [`split_prefill_chunks`] where every
/// request fits; a request that does not is cut into query pieces aligned
/// to key windows of `workspace_rows` rows (a query at position `p` sees keys
/// `[0, p]`), so no gather exceeds the workspace. An oversize request with no
/// new tokens needs no launch and gets none.
pub fn plan_gather_chunks(requests: &[PrefillRequest], workspace_rows: u64) -> Result<Vec<GatherChunk>> {
    check_workspace(workspace_rows)?;
    let seq_lens = requests
        .iter()
        .map(|r| r.context_len.checked_add(r.query_len).ok_or(PlanError::Overflow { what: "seq_len" }))
        .collect::<Result<Vec<u64>>>()?;
    let runs = greedy_runs(&seq_lens, workspace_rows);
    let launches = runs.iter().fold(0u64, |acc, (run, rows)| {
        // A split request of k windows takes up to k(k+1)/2 launches.
        let k = rows.div_ceil(workspace_rows);
        let split = if k > 1 { k.saturating_mul(k + 1) / 2 } else { 1 };
        acc.saturating_add(if run.len() == 1 { split } else { 1 })
    });
    crate::error::check_launches("the gather plan", launches, "give a larger gather workspace")?;
    let mut chunks = Vec::new();
    for (run, rows) in runs {
        if rows <= workspace_rows {
            chunks.push(GatherChunk::Requests { requests: run, rows });
        } else {
            split_request(run.start, requests[run.start], workspace_rows, &mut chunks);
        }
    }
    Ok(chunks)
}

fn split_request(request: usize, req: PrefillRequest, w: u64, out: &mut Vec<GatherChunk>) {
    let (first, end) = (req.context_len, req.seq_len());
    let mut piece_start = first;
    while piece_start < end {
        let window = piece_start / w;
        let piece_end = end.min((window + 1) * w);
        let query = piece_start - first..piece_end - first;
        // Keys [0, piece_end) in windows of w rows.
        let mut k = 0;
        while k < piece_end {
            let keys = k..piece_end.min(k + w);
            k = keys.end;
            out.push(GatherChunk::Split { request, query: query.clone(), keys });
        }
        piece_start = piece_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// vLLM's loop, transcribed literally as the oracle.
    fn vllm_oracle(seq_lens: &[u64], w: u64) -> Vec<Range<usize>> {
        let (mut bounds, mut i, n) = (Vec::new(), 0, seq_lens.len());
        while i < n {
            let (start, mut total) = (i, 0);
            while i < n && total + seq_lens[i] <= w {
                total += seq_lens[i];
                i += 1;
            }
            bounds.push(start..i);
        }
        bounds
    }

    #[test]
    fn oversize_request_is_refused_by_the_vllm_contract() {
        let err = split_prefill_chunks(&[10, 200, 10], 100).unwrap_err().to_string();
        assert!(err.contains("request 1") && err.contains("200") && err.contains("100"), "{err}");
    }

    #[test]
    fn oversize_request_is_split() {
        let reqs = [
            PrefillRequest { query_len: 5, context_len: 0 },
            PrefillRequest { query_len: 150, context_len: 100 },
            PrefillRequest { query_len: 7, context_len: 3 },
        ];
        let chunks = plan_gather_chunks(&reqs, 100).unwrap();
        use GatherChunk::*;
        assert_eq!(
            chunks,
            vec![
                Requests { requests: 0..1, rows: 5 },
                // Query positions 100..200 see windows [0,100), [100,200).
                Split { request: 1, query: 0..100, keys: 0..100 },
                Split { request: 1, query: 0..100, keys: 100..200 },
                Split { request: 1, query: 100..150, keys: 0..100 },
                Split { request: 1, query: 100..150, keys: 100..200 },
                Split { request: 1, query: 100..150, keys: 200..250 },
                Requests { requests: 2..3, rows: 10 },
            ]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        #[test]
        fn same_as_vllm_where_it_holds(seq_lens in prop::collection::vec(0u64..5_000, 0..60), w in 1u64..20_000) {
            let got = split_prefill_chunks(&seq_lens, w);
            if seq_lens.iter().all(|&s| s <= w) {
                prop_assert_eq!(got.unwrap(), vllm_oracle(&seq_lens, w));
            } else {
                prop_assert!(got.is_err());
            }
        }

        /// Every request once in order; every gather fits; every query row of
        /// a split request sees each key it may attend to exactly once.
        #[test]
        fn covers_and_fits(
            reqs in prop::collection::vec((0u64..3_000, 0u64..3_000), 0..30),
            w in 300u64..4_000,
        ) {
            let reqs: Vec<_> = reqs.into_iter()
                .map(|(query_len, context_len)| PrefillRequest { query_len, context_len }).collect();
            let chunks = plan_gather_chunks(&reqs, w).unwrap();
            let mut next = 0;
            let mut seen = vec![Vec::new(); reqs.len()];
            let idle = |r: usize| reqs[r].query_len == 0 && reqs[r].seq_len() > w;
            for c in &chunks {
                let first = match c {
                    GatherChunk::Requests { requests, .. } => requests.start,
                    GatherChunk::Split { request, .. } => *request,
                };
                while next < first && idle(next) {
                    next += 1;
                }
                prop_assert!(c.rows() <= w);
                match c {
                    GatherChunk::Requests { requests, rows } => {
                        prop_assert_eq!(requests.start, next);
                        prop_assert!(!requests.is_empty());
                        prop_assert_eq!(*rows, reqs[requests.clone()].iter().map(|r| r.seq_len()).sum::<u64>());
                        next = requests.end;
                    }
                    GatherChunk::Split { request, query, keys } => {
                        prop_assert!(reqs[*request].seq_len() > w);
                        prop_assert!(*request == next || *request + 1 == next);
                        next = request + 1;
                        seen[*request].push((query.clone(), keys.clone()));
                    }
                }
            }
            while next < reqs.len() && idle(next) {
                next += 1;
            }
            prop_assert_eq!(next, reqs.len());
            for (r, pieces) in seen.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
                let req = reqs[r];
                for q in 0..req.query_len {
                    let pos = req.context_len + q;
                    let mut covered = 0;
                    for (query, keys) in pieces.iter().filter(|(query, _)| query.contains(&q)) {
                        prop_assert!(keys.start <= pos, "a window wholly in the future of every query of its piece is wasted");
                        prop_assert_eq!(keys.start, covered, "windows are consecutive");
                        covered = keys.end;
                        let _ = query;
                    }
                    prop_assert!(covered > pos, "query {} at {} sees keys up to {}", q, pos, covered);
                }
            }
        }
    }
}
