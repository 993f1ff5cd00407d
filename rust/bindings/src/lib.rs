//! `mla_planner._core`: the planner crate as a Python module. Thin on
//! purpose: one file per planner module, each registering its own classes
//! and functions; conversions and the one `PlanError` -> `ValueError` mapping
//! live in `convert`. Planning releases the GIL; results are frozen classes
//! that hand out fresh numpy arrays.

mod config;
mod convert;
mod cost;
mod plan;
mod scratch;
mod step;

use mla_planner::geometry::{DEFAULT_TOPK, H200_NUM_SMS, MAX_HEADS};
use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_TOPK", DEFAULT_TOPK)?;
    m.add("H200_NUM_SMS", H200_NUM_SMS)?;
    m.add("MAX_HEADS", MAX_HEADS)?;
    // A panic is a planner bug; pyo3 raises it as this BaseException, which
    // `except Exception` lets through. Exported so callers that must not
    // raise (the vLLM backend) can name it.
    m.add("PanicException", m.py().get_type::<pyo3::panic::PanicException>())?;
    config::register(m)?;
    scratch::register(m)?;
    plan::register(m)?;
    step::register(m)?;
    cost::register(m)?;
    Ok(())
}
