//! `CostModel` and its route predictions (`mla_planner::cost`) for Python.

use std::collections::BTreeMap;

use mla_planner::cost::{self, RouteTime as CoreRouteTime};
use mla_planner::step::{self, Kernel, StepMode};
use mla_planner::PlanError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::config::StepConfig;
use crate::convert::{count, getters, OrValueError};
use crate::step::{StepArgs, StepPlan};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("COST_PROFILE_FORMAT", cost::PROFILE_FORMAT)?;
    m.add("COST_PROFILE_ENVIRONMENT_KEYS", cost::ENVIRONMENT_KEYS.to_vec())?;
    m.add_class::<CostModel>()?;
    m.add_class::<RouteTime>()?;
    m.add_class::<RoutePrediction>()?;
    m.add_class::<RouteChoice>()?;
    Ok(())
}

/// One route's predicted time for a step, by part.
#[pyclass(frozen, module = "mla_planner._core")]
struct RouteTime {
    inner: CoreRouteTime,
}

getters! { RouteTime {
    /// Predicted microseconds of the route, all parts.
    total_us: f64 = |t| t.total_us();
    /// Microseconds in the decode kernel.
    decode_us: f64 = |t| t.decode_us;
    /// Microseconds gathering and up-converting FP8 rows to BF16.
    gather_us: f64 = |t| t.gather_us;
    /// Microseconds in the prefill kernel.
    prefill_us: f64 = |t| t.prefill_us;
    /// Decode-kernel launches.
    decode_launches: usize = |t| t.decode_launches;
    /// Gathers.
    gathers: usize = |t| t.gathers;
    /// Prefill-kernel launches.
    prefill_launches: usize = |t| t.prefill_launches;
    /// Heads the prefill launches were priced at: padded (64 or 128) or
    /// native (16 or 32); 0 where the route has none.
    prefill_heads: u32 = |t| t.prefill_heads;
} }

#[pymethods]
impl RouteTime {
    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "RouteTime(total_us={:.1}, decode_us={:.1} x{}, gather_us={:.1} x{}, prefill_us={:.1} x{} at {} heads)",
            t.total_us(),
            t.decode_us,
            t.decode_launches,
            t.gather_us,
            t.gathers,
            t.prefill_us,
            t.prefill_launches,
            t.prefill_heads
        )
    }
}

/// Both FP8 routes' times; a route that does not fit the budget has an error instead.
#[pyclass(frozen, module = "mla_planner._core")]
struct RoutePrediction {
    inner: cost::Prediction,
}

fn time_or_none(r: &Result<CoreRouteTime, PlanError>) -> Option<RouteTime> {
    r.as_ref().ok().map(|&inner| RouteTime { inner })
}

fn error_or_none(r: &Result<CoreRouteTime, PlanError>) -> Option<String> {
    r.as_ref().err().map(ToString::to_string)
}

#[pymethods]
impl RoutePrediction {
    /// The mixed-batch route's time, or None when it does not fit.
    #[getter]
    fn mixed(&self) -> Option<RouteTime> {
        time_or_none(&self.inner.mixed)
    }
    /// The separate route's time, or None when it does not fit.
    #[getter]
    fn separate(&self) -> Option<RouteTime> {
        time_or_none(&self.inner.separate)
    }
    /// Why the mixed-batch route does not fit, or None.
    #[getter]
    fn mixed_error(&self) -> Option<String> {
        error_or_none(&self.inner.mixed)
    }
    /// Why the separate route does not fit, or None.
    #[getter]
    fn separate_error(&self) -> Option<String> {
        error_or_none(&self.inner.separate)
    }
    fn __repr__(&self) -> String {
        let show = |r: &Result<CoreRouteTime, PlanError>| match r {
            Ok(t) => format!("{:.1} us", t.total_us()),
            Err(_) => "does not fit".into(),
        };
        format!("RoutePrediction(mixed={}, separate={})", show(&self.inner.mixed), show(&self.inner.separate))
    }
}

/// The route a step takes, the prediction behind it, and the chosen route's plan.
#[pyclass(frozen, module = "mla_planner._core")]
struct RouteChoice {
    mode: StepMode,
    prediction: cost::Prediction,
    plan: step::StepPlan,
    config: StepConfig,
}

#[pymethods]
impl RouteChoice {
    /// "mixed_batch" or "separate_prefill_decode".
    #[getter]
    fn mode(&self) -> &'static str {
        self.mode.name()
    }
    /// Whether the chosen route is the mixed batch.
    #[getter]
    fn mixed_batch(&self) -> bool {
        self.mode == StepMode::MixedBatch
    }
    /// Both routes' predicted times.
    #[getter]
    fn prediction(&self) -> RoutePrediction {
        RoutePrediction { inner: self.prediction.clone() }
    }
    /// The chosen route's plan: the plan to execute.
    #[getter]
    fn plan(&self) -> StepPlan {
        StepPlan { inner: self.plan.clone() }
    }
    /// The configuration that plans it: the one given, with the route's mode
    /// and the prefill heads it was priced at (`native_prefill_heads`).
    #[getter]
    fn config(&self) -> StepConfig {
        self.config.with_inner(self.config.inner)
    }
    fn __repr__(&self) -> String {
        format!("RouteChoice(mode={:?}, {})", self.mode.name(), self.prediction().__repr__())
    }
}

/// Kernel times measured on one GPU (`mla-planner calibrate`), and the route
/// choice they imply.
#[pyclass(frozen, module = "mla_planner._core")]
struct CostModel {
    inner: cost::CostModel,
}

fn text_of(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return String::from_utf8(b.as_bytes().to_vec())
            .map_err(|e| PyValueError::new_err(format!("cost profile: not UTF-8 text: {e}")));
    }
    Err(PyValueError::new_err(format!(
        "cost profile: expected JSON text (str or bytes), got {}",
        crate::convert::repr(obj)
    )))
}

#[pymethods]
impl CostModel {
    /// Parse and validate a profile; any fault is a ValueError naming it.
    #[staticmethod]
    fn from_json(py: Python<'_>, text: &Bound<'_, PyAny>) -> PyResult<CostModel> {
        let text = text_of(text)?;
        let inner = py.detach(|| cost::CostModel::from_json(&text)).py()?;
        Ok(CostModel { inner })
    }

    /// Architecture the profile was measured on.
    #[getter]
    fn arch(&self) -> &'static str {
        self.inner.arch.name()
    }
    /// SMs of the GPU it was measured on.
    #[getter]
    fn num_sms(&self) -> u32 {
        self.inner.num_sms
    }
    /// The top-k the kernels were timed at.
    #[getter]
    fn topk(&self) -> u32 {
        self.inner.topk
    }
    /// Where the profile was measured: gpu, driver, cuda, torch, kernels, gather, ...
    #[getter]
    fn environment(&self) -> BTreeMap<String, String> {
        self.inner.environment.clone()
    }
    /// Padded head counts with a decode-kernel table.
    #[getter]
    fn decode_heads(&self) -> Vec<u32> {
        self.inner.decode_heads()
    }
    /// Head counts with a prefill-kernel table: padded (64, 128) and, on
    /// sm90, native (16, 32) where the kernel build runs them.
    #[getter]
    fn prefill_heads(&self) -> Vec<u32> {
        self.inner.prefill_heads()
    }

    /// One table's predicted microseconds at `size` tokens (kernels) or rows (gather).
    #[pyo3(signature = (kernel, size, *, padded_heads=None))]
    fn time_us(&self, kernel: &str, size: &Bound<'_, PyAny>, padded_heads: Option<&Bound<'_, PyAny>>) -> PyResult<f64> {
        let size = count(size, "size")?;
        let heads = padded_heads.map(|h| count(h, "padded_heads")).transpose()?;
        let table = match (kernel, heads) {
            ("gather_upconvert", None) => Some(self.inner.gather_table()),
            ("gather_upconvert", Some(_)) => {
                return Err(PyValueError::new_err("gather_upconvert does not depend on heads; leave padded_heads out"))
            }
            ("sparse_decode" | "sparse_prefill", None) => {
                return Err(PyValueError::new_err(format!("{kernel} needs padded_heads (64 or 128)")))
            }
            ("sparse_decode", Some(h)) => {
                u32::try_from(h).ok().and_then(|h| self.inner.kernel_table(Kernel::SparseDecode, h))
            }
            ("sparse_prefill", Some(h)) => {
                u32::try_from(h).ok().and_then(|h| self.inner.kernel_table(Kernel::SparsePrefill, h))
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "kernel must be \"sparse_decode\", \"sparse_prefill\" or \"gather_upconvert\", got {kernel:?}"
                )))
            }
        };
        let table = table.ok_or_else(|| {
            PyValueError::new_err(format!("the profile has no {kernel} table at {} padded heads", heads.unwrap_or(0)))
        })?;
        Ok(table.micros(size))
    }

    /// Raise ValueError unless this profile prices steps of `config`: the
    /// same GPU, top-k, and tables at the head counts its kernels run.
    fn check(&self, config: &StepConfig) -> PyResult<()> {
        self.inner.check(&config.inner).py()
    }

    /// Whether the profile prices the prefill kernel run natively at
    /// `config`'s heads (a table at exactly 16 or 32 heads, sm90): then the
    /// separate route is priced both ways and the cheaper taken.
    fn prices_native_prefill(&self, config: &StepConfig) -> bool {
        self.inner.prices_native_prefill(config.inner.gpu, config.inner.num_heads)
    }

    /// Both FP8 routes' predicted times for a step, each the sum over its
    /// planned launches (the step as `plan_step` takes it).
    fn predict(
        &self,
        py: Python<'_>,
        query_lens: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_decodes: &Bound<'_, PyAny>,
        config: &StepConfig,
    ) -> PyResult<RoutePrediction> {
        let args = StepArgs::parse(query_lens, context_lens, num_decodes)?;
        let cfg = config.inner;
        let inner = py.detach(|| self.inner.predict(args.step(), &cfg)).py()?;
        Ok(RoutePrediction { inner })
    }

    /// The faster FP8 route that fits the budget, and its plan: the plan to
    /// execute (the step as `plan_step` takes it).
    fn choose_route(
        &self,
        py: Python<'_>,
        query_lens: &Bound<'_, PyAny>,
        context_lens: &Bound<'_, PyAny>,
        num_decodes: &Bound<'_, PyAny>,
        config: &StepConfig,
    ) -> PyResult<RouteChoice> {
        let args = StepArgs::parse(query_lens, context_lens, num_decodes)?;
        let cfg = config.inner;
        let c = py.detach(|| self.inner.choose_route(args.step(), &cfg)).py()?;
        Ok(RouteChoice { mode: c.mode, prediction: c.prediction, plan: c.plan, config: config.with_inner(c.config) })
    }

    fn __repr__(&self) -> String {
        let gpu = self.inner.environment.get("gpu").map_or("?", String::as_str);
        format!(
            "CostModel(arch={:?}, num_sms={}, topk={}, gpu={gpu:?}, decode_heads={:?}, prefill_heads={:?})",
            self.arch(),
            self.inner.num_sms,
            self.inner.topk,
            self.inner.decode_heads(),
            self.inner.prefill_heads()
        )
    }
}
