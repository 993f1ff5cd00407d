//! `StepConfig`: the one step configuration, built once per engine and passed
//! to `plan_step` and the cost model as a single frozen object.

use mla_planner::bounds::{self, EngineLimits};
use mla_planner::config::{self as core, Execution, StepMode};
use mla_planner::geometry::KvDtype;
use mla_planner::plan::MaskConfig;
use mla_planner::scratch::GLOBAL_TOPK_MASK_MAX_BYTES;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{self, count, count_or, getters, gpu, heads, topk_or_default, OrValueError};
use crate::plan::DEFAULT_CONTEXT_CHUNK_ROWS;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MIN_HEADS_FOR_BF16_PREFILL", core::MIN_HEADS_FOR_BF16_PREFILL)?;
    m.add("ALLOCATOR_RESERVE_BYTES", core::ALLOCATOR_RESERVE_BYTES)?;
    m.add_class::<StepConfig>()?;
    Ok(())
}

/// The model, the GPU, the budgets, the workspaces and how plans are executed:
/// everything a step plan depends on besides the step. Frozen; `replace()`
/// makes a changed copy.
#[pyclass(frozen, module = "mla_planner._core")]
pub(crate) struct StepConfig {
    pub(crate) inner: core::StepConfig,
    max_model_len: Option<u64>,
}

impl StepConfig {
    /// `inner` as a configuration derived from this one (same `max_model_len`).
    pub(crate) fn with_inner(&self, inner: core::StepConfig) -> StepConfig {
        StepConfig { inner, max_model_len: self.max_model_len }
    }
}

getters! { StepConfig {
    /// Query heads per rank.
    num_heads: u32 = |c| c.num_heads;
    /// "sm90" or "sm100".
    arch: &'static str = |c| c.gpu.arch.name();
    /// Streaming multiprocessors of the GPU.
    num_sms: u32 = |c| c.gpu.num_sms;
    /// KV tokens each query attends to.
    topk: u32 = |c| c.topk;
    /// "fp8" (fp8_ds_mla) or "bf16".
    kv_dtype: &'static str = |c| c.kv_dtype.name();
    /// Bytes reserved for attention scratch.
    scratch_budget_bytes: u64 = |c| c.scratch_budget_bytes;
    /// Bytes one launch may allocate: the budget less the allocator's reserve.
    launch_budget_bytes: u64 = |c| c.launch_budget_bytes();
    /// Rows of the separate path's BF16 gather workspace.
    gather_workspace_rows: u64 = |c| c.gather_workspace_rows;
    /// KV rows of the indexer workspace.
    indexer_workspace_rows: u64 = |c| c.indexer_workspace_rows;
    /// Bytes of indexer logits one call may hold.
    indexer_logits_bytes: u64 = |c| c.indexer_logits_bytes;
    /// Masked-MHA prefill available (SM100, FA4, BF16 KV).
    masked_mha: bool = |c| c.mask.available;
    /// vLLM runs every prefill through sparse MQA, short ones too.
    force_mqa: bool = |c| c.mask.force_mqa;
    /// Bytes the masked-MHA top-k mask may take.
    mask_workspace_bytes: u64 = |c| c.mask.workspace_bytes;
    /// Rows of one chunked-context chunk (masked MHA).
    context_chunk_rows: u64 = |c| c.mask.context_chunk_rows;
    /// The mode every step takes: the one set, or vLLM's rule.
    mode: &'static str = |c| c.mode().name();
    /// Whether `mode` was set rather than left to vLLM's rule.
    mode_fixed: bool = |c| c.mode.is_some();
    /// Each launch translates its own rows of top-k positions in fresh tensors.
    translated_indices: bool = |c| c.execution.translated_indices;
    /// Mixed-batch launches in whole waves of the GPU where that costs at most one launch more.
    align_waves: bool = |c| c.execution.align_waves;
    /// The decode kernel writes into a caller's `out=`.
    decode_takes_out: bool = |c| c.execution.decode_takes_out;
    /// The prefill kernel writes into a caller's `out=`.
    prefill_takes_out: bool = |c| c.execution.prefill_takes_out;
    /// The prefill kernel runs the query heads unpadded (16 or 32 on sm90).
    native_prefill_heads: bool = |c| c.execution.native_prefill_heads;
    /// vLLM's `prefill_padding`, the head multiple it pads the prefill
    /// kernel's q to: the one given, else the padding by architecture (64 on
    /// sm90, 128 on sm100).
    prefill_padding: u32 = |c| c.prefill_padding();
    /// Heads the sparse decode kernel runs (64 or 128).
    decode_heads: u32 = |c| c.decode_heads();
    /// Heads the sparse prefill kernel runs: the query heads with
    /// `native_prefill_heads`, else `prefill_padded_heads`.
    prefill_heads: u32 = |c| c.prefill_heads();
    /// Heads vLLM pads the prefill kernel's q to (what its own code runs).
    prefill_padded_heads: u32 = |c| c.prefill_padded_heads();
    /// The prefill kernel can run these heads unpadded on this GPU (16 or 32
    /// on sm90), given a FlashMLA build with those kernels.
    native_prefill_heads_possible: bool = |c| mla_planner::geometry::prefill_runs_native(c.num_heads, c.gpu.arch);
    /// The decode kernel writes straight into the step's output.
    decode_writes_in_place: bool = |c| c.decode_writes_in_place();
    /// The prefill kernel writes straight into the step's output.
    prefill_writes_in_place: bool = |c| c.prefill_writes_in_place();
} }

fn limits(max_step_tokens: &Bound<'_, PyAny>, max_decode_query_len: &Bound<'_, PyAny>) -> PyResult<EngineLimits> {
    Ok(EngineLimits {
        max_step_tokens: count(max_step_tokens, "max_step_tokens")?,
        max_decode_query_len: count(max_decode_query_len, "max_decode_query_len")?,
    })
}

fn execution(name: &str) -> PyResult<Execution> {
    match name {
        "default" => Ok(Execution::default()),
        "vllm" => Ok(Execution::VLLM),
        _ => Err(PyValueError::new_err(format!("execution must be \"default\" or \"vllm\", got {name:?}"))),
    }
}

#[pymethods]
impl StepConfig {
    /// Workspaces: give `max_model_len` and they are sized as vLLM sizes them
    /// (gather 5x, indexer 40x), or give the rows. `execution="vllm"` is the
    /// vLLM backend's way of running plans (indices translated per launch,
    /// wave-aligned launches, kernels that take `out=`); each of its four
    /// flags can be set on its own. `mode`: "mixed_batch" or
    /// "separate_prefill_decode" fixes the FP8 route; None follows vLLM.
    /// `native_prefill_heads`: the prefill kernel runs 16 or 32 heads (sm90)
    /// unpadded, given a FlashMLA build with native 16/32-head prefill
    /// kernels; default: vLLM's padding. `prefill_padding`: that padding's
    /// head multiple (64 or 128); default the padding by architecture (64 on
    /// sm90, 128 on sm100), which a build with 64-head sm100 kernels lowers
    /// to 64 there.
    #[new]
    #[pyo3(signature = (
        num_heads, *, arch="sm90", num_sms=None, topk=None, kv_dtype="fp8", scratch_budget_bytes=None,
        max_model_len=None, gather_workspace_rows=None, indexer_workspace_rows=None, indexer_logits_bytes=None,
        masked_mha=false, force_mqa=false, mask_workspace_bytes=None, context_chunk_rows=None, mode=None,
        execution="default", translated_indices=None, align_waves=None, decode_takes_out=None, prefill_takes_out=None,
        native_prefill_heads=false, prefill_padding=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_heads: &Bound<'_, PyAny>,
        arch: &str,
        num_sms: Option<&Bound<'_, PyAny>>,
        topk: Option<&Bound<'_, PyAny>>,
        kv_dtype: &str,
        scratch_budget_bytes: Option<&Bound<'_, PyAny>>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        gather_workspace_rows: Option<&Bound<'_, PyAny>>,
        indexer_workspace_rows: Option<&Bound<'_, PyAny>>,
        indexer_logits_bytes: Option<&Bound<'_, PyAny>>,
        masked_mha: bool,
        force_mqa: bool,
        mask_workspace_bytes: Option<&Bound<'_, PyAny>>,
        context_chunk_rows: Option<&Bound<'_, PyAny>>,
        mode: Option<&str>,
        execution: &str,
        translated_indices: Option<bool>,
        align_waves: Option<bool>,
        decode_takes_out: Option<bool>,
        prefill_takes_out: Option<bool>,
        native_prefill_heads: bool,
        prefill_padding: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let topk = topk_or_default(topk)?;
        let kv_dtype = kv_dtype.parse::<KvDtype>().py()?;
        let budget = count_or(scratch_budget_bytes, "scratch_budget_bytes", 1 << 30)?;
        let model_len = max_model_len.map(|m| count(m, "max_model_len")).transpose()?;
        if model_len == Some(0) {
            return Err(PyValueError::new_err("max_model_len must be at least 1"));
        }
        let base = match model_len {
            Some(len) => core::StepConfig::vllm(
                gpu(arch, num_sms)?,
                heads(num_heads)?,
                topk,
                kv_dtype,
                budget,
                len,
                masked_mha,
                force_mqa,
            ),
            None => core::StepConfig::vllm(
                gpu(arch, num_sms)?,
                heads(num_heads)?,
                topk,
                kv_dtype,
                budget,
                1,
                masked_mha,
                force_mqa,
            ),
        }
        .py()?;
        let rows = |obj: Option<&Bound<'_, PyAny>>, name: &str, derived: u64| -> PyResult<u64> {
            match (obj, model_len) {
                (Some(o), _) => count(o, name),
                (None, Some(_)) => Ok(derived),
                (None, None) => Err(PyValueError::new_err(format!(
                    "give max_model_len (vLLM sizes its workspaces from it) or {name}"
                ))),
            }
        };
        let defaults = self::execution(execution)?;
        let inner = core::StepConfig {
            gather_workspace_rows: rows(gather_workspace_rows, "gather_workspace_rows", base.gather_workspace_rows)?,
            indexer_workspace_rows: rows(
                indexer_workspace_rows,
                "indexer_workspace_rows",
                base.indexer_workspace_rows,
            )?,
            indexer_logits_bytes: count_or(indexer_logits_bytes, "indexer_logits_bytes", base.indexer_logits_bytes)?,
            mask: MaskConfig {
                workspace_bytes: count_or(mask_workspace_bytes, "mask_workspace_bytes", GLOBAL_TOPK_MASK_MAX_BYTES)?,
                context_chunk_rows: count_or(context_chunk_rows, "context_chunk_rows", DEFAULT_CONTEXT_CHUNK_ROWS)?,
                ..base.mask
            },
            mode: mode.map(StepMode::parse).transpose().py()?,
            execution: Execution {
                translated_indices: translated_indices.unwrap_or(defaults.translated_indices),
                align_waves: align_waves.unwrap_or(defaults.align_waves),
                decode_takes_out: decode_takes_out.unwrap_or(defaults.decode_takes_out),
                prefill_takes_out: prefill_takes_out.unwrap_or(defaults.prefill_takes_out),
                native_prefill_heads,
                prefill_padding: convert::prefill_padding(prefill_padding)?,
            },
            ..base
        };
        inner.validate().py()?;
        Ok(StepConfig { inner, max_model_len: model_len })
    }

    /// The `max_model_len` the workspaces were sized from, if given.
    #[getter]
    fn max_model_len(&self) -> Option<u64> {
        self.max_model_len
    }

    /// The smallest `scratch_budget_bytes` under which every step of this configuration's
    /// route plans, for an engine whose steps carry at most `max_step_tokens` tokens and whose
    /// decodes at most `max_decode_query_len` tokens each (vLLM's decode threshold).
    #[pyo3(signature = (max_step_tokens, max_decode_query_len))]
    fn min_scratch_budget(
        &self,
        max_step_tokens: &Bound<'_, PyAny>,
        max_decode_query_len: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        bounds::min_scratch_budget(&self.inner, limits(max_step_tokens, max_decode_query_len)?).py()
    }

    /// The most one launch of any plan of this configuration's route allocates, for the same
    /// engine limits, less its padded q and kernel output where the kernel runs `served_heads`
    /// (the heads of a caller's workspace views that hold both; `None`: no such workspace).
    #[pyo3(signature = (max_step_tokens, max_decode_query_len, served_heads=None))]
    fn largest_launch_bytes(
        &self,
        max_step_tokens: &Bound<'_, PyAny>,
        max_decode_query_len: &Bound<'_, PyAny>,
        served_heads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let served = served_heads.map(heads).transpose()?;
        bounds::largest_launch_bytes(&self.inner, limits(max_step_tokens, max_decode_query_len)?, served).py()
    }

    /// The bounded path's configurations, one per rung: mixed batch, every launch's bytes within
    /// `allowance` (the bytes reserved for one launch), each rung's launches a `shrink`th of the
    /// one before, down to one token. `ValueError` where not even one token fits `allowance`.
    #[pyo3(signature = (allowance, shrink=None))]
    fn bounded_configs(
        &self,
        allowance: &Bound<'_, PyAny>,
        shrink: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<StepConfig>> {
        let shrink = count_or(shrink, "shrink", 4)?;
        let configs = bounds::bounded_configs(&self.inner, count(allowance, "allowance")?, shrink).py()?;
        Ok(configs.into_iter().map(|c| self.with_inner(c)).collect())
    }

    /// The arguments that rebuild this configuration.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        d.set_item("num_heads", c.num_heads)?;
        d.set_item("arch", c.gpu.arch.name())?;
        d.set_item("num_sms", c.gpu.num_sms)?;
        d.set_item("topk", c.topk)?;
        d.set_item("kv_dtype", c.kv_dtype.name())?;
        d.set_item("scratch_budget_bytes", c.scratch_budget_bytes)?;
        d.set_item("max_model_len", self.max_model_len)?;
        d.set_item("gather_workspace_rows", c.gather_workspace_rows)?;
        d.set_item("indexer_workspace_rows", c.indexer_workspace_rows)?;
        d.set_item("indexer_logits_bytes", c.indexer_logits_bytes)?;
        d.set_item("masked_mha", c.mask.available)?;
        d.set_item("force_mqa", c.mask.force_mqa)?;
        d.set_item("mask_workspace_bytes", c.mask.workspace_bytes)?;
        d.set_item("context_chunk_rows", c.mask.context_chunk_rows)?;
        d.set_item("mode", c.mode.map(StepMode::name))?;
        d.set_item("translated_indices", c.execution.translated_indices)?;
        d.set_item("align_waves", c.execution.align_waves)?;
        d.set_item("decode_takes_out", c.execution.decode_takes_out)?;
        d.set_item("prefill_takes_out", c.execution.prefill_takes_out)?;
        d.set_item("native_prefill_heads", c.execution.native_prefill_heads)?;
        d.set_item("prefill_padding", c.execution.prefill_padding)?;
        Ok(d)
    }

    /// A copy with the given arguments changed (as the constructor takes
    /// them). A new `max_model_len` sizes the workspaces anew unless their
    /// rows are given too; otherwise they keep their rows.
    #[pyo3(signature = (**changes))]
    fn replace<'py>(slf: &Bound<'py, Self>, changes: Option<&Bound<'py, PyDict>>) -> PyResult<Bound<'py, PyAny>> {
        let args = slf.get().to_dict(slf.py())?;
        if let Some(changes) = changes {
            if changes.contains("max_model_len")? {
                for rows in ["gather_workspace_rows", "indexer_workspace_rows"] {
                    if !changes.contains(rows)? {
                        args.del_item(rows)?;
                    }
                }
            }
            args.update(changes.as_mapping())?;
        }
        slf.get_type().call((), Some(&args))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<StepConfig>().map(|o| o.get().inner == self.inner).unwrap_or(false)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{:?}", self.inner).hash(&mut h);
        h.finish()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let d = self.to_dict(py)?;
        let parts: Vec<String> =
            d.iter().map(|(k, v)| format!("{k}={}", v.repr().map(|r| r.to_string()).unwrap_or_default())).collect();
        Ok(format!("StepConfig({})", parts.join(", ")))
    }
}
