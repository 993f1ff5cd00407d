//! FlashMLA sparse decode (`flash_mla_with_kvcache(..., is_fp8_kvcache=True,
//! indices=...)`): split-KV accumulators, outputs and the caller's padded q.

use super::Breakdown;
use crate::error::{add, mul, Result};
use crate::geometry::{check_topk, decode_padded_heads, Arch, Gpu, D_QK, D_V};

/// One call of the sparse decode kernel, as the caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: u64,
    /// Query tokens per batch entry (`T` in mixed-batch mode, where `batch = 1`).
    pub s_q: u64,
    /// Query heads per rank before padding.
    pub num_heads: u32,
    pub topk: u32,
    /// The caller passes `out=`, so the kernel allocates no output.
    pub out_preallocated: bool,
    /// The caller turns request-relative top-k positions into cache slots
    /// for this call only, in a fresh `(batch x s_q, topk)` int32 tensor
    /// (vLLM's `triton_convert_req_index_to_global_index`).
    pub translated_indices: bool,
}

/// `num_sm_parts`: how many SM groups split each query's KV work. It falls
/// as `s_q` grows, which is why scratch is not monotonic below `num_sms + 1`
/// tokens.
pub fn num_sm_parts(gpu: Gpu, s_q: u64, padded_heads: u32) -> u64 {
    let sms = u64::from(gpu.num_sms);
    let per_query = sms / s_q.max(1);
    let parts = match gpu.arch {
        Arch::Sm90 => per_query / u64::from(padded_heads / 64),
        // From FlashMLA's SM100 source; not verified by a run.
        Arch::Sm100 if padded_heads == 64 => per_query,
        Arch::Sm100 => per_query / 2,
    };
    parts.max(1)
}

/// Split-KV is always on for SM90 and on SM100 once `topk > 640`.
pub fn split_kv_enabled(arch: Arch, topk: u32) -> bool {
    matches!(arch, Arch::Sm90) || topk > 640
}

/// Every buffer one sparse decode call allocates.
pub fn decode_scratch(gpu: Gpu, shape: DecodeShape) -> Result<Breakdown> {
    let DecodeShape { batch, s_q, num_heads, topk, out_preallocated, translated_indices } = shape;
    check_topk(topk, 64, "topk of the sparse decode kernel")?;
    let h = u64::from(decode_padded_heads(num_heads)?);
    let rows = mul("decode rows (batch x s_q x heads)", &[batch, s_q, h])?;
    let mut bd = Breakdown::default();
    if u64::from(num_heads) < h {
        bd.push("q_padded", mul("q_padded", &[rows, D_QK, 2])?)?;
    }
    if split_kv_enabled(gpu.arch, topk) {
        let parts = num_sm_parts(gpu, s_q, h as u32);
        let accum_rows = mul("o_accum", &[add("o_accum", batch, parts)?, s_q, h])?;
        bd.push("o_accum", mul("o_accum", &[accum_rows, D_V, 4])?)?;
        bd.push("lse_accum", mul("lse_accum", &[accum_rows, 4])?)?;
    }
    if !out_preallocated {
        bd.push("out", mul("out", &[rows, D_V, 2])?)?;
    }
    bd.push("lse", mul("lse", &[rows, 4])?)?;
    if translated_indices {
        bd.push("slot_indices", mul("slot_indices", &[batch, s_q, u64::from(topk), 4])?)?;
    }
    Ok(bd)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;

    fn accum(batch: u64, s_q: u64, heads: u32) -> Breakdown {
        let shape =
            DecodeShape { batch, s_q, num_heads: heads, topk: 2048, out_preallocated: true, translated_indices: false };
        decode_scratch(Gpu::h200(), shape).unwrap()
    }

    fn accum_gib(batch: u64, s_q: u64) -> f64 {
        let bd = accum(batch, s_q, 64);
        (bd.get("o_accum") + bd.get("lse_accum")) as f64 / GIB
    }

    /// docs/kernels.md, "Sparse decode": o_accum + lse_accum measured on the H200 by the allocator.
    #[test]
    fn reproduces_h200_measurements() {
        for (batch, s_q, gib) in
            [(1, 1, 0.016), (1, 1024, 0.25), (1, 4096, 1.002), (1, 16384, 4.008), (1, 32768, 8.016), (8, 4096, 4.509)]
        {
            let got = accum_gib(batch, s_q);
            assert!((got - gib).abs() < 0.0005 + 1e-3 * gib, "b={batch} s_q={s_q}: {got} vs {gib}");
        }
    }

    #[test]
    fn exact_bytes_at_one_token() {
        // P = 132 at s_q = 1, 64 heads: (1 + 132) x 64 x 512 x 4.
        assert_eq!(accum(1, 1, 64).get("o_accum"), 133 * 64 * 512 * 4);
        assert_eq!(accum(1, 1, 64).get("lse_accum"), 133 * 64 * 4);
    }

    /// The non-monotonic region: P drops from 2 to 1 between 66 and 67 tokens.
    #[test]
    fn not_monotonic_below_133_tokens() {
        assert_eq!(num_sm_parts(Gpu::h200(), 66, 64), 2);
        assert_eq!(num_sm_parts(Gpu::h200(), 67, 64), 1);
        let mib = |s| accum(1, s, 64).get("o_accum") as f64 / MIB;
        assert!((mib(1) - 16.625).abs() < 1e-9);
        assert!((mib(66) - 24.75).abs() < 1e-9);
        assert!((mib(67) - 16.75).abs() < 1e-9);
        assert_eq!(num_sm_parts(Gpu::h200(), 1, 128), 66);
    }

    /// Mixed-batch mode at 16 heads: ~392.75 KiB per token all told.
    #[test]
    fn mixed_batch_transient_per_token() {
        let shape = DecodeShape {
            batch: 1,
            s_q: 32768,
            num_heads: 16,
            topk: 2048,
            out_preallocated: false,
            translated_indices: false,
        };
        let bd = decode_scratch(Gpu::h200(), shape).unwrap();
        assert_eq!(bd.get("q_padded"), 32768 * 72 * 1024);
        assert_eq!(bd.get("out"), 32768 * 64 * 1024);
        assert_eq!(bd.total_bytes(), 32768 * (256 * 1024 + 512 + 72 * 1024 + 64 * 1024 + 256));
        assert!((bd.total_bytes() as f64 / GIB - 12.27).abs() < 0.01);
        let names: Vec<_> = bd.buffers.iter().map(|b| b.name).collect();
        assert_eq!(names, ["q_padded", "o_accum", "lse_accum", "out", "lse"]);
    }

    #[test]
    fn translated_indices_are_int32_per_query_row() {
        let with = |t| DecodeShape {
            batch: 2,
            s_q: 3,
            num_heads: 64,
            topk: 2048,
            out_preallocated: true,
            translated_indices: t,
        };
        let a = decode_scratch(Gpu::h200(), with(true)).unwrap();
        let b = decode_scratch(Gpu::h200(), with(false)).unwrap();
        assert_eq!(a.get("slot_indices"), 2 * 3 * 2048 * 4);
        assert_eq!(a.total_bytes() - b.total_bytes(), 2 * 3 * 2048 * 4);
    }

    #[test]
    fn absent_buffers() {
        let bd = accum(1, 100, 64);
        assert!(bd.buffers.iter().all(|b| b.name != "out" && b.name != "q_padded"));
        // SM100 without split-KV (topk <= 640) has no accumulators.
        let gpu = Gpu::new(Arch::Sm100, 148).unwrap();
        let shape = DecodeShape {
            batch: 1,
            s_q: 10,
            num_heads: 64,
            topk: 512,
            out_preallocated: true,
            translated_indices: false,
        };
        let bd = decode_scratch(gpu, shape).unwrap();
        assert_eq!(bd.get("o_accum"), 0);
        assert_eq!(bd.total_bytes(), 10 * 64 * 4);
    }

    #[test]
    fn bad_input_is_an_error() {
        let shape = DecodeShape {
            batch: 1,
            s_q: 1,
            num_heads: 16,
            topk: 100,
            out_preallocated: true,
            translated_indices: false,
        };
        assert!(decode_scratch(Gpu::h200(), shape).is_err());
        let shape = DecodeShape {
            batch: u64::MAX,
            s_q: u64::MAX,
            num_heads: 16,
            topk: 2048,
            out_preallocated: true,
            translated_indices: false,
        };
        assert!(decode_scratch(Gpu::h200(), shape).is_err());
    }
}
