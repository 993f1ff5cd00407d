//! Planners: cut a step's work into kernel launches that fit the budgets
//! and the hard limits.

mod gather;
mod indexer;
mod mask;
mod mixed;
mod prefill;

pub use gather::{plan_gather_chunks, split_prefill_chunks, GatherChunk, PrefillRequest};
pub use indexer::{split_indexer_prefill_chunks, IndexerChunk};
pub use mask::{
    masked_mha_workspace_fits, plan_prefill_groups, prefill_masks, route_prefills_stock, MaskConfig, MaskSet, PrefillGroup, PrefillRoute,
};
pub use mixed::{plan_mixed_batch, MixedBatchConfig, MixedBatchPlan};
pub use prefill::prefill_launch_tokens;

use crate::limits::HardLimit;

/// One kernel launch over the token range `[start, end)` of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub start: u64,
    pub end: u64,
    /// Bytes the launch allocates, all buffers together.
    pub bytes: u64,
}

impl Launch {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// What kept a piece of work from running as one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Nothing: it ran whole.
    Unbounded,
    /// The byte budget.
    Budget,
    /// A hard kernel limit, whatever the budget.
    Limit(HardLimit),
}

impl Bound {
    pub fn describe(self) -> &'static str {
        match self {
            Bound::Unbounded => "fits in one launch",
            Bound::Budget => "the scratch budget",
            Bound::Limit(limit) => limit.describe(),
        }
    }
}
