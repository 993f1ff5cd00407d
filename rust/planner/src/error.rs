//! The one error type of the planner. Every message says what was asked, which
//! rule refused it, and what would work instead.

use thiserror::Error;

/// Everything the planner can refuse. The bindings map each variant to a
/// Python `ValueError` carrying the same message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    #[error("unknown architecture {0:?}: expected \"sm90\" (Hopper) or \"sm100\" (Blackwell)")]
    UnknownArch(String),

    #[error("unknown kv_dtype {0:?}: expected \"fp8\" (fp8_ds_mla) or \"bf16\"")]
    UnknownKvDtype(String),

    #[error("{what} must be {rule}, got {got}")]
    InvalidArgument { what: &'static str, rule: &'static str, got: String },

    #[error("{what} has length {got}, but {other} has length {expected}; they must match")]
    LengthMismatch { what: &'static str, got: usize, other: &'static str, expected: usize },

    #[error(
        "{what} overflows 64-bit byte arithmetic (counts must stay below 2^63); the sizes asked for are \
         not physical: check the lengths and shapes passed in"
    )]
    Overflow { what: &'static str },

    #[error(
        "a budget of {budget} is below the {minimum} that one launch of {tokens} token(s) needs \
         at {num_heads} heads on {arch} ({detail}); give at least {minimum}"
    )]
    BudgetTooSmall { budget: Bytes, minimum: Bytes, tokens: u64, num_heads: u32, arch: &'static str, detail: String },

    #[error(
        "{what} would need {launches} launches, more than the {max} a plan may hold; {hint}",
        max = MAX_LAUNCHES
    )]
    TooManyLaunches { what: &'static str, launches: u64, hint: &'static str },

    #[error(
        "request {request} needs {needed} rows of {what} but only {available} are available; \
         {hint}"
    )]
    WorkspaceTooSmall { request: usize, what: &'static str, needed: u64, available: u64, hint: String },

    /// A cost profile that is malformed, or made for another GPU or model.
    #[error("cost profile: {0}")]
    CostProfile(String),
}

/// No plan has more launches than this: a step that needs more asks for a
/// budget or workspace far too small for it, and would take longer to run
/// than to fix.
pub const MAX_LAUNCHES: u64 = 1 << 20;

pub(crate) fn check_launches(what: &'static str, launches: u64, hint: &'static str) -> Result<()> {
    if launches > MAX_LAUNCHES {
        return Err(PlanError::TooManyLaunches { what, launches, hint });
    }
    Ok(())
}

/// The launches of a whole plan, counted as its parts are planned. Each
/// planner keeps its own output under [`MAX_LAUNCHES`]; a plan assembled
/// from several planners' outputs adds each part here before keeping it, so
/// the whole plan stays under the same cap and never holds more than twice
/// the cap in memory on the way to refusing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchCount(u64);

impl LaunchCount {
    pub fn new() -> Self {
        LaunchCount(0)
    }

    /// Count `launches` more, planned for `what`; past [`MAX_LAUNCHES`] in
    /// total, an error naming `what` and `hint` (what to change).
    pub fn add(&mut self, what: &'static str, launches: u64, hint: &'static str) -> Result<()> {
        let total = self.0.saturating_add(launches);
        check_launches(what, total, hint)?;
        self.0 = total;
        Ok(())
    }

    /// Launches counted so far.
    pub fn total(self) -> u64 {
        self.0
    }

    /// Launches the plan may still take.
    pub fn remaining(self) -> u64 {
        MAX_LAUNCHES - self.0
    }
}

pub type Result<T> = std::result::Result<T, PlanError>;

/// A byte count that prints itself in the unit a reader wants (MiB, GiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const KIB: f64 = 1024.0;
        let b = self.0 as f64;
        if b >= KIB * KIB * KIB {
            write!(f, "{:.2} GiB", b / (KIB * KIB * KIB))
        } else if b >= KIB * KIB {
            write!(f, "{:.1} MiB", b / (KIB * KIB))
        } else if b >= KIB {
            write!(f, "{:.1} KiB", b / KIB)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

/// Checked arithmetic on byte counts: any overflow becomes [`PlanError::Overflow`].
pub(crate) fn mul(what: &'static str, factors: &[u64]) -> Result<u64> {
    factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f)).ok_or(PlanError::Overflow { what })
}

pub(crate) fn add(what: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or(PlanError::Overflow { what })
}

/// The largest count (rows, tokens, bytes) a plan may return: callers keep
/// them in signed 64-bit integers (numpy int64, torch sizes).
pub const MAX_COUNT: u64 = i64::MAX as u64;

/// `value` when it fits [`MAX_COUNT`]; [`PlanError::Overflow`] otherwise.
pub(crate) fn count(what: &'static str, value: u64) -> Result<u64> {
    if value > MAX_COUNT {
        return Err(PlanError::Overflow { what });
    }
    Ok(value)
}

/// A product of byte or row factors that must fit [`MAX_COUNT`].
pub(crate) fn mul_count(what: &'static str, factors: &[u64]) -> Result<u64> {
    count(what, mul(what, factors)?)
}
