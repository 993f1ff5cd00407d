//! The sparse indexer's prefill chunks: contiguous requests whose KV rows
//! fit the indexer workspace and whose `M x N` fp32 logits fit the logits
//! budget; a request too large alone is cut on its query rows.

use std::ops::Range;

use super::check_rows;
use crate::error::{check_launches, PlanError, Result, MAX_COUNT};

/// One `fp8_mqa_logits` call: requests `[start, end)` and the rows `query`
/// of their concatenated queries (starting at 0 for each request range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerChunk {
    pub requests: Range<usize>,
    pub query: Range<u64>,
    /// KV rows (`N`) of the chunk's requests.
    pub kv_rows: u64,
}

impl IndexerChunk {
    /// Bytes of this call's logits matrix. A chunk the planner returns never
    /// passes `i64::MAX`; one built by hand saturates rather than wraps.
    pub fn logits_bytes(&self) -> u64 {
        self.query.end.saturating_sub(self.query.start).saturating_mul(self.kv_rows).saturating_mul(4)
    }
}

/// vLLM's `split_indexer_prefill_chunks`, the same output for the same
/// input: greedy while `N <= workspace_rows` and `M * N <= budget / 4`; one
/// request that fits neither alone is taken alone and split into query
/// pieces of `max(1, budget / 4 / N)` rows. A request with no query rows
/// gets no chunk. A budget past `i64::MAX` bytes counts as `i64::MAX`
/// (no logits matrix is that large), so every chunk's logits fit an `i64`.
pub fn split_indexer_prefill_chunks(
    seq_lens: &[u64],
    query_lens: &[u64],
    workspace_rows: u64,
    max_logits_bytes: u64,
) -> Result<Vec<IndexerChunk>> {
    if seq_lens.len() != query_lens.len() {
        return Err(PlanError::LengthMismatch {
            what: "query_lens",
            got: query_lens.len(),
            other: "seq_lens",
            expected: seq_lens.len(),
        });
    }
    if let Some(i) = (0..seq_lens.len()).find(|&i| query_lens[i] > seq_lens[i]) {
        return Err(PlanError::InvalidArgument {
            what: "query_lens",
            rule: "at most seq_lens at the same index (a request's new tokens are part of its sequence)",
            got: format!("query_lens[{i}] = {} with seq_lens[{i}] = {}", query_lens[i], seq_lens[i]),
        });
    }
    // Within this bound, and with every query length at most its sequence
    // length, the sums below cannot wrap.
    check_rows("the indexer's KV rows (seq_lens, summed)", seq_lens.iter().copied())?;
    let max_elems = max_logits_bytes.min(MAX_COUNT) / 4;
    let runs = greedy_runs(seq_lens, query_lens, workspace_rows, max_elems);
    // Query rows one call of a run takes.
    let rows_per_call = |m: u64, kv: u64| max_elems.checked_div(kv).unwrap_or(m).max(1);
    let launches = runs.iter().fold(0u64, |acc, &(_, m, kv)| acc.saturating_add(m.div_ceil(rows_per_call(m, kv))));
    check_launches(
        "the indexer plan",
        launches,
        "give a larger max_logits_bytes: one call takes max_logits_bytes / 4 / kv_rows query rows",
    )?;
    // Counted exactly above, so this is the only allocation of chunks.
    let mut chunks = Vec::with_capacity(launches as usize);
    for (requests, m, kv) in runs {
        let max_q = rows_per_call(m, kv);
        let mut q = 0;
        while q < m {
            let piece = max_q.min(m - q);
            chunks.push(IndexerChunk { requests: requests.clone(), query: q..q + piece, kv_rows: kv });
            q += piece;
        }
    }
    Ok(chunks)
}

/// vLLM's greedy runs: `(requests, query rows M, KV rows N)` of each, the
/// next request joining while `N <= workspace_rows` and `M * N <= max_elems`,
/// one request at least per run. At most one run per request.
fn greedy_runs(
    seq_lens: &[u64],
    query_lens: &[u64],
    workspace_rows: u64,
    max_elems: u64,
) -> Vec<(Range<usize>, u64, u64)> {
    let n = seq_lens.len();
    let mut runs = Vec::new();
    let mut end = 0;
    while end < n {
        let (start, mut m, mut kv) = (end, 0u64, 0u64);
        while end < n {
            let (new_m, new_kv) = (m + query_lens[end], kv + seq_lens[end]);
            if new_kv <= workspace_rows && u128::from(new_m) * u128::from(new_kv) <= u128::from(max_elems) {
                (m, kv) = (new_m, new_kv);
                end += 1;
            } else {
                break;
            }
        }
        if end == start {
            (m, kv) = (query_lens[end], seq_lens[end]);
            end += 1;
        }
        runs.push((start..end, m, kv));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn oversize_request_is_cut_on_queries() {
        // 512 MiB of logits = 2^27 elements; N = 65536 -> 2048 query rows per piece.
        let chunks = split_indexer_prefill_chunks(&[65536], &[5000], 1 << 30, 512 << 20).unwrap();
        let pieces: Vec<_> = chunks.iter().map(|c| c.query.clone()).collect();
        assert_eq!(pieces, vec![0..2048, 2048..4096, 4096..5000]);
        assert!(chunks.iter().all(|c| c.logits_bytes() <= 512 << 20));
    }

    #[test]
    fn mismatched_lengths() {
        assert!(split_indexer_prefill_chunks(&[1, 2], &[1], 10, 10).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// Every query row of every request exactly once, in order; every
        /// multi-request chunk fits both limits; every chunk fits the logits
        /// budget unless a single KV row set alone exceeds it.
        #[test]
        fn covers_and_fits(
            reqs in prop::collection::vec((0u64..4_000, 0u64..4_000), 0..40),
            workspace in 1u64..20_000,
            budget in 4u64..(64 << 20),
        ) {
            let query_lens: Vec<u64> = reqs.iter().map(|r| r.0).collect();
            let seq_lens: Vec<u64> = reqs.iter().map(|r| r.0 + r.1).collect();
            let chunks = split_indexer_prefill_chunks(&seq_lens, &query_lens, workspace, budget).unwrap();
            // Request ranges in order; within one range the query pieces
            // tile [0, M) in order.
            let mut next_req = 0;
            let mut i = 0;
            while i < chunks.len() {
                let range = chunks[i].requests.clone();
                prop_assert!(range.start >= next_req && !range.is_empty());
                prop_assert!(query_lens[next_req..range.start].iter().all(|&q| q == 0));
                let m: u64 = query_lens[range.clone()].iter().sum();
                let mut q = 0;
                while i < chunks.len() && chunks[i].requests == range {
                    let c = &chunks[i];
                    prop_assert_eq!(c.query.start, q);
                    prop_assert_eq!(c.kv_rows, seq_lens[range.clone()].iter().sum::<u64>());
                    if range.len() > 1 {
                        prop_assert!(c.kv_rows <= workspace && c.logits_bytes() <= budget);
                    } else if c.kv_rows <= budget / 4 {
                        prop_assert!(c.logits_bytes() <= budget);
                    }
                    q = c.query.end;
                    i += 1;
                }
                prop_assert_eq!(q, m);
                next_req = range.end;
            }
            prop_assert!(query_lens[next_req..].iter().all(|&q| q == 0));
        }
    }
}
