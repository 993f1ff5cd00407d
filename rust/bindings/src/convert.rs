//! Conversions between Python objects and the planner's types, in one place:
//! integers and 1-D arrays in (each refused with a `ValueError` naming the
//! argument), numpy tables out, and the one mapping of `PlanError` to
//! `ValueError`.

use std::ops::Range;

use mla_planner::geometry::{default_prefill_padding, Arch, Gpu, DEFAULT_TOPK, H200_NUM_SMS};
use mla_planner::plan::{self, Bound as PlanBound, GatherChunk, PrefillRequest};
use mla_planner::scratch::PrefillShape;
use mla_planner::PlanError;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

pub(crate) fn value_error(e: PlanError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub(crate) trait OrValueError<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrValueError<T> for Result<T, PlanError> {
    fn py(self) -> PyResult<T> {
        self.map_err(value_error)
    }
}

/// A non-negative Python int (not a bool, not a float) as `u64`.
pub(crate) fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let bad = || PyValueError::new_err(format!("{name} must be a non-negative integer, got {}", repr(obj)));
    if obj.is_instance_of::<PyBool>() {
        return Err(bad());
    }
    let index = obj.call_method0("__index__").map_err(|_| bad())?;
    let value: i128 = index.extract().map_err(|_| bad())?;
    u64::try_from(value).map_err(|_| bad())
}

pub(crate) fn count_or(obj: Option<&Bound<'_, PyAny>>, name: &str, default: u64) -> PyResult<u64> {
    obj.map_or(Ok(default), |o| count(o, name))
}

pub(crate) fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<unprintable>".into())
}

/// A 1-D array-like of non-negative integers as `Vec<u64>`.
pub(crate) fn lengths(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
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

pub(crate) fn heads(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let n = count(obj, "num_heads")?;
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("num_heads must be between 1 and 128, got {n}")))
}

/// vLLM's `prefill_padding` where given (the planner checks it is 64 or 128).
pub(crate) fn prefill_padding(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u32>> {
    obj.map(|o| {
        let n = count(o, "prefill_padding")?;
        u32::try_from(n).map_err(|_| PyValueError::new_err(format!("prefill_padding must be 64 or 128, got {n}")))
    })
    .transpose()
}

/// [`prefill_padding`], or the padding by architecture when not given.
pub(crate) fn prefill_padding_or_default(obj: Option<&Bound<'_, PyAny>>, arch: Arch) -> PyResult<u32> {
    Ok(prefill_padding(obj)?.unwrap_or_else(|| default_prefill_padding(arch)))
}

/// One sparse prefill call as `prefill_scratch` and `prefill_launch_tokens`
/// take it from Python, with its architecture.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_shape(
    s_q: u64,
    num_heads: &Bound<'_, PyAny>,
    arch: &str,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
    native_heads: bool,
    padding: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Arch, PrefillShape)> {
    let arch = arch.parse::<Arch>().py()?;
    let shape = PrefillShape {
        s_q,
        num_heads: heads(num_heads)?,
        topk: topk_or_default(topk)?,
        out_preallocated,
        translated_indices,
        native_heads,
        padding: prefill_padding_or_default(padding, arch)?,
    };
    Ok((arch, shape))
}

/// `topk`, or DeepSeek-V3.2's 2048 when not given.
pub(crate) fn topk_or_default(obj: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
    let n = count_or(obj, "topk", u64::from(DEFAULT_TOPK))?;
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("topk is far too large: {n}")))
}

/// The GPU for `arch`, with an H200's 132 SMs unless `num_sms` is given.
pub(crate) fn gpu(arch: &str, num_sms: Option<&Bound<'_, PyAny>>) -> PyResult<Gpu> {
    let sms = count_or(num_sms, "num_sms", u64::from(H200_NUM_SMS))?;
    let sms = u32::try_from(sms).map_err(|_| PyValueError::new_err(format!("num_sms is far too large: {sms}")))?;
    Gpu::new(arch.parse::<Arch>().py()?, sms).py()
}

pub(crate) fn table<'py>(
    py: Python<'py>,
    rows: usize,
    cols: usize,
    flat: Vec<i64>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let arr = Array2::from_shape_vec((rows, cols), flat).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(arr.into_pyarray(py))
}

pub(crate) fn ranges<'py>(py: Python<'py>, rs: &[Range<u64>]) -> PyResult<Bound<'py, PyArray2<i64>>> {
    table(py, rs.len(), 2, rs.iter().flat_map(|r| [r.start as i64, r.end as i64]).collect())
}

pub(crate) fn bound_name(b: PlanBound) -> &'static str {
    match b {
        PlanBound::Unbounded => "none",
        PlanBound::Budget => "budget",
        PlanBound::Limit(mla_planner::limits::HardLimit::Int32Stride) => "int32_stride",
        PlanBound::Limit(mla_planner::limits::HardLimit::Grid) => "grid",
    }
}

pub(crate) fn gather_rows(chunks: &[GatherChunk], offset: i64) -> (usize, Vec<i64>) {
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

pub(crate) fn prefill_requests(
    query_lens: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
) -> PyResult<Vec<PrefillRequest>> {
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

pub(crate) fn indexer_rows(chunks: &[plan::IndexerChunk], offset: i64) -> (usize, Vec<i64>) {
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

/// Read-only attributes of a frozen class wrapping a planner value in `inner`:
/// each a doc line, a name, a type and the expression that reads it from `inner`.
macro_rules! getters {
    ($cls:ty { $($(#[doc = $doc:literal])* $name:ident: $ty:ty = |$c:ident| $body:expr;)* }) => {
        #[pymethods]
        impl $cls {
            $(
                $(#[doc = $doc])*
                #[getter]
                fn $name(&self) -> $ty {
                    let $c = &self.inner;
                    $body
                }
            )*
        }
    };
}
pub(crate) use getters;
