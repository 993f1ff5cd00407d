//! The sparse indexer's logits: DeepGEMM `fp8_mqa_logits` materialises one
//! fp32 score per (query row, KV row) of a chunk.

use crate::error::{mul_count, Result};

/// Bytes of the `M x N` fp32 logits matrix.
pub fn indexer_logits_bytes(query_rows: u64, kv_rows: u64) -> Result<u64> {
    mul_count("indexer logits", &[query_rows, kv_rows, 4])
}

#[cfg(test)]
mod tests {
    #[test]
    fn logits() {
        assert_eq!(super::indexer_logits_bytes(8192, 16384).unwrap(), 512 << 20);
    }
}
