//! Sparse prefill kernel launches: how many query tokens one launch may
//! take. Every prefill buffer grows linearly with the tokens, so the answer
//! is the budget over the bytes of one token, capped by the int32 limit.

use super::Bound;
use crate::error::{PlanError, Result};
use crate::geometry::{prefill_kernel_heads, Arch};
use crate::limits::max_tokens_per_launch;
use crate::scratch::{prefill_scratch, PrefillShape};

/// The most query tokens one launch of `shape` (its `s_q` ignored) may take
/// within `budget_bytes`, and what caps it: the budget or a hard limit.
pub fn prefill_launch_tokens(arch: Arch, shape: PrefillShape, budget_bytes: u64) -> Result<(u64, Bound)> {
    let per_token = prefill_scratch(arch, PrefillShape { s_q: 1, ..shape })?.total_bytes();
    let by_budget = budget_bytes / per_token;
    if by_budget == 0 {
        return Err(PlanError::BudgetTooSmall {
            budget: crate::Bytes(budget_bytes),
            minimum: crate::Bytes(per_token),
            tokens: 1,
            num_heads: shape.num_heads,
            arch: arch.name(),
            detail: "one token of the sparse prefill kernel (padded q, output, softmax statistics)".into(),
        });
    }
    let (by_limit, limit) =
        max_tokens_per_launch(prefill_kernel_heads(shape.num_heads, arch, shape.native_heads, shape.padding)?);
    Ok(if by_limit < by_budget { (by_limit, Bound::Limit(limit)) } else { (by_budget, Bound::Budget) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(num_heads: u32, translated_indices: bool) -> PrefillShape {
        PrefillShape {
            s_q: 0,
            num_heads,
            topk: 2048,
            out_preallocated: false,
            translated_indices,
            native_heads: false,
            padding: 64,
        }
    }

    #[test]
    fn the_largest_launch_fits_and_one_more_token_does_not() {
        for (heads, translated, budget) in [(16, true, 1u64 << 30), (64, false, 256 << 20), (128, true, 3 << 30)] {
            let s = shape(heads, translated);
            let (n, bound) = prefill_launch_tokens(Arch::Sm90, s, budget).unwrap();
            assert_eq!(bound, Bound::Budget);
            let bytes = |t| prefill_scratch(Arch::Sm90, PrefillShape { s_q: t, ..s }).unwrap().total_bytes();
            assert!(bytes(n) <= budget && bytes(n + 1) > budget, "heads {heads}: {n}");
        }
    }

    #[test]
    fn int32_stride_caps_a_huge_budget() {
        let (n, bound) = prefill_launch_tokens(Arch::Sm90, shape(64, false), 1 << 50).unwrap();
        assert!(matches!(bound, Bound::Limit(_)));
        assert_eq!(n, 58_254);
    }

    #[test]
    fn native_heads_take_more_tokens_per_launch() {
        // 16 native heads hold a quarter of the rows of 64 padded ones, and no padded q: more
        // than four times the tokens fit; the int32 limit (by heads) moves up with them.
        for heads in [16, 32] {
            let padded = shape(heads, true);
            let native = PrefillShape { native_heads: true, ..padded };
            let (p, _) = prefill_launch_tokens(Arch::Sm90, padded, 1 << 30).unwrap();
            let (n, _) = prefill_launch_tokens(Arch::Sm90, native, 1 << 30).unwrap();
            assert!(n > p * (64 / u64::from(heads)), "{heads} heads: native {n}, padded {p}");
            let (cap_native, _) = prefill_launch_tokens(Arch::Sm90, native, 1 << 50).unwrap();
            let (cap_padded, _) = prefill_launch_tokens(Arch::Sm90, padded, 1 << 50).unwrap();
            assert!(cap_native > cap_padded, "{cap_native} <= {cap_padded}");
        }
    }

    #[test]
    fn a_budget_below_one_token_is_an_error() {
        let err = prefill_launch_tokens(Arch::Sm90, shape(16, true), 1000).unwrap_err();
        assert!(matches!(err, PlanError::BudgetTooSmall { .. }), "{err}");
    }
}
