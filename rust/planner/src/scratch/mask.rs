//! The bit-packed top-k mask of the masked-MHA prefill path (SM100, FA4,
//! BF16 KV): one bit per (query row, key), 32 keys per int32 word.

use crate::error::{add, count, mul_count, Result};

/// vLLM's fixed workspace for the mask (`GLOBAL_TOPK_MASK_MAX_BYTES`).
pub const GLOBAL_TOPK_MASK_MAX_BYTES: u64 = 128 << 20;

/// The int32 tensor vLLM allocates: `(batch, rows, words)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskShape {
    pub batch: u64,
    /// Query rows rounded up to the attention kernel's tile.
    pub rows: u64,
    /// int32 words per row, rounded up to 4 (16-byte rows).
    pub words: u64,
}

impl MaskShape {
    pub fn bytes(&self) -> Result<u64> {
        mul_count("top-k mask", &[self.batch, self.rows, self.words, 4])
    }
}

/// The mask's shape for a prefill set, as vLLM's `_topk_mask_shape`
/// computes it. `reserve_key_starts_word` adds the word the global mask
/// keeps for per-request key offsets.
pub fn topk_mask_shape(
    batch_size: u64,
    max_query_len: u64,
    max_key_len: u64,
    reserve_key_starts_word: bool,
) -> Result<MaskShape> {
    let tile_m = if max_query_len <= 128 { 128 } else { 256 };
    let rows = mul_count("top-k mask rows", &[max_query_len.div_ceil(tile_m), tile_m])?;
    let words = add("top-k mask words", max_key_len.div_ceil(32), u64::from(reserve_key_starts_word))?;
    let words = mul_count("top-k mask words", &[words.div_ceil(4), 4])?;
    count("top-k mask batch", batch_size)?;
    Ok(MaskShape { batch: batch_size, rows, words })
}

/// Bytes of [`topk_mask_shape`].
pub fn topk_mask_bytes(
    batch_size: u64,
    max_query_len: u64,
    max_key_len: u64,
    reserve_key_starts_word: bool,
) -> Result<u64> {
    topk_mask_shape(batch_size, max_query_len, max_key_len, reserve_key_starts_word)?.bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The examples of docs/kernels.md, "Masked-MHA top-k mask".
    #[test]
    fn brief_cases() {
        assert_eq!(topk_mask_bytes(1, 32768, 32768, false).unwrap(), GLOBAL_TOPK_MASK_MAX_BYTES);
        assert_eq!(topk_mask_bytes(1, 33024, 33024, false).unwrap(), 136_323_072);
        assert_eq!(topk_mask_bytes(2, 16384, 16384, false).unwrap(), 64 << 20);
    }

    #[test]
    fn tile_and_word_rounding() {
        let s = topk_mask_shape(1, 128, 1, false).unwrap();
        assert_eq!((s.rows, s.words), (128, 4));
        let s = topk_mask_shape(1, 129, 128, true).unwrap();
        assert_eq!((s.rows, s.words), (256, 8)); // 4 words + key-starts word -> 8
        let s = topk_mask_shape(3, 0, 0, false).unwrap();
        assert_eq!(s.bytes().unwrap(), 0);
    }
}
