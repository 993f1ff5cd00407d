//! `plan_step`: a whole scheduler step under one `StepConfig`, and the
//! `StepPlan` the executor runs launch by launch.

use mla_planner::bounds;
use mla_planner::step::{self, Kernel};
use numpy::{PyArray1, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::type_object::PyTypeInfo;
use pyo3::types::{PyIterator, PyList, PySlice};

use crate::config::StepConfig;
use mla_planner::geometry::KvDtype;

use crate::convert::{bound_name, count, gather_rows, heads, indexer_rows, lengths, table, OrValueError};
use crate::plan::PrefillGroups;
use crate::scratch::Scratch;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MAX_DECODE_QUERY_LEN", mla_planner::step::MAX_DECODE_QUERY_LEN)?;
    m.add_class::<StepPlan>()?;
    m.add_class::<Launch>()?;
    m.add_function(wrap_pyfunction!(plan_step, m)?)?;
    m.add_function(wrap_pyfunction!(step_mode, m)?)?;
    Ok(())
}

/// A scheduler step as vLLM's builder sees it: requests in order, decodes
/// first; `query_lens` new tokens and `context_lens` cached tokens each.
pub(crate) struct StepArgs {
    query_lens: Vec<u64>,
    context_lens: Vec<u64>,
    num_decodes: usize,
}

impl StepArgs {
    pub(crate) fn parse(
        query_lens: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_decodes: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(StepArgs {
            query_lens: lengths(query_lens, "query_lens")?,
            context_lens: lengths(context_lens, "context_lens")?,
            num_decodes: usize::try_from(count(num_decodes, "num_decodes")?).unwrap_or(usize::MAX),
        })
    }

    pub(crate) fn step(&self) -> step::Step<'_> {
        step::Step { query_lens: &self.query_lens, context_lens: &self.context_lens, num_decodes: self.num_decodes }
    }
}

/// vLLM's mode for steps of `num_heads` heads per rank (1..=128): "bf16" for
/// a BF16 cache; for FP8, "mixed_batch" below 32 heads, else
/// "separate_prefill_decode".
#[pyfunction]
#[pyo3(signature = (num_heads, *, kv_dtype="fp8"))]
fn step_mode(num_heads: &Bound<'_, PyAny>, kv_dtype: &str) -> PyResult<&'static str> {
    let kv_dtype = kv_dtype.parse::<KvDtype>().py()?;
    Ok(step::vllm_step_mode(heads(num_heads)?, kv_dtype).py()?.name())
}

fn kernel(name: &str) -> PyResult<Kernel> {
    match name {
        "sparse_decode" => Ok(Kernel::SparseDecode),
        "sparse_prefill" => Ok(Kernel::SparsePrefill),
        _ => {
            Err(PyValueError::new_err(format!("kernel must be \"sparse_decode\" or \"sparse_prefill\", got {name:?}")))
        }
    }
}

/// Plan one step under `config`: its launches are exactly the kernel calls
/// the executor (and the vLLM backend) issues, with the bytes each holds.
/// `gather_chunks`: `(n, 2)` request ranges `[start, end)` of the step in
/// which vLLM gathers its prefills (separate route); the plan follows them
/// instead of planning its own.
#[pyfunction]
#[pyo3(signature = (query_lens, context_lens, num_decodes, config, *, gather_chunks=None))]
pub(crate) fn plan_step(
    py: Python<'_>,
    query_lens: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    num_decodes: &Bound<'_, PyAny>,
    config: &StepConfig,
    gather_chunks: Option<&Bound<'_, PyAny>>,
) -> PyResult<StepPlan> {
    let args = StepArgs::parse(query_lens, context_lens, num_decodes)?;
    let cfg = config.inner;
    let inner = match gather_chunks {
        None => py.detach(|| step::plan_step(args.step(), &cfg)).py()?,
        Some(chunks) => {
            let chunks = request_ranges(chunks, "gather_chunks")?;
            py.detach(|| step::plan_step_in_chunks(args.step(), &cfg, &chunks)).py()?
        }
    };
    Ok(StepPlan { inner })
}

/// `(n, 2)` integer rows `[start, end)` as ranges.
fn request_ranges(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<std::ops::Range<usize>>> {
    let flat = lengths(&obj.py().import("numpy")?.call_method1("ravel", (obj,))?, name)?;
    if flat.len() % 2 != 0 {
        return Err(PyValueError::new_err(format!("{name} must be (n, 2) request ranges [start, end)")));
    }
    flat.chunks(2)
        .map(|r| {
            let at =
                |v: u64| usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name}: {v} is too large")));
            Ok(at(r[0])?..at(r[1])?)
        })
        .collect()
}

/// One kernel call of a plan, as the executor issues it (iterate a
/// `StepPlan` for them, in order).
#[pyclass(frozen, module = "mla_planner._core")]
pub(crate) struct Launch {
    inner: step::KernelLaunch,
}

/// `slice(start, end)`, as Python writes it (no step).
fn range_slice<'py>(py: Python<'py>, start: u64, end: u64) -> PyResult<Bound<'py, PySlice>> {
    Ok(PySlice::type_object(py).call1((start, end))?.cast_into::<PySlice>()?)
}

#[pymethods]
impl Launch {
    /// "sparse_decode" or "sparse_prefill".
    #[getter]
    fn kernel(&self) -> &'static str {
        self.inner.kernel.name()
    }

    /// The step's query tokens it computes: its rows of q and of the output.
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySlice>> {
        range_slice(py, self.inner.tokens.start, self.inner.tokens.end)
    }

    /// The step's requests whose tokens it computes.
    #[getter]
    fn requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySlice>> {
        range_slice(py, self.inner.requests.start as u64, self.inner.requests.end as u64)
    }

    /// Separate route, prefill launches: the gather chunk whose workspace it
    /// reads (an index into `StepPlan.gather_chunks`); `None` for others.
    #[getter]
    fn gather_chunk(&self) -> Option<usize> {
        self.inner.gather_chunk
    }

    /// The bytes live while it runs.
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }

    /// Those bytes by buffer. Those the step holds once for every launch of the kernel are at its
    /// longest launch's size: the mixed route's padded q, the separate route's prefill padded q and
    /// kernel output. The rest are the launch's own.
    #[getter]
    fn scratch(&self) -> Scratch {
        self.inner.buffers.clone().into()
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Launch(kernel={:?}, tokens=slice({}, {}), requests=slice({}, {}), gather_chunk={}, bytes={})",
            l.kernel.name(),
            l.tokens.start,
            l.tokens.end,
            l.requests.start,
            l.requests.end,
            l.gather_chunk.map_or("None".to_string(), |g| g.to_string()),
            l.bytes
        )
    }
}

/// A planned scheduler step.
#[pyclass(frozen, module = "mla_planner._core")]
pub(crate) struct StepPlan {
    pub(crate) inner: step::StepPlan,
}

#[pymethods]
impl StepPlan {
    /// "mixed_batch", "separate_prefill_decode" or "bf16".
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode.name()
    }

    /// Query tokens of the step.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens
    }

    /// Decode requests (the first ones), CUDA-graph padding of length 0 included.
    #[getter]
    fn num_decodes(&self) -> usize {
        self.inner.num_decodes
    }

    /// The decodes' query length: 1, or 1 + the speculative tokens; 0 when no
    /// decode has tokens. A separate-route decode launch of `n` tokens runs
    /// `n / decode_query_len` requests.
    #[getter]
    fn decode_query_len(&self) -> u64 {
        self.inner.decode_query_len
    }

    /// `(n, 5)` int64 per launch: token_start, token_end, req_start, req_end,
    /// and the gather chunk whose workspace a separate-path prefill launch
    /// reads (-1 for other launches).
    #[getter]
    fn launches<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let l = &self.inner.launches;
        let flat = l
            .iter()
            .flat_map(|k| {
                [
                    k.tokens.start as i64,
                    k.tokens.end as i64,
                    k.requests.start as i64,
                    k.requests.end as i64,
                    k.gather_chunk.map_or(-1, |g| g as i64),
                ]
            })
            .collect();
        table(py, l.len(), 5, flat)
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

    /// What kept the sparse tokens from fewer launches: "none", "budget", "int32_stride" or "grid".
    #[getter]
    fn bound(&self) -> &'static str {
        bound_name(self.inner.bound)
    }

    /// The largest launch's bytes.
    #[getter]
    fn peak_bytes(&self) -> u64 {
        self.inner.peak_bytes
    }

    /// The largest launch's bytes beyond a caller's workspace that holds the padded q and kernel
    /// output of launches whose kernel runs `served_heads` heads (`None`: no such workspace); what
    /// of the peak the reservation holds. `decode_heads`: the configuration's `decode_heads`.
    #[pyo3(signature = (decode_heads, served_heads=None))]
    fn peak_beyond_workspace(
        &self,
        decode_heads: &Bound<'_, PyAny>,
        served_heads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let served = served_heads.map(heads).transpose()?;
        Ok(bounds::peak_beyond_workspace(&self.inner, heads(decode_heads)?, served))
    }

    /// The prefills' attention paths, request indices from the step's first request.
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

    /// The largest indexer call's logits (bound by the indexer's own budget, not the scratch budget).
    #[getter]
    fn indexer_peak_bytes(&self) -> u64 {
        self.inner.indexer_peak_bytes
    }

    /// The separate path's BF16 gather workspace (vLLM reserves it at start-up).
    #[getter]
    fn gather_workspace_bytes(&self) -> u64 {
        self.inner.gather_workspace_bytes
    }

    /// Heads the prefill launches run the kernel at: vLLM's padding, or the
    /// query heads themselves in a plan made for native prefill heads. The
    /// executor pads q and sizes the kernel's output to exactly this.
    #[getter]
    fn prefill_heads(&self) -> u32 {
        self.inner.prefill_heads
    }

    /// The prefill launches write straight into the step's output.
    #[getter]
    fn prefill_writes_in_place(&self) -> bool {
        self.inner.prefill_writes_in_place
    }

    /// Tokens of the longest launch of `kernel` ("sparse_decode" or
    /// "sparse_prefill"); 0 when none. The step's shared buffers of that
    /// kernel are sized for it.
    fn longest_launch(&self, kernel: &str) -> PyResult<u64> {
        Ok(self.inner.longest_launch(self::kernel(kernel)?))
    }

    fn __len__(&self) -> usize {
        self.inner.launches.len()
    }

    /// Its launches, in order, as `Launch` objects.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        let launches: Vec<Launch> = self.inner.launches.iter().map(|l| Launch { inner: l.clone() }).collect();
        PyList::new(py, launches)?.try_iter()
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
