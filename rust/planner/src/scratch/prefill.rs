//! FlashMLA sparse prefill (`flash_mla_sparse_fwd`, BF16 KV) and the BF16
//! workspace the FP8 "separate" path gathers the cache into first.

use super::Breakdown;
use crate::error::{mul, mul_count, Result};
use crate::geometry::{check_topk, prefill_kernel_heads, Arch, D_QK, D_V};

/// One call of the sparse prefill kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillShape {
    pub s_q: u64,
    pub num_heads: u32,
    pub topk: u32,
    pub out_preallocated: bool,
    /// The caller translates this call's top-k positions to workspace rows
    /// in fresh tensors: `(s_q, topk)` int32 rows and `(s_q,)` int32 valid
    /// counts (vLLM's `triton_convert_req_index_to_global_index`).
    pub translated_indices: bool,
    /// The kernel runs `num_heads` as they are (16 or 32 on SM90, in a
    /// FlashMLA build that has those kernels) instead of vLLM's padding.
    pub native_heads: bool,
    /// vLLM's `prefill_padding` (64 or 128): q's heads are padded to a
    /// multiple of it where the kernel does not run them natively.
    pub padding: u32,
}

/// Every buffer one sparse prefill call allocates. No split-KV scratch.
pub fn prefill_scratch(arch: Arch, shape: PrefillShape) -> Result<Breakdown> {
    let PrefillShape { s_q, num_heads, topk, out_preallocated, translated_indices, native_heads, padding } = shape;
    check_topk(topk, 128, "topk of the sparse prefill kernel")?;
    let h = u64::from(prefill_kernel_heads(num_heads, arch, native_heads, padding)?);
    let rows = mul("prefill rows (s_q x heads)", &[s_q, h])?;
    let mut bd = Breakdown::default();
    if u64::from(num_heads) < h {
        bd.push("q_padded", mul("q_padded", &[rows, D_QK, 2])?)?;
    }
    if !out_preallocated {
        bd.push("out", mul("out", &[rows, D_V, 2])?)?;
    }
    bd.push("max_logits", mul("max_logits", &[rows, 4])?)?;
    bd.push("lse", mul("lse", &[rows, 4])?)?;
    if translated_indices {
        bd.push("workspace_indices", mul("workspace_indices", &[s_q, u64::from(topk), 4])?)?;
        bd.push("topk_length", mul("topk_length", &[s_q, 4])?)?;
    }
    Ok(bd)
}

/// Bytes of the BF16 workspace holding `rows` gathered and up-converted KV
/// rows (576 x bf16 each).
pub fn gather_workspace_bytes(rows: u64) -> Result<u64> {
    mul_count("gather workspace", &[rows, D_QK, 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One query token at 16 heads, padded to 64 (vLLM's SM90 padding), nothing preallocated.
    fn one_token_at_16_heads() -> PrefillShape {
        PrefillShape {
            s_q: 1,
            num_heads: 16,
            topk: 2048,
            out_preallocated: false,
            translated_indices: false,
            native_heads: false,
            padding: 64,
        }
    }

    #[test]
    fn separate_path_transient_per_token() {
        // docs/kernels.md, "Sparse prefill": padded q + kernel out = 136 KiB/token at 64 heads.
        let shape = one_token_at_16_heads();
        let bd = prefill_scratch(Arch::Sm90, shape).unwrap();
        assert_eq!(bd.get("q_padded") + bd.get("out"), 136 * 1024);
        assert_eq!(bd.get("max_logits"), 256);
    }

    #[test]
    fn outputs_only_with_out_given() {
        // docs/kernels.md, "Sparse prefill": 32768 tokens, out= given: 16 MiB (64 heads) / 32 (128).
        for (heads, mib) in [(64, 16), (128, 32)] {
            let shape =
                PrefillShape { s_q: 32768, num_heads: heads, out_preallocated: true, ..one_token_at_16_heads() };
            let bd = prefill_scratch(Arch::Sm90, shape).unwrap();
            assert_eq!(bd.total_bytes(), mib << 20);
        }
    }

    #[test]
    fn native_heads_hold_no_padded_q() {
        // 16 heads native: no padded q; out, max_logits and lse at 16 rows per token, not 64.
        let padded = one_token_at_16_heads();
        let native = PrefillShape { native_heads: true, ..padded };
        let bd = prefill_scratch(Arch::Sm90, native).unwrap();
        assert_eq!(bd.get("q_padded"), 0);
        assert_eq!(bd.get("out"), 16 * D_V * 2);
        assert_eq!(bd.get("lse"), 16 * 4);
        assert_eq!(prefill_scratch(Arch::Sm90, padded).unwrap().get("out"), 64 * D_V * 2);
        assert!(prefill_scratch(Arch::Sm100, native).is_err());
        // Blackwell: 128 heads under the padding by architecture, 64 with 64-head Blackwell kernels.
        assert_eq!(
            prefill_scratch(Arch::Sm100, PrefillShape { padding: 128, ..padded }).unwrap().get("out"),
            128 * D_V * 2
        );
        assert_eq!(prefill_scratch(Arch::Sm100, padded).unwrap().get("out"), 64 * D_V * 2);
        assert!(prefill_scratch(Arch::Sm90, PrefillShape { num_heads: 24, ..native }).is_err());
    }

    #[test]
    fn workspace_rows() {
        assert_eq!(gather_workspace_bytes(1).unwrap(), 1152);
        assert!(gather_workspace_bytes(u64::MAX).is_err());
        let shape = PrefillShape { topk: 64, out_preallocated: true, ..one_token_at_16_heads() };
        assert!(prefill_scratch(Arch::Sm90, shape).is_err());
    }
}
