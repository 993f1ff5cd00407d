//! `mla_planner._core`: the planner crate as a Python module. Thin on
//! purpose: convert arguments, release the GIL around planning, wrap results
//! in frozen classes that hand out fresh numpy arrays. Every planner error
//! becomes one `ValueError` with the planner's message.

mod cost;

use std::ops::Range;

use mla_planner::geometry::{Arch, Gpu, KvDtype, DEFAULT_TOPK, H200_NUM_SMS};
use mla_planner::plan::{self, Bound as PlanBound, GatherChunk, MaskConfig, PrefillRequest};
use mla_planner::scratch::{self, Breakdown, DecodeShape, PrefillShape, GLOBAL_TOPK_MASK_MAX_BYTES};
use mla_planner::step::{self, StepConfig};
use mla_planner::PlanError;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

/// vLLM's `VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` default, 512 MiB.
const DEFAULT_INDEXER_LOGITS_BYTES: u64 = 512 << 20;
/// vLLM's cap on the chunked-context workspace, 64K rows.
const DEFAULT_CONTEXT_CHUNK_ROWS: u64 = 64 * 1024;

fn value_error(e: PlanError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

trait OrValueError<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrValueError<T> for Result<T, PlanError> {
    fn py(self) -> PyResult<T> {
        self.map_err(value_error)
    }
}

/// A non-negative Python int (not a bool, not a float) as `u64`.
fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let bad = || PyValueError::new_err(format!("{name} must be a non-negative integer, got {}", repr(obj)));
    if obj.is_instance_of::<PyBool>() {
        return Err(bad());
    }
    let index = obj.call_method0("__index__").map_err(|_| bad())?;
    let value: i128 = index.extract().map_err(|_| bad())?;
    u64::try_from(value).map_err(|_| bad())
}

fn count_or(obj: Option<&Bound<'_, PyAny>>, name: &str, default: u64) -> PyResult<u64> {
    obj.map_or(Ok(default), |o| count(o, name))
}

fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<unprintable>".into())
}

/// A 1-D array-like of non-negative integers as `Vec<u64>`.
fn lengths(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    let py = obj.py();
    let np = py.import("numpy")?;
    let arr = np
        .call_method1("asarray", (obj,))
        .map_err(|e| PyValueError::new_err(format!("{name} must be a 1-D array of integers: {e}")))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    let size: usize = arr.getattr("size")?.extract()?;
    if ndim == 1 && size == 0 {
        // `np.asarray([])` is float64; an empty list is still no lengths.
        return Ok(Vec::new());
    }
    if ndim != 1 || !(kind == "i" || kind == "u") {
        let dtype = arr.getattr("dtype")?.str()?.to_string();
        return Err(PyValueError::new_err(format!(
            "{name} must be a 1-D array of integers, got a {ndim}-D array of {dtype}"
        )));
    }
    if kind == "u" {
        let too_big: bool = arr.call_method0("max").and_then(|m| m.gt(i64::MAX)).unwrap_or(false);
        if too_big {
            return Err(PyValueError::new_err(format!("{name} has a value above 2**63 - 1")));
        }
    }
    let arr = arr.call_method1("astype", ("int64",))?;
    let arr: PyReadonlyArray1<'_, i64> = arr.extract()?;
    arr.as_array()
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u64::try_from(v).map_err(|_| PyValueError::new_err(format!("{name}[{i}] must be non-negative, got {v}")))
        })
        .collect()
}

fn heads(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let n = count(obj, "num_heads")?;
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("num_heads must be between 1 and 128, got {n}")))
}

/// `topk`, or DeepSeek-V3.2's 2048 when not given.
fn topk_or_default(obj: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
    let n = count_or(obj, "topk", u64::from(DEFAULT_TOPK))?;
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("topk is far too large: {n}")))
}

/// The GPU for `arch`, with an H200's 132 SMs unless `num_sms` is given.
fn gpu(arch: &str, num_sms: Option<&Bound<'_, PyAny>>) -> PyResult<Gpu> {
    let sms = count_or(num_sms, "num_sms", u64::from(H200_NUM_SMS))?;
    let sms = u32::try_from(sms).map_err(|_| PyValueError::new_err(format!("num_sms is far too large: {sms}")))?;
    Gpu::new(arch.parse::<Arch>().py()?, sms).py()
}

fn table<'py>(py: Python<'py>, rows: usize, cols: usize, flat: Vec<i64>) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let arr = Array2::from_shape_vec((rows, cols), flat).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(arr.into_pyarray(py))
}

fn ranges<'py>(py: Python<'py>, rs: &[Range<u64>]) -> PyResult<Bound<'py, PyArray2<i64>>> {
    table(py, rs.len(), 2, rs.iter().flat_map(|r| [r.start as i64, r.end as i64]).collect())
}

fn bound_name(b: PlanBound) -> &'static str {
    match b {
        PlanBound::Unbounded => "none",
        PlanBound::Budget => "budget",
        PlanBound::Limit(mla_planner::limits::HardLimit::Int32Stride) => "int32_stride",
        PlanBound::Limit(mla_planner::limits::HardLimit::Grid) => "grid",
    }
}

/// The buffers one kernel call allocates.
#[pyclass(frozen, module = "mla_planner._core")]
struct Scratch {
    buffers: Vec<(&'static str, u64)>,
}

impl From<Breakdown> for Scratch {
    fn from(bd: Breakdown) -> Self {
        Scratch { buffers: bd.buffers.iter().map(|b| (b.name, b.bytes)).collect() }
    }
}

#[pymethods]
impl Scratch {
    /// Buffer name -> bytes, in allocation order.
    #[getter]
    fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, bytes) in &self.buffers {
            d.set_item(name, bytes)?;
        }
        Ok(d)
    }

    #[getter]
    fn total_bytes(&self) -> u64 {
        self.buffers.iter().map(|(_, b)| b).sum()
    }

    fn __repr__(&self) -> String {
        let parts: Vec<String> = self.buffers.iter().map(|(n, b)| format!("{n}={b}")).collect();
        format!("Scratch(total_bytes={}, {})", self.total_bytes(), parts.join(", "))
    }
}

#[pyfunction]
#[pyo3(signature = (batch, s_q, num_heads, *, arch="sm90", num_sms=None, topk=None, out_preallocated=false, translated_indices=false))]
#[allow(clippy::too_many_arguments)]
fn decode_scratch(
    batch: &Bound<'_, PyAny>,
    s_q: &Bound<'_, PyAny>,
    num_heads: &Bound<'_, PyAny>,
    arch: &str,
    num_sms: Option<&Bound<'_, PyAny>>,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
) -> PyResult<Scratch> {
    let g = gpu(arch, num_sms)?;
    let shape = DecodeShape {
        batch: count(batch, "batch")?,
        s_q: count(s_q, "s_q")?,
        num_heads: heads(num_heads)?,
        topk: topk_or_default(topk)?,
        out_preallocated,
        translated_indices,
    };
    Ok(scratch::decode_scratch(g, shape).py()?.into())
}

#[pyfunction]
#[pyo3(signature = (s_q, num_heads, *, arch="sm90", topk=None, out_preallocated=false, translated_indices=false))]
fn prefill_scratch(
    s_q: &Bound<'_, PyAny>,
    num_heads: &Bound<'_, PyAny>,
    arch: &str,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
) -> PyResult<Scratch> {
    let shape = PrefillShape {
        s_q: count(s_q, "s_q")?,
        num_heads: heads(num_heads)?,
        topk: topk_or_default(topk)?,
        out_preallocated,
        translated_indices,
    };
    Ok(scratch::prefill_scratch(arch.parse::<Arch>().py()?, shape).py()?.into())
}

#[pyfunction]
#[pyo3(signature = (num_heads, *, budget_bytes, arch="sm90", topk=None, out_preallocated=false, translated_indices=false))]
fn prefill_launch_tokens(
    num_heads: &Bound<'_, PyAny>,
    budget_bytes: &Bound<'_, PyAny>,
    arch: &str,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
) -> PyResult<(u64, &'static str)> {
    let shape = PrefillShape {
        s_q: 1,
        num_heads: heads(num_heads)?,
        topk: topk_or_default(topk)?,
        out_preallocated,
        translated_indices,
    };
    let budget = count(budget_bytes, "budget_bytes")?;
    let (n, bound) = plan::prefill_launch_tokens(arch.parse::<Arch>().py()?, shape, budget).py()?;
    Ok((n, bound_name(bound)))
}

fn mask_shape(
    batch_size: &Bound<'_, PyAny>,
    max_query_len: &Bound<'_, PyAny>,
    max_key_len: &Bound<'_, PyAny>,
    reserve_key_starts_word: bool,
) -> PyResult<scratch::MaskShape> {
    scratch::topk_mask_shape(
        count(batch_size, "batch_size")?,
        count(max_query_len, "max_query_len")?,
        count(max_key_len, "max_key_len")?,
        reserve_key_starts_word,
    )
    .py()
}

#[pyfunction]
#[pyo3(signature = (batch_size, max_query_len, max_key_len, *, reserve_key_starts_word=false))]
fn topk_mask_shape(
    batch_size: &Bound<'_, PyAny>,
    max_query_len: &Bound<'_, PyAny>,
    max_key_len: &Bound<'_, PyAny>,
    reserve_key_starts_word: bool,
) -> PyResult<(u64, u64, u64)> {
    let s = mask_shape(batch_size, max_query_len, max_key_len, reserve_key_starts_word)?;
    Ok((s.batch, s.rows, s.words))
}

#[pyfunction]
#[pyo3(signature = (batch_size, max_query_len, max_key_len, *, reserve_key_starts_word=false))]
fn topk_mask_bytes(
    batch_size: &Bound<'_, PyAny>,
    max_query_len: &Bound<'_, PyAny>,
    max_key_len: &Bound<'_, PyAny>,
    reserve_key_starts_word: bool,
) -> PyResult<u64> {
    mask_shape(batch_size, max_query_len, max_key_len, reserve_key_starts_word)?.bytes().py()
}

#[pyfunction]
fn gather_workspace_bytes(rows: &Bound<'_, PyAny>) -> PyResult<u64> {
    scratch::gather_workspace_bytes(count(rows, "rows")?).py()
}

#[pyfunction]
fn indexer_logits_bytes(query_rows: &Bound<'_, PyAny>, kv_rows: &Bound<'_, PyAny>) -> PyResult<u64> {
    scratch::indexer_logits_bytes(count(query_rows, "query_rows")?, count(kv_rows, "kv_rows")?).py()
}

/// `(tokens, limit)`: the most query tokens one decode call may carry at
/// `num_heads` and the limit that sets it.
#[pyfunction]
fn max_tokens_per_launch(num_heads: &Bound<'_, PyAny>) -> PyResult<(u64, &'static str)> {
    let padded = mla_planner::geometry::decode_padded_heads(heads(num_heads)?).py()?;
    let (n, limit) = mla_planner::limits::max_tokens_per_launch(padded);
    Ok((n, bound_name(PlanBound::Limit(limit))))
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
    fn chunks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let rs: Vec<Range<u64>> = self.inner.launches.iter().map(|l| l.start..l.end).collect();
        ranges(py, &rs)
    }

    /// `(n,)` int64 bytes each launch allocates.
    #[getter]
    fn launch_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.inner.launches.iter().map(|l| l.bytes as i64).collect())
    }

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

#[pyfunction]
#[pyo3(signature = (seq_lens, workspace_rows, *, request_offset=None))]
fn split_prefill_chunks<'py>(
    py: Python<'py>,
    seq_lens: &Bound<'py, PyAny>,
    workspace_rows: &Bound<'py, PyAny>,
    request_offset: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let request_offset = count_or(request_offset, "request_offset", 0)? as i64;
    let seq = lengths(seq_lens, "seq_lens")?;
    let w = count(workspace_rows, "workspace_rows")?;
    let chunks = py.detach(|| plan::split_prefill_chunks(&seq, w)).py()?;
    let flat = chunks.iter().flat_map(|r| [r.start as i64 + request_offset, r.end as i64 + request_offset]).collect();
    table(py, chunks.len(), 2, flat)
}

fn gather_rows(chunks: &[GatherChunk], offset: i64) -> (usize, Vec<i64>) {
    let flat = chunks
        .iter()
        .flat_map(|c| match c {
            GatherChunk::Requests { requests, rows } => {
                [requests.start as i64 + offset, requests.end as i64 + offset, -1, -1, -1, -1, *rows as i64]
            }
            GatherChunk::Split { request, query, keys } => [
                *request as i64 + offset,
                *request as i64 + offset + 1,
                query.start as i64,
                query.end as i64,
                keys.start as i64,
                keys.end as i64,
                (keys.end - keys.start) as i64,
            ],
        })
        .collect();
    (chunks.len(), flat)
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

fn prefill_requests(query_lens: &Bound<'_, PyAny>, context_lens: &Bound<'_, PyAny>) -> PyResult<Vec<PrefillRequest>> {
    let q = lengths(query_lens, "query_lens")?;
    let c = lengths(context_lens, "context_lens")?;
    if q.len() != c.len() {
        return Err(value_error(PlanError::LengthMismatch {
            what: "context_lens",
            got: c.len(),
            other: "query_lens",
            expected: q.len(),
        }));
    }
    q.iter()
        .zip(&c)
        .map(|(&query_len, &context_len)| {
            query_len.checked_add(context_len).ok_or_else(|| value_error(PlanError::Overflow { what: "seq_len" }))?;
            Ok(PrefillRequest { query_len, context_len })
        })
        .collect()
}

fn indexer_rows(chunks: &[plan::IndexerChunk], offset: i64) -> (usize, Vec<i64>) {
    let flat = chunks
        .iter()
        .flat_map(|c| {
            [
                c.requests.start as i64 + offset,
                c.requests.end as i64 + offset,
                c.query.start as i64,
                c.query.end as i64,
                c.kv_rows as i64,
            ]
        })
        .collect();
    (chunks.len(), flat)
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
    let request_offset = count_or(request_offset, "request_offset", 0)? as i64;
    let seq = lengths(seq_lens, "seq_lens")?;
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

/// Prefill groups and their routes.
#[pyclass(frozen, module = "mla_planner._core")]
struct PrefillGroups {
    groups: Vec<plan::PrefillGroup>,
}

#[pymethods]
impl PrefillGroups {
    /// `(n, 2)` request ranges.
    #[getter]
    fn requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let rs: Vec<Range<u64>> = self.groups.iter().map(|g| g.requests.start as u64..g.requests.end as u64).collect();
        ranges(py, &rs)
    }

    /// Route per group: "dense_mha", "masked_mha" or "sparse_mqa".
    #[getter]
    fn routes(&self) -> Vec<&'static str> {
        self.groups.iter().map(|g| g.route.name()).collect()
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
            self.groups.iter().map(|g| format!("{}..{}:{}", g.requests.start, g.requests.end, g.route.name())).collect();
        format!("PrefillGroups([{}])", parts.join(", "))
    }
}

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
        .detach(|| if stock { plan::route_prefills_stock(&reqs, &cfg) } else { plan::plan_prefill_groups(&reqs, &cfg) })
        .py()?;
    Ok(PrefillGroups { groups })
}

/// A planned scheduler step.
#[pyclass(frozen, module = "mla_planner._core")]
struct StepPlan {
    inner: step::StepPlan,
}

#[pymethods]
impl StepPlan {
    /// "mixed_batch", "separate_prefill_decode" or "bf16".
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode.name()
    }

    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens
    }

    #[getter]
    fn num_decodes(&self) -> usize {
        self.inner.num_decodes
    }

    /// `(n, 4)` int64: token_start, token_end, req_start, req_end per launch.
    #[getter]
    fn launches<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let l = &self.inner.launches;
        let flat = l
            .iter()
            .flat_map(|k| [k.tokens.start as i64, k.tokens.end as i64, k.requests.start as i64, k.requests.end as i64])
            .collect();
        table(py, l.len(), 4, flat)
    }

    /// Kernel per launch: "sparse_decode" or "sparse_prefill".
    #[getter]
    fn launch_kernels(&self) -> Vec<&'static str> {
        self.inner.launches.iter().map(|l| l.kernel.name()).collect()
    }

    /// `(n,)` int64 bytes each launch allocates.
    #[getter]
    fn launch_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.inner.launches.iter().map(|l| l.bytes as i64).collect())
    }

    #[getter]
    fn bound(&self) -> &'static str {
        bound_name(self.inner.bound)
    }

    #[getter]
    fn peak_bytes(&self) -> u64 {
        self.inner.peak_bytes
    }

    #[getter]
    fn prefill_groups(&self) -> PrefillGroups {
        PrefillGroups { groups: self.inner.prefill_groups.clone() }
    }

    /// `(n, 7)`: as `plan_gather_chunks`, request indices from the step's first request.
    #[getter]
    fn gather_chunks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let (n, flat) = gather_rows(&self.inner.gather_chunks, 0);
        table(py, n, 7, flat)
    }

    /// `(n, 5)`: as `split_indexer_prefill_chunks`, request indices from the step's first request.
    #[getter]
    fn indexer_chunks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let (n, flat) = indexer_rows(&self.inner.indexer_chunks, 0);
        table(py, n, 5, flat)
    }

    #[getter]
    fn indexer_peak_bytes(&self) -> u64 {
        self.inner.indexer_peak_bytes
    }

    #[getter]
    fn gather_workspace_bytes(&self) -> u64 {
        self.inner.gather_workspace_bytes
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(mode={:?}, num_tokens={}, launches={}, peak_bytes={}, bound={:?})",
            self.mode(),
            self.inner.num_tokens,
            self.inner.launches.len(),
            self.inner.peak_bytes,
            self.bound()
        )
    }
}

/// A step and its configuration from `plan_step`'s arguments; the cost model's `predict` and
/// `choose_route` take the same ones.
pub(crate) struct StepArgs {
    query_lens: Vec<u64>,
    context_lens: Vec<u64>,
    num_decodes: usize,
    pub(crate) cfg: StepConfig,
}

impl StepArgs {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn parse(
        query_lens: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_decodes: &Bound<'_, PyAny>,
        gpu: Gpu,
        num_heads: &Bound<'_, PyAny>,
        budget_bytes: &Bound<'_, PyAny>,
        kv_dtype: KvDtype,
        topk: Option<&Bound<'_, PyAny>>,
        gather_workspace_rows: &Bound<'_, PyAny>,
        indexer_workspace_rows: &Bound<'_, PyAny>,
        indexer_logits_bytes: Option<&Bound<'_, PyAny>>,
        mask_workspace_bytes: Option<&Bound<'_, PyAny>>,
        context_chunk_rows: Option<&Bound<'_, PyAny>>,
        masked_mha_available: bool,
        force_mqa: bool,
        mixed_batch: Option<bool>,
    ) -> PyResult<Self> {
        let topk = topk_or_default(topk)?;
        let cfg = StepConfig {
            gpu,
            num_heads: heads(num_heads)?,
            topk,
            kv_dtype,
            scratch_budget_bytes: count(budget_bytes, "budget_bytes")?,
            gather_workspace_rows: count(gather_workspace_rows, "gather_workspace_rows")?,
            indexer_workspace_rows: count(indexer_workspace_rows, "indexer_workspace_rows")?,
            indexer_logits_bytes: count_or(indexer_logits_bytes, "indexer_logits_bytes", DEFAULT_INDEXER_LOGITS_BYTES)?,
            mask: MaskConfig {
                topk,
                workspace_bytes: count_or(mask_workspace_bytes, "mask_workspace_bytes", GLOBAL_TOPK_MASK_MAX_BYTES)?,
                context_chunk_rows: count_or(context_chunk_rows, "context_chunk_rows", DEFAULT_CONTEXT_CHUNK_ROWS)?,
                available: masked_mha_available,
                force_mqa,
            },
            mixed_batch,
        };
        Ok(StepArgs {
            query_lens: lengths(query_lens, "query_lens")?,
            context_lens: lengths(context_lens, "context_lens")?,
            num_decodes: usize::try_from(count(num_decodes, "num_decodes")?).unwrap_or(usize::MAX),
            cfg,
        })
    }

    pub(crate) fn step(&self) -> step::Step<'_> {
        step::Step { query_lens: &self.query_lens, context_lens: &self.context_lens, num_decodes: self.num_decodes }
    }
}

#[pyfunction]
#[pyo3(signature = (
    query_lens, context_lens, num_decodes, *, num_heads, budget_bytes, kv_dtype="fp8", arch="sm90",
    num_sms=None, topk=None, gather_workspace_rows, indexer_workspace_rows, indexer_logits_bytes=None,
    mask_workspace_bytes=None, context_chunk_rows=None, masked_mha_available=false,
    mixed_batch=None, force_mqa=false,
))]
#[allow(clippy::too_many_arguments)]
fn plan_step<'py>(
    py: Python<'py>,
    query_lens: &Bound<'py, PyAny>,
    context_lens: &Bound<'py, PyAny>,
    num_decodes: &Bound<'py, PyAny>,
    num_heads: &Bound<'py, PyAny>,
    budget_bytes: &Bound<'py, PyAny>,
    kv_dtype: &str,
    arch: &str,
    num_sms: Option<&Bound<'py, PyAny>>,
    topk: Option<&Bound<'py, PyAny>>,
    gather_workspace_rows: &Bound<'py, PyAny>,
    indexer_workspace_rows: &Bound<'py, PyAny>,
    indexer_logits_bytes: Option<&Bound<'py, PyAny>>,
    mask_workspace_bytes: Option<&Bound<'py, PyAny>>,
    context_chunk_rows: Option<&Bound<'py, PyAny>>,
    masked_mha_available: bool,
    mixed_batch: Option<bool>,
    force_mqa: bool,
) -> PyResult<StepPlan> {
    let args = StepArgs::parse(
        query_lens, context_lens, num_decodes, gpu(arch, num_sms)?, num_heads, budget_bytes,
        kv_dtype.parse::<KvDtype>().py()?, topk, gather_workspace_rows, indexer_workspace_rows, indexer_logits_bytes,
        mask_workspace_bytes, context_chunk_rows, masked_mha_available, force_mqa, mixed_batch,
    )?; // fmt: skip
    let inner = py.detach(|| step::plan_step(args.step(), &args.cfg)).py()?;
    Ok(StepPlan { inner })
}

/// The mode `plan_step` runs a step in: "mixed_batch", "separate_prefill_decode" or "bf16".
#[pyfunction]
#[pyo3(signature = (num_heads, *, kv_dtype="fp8", mixed_batch=None))]
fn step_mode(num_heads: &Bound<'_, PyAny>, kv_dtype: &str, mixed_batch: Option<bool>) -> PyResult<&'static str> {
    let kv_dtype = kv_dtype.parse::<KvDtype>().py()?;
    Ok(step::step_mode(heads(num_heads)?, kv_dtype, mixed_batch).name())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GLOBAL_TOPK_MASK_MAX_BYTES", GLOBAL_TOPK_MASK_MAX_BYTES)?;
    m.add("MIN_HEADS_FOR_BF16_PREFILL", step::MIN_HEADS_FOR_BF16_PREFILL)?;
    m.add("DEFAULT_TOPK", DEFAULT_TOPK)?;
    m.add("H200_NUM_SMS", H200_NUM_SMS)?;
    m.add_class::<Scratch>()?;
    m.add_class::<MixedBatchPlan>()?;
    m.add_class::<PrefillGroups>()?;
    m.add_class::<StepPlan>()?;
    m.add_function(wrap_pyfunction!(decode_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(prefill_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(prefill_launch_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(topk_mask_shape, m)?)?;
    m.add_function(wrap_pyfunction!(topk_mask_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(gather_workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(indexer_logits_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(max_tokens_per_launch, m)?)?;
    m.add_function(wrap_pyfunction!(plan_mixed_batch, m)?)?;
    m.add_function(wrap_pyfunction!(split_prefill_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(plan_gather_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(split_indexer_prefill_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(masked_mha_workspace_fits, m)?)?;
    m.add_function(wrap_pyfunction!(plan_prefill_groups, m)?)?;
    m.add_function(wrap_pyfunction!(plan_step, m)?)?;
    m.add_function(wrap_pyfunction!(step_mode, m)?)?;
    cost::register(m)?;
    Ok(())
}
