//! The one error type of the planner. Every message says what was asked, which
//! rule refused it, and what would work instead.

use thiserror::Error;

/// Everything the planner can refuse. The bindings map each variant to a
/// Python `ValueError` carrying the same message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    #[error("unknown architecture {0:?}: expected \"sm90\" (Hopper) or \"sm100\" (Blackwell)")]
    UnknownArch(String),

    #[error("unknown KV-cache dtype {0:?}: expected \"fp8\" (fp8_ds_mla) or \"bf16\"")]
    UnknownKvDtype(String),

    #[error("{what} must be {rule}, got {got}")]
    InvalidArgument {
        what: &'static str,
        rule: &'static str,
        got: String,
    },

    #[error("{what} has length {got}, but {other} has length {expected}; they must match")]
    LengthMismatch {
        what: &'static str,
        got: usize,
        other: &'static str,
        expected: usize,
    },

    #[error("{what} overflows 64-bit byte arithmetic; the sizes asked for are not physical")]
    Overflow { what: &'static str },

    #[error(
        "a budget of {budget} is below the {minimum} that one launch of {tokens} token(s) needs \
         at {num_heads} heads on {arch} ({detail}); give at least {minimum}"
    )]
    BudgetTooSmall {
        budget: Bytes,
        minimum: Bytes,
        tokens: u64,
        num_heads: u32,
        arch: &'static str,
        detail: String,
    },

    #[error(
        "{what} would need {launches} launches, more than the {max} a plan may hold; {hint}",
        max = MAX_LAUNCHES
    )]
    TooManyLaunches { what: &'static str, launches: u64, hint: &'static str },

    #[error(
        "request {request} needs {needed} rows of {what} but only {available} are available; \
         {hint}"
    )]
    WorkspaceTooSmall {
        request: usize,
        what: &'static str,
        needed: u64,
        available: u64,
        hint: String,
    },

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
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f))
        .ok_or(PlanError::Overflow { what })
}

pub(crate) fn add(what: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or(PlanError::Overflow { what })
}
