//! The FP8 separate path's prefill chunks: each chunk's requests have their
//! whole KV (context + query) gathered and up-converted into a BF16
//! workspace of `workspace_rows` rows before the BF16 prefill kernel runs.

use std::ops::Range;

use super::check_rows;
use crate::error::{add, check_launches, PlanError, Result};

/// One prefill request of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillRequest {
    /// New tokens this step.
    pub query_len: u64,
    /// Tokens already in the KV cache before this step.
    pub context_len: u64,
}

impl PrefillRequest {
    /// KV rows the request's last query token can attend to. Saturates
    /// where the sum does not fit; the planners refuse such requests first
    /// (see [`checked_seq_len`](Self::checked_seq_len)).
    pub fn seq_len(&self) -> u64 {
        self.context_len.saturating_add(self.query_len)
    }

    /// [`seq_len`](Self::seq_len), or [`PlanError::Overflow`] where it does not fit.
    pub fn checked_seq_len(&self) -> Result<u64> {
        add("seq_len (context_len + query_len)", self.context_len, self.query_len)
    }
}

/// The requests' KV rows all together, refused past
/// [`MAX_ROWS`](crate::limits::MAX_ROWS): within it, no row, key or token
/// count of a plan over them can wrap or pass `i64::MAX`.
pub(crate) fn check_requests(requests: &[PrefillRequest]) -> Result<u64> {
    check_rows(
        "the requests' KV rows (context_lens + query_lens, summed)",
        requests.iter().map(PrefillRequest::seq_len),
    )
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
            GatherChunk::Split { keys, .. } => keys.end.saturating_sub(keys.start),
        }
    }
}

fn check_workspace(workspace_rows: u64) -> Result<()> {
    if workspace_rows == 0 {
        return Err(PlanError::InvalidArgument { what: "workspace_rows", rule: "at least 1", got: "0".into() });
    }
    Ok(())
}

/// Greedy runs of contiguous requests whose rows fit the workspace, one
/// request at least per run: vLLM's `split_prefill_chunks` contract. A
/// request longer than the workspace ends up alone in its run. An iterator,
/// so the runs can be counted before any is stored.
fn greedy_runs(seq_lens: &[u64], workspace_rows: u64) -> impl Iterator<Item = (Range<usize>, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= seq_lens.len() {
            return None;
        }
        let (start, mut rows) = (i, 0u64);
        // `rows` never passes `workspace_rows`, so the sum cannot wrap.
        while let Some(next) = seq_lens.get(i).and_then(|&s| rows.checked_add(s)).filter(|&r| r <= workspace_rows) {
            rows = next;
            i += 1;
        }
        if i == start {
            // Oversize: vLLM asserts here; the caller decides.
            rows = seq_lens[i];
            i += 1;
        }
        Some((start..i, rows))
    })
}

/// Gathers (and prefill launches) one oversize request takes when split
/// by [`split_request`]: a piece in key window `j` reads windows `0..=j`,
/// and the pieces run over the windows holding the request's new tokens.
fn split_launches(req: PrefillRequest, w: u64) -> u64 {
    if req.query_len == 0 {
        return 0;
    }
    let (first, last) = (req.context_len / w, (req.seq_len() - 1) / w);
    // Sum of (j + 1) for j in first..=last; u128 because it is quadratic.
    let triangle = |n: u64| u128::from(n) * (u128::from(n) + 1) / 2;
    u64::try_from(triangle(last + 1) - triangle(first)).unwrap_or(u64::MAX)
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
    let launches = greedy_runs(seq_lens, workspace_rows).count() as u64;
    check_launches("the gather chunks", launches, "give a larger gather workspace, or pass fewer requests at once")?;
    Ok(greedy_runs(seq_lens, workspace_rows).map(|(r, _)| r).collect())
}

/// Gather chunks for a prefill set: [`split_prefill_chunks`] where every
/// request fits; a request that does not is cut into query pieces aligned
/// to key windows of `workspace_rows` rows (a query at position `p` sees keys
/// `[0, p]`), so no gather exceeds the workspace. An oversize request with no
/// new tokens needs no launch and gets none.
pub fn plan_gather_chunks(requests: &[PrefillRequest], workspace_rows: u64) -> Result<Vec<GatherChunk>> {
    check_workspace(workspace_rows)?;
    check_requests(requests)?;
    let seq_lens: Vec<u64> = requests.iter().map(PrefillRequest::seq_len).collect();
    let launches = greedy_runs(&seq_lens, workspace_rows).fold(0u64, |acc, (run, rows)| {
        let n = if rows <= workspace_rows { 1 } else { split_launches(requests[run.start], workspace_rows) };
        acc.saturating_add(n)
    });
    check_launches(
        "the gather plan",
        launches,
        "give a larger gather workspace (a request n workspaces long takes up to n(n+1)/2 gathers)",
    )?;
    // Counted exactly above, so this is the only allocation of chunks.
    let mut chunks = Vec::with_capacity(launches as usize);
    for (run, rows) in greedy_runs(&seq_lens, workspace_rows) {
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
        // The end of the key window holding `piece_start`; saturating, it
        // still lies past `piece_start`, so every turn makes progress.
        let window_end = (piece_start - piece_start % w).saturating_add(w);
        let piece_end = end.min(window_end);
        let query = piece_start - first..piece_end - first;
        // Keys [0, piece_end) in windows of w rows.
        let mut k = 0;
        while k < piece_end {
            let keys = k..piece_end.min(k.saturating_add(w));
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
