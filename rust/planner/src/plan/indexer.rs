//! The sparse indexer's prefill chunks: contiguous requests whose KV rows
//! fit the indexer workspace and whose `M x N` fp32 logits fit the logits
//! budget; a request too large alone is cut on its query rows.

use std::ops::Range;

use crate::error::{PlanError, Result};

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
    /// Bytes of this call's logits matrix.
    pub fn logits_bytes(&self) -> u64 {
        (self.query.end - self.query.start) * self.kv_rows * 4
    }
}

/// vLLM's `split_indexer_prefill_chunks`, the same output for the same
/// input: greedy while `N <= workspace_rows` and `M * N <= budget / 4`; one
/// request that fits neither alone is taken alone and split into query
/// pieces of `max(1, budget / 4 / N)` rows. A request with no query rows
/// gets no chunk.
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
    let max_elems = u128::from(max_logits_bytes / 4);
    let n = seq_lens.len();
    let mut chunks = Vec::new();
    let mut end = 0;
    while end < n {
        let (start, mut m, mut kv) = (end, 0u64, 0u64);
        while end < n {
            let (new_m, new_kv) = (m + query_lens[end], kv + seq_lens[end]);
            if new_kv <= workspace_rows && u128::from(new_m) * u128::from(new_kv) <= max_elems {
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
        let max_q = if kv > 0 { (max_elems / u128::from(kv)).max(1) as u64 } else { m.max(1) };
        let mut q = 0;
        while q < m {
            let piece = max_q.min(m - q);
            chunks.push(IndexerChunk { requests: start..end, query: q..q + piece, kv_rows: kv });
            q += piece;
        }
    }
    Ok(chunks)
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
