//! Exact scratch-memory models and launch planners for sparse-MLA attention
//! (DeepSeek-V3.2-style models on FlashMLA kernels).
//!
//! Data flows one way: host arrays describing a scheduler step go in, an
//! immutable plan of kernel launches with the bytes each allocates comes
//! out. Nothing here depends on Python; `rust/bindings` wraps it.

pub mod bounds;
pub mod config;
pub mod cost;
pub mod error;
pub mod geometry;
pub mod limits;
pub mod plan;
pub mod scratch;
pub mod step;

pub use error::{Bytes, PlanError, Result};
pub use geometry::{Arch, Gpu, KvDtype};
