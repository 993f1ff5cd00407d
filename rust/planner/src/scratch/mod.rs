//! Byte models of every buffer a sparse-MLA kernel call allocates.
//!
//! One function per kernel; each returns a [`Breakdown`] naming its buffers
//! as the kernels and vLLM name them, so a reader can hold a number here
//! against an allocator trace.

mod decode;
mod indexer;
mod mask;
mod prefill;

pub use decode::{decode_scratch, num_sm_parts, split_kv_enabled, DecodeShape};
pub use indexer::indexer_logits_bytes;
pub use mask::{topk_mask_bytes, topk_mask_shape, MaskShape, GLOBAL_TOPK_MASK_MAX_BYTES};
pub use prefill::{gather_workspace_bytes, prefill_scratch, PrefillShape};

use crate::error::{add, count, Result};

/// One buffer of a kernel call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub name: &'static str,
    pub bytes: u64,
}

/// The buffers one kernel call allocates, in allocation order. Buffers a call
/// does not allocate (an `out=` the caller passed, a q that needs no padding,
/// split-KV accumulators when split-KV is off) are absent, not zero.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Breakdown {
    pub buffers: Vec<Buffer>,
}

impl Breakdown {
    /// Add a buffer, refusing it when the buffers together would pass
    /// `i64::MAX` bytes: each buffer may fit while their sum does not.
    pub(crate) fn push(&mut self, name: &'static str, bytes: u64) -> Result<()> {
        const WHAT: &str = "the scratch total (all buffers of the call)";
        count(WHAT, add(WHAT, self.total_bytes(), bytes)?)?;
        self.buffers.push(Buffer { name, bytes });
        Ok(())
    }

    /// Bytes of one named buffer; 0 when the call does not allocate it.
    pub fn get(&self, name: &str) -> u64 {
        self.buffers.iter().find(|b| b.name == name).map_or(0, |b| b.bytes)
    }

    /// All buffers live at once: the call's transient peak.
    pub fn total_bytes(&self) -> u64 {
        // A breakdown the crate builds never passes i64::MAX (see `push`);
        // one built by hand saturates rather than wraps.
        self.buffers.iter().fold(0u64, |acc, b| acc.saturating_add(b.bytes))
    }
}
