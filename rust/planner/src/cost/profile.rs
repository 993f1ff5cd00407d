//! The calibration profile's JSON format (`mla-planner calibrate` writes it;
//! docs/routing.md describes it).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::table::Table;
use crate::error::{PlanError, Result};
use crate::geometry::{prefill_runs_native, Arch, NATIVE_PREFILL_HEADS};

/// The `format` a profile must name; bumped whenever the layout changes.
pub const PROFILE_FORMAT: &str = "mla-planner.cost-profile/1";

/// What a profile must say about where it was measured: a profile is only
/// valid where all of these are the same (the caller checks; see
/// `mla_planner.routing`).
pub const ENVIRONMENT_KEYS: [&str; 6] = ["gpu", "driver", "cuda", "torch", "kernels", "gather"];

/// Head counts the FlashMLA sparse kernels run with padding (queries are
/// zero-padded up to one of them).
const KERNEL_HEADS: [u32; 2] = [64, 128];

type Points = Vec<[f64; 2]>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileJson {
    format: String,
    arch: String,
    num_sms: u32,
    topk: u32,
    environment: BTreeMap<String, String>,
    /// How it was measured (runs, grid, raw medians): kept, not interpreted.
    #[serde(default)]
    calibration: serde_json::Value,
    /// Padded heads -> decode kernel, `b = 1, s_q = tokens`.
    sparse_decode: BTreeMap<u32, Points>,
    /// Padded heads -> BF16 prefill kernel by tokens; on sm90 also 16 and 32
    /// heads, where the kernel build runs them natively.
    sparse_prefill: BTreeMap<u32, Points>,
    /// FP8 cache rows -> BF16 workspace rows, by rows.
    gather_upconvert: Points,
}

/// A profile, validated.
pub(super) struct Parsed {
    pub arch: Arch,
    pub num_sms: u32,
    pub topk: u32,
    pub environment: BTreeMap<String, String>,
    pub calibration: serde_json::Value,
    pub decode: BTreeMap<u32, Table>,
    pub prefill: BTreeMap<u32, Table>,
    pub gather: Table,
}

fn bad(msg: impl Into<String>) -> PlanError {
    PlanError::CostProfile(msg.into())
}

/// Which head counts a kernel's tables may be at: 64 and 128 for both; for
/// the prefill kernel on sm90 also the counts it runs natively, and only
/// those: a table at 16 heads says "this build runs 16 heads unpadded".
fn check_table_heads(kernel: &str, heads: u32, arch: Arch) -> Result<()> {
    if KERNEL_HEADS.contains(&heads) {
        return Ok(());
    }
    let native = kernel == "sparse_prefill" && NATIVE_PREFILL_HEADS.contains(&heads);
    if native && prefill_runs_native(heads, arch) {
        return Ok(());
    }
    Err(bad(if native {
        format!(
            "{kernel} at {heads} heads: native-head tables are for sm90 only ({} pads the prefill kernel to 128); \
             remove it or re-run `mla-planner calibrate`",
            arch.name()
        )
    } else if kernel == "sparse_prefill" {
        format!("{kernel}: heads must be 64 or 128 (or 16 or 32 on sm90, run natively), got {heads}")
    } else {
        format!("{kernel}: padded heads must be 64 or 128, got {heads}")
    }))
}

fn tables(kernel: &str, by_heads: BTreeMap<u32, Points>, arch: Arch) -> Result<BTreeMap<u32, Table>> {
    if by_heads.is_empty() {
        return Err(bad(format!("{kernel} has no table")));
    }
    by_heads
        .into_iter()
        .map(|(heads, points)| {
            check_table_heads(kernel, heads, arch)?;
            let table = Table::new(&points).map_err(|e| bad(format!("{kernel} at {heads} heads: {e}")))?;
            Ok((heads, table))
        })
        .collect()
}

pub(super) fn parse(text: &str) -> Result<Parsed> {
    // Check the format first, so a profile of another version says so
    // instead of failing on a field it does not know.
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    match value.get("format").and_then(|f| f.as_str()) {
        Some(PROFILE_FORMAT) => {}
        Some(other) => {
            return Err(bad(format!("format {other:?} is not {PROFILE_FORMAT:?}; re-run `mla-planner calibrate`")))
        }
        None => return Err(bad(format!("not a cost profile: no \"format\": {PROFILE_FORMAT:?} field"))),
    }
    // Parsed again from the text, so an error names its line and column.
    let p: ProfileJson = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    debug_assert_eq!(p.format, PROFILE_FORMAT);
    let arch = p.arch.parse::<Arch>().map_err(|e| bad(e.to_string()))?;
    if p.num_sms == 0 {
        return Err(bad("num_sms must be at least 1"));
    }
    // The kernels it was timed on take a top-k in blocks of 64 (decode) and 128 (prefill).
    crate::geometry::check_topk(p.topk, 128, "topk").map_err(|e| bad(e.to_string()))?;
    for key in ENVIRONMENT_KEYS {
        if p.environment.get(key).map_or(true, |v| v.trim().is_empty()) {
            return Err(bad(format!("environment.{key} is missing; a profile must name where it was measured")));
        }
    }
    Ok(Parsed {
        arch,
        num_sms: p.num_sms,
        topk: p.topk,
        environment: p.environment,
        calibration: p.calibration,
        decode: tables("sparse_decode", p.sparse_decode, arch)?,
        prefill: tables("sparse_prefill", p.sparse_prefill, arch)?,
        gather: Table::new(&p.gather_upconvert).map_err(|e| bad(format!("gather_upconvert: {e}")))?,
    })
}
