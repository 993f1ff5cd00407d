//! The planners of one kind of work each (`mla_planner::plan`): mixed-batch
//! launches, prefill launch length, gather and indexer chunks, masked-MHA
//! prefill groups. `plan_step` (in `step`) puts them together for a step.

use std::ops::Range;

use mla_planner::plan::{self, MaskConfig};
use mla_planner::scratch::GLOBAL_TOPK_MASK_MAX_BYTES;
use numpy::{PyArray1, PyArray2};
use pyo3::prelude::*;

use crate::convert::{
    self, bound_name, count, count_or, gather_rows, gpu, heads, indexer_rows, lengths, prefill_requests, ranges, table,
    topk_or_default, OrValueError,
};

/// vLLM's cap on the chunked-context workspace, 64K rows.
pub(crate) const DEFAULT_CONTEXT_CHUNK_ROWS: u64 = 64 * 1024;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MixedBatchPlan>()?;
    m.add_class::<PrefillGroups>()?;
    m.add_function(wrap_pyfunction!(prefill_launch_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(plan_mixed_batch, m)?)?;
    m.add_function(wrap_pyfunction!(split_prefill_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(plan_gather_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(split_indexer_prefill_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(masked_mha_workspace_fits, m)?)?;
    m.add_function(wrap_pyfunction!(plan_prefill_groups, m)?)?;
    Ok(())
}

/// `(tokens, bound)`: the most query tokens one sparse prefill launch may take
/// within `budget_bytes`, and what caps it ("budget" or a hard limit).
/// `padding`: vLLM's `prefill_padding` (default: the padding by architecture).
#[pyfunction]
#[pyo3(signature = (num_heads, *, budget_bytes, arch="sm90", topk=None, out_preallocated=false, translated_indices=false, native_heads=false, padding=None))]
#[allow(clippy::too_many_arguments)]
fn prefill_launch_tokens(
    num_heads: &Bound<'_, PyAny>,
    budget_bytes: &Bound<'_, PyAny>,
    arch: &str,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
    native_heads: bool,
    padding: Option<&Bound<'_, PyAny>>,
) -> PyResult<(u64, &'static str)> {
    let (arch, shape) =
        convert::prefill_shape(1, num_heads, arch, topk, out_preallocated, translated_indices, native_heads, padding)?;
    let budget = count(budget_bytes, "budget_bytes")?;
    let (n, bound) = plan::prefill_launch_tokens(arch, shape, budget).py()?;
    Ok((n, bound_name(bound)))
}

/// Launches of one mixed-batch step.
#[pyclass(frozen, module = "mla_planner._core")]
struct MixedBatchPlan {
    inner: plan::MixedBatchPlan,
}

#[pymethods]
impl MixedBatchPlan {
    /// `(n, 2)` int64 `[start, end)` token ranges, in launch order.
    #[getter]
    fn launches<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let rs: Vec<Range<u64>> = self.inner.launches.iter().map(|l| l.start..l.end).collect();
        ranges(py, &rs)
    }

    /// `(n,)` int64 bytes each launch allocates.
    #[getter]
    fn launch_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.inner.launches.iter().map(|l| l.bytes as i64).collect())
    }

    /// The largest launch's bytes.
    #[getter]
    fn peak_bytes(&self) -> u64 {
        self.inner.peak_bytes
    }

    /// What kept the step from one launch: "none", "budget", "int32_stride" or "grid".
    #[getter]
    fn bound(&self) -> &'static str {
        bound_name(self.inner.bound)
    }

    /// Distinct launch lengths (at most two), ascending.
    #[getter]
    fn distinct_lengths(&self) -> Vec<u64> {
        self.inner.distinct_lengths()
    }

    fn __len__(&self) -> usize {
        self.inner.launches.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "MixedBatchPlan(launches={}, lengths={:?}, peak_bytes={}, bound={:?})",
            self.inner.launches.len(),
            self.inner.distinct_lengths(),
            self.inner.peak_bytes,
            self.bound()
        )
    }
}

/// The fewest contiguous launches of the FP8 decode kernel (`b = 1, s_q = launch`)
/// covering `num_tokens` tokens, each within `budget_bytes` and the kernel's limits.
/// A building block of `plan_step`, which adds the step's shared buffers.
#[pyfunction]
#[pyo3(signature = (num_tokens, *, num_heads, budget_bytes, arch="sm90", num_sms=None, topk=None, out_preallocated=true, translated_indices=false, align_waves=false))]
#[allow(clippy::too_many_arguments)]
fn plan_mixed_batch(
    py: Python<'_>,
    num_tokens: &Bound<'_, PyAny>,
    num_heads: &Bound<'_, PyAny>,
    budget_bytes: &Bound<'_, PyAny>,
    arch: &str,
    num_sms: Option<&Bound<'_, PyAny>>,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
    align_waves: bool,
) -> PyResult<MixedBatchPlan> {
    let cfg = plan::MixedBatchConfig {
        gpu: gpu(arch, num_sms)?,
        num_heads: heads(num_heads)?,
        topk: topk_or_default(topk)?,
        budget_bytes: count(budget_bytes, "budget_bytes")?,
        out_preallocated,
        translated_indices,
        align_waves,
    };
    let t = count(num_tokens, "num_tokens")?;
    let inner = py.detach(|| plan::plan_mixed_batch(t, &cfg)).py()?;
    Ok(MixedBatchPlan { inner })
}

/// vLLM's `split_prefill_chunks`: `(n, 2)` request ranges whose KV rows fit
/// `workspace_rows` (a request longer than the workspace alone in its range).
#[pyfunction]
#[pyo3(signature = (seq_lens, workspace_rows, *, request_offset=None))]
fn split_prefill_chunks<'py>(
    py: Python<'py>,
    seq_lens: &Bound<'py, PyAny>,
    workspace_rows: &Bound<'py, PyAny>,
    request_offset: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let seq = lengths(seq_lens, "seq_lens")?;
    let request_offset = plan::request_offset(count_or(request_offset, "request_offset", 0)?, seq.len()).py()?;
    let w = count(workspace_rows, "workspace_rows")?;
    let chunks = py.detach(|| plan::split_prefill_chunks(&seq, w)).py()?;
    let flat = chunks.iter().flat_map(|r| [r.start as i64 + request_offset, r.end as i64 + request_offset]).collect();
    table(py, chunks.len(), 2, flat)
}

/// `(n, 7)`: req_start, req_end, query_start, query_end, key_start, key_end, rows.
#[pyfunction]
fn plan_gather_chunks<'py>(
    py: Python<'py>,
    query_lens: &Bound<'py, PyAny>,
    context_lens: &Bound<'py, PyAny>,
    workspace_rows: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let reqs = prefill_requests(query_lens, context_lens)?;
    let w = count(workspace_rows, "workspace_rows")?;
    let chunks = py.detach(|| plan::plan_gather_chunks(&reqs, w)).py()?;
    let (n, flat) = gather_rows(&chunks, 0);
    table(py, n, 7, flat)
}

/// `(n, 5)`: req_start, req_end, query_start, query_end, kv_rows.
#[pyfunction]
#[pyo3(signature = (seq_lens, query_lens, workspace_rows, max_logits_bytes, *, request_offset=None))]
fn split_indexer_prefill_chunks<'py>(
    py: Python<'py>,
    seq_lens: &Bound<'py, PyAny>,
    query_lens: &Bound<'py, PyAny>,
    workspace_rows: &Bound<'py, PyAny>,
    max_logits_bytes: &Bound<'py, PyAny>,
    request_offset: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let seq = lengths(seq_lens, "seq_lens")?;
    let request_offset = plan::request_offset(count_or(request_offset, "request_offset", 0)?, seq.len()).py()?;
    let q = lengths(query_lens, "query_lens")?;
    let w = count(workspace_rows, "workspace_rows")?;
    let budget = count(max_logits_bytes, "max_logits_bytes")?;
    let chunks = py.detach(|| plan::split_indexer_prefill_chunks(&seq, &q, w, budget)).py()?;
    let (n, flat) = indexer_rows(&chunks, request_offset);
    table(py, n, 5, flat)
}

/// Whether a prefill set's masks fit (vLLM's `_masked_mha_workspace_fits`).
#[pyfunction]
#[pyo3(signature = (batch_size, max_query_len, max_context_chunk_seq_len, *, workspace_bytes=None))]
fn masked_mha_workspace_fits(
    batch_size: &Bound<'_, PyAny>,
    max_query_len: &Bound<'_, PyAny>,
    max_context_chunk_seq_len: &Bound<'_, PyAny>,
    workspace_bytes: Option<&Bound<'_, PyAny>>,
) -> PyResult<bool> {
    plan::masked_mha_workspace_fits(
        count(batch_size, "batch_size")?,
        count(max_query_len, "max_query_len")?,
        count(max_context_chunk_seq_len, "max_context_chunk_seq_len")?,
        count_or(workspace_bytes, "workspace_bytes", GLOBAL_TOPK_MASK_MAX_BYTES)?,
    )
    .py()
}

/// Prefill groups and the attention path each takes.
#[pyclass(frozen, module = "mla_planner._core")]
pub(crate) struct PrefillGroups {
    pub(crate) groups: Vec<plan::PrefillGroup>,
}

#[pymethods]
impl PrefillGroups {
    /// `(n, 2)` request ranges.
    #[getter]
    fn requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let rs: Vec<Range<u64>> = self.groups.iter().map(|g| g.requests.start as u64..g.requests.end as u64).collect();
        ranges(py, &rs)
    }

    /// Path per group: "dense_mha", "masked_mha" or "sparse_mqa".
    #[getter]
    fn paths(&self) -> Vec<&'static str> {
        self.groups.iter().map(|g| g.path.name()).collect()
    }

    /// `(n,)` bytes of each group's largest mask (0 unless masked MHA).
    #[getter]
    fn mask_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.groups.iter().map(|g| g.mask_bytes as i64).collect())
    }

    fn __len__(&self) -> usize {
        self.groups.len()
    }

    fn __repr__(&self) -> String {
        let parts: Vec<String> =
            self.groups.iter().map(|g| format!("{}..{}:{}", g.requests.start, g.requests.end, g.path.name())).collect();
        format!("PrefillGroups([{}])", parts.join(", "))
    }
}

/// The prefills' attention paths (dense MHA, masked MHA, sparse MQA) in groups:
/// vLLM's all-or-nothing rule with `stock=True`, else the fewest masked-MHA
/// groups whose masks fit and sparse MQA for the rest.
#[pyfunction]
#[pyo3(signature = (query_lens, context_lens, *, topk=None, workspace_bytes=None, context_chunk_rows=None, available=true, stock=false, force_mqa=false))]
#[allow(clippy::too_many_arguments)]
fn plan_prefill_groups(
    py: Python<'_>,
    query_lens: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    topk: Option<&Bound<'_, PyAny>>,
    workspace_bytes: Option<&Bound<'_, PyAny>>,
    context_chunk_rows: Option<&Bound<'_, PyAny>>,
    available: bool,
    stock: bool,
    force_mqa: bool,
) -> PyResult<PrefillGroups> {
    let reqs = prefill_requests(query_lens, context_lens)?;
    let cfg = MaskConfig {
        topk: topk_or_default(topk)?,
        workspace_bytes: count_or(workspace_bytes, "workspace_bytes", GLOBAL_TOPK_MASK_MAX_BYTES)?,
        context_chunk_rows: count_or(context_chunk_rows, "context_chunk_rows", DEFAULT_CONTEXT_CHUNK_ROWS)?,
        available,
        force_mqa,
    };
    let groups = py
        .detach(|| if stock { plan::stock_prefill_groups(&reqs, &cfg) } else { plan::plan_prefill_groups(&reqs, &cfg) })
        .py()?;
    Ok(PrefillGroups { groups })
}
