//! Byte models of the kernels' buffers (`mla_planner::scratch`).

use mla_planner::geometry::Arch;
use mla_planner::plan::Bound as PlanBound;
use mla_planner::scratch::{self, Breakdown, DecodeShape};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{self, bound_name, count, gpu, heads, topk_or_default, OrValueError};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GLOBAL_TOPK_MASK_MAX_BYTES", scratch::GLOBAL_TOPK_MASK_MAX_BYTES)?;
    m.add("NATIVE_PREFILL_HEADS", mla_planner::geometry::NATIVE_PREFILL_HEADS.to_vec())?;
    m.add_class::<Scratch>()?;
    m.add_function(wrap_pyfunction!(decode_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(prefill_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(topk_mask_shape, m)?)?;
    m.add_function(wrap_pyfunction!(topk_mask_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(gather_workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(indexer_logits_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(max_tokens_per_launch, m)?)?;
    m.add_function(wrap_pyfunction!(padded_heads, m)?)?;
    Ok(())
}

/// The buffers one kernel call allocates.
#[pyclass(frozen, module = "mla_planner._core")]
pub(crate) struct Scratch {
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

    /// All buffers together: the call's transient peak.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.buffers.iter().map(|(_, b)| b).sum()
    }

    fn __repr__(&self) -> String {
        let parts: Vec<String> = self.buffers.iter().map(|(n, b)| format!("{n}={b}")).collect();
        format!("Scratch(total_bytes={}, {})", self.total_bytes(), parts.join(", "))
    }
}

/// Every buffer one FlashMLA sparse decode call allocates: `batch` x `s_q` query
/// tokens at `num_heads` heads per rank (padded to the kernel's 64 or 128), the
/// split-KV accumulators, out (unless `out_preallocated`), lse, and the translated
/// indices (with `translated_indices`).
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

/// Every buffer one FlashMLA sparse prefill call allocates for `s_q` query tokens:
/// padded q, out (unless `out_preallocated`), max_logits, lse, and with
/// `translated_indices` the workspace indices and valid counts. With
/// `native_heads` the kernel runs `num_heads` unpadded (16 or 32, sm90); else
/// q is padded to a multiple of `padding` (vLLM's `prefill_padding`; default
/// the padding by architecture: 64 on sm90, 128 on sm100).
#[pyfunction]
#[pyo3(signature = (s_q, num_heads, *, arch="sm90", topk=None, out_preallocated=false, translated_indices=false, native_heads=false, padding=None))]
#[allow(clippy::too_many_arguments)]
fn prefill_scratch(
    s_q: &Bound<'_, PyAny>,
    num_heads: &Bound<'_, PyAny>,
    arch: &str,
    topk: Option<&Bound<'_, PyAny>>,
    out_preallocated: bool,
    translated_indices: bool,
    native_heads: bool,
    padding: Option<&Bound<'_, PyAny>>,
) -> PyResult<Scratch> {
    let s_q = count(s_q, "s_q")?;
    let (arch, shape) = convert::prefill_shape(
        s_q,
        num_heads,
        arch,
        topk,
        out_preallocated,
        translated_indices,
        native_heads,
        padding,
    )?;
    Ok(scratch::prefill_scratch(arch, shape).py()?.into())
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

/// `(batch, rows, words)` of the masked-MHA top-k mask vLLM builds for this prefill set.
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

/// Bytes of the masked-MHA top-k mask (int32 words, 32 keys per word).
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

/// Bytes of the BF16 workspace holding `rows` gathered KV rows (576 bf16 each).
#[pyfunction]
fn gather_workspace_bytes(rows: &Bound<'_, PyAny>) -> PyResult<u64> {
    scratch::gather_workspace_bytes(count(rows, "rows")?).py()
}

/// Bytes of one indexer call's fp32 logits: `query_rows` x `kv_rows` x 4.
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

/// Heads `kernel` ("sparse_decode" or "sparse_prefill") runs for `num_heads`
/// query heads per rank: the caller zero-pads q up to it. `padding`: vLLM's
/// `prefill_padding` for the prefill kernel (default: the padding by
/// architecture).
#[pyfunction]
#[pyo3(signature = (num_heads, *, kernel="sparse_decode", arch="sm90", padding=None))]
fn padded_heads(
    num_heads: &Bound<'_, PyAny>,
    kernel: &str,
    arch: &str,
    padding: Option<&Bound<'_, PyAny>>,
) -> PyResult<u32> {
    let n = heads(num_heads)?;
    match kernel {
        "sparse_decode" => mla_planner::geometry::decode_padded_heads(n).py(),
        "sparse_prefill" => {
            let padding = convert::prefill_padding_or_default(padding, arch.parse::<Arch>().py()?)?;
            mla_planner::geometry::prefill_padded_heads(n, padding).py()
        }
        _ => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "kernel must be \"sparse_decode\" or \"sparse_prefill\", got {kernel:?}"
        ))),
    }
}
