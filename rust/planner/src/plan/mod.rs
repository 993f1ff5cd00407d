//! Planners: cut a step's work into kernel launches that fit the budgets
//! and the hard limits.

mod gather;
mod indexer;
mod mixed;
mod prefill;
mod prefill_groups;

pub use crate::error::{LaunchCount, MAX_LAUNCHES};
pub use gather::{plan_gather_chunks, split_prefill_chunks, GatherChunk, PrefillRequest};
pub use indexer::{split_indexer_prefill_chunks, IndexerChunk};
pub use mixed::{plan_mixed_batch, MixedBatchConfig, MixedBatchPlan};
pub use prefill::prefill_launch_tokens;
pub use prefill_groups::{
    masked_mha_workspace_fits, plan_prefill_groups, prefill_masks, stock_prefill_groups, MaskConfig, MaskSet,
    PrefillGroup, PrefillPath,
};

use crate::error::{PlanError, Result, MAX_COUNT};
use crate::limits::{HardLimit, MAX_ROWS};

/// The total of `lens` (rows or tokens of `what`), refused past
/// [`MAX_ROWS`]: past it no sum a plan forms can wrap, and every count it
/// returns fits an `i64`.
pub(crate) fn check_rows(what: &'static str, lens: impl IntoIterator<Item = u64>) -> Result<u64> {
    let mut total = 0u64;
    for len in lens {
        total = match total.checked_add(len) {
            Some(t) if t <= MAX_ROWS => t,
            _ => {
                return Err(PlanError::InvalidArgument {
                    what,
                    rule: "at most 2^40 (1,099,511,627,776) rows in all, already more than any GPU holds; \
                           check the lengths passed in, or plan the step in parts",
                    got: format!("{total} rows, then {len} more"),
                })
            }
        };
    }
    Ok(total)
}

/// `request_offset`, the index of a plan's first request in its step, as
/// the `i64` to add to the request indices of a plan over `num_requests`
/// requests: an error when the last index would not fit an `i64`. Check it
/// before planning; after it, `index as i64 + offset` cannot wrap for any
/// index the plan returns.
pub fn request_offset(request_offset: u64, num_requests: usize) -> Result<i64> {
    match request_offset.checked_add(num_requests as u64) {
        Some(last) if last <= MAX_COUNT => Ok(request_offset as i64),
        _ => Err(PlanError::InvalidArgument {
            what: "request_offset",
            rule: "such that request_offset + the number of requests is at most 2^63 - 1 \
                   (request indices are int64); pass the index of the chunk's first request in its step",
            got: format!("{request_offset} with {num_requests} request(s)"),
        }),
    }
}

/// One mixed-batch launch of the decode kernel over the token range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedLaunch {
    pub start: u64,
    pub end: u64,
    /// Bytes the launch allocates, all buffers together.
    pub bytes: u64,
}

impl MixedLaunch {
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
