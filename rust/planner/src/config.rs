//! One step configuration: the model, the GPU, the budgets, the workspaces
//! and how the plan is executed. Built once per engine (from vLLM's config in
//! the backend, from presets and flags in the CLI); every kernel fact the
//! planner and its callers need derives from it here, so nothing downstream
//! restates a padding rule, a workspace factor or a reserve.

use crate::error::{mul, PlanError, Result};
use crate::geometry::{
    check_topk, decode_padded_heads, default_prefill_padding, prefill_kernel_heads, prefill_padded_heads, Gpu, KvDtype,
};
use crate::plan::MaskConfig;

/// Held back from every scratch budget for what the byte models leave out:
/// the caching allocator rounds each block up to 512 B, and each FlashMLA
/// schedule holds two small int32 tensors (< 5 KiB at 132 SMs).
pub const ALLOCATOR_RESERVE_BYTES: u64 = 64 << 10;

/// vLLM's gather workspace: `get_prefill_workspace_size(max_model_len)` is
/// `max_model_len * 5` rows of 576 bf16 (a release that sizes it otherwise
/// passes its rows: `gather_workspace_rows`).
pub const VLLM_GATHER_ROWS_PER_MODEL_LEN: u64 = 5;
/// vLLM's sparse indexer sizes its KV workspace `max_model_len * 40` rows.
pub const VLLM_INDEXER_ROWS_PER_MODEL_LEN: u64 = 40;
/// vLLM's `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` default, 512 MiB.
pub const VLLM_INDEXER_LOGITS_BYTES: u64 = 512 << 20;
/// vLLM runs FP8 steps in mixed-batch mode below this many heads per rank
/// (`MIN_HEADS_FOR_BF16_PREFILL`).
pub const MIN_HEADS_FOR_BF16_PREFILL: u32 = 32;

/// How a step's sparse tokens reach the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepMode {
    /// FP8 KV: every sparse token through the FP8 decode kernel as one batch.
    MixedBatch,
    /// FP8 KV: decodes through the decode kernel, prefills gathered to BF16
    /// and run through the prefill kernel.
    SeparatePrefillDecode,
    /// BF16 KV: every sparse token through the BF16 prefill kernel.
    Bf16,
}

impl StepMode {
    pub fn name(self) -> &'static str {
        match self {
            StepMode::MixedBatch => "mixed_batch",
            StepMode::SeparatePrefillDecode => "separate_prefill_decode",
            StepMode::Bf16 => "bf16",
        }
    }

    pub fn parse(name: &str) -> Result<StepMode> {
        match name {
            "mixed_batch" => Ok(StepMode::MixedBatch),
            "separate_prefill_decode" => Ok(StepMode::SeparatePrefillDecode),
            "bf16" => Ok(StepMode::Bf16),
            _ => Err(PlanError::InvalidArgument {
                what: "mode",
                rule: "\"mixed_batch\", \"separate_prefill_decode\" or \"bf16\"",
                got: format!("{name:?}"),
            }),
        }
    }
}

/// vLLM's choice of mode: BF16 KV runs the prefill kernel; FP8 KV runs mixed
/// batch below [`MIN_HEADS_FOR_BF16_PREFILL`] heads per rank.
pub fn vllm_step_mode(num_heads: u32, kv_dtype: KvDtype) -> Result<StepMode> {
    crate::geometry::check_heads(num_heads)?;
    Ok(match kv_dtype {
        KvDtype::Bf16 => StepMode::Bf16,
        KvDtype::Fp8 if num_heads < MIN_HEADS_FOR_BF16_PREFILL => StepMode::MixedBatch,
        KvDtype::Fp8 => StepMode::SeparatePrefillDecode,
    })
}

/// What executes a plan, as far as it changes the bytes and the launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Execution {
    /// Every launch translates its own rows of top-k positions (cache slots,
    /// or workspace rows on the separate path) into fresh tensors, instead of
    /// the step translating all rows up front.
    pub translated_indices: bool,
    /// Mixed-batch launch lengths in whole waves of the GPU where that costs
    /// at most one launch more than the fewest.
    pub align_waves: bool,
    /// The decode kernel writes into a caller's `out=`.
    pub decode_takes_out: bool,
    /// The prefill kernel writes into a caller's `out=`.
    pub prefill_takes_out: bool,
    /// The prefill kernel runs the query heads as they are (16 or 32 on SM90,
    /// given a FlashMLA build with native 16/32-head prefill kernels) instead
    /// of the padding vLLM uses: no padded q, a quarter or half of the
    /// kernel's rows.
    pub native_prefill_heads: bool,
    /// vLLM's `prefill_padding`, the head multiple it pads the prefill
    /// kernel's q to (64 or 128); `None`: the padding by architecture
    /// ([`default_prefill_padding`]: 64 on Hopper, 128 on Blackwell).
    pub prefill_padding: Option<u32>,
}

impl Execution {
    /// The vLLM backend on vLLM's own FlashMLA build.
    pub const VLLM: Execution = Execution {
        translated_indices: true,
        align_waves: true,
        decode_takes_out: true,
        prefill_takes_out: true,
        native_prefill_heads: false,
        prefill_padding: None,
    };
}

impl Default for Execution {
    /// Kernels that take `out=`, indices translated up front, fewest launches.
    fn default() -> Self {
        Execution {
            translated_indices: false,
            align_waves: false,
            decode_takes_out: true,
            prefill_takes_out: true,
            native_prefill_heads: false,
            prefill_padding: None,
        }
    }
}

/// Everything a step plan depends on besides the step itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepConfig {
    pub gpu: Gpu,
    /// Query heads per rank (total heads / tensor-parallel size).
    pub num_heads: u32,
    pub topk: u32,
    pub kv_dtype: KvDtype,
    /// Bytes of scratch reserved for attention; launches take at most
    /// [`StepConfig::launch_budget_bytes`] of it.
    pub scratch_budget_bytes: u64,
    /// Rows of the BF16 gather workspace of the separate path.
    pub gather_workspace_rows: u64,
    /// KV rows of the indexer workspace.
    pub indexer_workspace_rows: u64,
    /// Bytes of indexer logits per call.
    pub indexer_logits_bytes: u64,
    pub mask: MaskConfig,
    /// The FP8 mode every step takes; `None` follows vLLM's rule
    /// ([`vllm_step_mode`]). A cost model sets it per step.
    pub mode: Option<StepMode>,
    /// Its `native_prefill_heads` is, like `mode`, what every step takes; a
    /// cost model may also take native heads per step where its profile
    /// prices them (see [`crate::cost`]).
    pub execution: Execution,
}

impl StepConfig {
    /// The configuration vLLM runs for a model: workspaces sized from
    /// `max_model_len` as vLLM sizes them (the gather workspace at 5 rows a
    /// token), its indexer logits budget, its prefill routing (`force_mqa`:
    /// every prefill through sparse MQA), the padding by architecture, and the
    /// backend's execution.
    #[allow(clippy::too_many_arguments)]
    pub fn vllm(
        gpu: Gpu,
        num_heads: u32,
        topk: u32,
        kv_dtype: KvDtype,
        scratch_budget_bytes: u64,
        max_model_len: u64,
        masked_mha: bool,
        force_mqa: bool,
    ) -> Result<StepConfig> {
        let cfg = StepConfig {
            gpu,
            num_heads,
            topk,
            kv_dtype,
            scratch_budget_bytes,
            gather_workspace_rows: mul("gather workspace rows", &[max_model_len, VLLM_GATHER_ROWS_PER_MODEL_LEN])?,
            indexer_workspace_rows: mul("indexer workspace rows", &[max_model_len, VLLM_INDEXER_ROWS_PER_MODEL_LEN])?,
            indexer_logits_bytes: VLLM_INDEXER_LOGITS_BYTES,
            mask: MaskConfig { force_mqa, ..MaskConfig::vllm_default(topk, masked_mha) },
            mode: None,
            execution: Execution::VLLM,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what no plan could use: heads outside 1..=128, a top-k the
    /// kernels refuse, an FP8 mode on a BF16 cache, a budget below the
    /// allocator's reserve, a prefill padding no kernel runs, native prefill
    /// heads no kernel runs.
    pub fn validate(&self) -> Result<()> {
        crate::geometry::check_heads(self.num_heads)?;
        prefill_kernel_heads(
            self.num_heads,
            self.gpu.arch,
            self.execution.native_prefill_heads,
            self.prefill_padding(),
        )?;
        check_topk(self.topk, 64, "topk")?;
        if self.kv_dtype == KvDtype::Bf16 && matches!(self.mode, Some(m) if m != StepMode::Bf16) {
            return Err(PlanError::InvalidArgument {
                what: "mode",
                rule: "\"bf16\" (or unset) with a BF16 KV cache: the FP8 routes need an FP8 cache",
                got: self.mode.map_or("none", StepMode::name).into(),
            });
        }
        if self.kv_dtype == KvDtype::Fp8 && self.mode == Some(StepMode::Bf16) {
            return Err(PlanError::InvalidArgument {
                what: "mode",
                rule: "\"mixed_batch\" or \"separate_prefill_decode\" (or unset) with an FP8 KV cache",
                got: "bf16".into(),
            });
        }
        if self.scratch_budget_bytes <= ALLOCATOR_RESERVE_BYTES {
            return Err(PlanError::InvalidArgument {
                what: "scratch_budget_bytes",
                rule: "more than the allocator's 64 KiB reserve (give at least a few MiB)",
                got: format!("{} bytes", self.scratch_budget_bytes),
            });
        }
        Ok(())
    }

    /// The mode this configuration's steps take.
    pub fn mode(&self) -> StepMode {
        match (self.kv_dtype, self.mode) {
            (KvDtype::Bf16, _) => StepMode::Bf16,
            (KvDtype::Fp8, Some(m)) => m,
            (KvDtype::Fp8, None) if self.num_heads < MIN_HEADS_FOR_BF16_PREFILL => StepMode::MixedBatch,
            (KvDtype::Fp8, None) => StepMode::SeparatePrefillDecode,
        }
    }

    /// The same configuration with every step on `mode`.
    pub fn with_mode(&self, mode: StepMode) -> StepConfig {
        StepConfig { mode: Some(mode), ..*self }
    }

    /// The same configuration with the prefill kernel on native heads or on
    /// vLLM's padding.
    pub fn with_native_prefill_heads(&self, native: bool) -> StepConfig {
        StepConfig { execution: Execution { native_prefill_heads: native, ..self.execution }, ..*self }
    }

    /// Bytes one launch may allocate: the budget less the allocator's reserve.
    pub fn launch_budget_bytes(&self) -> u64 {
        self.scratch_budget_bytes.saturating_sub(ALLOCATOR_RESERVE_BYTES)
    }

    /// Heads the sparse decode kernel runs (64 or 128).
    pub fn decode_heads(&self) -> u32 {
        decode_padded_heads(self.num_heads).unwrap_or(128)
    }

    /// vLLM's `prefill_padding`: the execution's, else the padding by
    /// architecture (64 on SM90, 128 on SM100).
    pub fn prefill_padding(&self) -> u32 {
        self.execution.prefill_padding.unwrap_or_else(|| default_prefill_padding(self.gpu.arch))
    }

    /// Heads the sparse prefill kernel runs: `num_heads` with native prefill
    /// heads, else padded to a multiple of [`Self::prefill_padding`].
    pub fn prefill_heads(&self) -> u32 {
        prefill_kernel_heads(self.num_heads, self.gpu.arch, self.execution.native_prefill_heads, self.prefill_padding())
            .unwrap_or(128)
    }

    /// Heads vLLM pads the prefill kernel's q to, whatever this configuration
    /// runs: what vLLM's own code (and its workspace) uses.
    pub fn prefill_padded_heads(&self) -> u32 {
        prefill_padded_heads(self.num_heads, self.prefill_padding()).unwrap_or(128)
    }

    /// The decode kernel writes straight into the step's output: it takes
    /// `out=` and runs the caller's own head count.
    pub fn decode_writes_in_place(&self) -> bool {
        self.execution.decode_takes_out && self.num_heads == self.decode_heads()
    }

    /// The prefill kernel writes straight into the step's output.
    pub fn prefill_writes_in_place(&self) -> bool {
        self.execution.prefill_takes_out && self.num_heads == self.prefill_heads()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200(num_heads: u32, kv: KvDtype) -> StepConfig {
        StepConfig::vllm(Gpu::h200(), num_heads, 2048, kv, 1 << 30, 70_000, false, true).unwrap()
    }

    #[test]
    fn vllm_derives_workspaces_and_rule() {
        let cfg = h200(16, KvDtype::Fp8);
        assert_eq!(cfg.gather_workspace_rows, 350_000);
        assert_eq!(cfg.indexer_workspace_rows, 2_800_000);
        assert_eq!(cfg.mode(), StepMode::MixedBatch);
        assert_eq!(h200(32, KvDtype::Fp8).mode(), StepMode::SeparatePrefillDecode);
        assert_eq!(h200(16, KvDtype::Bf16).mode(), StepMode::Bf16);
        assert_eq!(cfg.with_mode(StepMode::SeparatePrefillDecode).mode(), StepMode::SeparatePrefillDecode);
        assert_eq!(cfg.launch_budget_bytes(), (1 << 30) - ALLOCATOR_RESERVE_BYTES);
        assert!(!cfg.decode_writes_in_place() && h200(64, KvDtype::Fp8).decode_writes_in_place());
    }

    #[test]
    fn refuses_what_no_plan_can_use() {
        for heads in [0, 129, 1_000_000_000] {
            let err =
                StepConfig::vllm(Gpu::h200(), heads, 2048, KvDtype::Fp8, 1 << 30, 1000, false, false).unwrap_err();
            assert!(err.to_string().contains("num_heads"), "{err}");
        }
        assert!(StepConfig::vllm(Gpu::h200(), 16, 2048, KvDtype::Fp8, 1 << 10, 1000, false, false).is_err());
        assert!(StepConfig::vllm(Gpu::h200(), 16, 2048, KvDtype::Fp8, 1 << 30, u64::MAX, false, false).is_err());
        let bf16 = StepConfig { mode: Some(StepMode::MixedBatch), ..h200(16, KvDtype::Bf16) };
        assert!(bf16.validate().is_err());
        assert!(vllm_step_mode(0, KvDtype::Fp8).is_err());
        // Native prefill heads: 16 or 32 on sm90 only, refused (not clamped) elsewhere.
        for heads in [16, 32] {
            let native = h200(heads, KvDtype::Fp8).with_native_prefill_heads(true);
            native.validate().unwrap();
            assert_eq!((native.prefill_heads(), native.prefill_padded_heads()), (heads, 64));
            assert!(native.prefill_writes_in_place(), "no padding: the kernel writes the caller's out=");
            let mut sm100 = native;
            sm100.gpu = Gpu::new(crate::geometry::Arch::Sm100, 148).unwrap();
            let err = sm100.validate().unwrap_err().to_string();
            assert!(err.contains("native_prefill_heads") && err.contains("sm100"), "{err}");
        }
        let err = h200(64, KvDtype::Fp8).with_native_prefill_heads(true).validate().unwrap_err().to_string();
        assert!(err.contains("64 heads on sm90"), "{err}");
        assert_eq!(vllm_step_mode(16, KvDtype::Fp8).unwrap(), StepMode::MixedBatch);
    }
}
