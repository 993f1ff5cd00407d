//! Hard limits of the FlashMLA kernels. A plan never crosses them, whatever
//! the budget.

use crate::geometry::D_QK;

/// FlashMLA checks that every tensor stride fits an int32: for the query,
/// one batch entry spans `s_q * h_q * 576` elements.
pub const INT32_STRIDE_LIMIT: u64 = i32::MAX as u64;
/// Query tokens go on a CUDA grid dimension of at most 65,535 blocks.
pub const GRID_LIMIT: u64 = 65_535;

/// The most KV rows (context + new tokens, all requests together) one call
/// of a planner takes. 2^40 rows of the smallest KV cache (656 bytes a row)
/// would be 721 TB, far past any GPU's memory, so larger sizes are mistakes;
/// refusing them keeps every row, token and offset of a plan exact in the
/// signed 64-bit integers callers store them in, with room for the
/// products the planners form.
pub const MAX_ROWS: u64 = 1 << 40;

/// Which limit caps the tokens of one kernel call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HardLimit {
    Int32Stride,
    Grid,
}

impl HardLimit {
    pub fn describe(self) -> &'static str {
        match self {
            HardLimit::Int32Stride => "FlashMLA's int32 stride check (s_q x heads x 576 < 2^31)",
            HardLimit::Grid => "the CUDA grid limit (s_q <= 65,535)",
        }
    }
}

/// The most query tokens one call may carry at `padded_heads`, and the
/// limit that sets it: 58,254 at 64 heads and 29,127 at 128 (int32 stride).
pub fn max_tokens_per_launch(padded_heads: u32) -> (u64, HardLimit) {
    let by_stride = INT32_STRIDE_LIMIT / (u64::from(padded_heads) * D_QK);
    if by_stride < GRID_LIMIT {
        (by_stride, HardLimit::Int32Stride)
    } else {
        (GRID_LIMIT, HardLimit::Grid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brief_limits() {
        assert_eq!(max_tokens_per_launch(64), (58_254, HardLimit::Int32Stride));
        assert_eq!(max_tokens_per_launch(128), (29_127, HardLimit::Int32Stride));
        // Measured failures: 65536 x 64 and 32768 x 128 cross the stride check.
        assert!(65_536 * 64 * D_QK > INT32_STRIDE_LIMIT);
        assert!(32_768 * 128 * D_QK > INT32_STRIDE_LIMIT);
        assert!(58_254 * 64 * D_QK <= INT32_STRIDE_LIMIT);
        assert!(58_255 * 64 * D_QK > INT32_STRIDE_LIMIT);
    }
}
