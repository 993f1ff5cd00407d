//! What the kernels see: architecture, SM count, MLA dimensions, head padding.

use std::str::FromStr;

use crate::error::{PlanError, Result};

/// Value (and output) width of MLA attention: `kv_lora_rank`.
pub const D_V: u64 = 512;
/// Query/key width: `kv_lora_rank + qk_rope_head_dim` (512 + 64).
pub const D_QK: u64 = 576;
/// DeepSeek-V3.2's `index_topk`.
pub const DEFAULT_TOPK: u32 = 2048;
/// Streaming multiprocessors of an H200 (and H100 SXM).
pub const H200_NUM_SMS: u32 = 132;
/// Most query heads per rank: the widest FlashMLA sparse kernels run 128 heads.
pub const MAX_HEADS: u32 = 128;

/// GPU architecture families with different FlashMLA kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper (H100, H200).
    Sm90,
    /// Blackwell (B200, GB200).
    Sm100,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm90 => "sm90",
            Arch::Sm100 => "sm100",
        }
    }
}

impl FromStr for Arch {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sm90" | "sm90a" | "hopper" => Ok(Arch::Sm90),
            "sm100" | "sm100a" | "blackwell" => Ok(Arch::Sm100),
            _ => Err(PlanError::UnknownArch(s.to_string())),
        }
    }
}

/// The device a plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    pub arch: Arch,
    pub num_sms: u32,
}

impl Gpu {
    pub fn new(arch: Arch, num_sms: u32) -> Result<Self> {
        if num_sms == 0 {
            return Err(PlanError::InvalidArgument { what: "num_sms", rule: "at least 1", got: "0".into() });
        }
        Ok(Gpu { arch, num_sms })
    }

    pub fn h200() -> Self {
        Gpu { arch: Arch::Sm90, num_sms: H200_NUM_SMS }
    }
}

/// How the KV cache is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// `fp8_ds_mla`: 656 bytes per token (512 x e4m3, 4 x fp32 scales, 64 x bf16 RoPE).
    Fp8,
    /// 576 x bf16 = 1152 bytes per token.
    Bf16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Fp8 => "fp8",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Bytes one token occupies in the paged KV cache.
    pub fn bytes_per_token(self) -> u64 {
        match self {
            KvDtype::Fp8 => 656,
            KvDtype::Bf16 => 2 * D_QK,
        }
    }
}

impl FromStr for KvDtype {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp8" | "fp8_ds_mla" => Ok(KvDtype::Fp8),
            "bf16" | "auto" | "bfloat16" => Ok(KvDtype::Bf16),
            _ => Err(PlanError::UnknownKvDtype(s.to_string())),
        }
    }
}

/// Query heads per rank must be 1 to 128: the kernels run 64 or 128 padded
/// heads. Every planner taking a head count checks it with this.
pub fn check_heads(num_heads: u32) -> Result<()> {
    if num_heads == 0 || num_heads > MAX_HEADS {
        return Err(PlanError::InvalidArgument {
            what: "num_heads (query heads per rank)",
            rule:
                "between 1 and 128 (the kernels run 64 or 128 padded heads); pass the heads of one tensor-parallel rank",
            got: num_heads.to_string(),
        });
    }
    Ok(())
}

/// Heads the FlashMLA sparse decode kernel runs: it has 64- and 128-head
/// kernels only, so callers zero-pad the query up to one of them.
pub fn decode_padded_heads(num_heads: u32) -> Result<u32> {
    check_heads(num_heads)?;
    Ok(if num_heads <= 64 { 64 } else { 128 })
}

/// vLLM's `prefill_padding` where the caller names none: the padding by
/// architecture of the BF16 sparse prefill kernel's q, 64 on Hopper and 128 on
/// Blackwell. A FlashMLA build with 64-head Blackwell prefill kernels pads to
/// 64 on both; a release that has one passes that (its release module says).
pub fn default_prefill_padding(arch: Arch) -> u32 {
    match arch {
        Arch::Sm90 => 64,
        Arch::Sm100 => 128,
    }
}

/// Heads the BF16 sparse prefill kernel runs: `num_heads` padded to a
/// multiple of `padding` (vLLM's `prefill_padding`: 64 or 128, the kernels'
/// head counts).
pub fn prefill_padded_heads(num_heads: u32, padding: u32) -> Result<u32> {
    check_heads(num_heads)?;
    if padding != 64 && padding != 128 {
        return Err(PlanError::InvalidArgument {
            what: "prefill_padding",
            rule: "64 or 128 (the head counts of FlashMLA's sparse prefill kernels)",
            got: padding.to_string(),
        });
    }
    Ok(num_heads.div_ceil(padding) * padding)
}

/// Head counts FlashMLA's SM90 BF16 sparse prefill kernel runs without
/// padding in a build with native 16/32-head prefill kernels (besides its 64
/// and 128).
pub const NATIVE_PREFILL_HEADS: [u32; 2] = [16, 32];

/// Whether the sparse prefill kernel can run `num_heads` natively on `arch`
/// (given a FlashMLA build with native 16/32-head prefill kernels).
pub fn prefill_runs_native(num_heads: u32, arch: Arch) -> bool {
    arch == Arch::Sm90 && NATIVE_PREFILL_HEADS.contains(&num_heads)
}

/// Heads the sparse prefill kernel runs: `num_heads` itself with `native`
/// (refused where no kernel runs it), padded to `padding` otherwise. The
/// padding is checked either way: it is vLLM's, whatever this call runs.
pub fn prefill_kernel_heads(num_heads: u32, arch: Arch, native: bool, padding: u32) -> Result<u32> {
    let padded = prefill_padded_heads(num_heads, padding)?;
    if !native {
        return Ok(padded);
    }
    if !prefill_runs_native(num_heads, arch) {
        return Err(PlanError::InvalidArgument {
            what: "native_prefill_heads",
            rule: "off except at 16 or 32 heads per rank on sm90 (the head counts FlashMLA's prefill kernel \
                   runs unpadded there); leave it off to pad q as vLLM does",
            got: format!("{num_heads} heads on {}", arch.name()),
        });
    }
    Ok(num_heads)
}

pub(crate) fn check_topk(topk: u32, multiple: u32, kernel: &'static str) -> Result<()> {
    if topk == 0 || topk % multiple != 0 {
        return Err(PlanError::InvalidArgument {
            what: kernel,
            rule: if multiple == 64 {
                "a positive multiple of 64 (the decode kernel's topk block)"
            } else {
                "a positive multiple of 128 (the prefill kernel's topk block)"
            },
            got: topk.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_padding() {
        assert_eq!(decode_padded_heads(1).unwrap(), 64);
        assert_eq!(decode_padded_heads(16).unwrap(), 64);
        assert_eq!(decode_padded_heads(64).unwrap(), 64);
        assert_eq!(decode_padded_heads(65).unwrap(), 128);
        assert_eq!(decode_padded_heads(128).unwrap(), 128);
        assert!(decode_padded_heads(0).is_err());
        assert!(decode_padded_heads(129).is_err());
        assert_eq!(prefill_padded_heads(16, default_prefill_padding(Arch::Sm90)).unwrap(), 64);
        assert_eq!(prefill_padded_heads(96, default_prefill_padding(Arch::Sm90)).unwrap(), 128);
        assert_eq!(prefill_padded_heads(16, default_prefill_padding(Arch::Sm100)).unwrap(), 128);
        assert_eq!(prefill_padded_heads(16, 64).unwrap(), 64); // 64-head Blackwell kernels
        assert_eq!(prefill_padded_heads(65, 128).unwrap(), 128);
        for bad in [0, 32, 96, 256] {
            let err = prefill_padded_heads(16, bad).unwrap_err().to_string();
            assert!(err.contains("prefill_padding") && err.contains("64 or 128"), "{err}");
        }
        for (heads, arch, native) in [
            (16, Arch::Sm90, Some(16)),
            (32, Arch::Sm90, Some(32)),
            (64, Arch::Sm90, None),
            (24, Arch::Sm90, None),
            (16, Arch::Sm100, None),
            (32, Arch::Sm100, None),
        ] {
            let padding = default_prefill_padding(arch);
            assert_eq!(prefill_kernel_heads(heads, arch, true, padding).ok(), native, "{heads} on {arch:?}");
            assert_eq!(
                prefill_kernel_heads(heads, arch, false, padding).unwrap(),
                prefill_padded_heads(heads, padding).unwrap()
            );
        }
        let err = prefill_kernel_heads(16, Arch::Sm100, true, 64).unwrap_err().to_string();
        assert!(err.contains("native_prefill_heads") && err.contains("16 heads on sm100"), "{err}");
        assert!(prefill_kernel_heads(0, Arch::Sm90, true, 64).unwrap_err().to_string().contains("num_heads"));
        // Native heads still need vLLM's padding to be one the kernels run.
        let err = prefill_kernel_heads(16, Arch::Sm90, true, 96).unwrap_err().to_string();
        assert!(err.contains("prefill_padding"), "{err}");
    }

    #[test]
    fn parse_names() {
        assert_eq!("sm90".parse::<Arch>().unwrap(), Arch::Sm90);
        assert_eq!("SM100".parse::<Arch>().unwrap(), Arch::Sm100);
        let err = "sm80".parse::<Arch>().unwrap_err().to_string();
        assert!(err.contains("sm80") && err.contains("sm90"), "{err}");
        assert_eq!("fp8_ds_mla".parse::<KvDtype>().unwrap(), KvDtype::Fp8);
        assert!("int4".parse::<KvDtype>().is_err());
    }
}
