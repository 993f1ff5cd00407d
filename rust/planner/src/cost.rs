//! Which FP8 route a step should take, from kernel times measured on the GPU.
//!
//! A calibration profile holds, per architecture and padded head count, the
//! measured time of the sparse decode kernel (`b = 1, s_q = tokens`), the
//! gather-and-up-convert of FP8 cache rows to BF16, and the BF16 sparse
//! prefill kernel. A route's time for a step is the sum over the launches its
//! plan makes (the planners decide the launches and bound their memory; this
//! module only prices them):
//!
//! * mixed batch: every launch of [`StepMode::MixedBatch`]'s plan;
//! * separate: the decode launches, one gather per gather chunk, and the
//!   prefill launches of [`StepMode::SeparatePrefillDecode`]'s plan.
//!
//! The separate route is planned and priced at vLLM's padded prefill heads
//! and, where the profile has a prefill table at exactly the query heads (16
//! or 32 on sm90: the kernel build runs them natively), at native heads too;
//! the cheaper of the two is the separate route (a tie keeps vLLM's padding).
//! A configuration that asks for native heads is priced at native heads only.
//!
//! Left out, as they cost about the same on both routes or little: head
//! padding of q, top-k index translation, the LSE merge of split requests.

mod profile;
mod table;

use std::collections::BTreeMap;

pub use profile::{ENVIRONMENT_KEYS, PROFILE_FORMAT};
pub use table::Table;

use crate::error::{PlanError, Result};
use crate::geometry::{decode_padded_heads, prefill_kernel_heads, prefill_runs_native, Arch, Gpu, KvDtype};
use crate::step::{plan_step, vllm_step_mode, Kernel, Step, StepConfig, StepMode, StepPlan};

/// Kernel times measured on one GPU, for every padded head count calibrated.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    pub arch: Arch,
    pub num_sms: u32,
    /// The top-k the kernels were timed at (their time grows with it).
    pub topk: u32,
    /// Where it was measured: [`ENVIRONMENT_KEYS`] at least.
    pub environment: BTreeMap<String, String>,
    /// How it was measured, as the profile says; not interpreted.
    pub calibration: serde_json::Value,
    decode: BTreeMap<u32, Table>,
    prefill: BTreeMap<u32, Table>,
    gather: Table,
}

/// The tables one configuration reads.
#[derive(Clone, Copy)]
struct Tables<'a> {
    decode: &'a Table,
    prefill: &'a Table,
    gather: &'a Table,
}

/// A route's predicted time for a step, by part.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RouteTime {
    pub decode_us: f64,
    pub gather_us: f64,
    pub prefill_us: f64,
    pub decode_launches: usize,
    pub gathers: usize,
    pub prefill_launches: usize,
    /// Heads the prefill launches were priced at (the plan's
    /// [`StepPlan::prefill_heads`]); 0 where the route has none.
    pub prefill_heads: u32,
}

impl RouteTime {
    pub fn total_us(&self) -> f64 {
        self.decode_us + self.gather_us + self.prefill_us
    }
}

/// Both FP8 routes' predicted times; a route the planner cannot fit in the
/// budget carries the planner's error instead.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub mixed: Result<RouteTime>,
    pub separate: Result<RouteTime>,
}

/// The route taken for a step, why, and its plan.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteChoice {
    /// [`StepMode::MixedBatch`] or [`StepMode::SeparatePrefillDecode`].
    pub mode: StepMode,
    pub prediction: Prediction,
    /// The chosen route's plan, so the caller need not plan again.
    pub plan: StepPlan,
    /// The configuration that plans it: the caller's, with the route's mode
    /// and the prefill heads it was priced at.
    pub config: StepConfig,
}

/// A route's price, its plan and the configuration that made it.
type Priced = (RouteTime, StepPlan, StepConfig);

impl CostModel {
    /// Parse and validate a profile (format in docs/routing.md).
    pub fn from_json(text: &str) -> Result<CostModel> {
        let p = profile::parse(text)?;
        Ok(CostModel {
            arch: p.arch,
            num_sms: p.num_sms,
            topk: p.topk,
            environment: p.environment,
            calibration: p.calibration,
            decode: p.decode,
            prefill: p.prefill,
            gather: p.gather,
        })
    }

    /// Padded head counts with a decode table.
    pub fn decode_heads(&self) -> Vec<u32> {
        self.decode.keys().copied().collect()
    }

    /// Head counts with a prefill table: padded ones, and on sm90 the native
    /// 16 or 32 where the kernel build runs them.
    pub fn prefill_heads(&self) -> Vec<u32> {
        self.prefill.keys().copied().collect()
    }

    /// One kernel's table: the decode or prefill kernel at `padded_heads`.
    pub fn kernel_table(&self, kernel: Kernel, padded_heads: u32) -> Option<&Table> {
        match kernel {
            Kernel::SparseDecode => self.decode.get(&padded_heads),
            Kernel::SparsePrefill => self.prefill.get(&padded_heads),
        }
    }

    /// The gather-and-up-convert table (it does not depend on heads).
    pub fn gather_table(&self) -> &Table {
        &self.gather
    }

    /// Whether this profile can price the steps of `cfg` (its GPU, top-k and
    /// the head counts its kernels run): an error naming the difference
    /// rather than a guess.
    pub fn check(&self, cfg: &StepConfig) -> Result<()> {
        self.tables(cfg).map(|_| ())
    }

    /// Whether this profile prices the prefill kernel at `num_heads` run
    /// natively on `gpu`: a table at exactly those heads, on an architecture
    /// whose kernel runs them.
    pub fn prices_native_prefill(&self, gpu: Gpu, num_heads: u32) -> bool {
        gpu.arch == self.arch && prefill_runs_native(num_heads, gpu.arch) && self.prefill.contains_key(&num_heads)
    }

    fn tables(&self, cfg: &StepConfig) -> Result<Tables<'_>> {
        let (gpu, num_heads, topk, native_prefill) =
            (cfg.gpu, cfg.num_heads, cfg.topk, cfg.execution.native_prefill_heads);
        let mismatch = |what: String| {
            PlanError::CostProfile(format!(
                "{what}; calibrate this configuration (`mla-planner calibrate`) instead of reusing it"
            ))
        };
        if gpu.arch != self.arch || gpu.num_sms != self.num_sms {
            return Err(mismatch(format!(
                "measured on {} with {} SMs, asked about {} with {} SMs",
                self.arch.name(),
                self.num_sms,
                gpu.arch.name(),
                gpu.num_sms
            )));
        }
        if topk != self.topk {
            return Err(mismatch(format!("measured at topk {}, asked about topk {topk}", self.topk)));
        }
        let (dh, ph) = (
            decode_padded_heads(num_heads)?,
            prefill_kernel_heads(num_heads, gpu.arch, native_prefill, cfg.prefill_padding())?,
        );
        let missing = |kernel: &str, heads: u32, run: &str, have: Vec<u32>| {
            mismatch(format!(
                "has no {kernel} table at {heads} {run} heads ({num_heads} heads per rank); it has {have:?}"
            ))
        };
        let prefill_run = if native_prefill { "native" } else { "padded" };
        Ok(Tables {
            decode: self.decode.get(&dh).ok_or_else(|| missing("sparse_decode", dh, "padded", self.decode_heads()))?,
            prefill: self
                .prefill
                .get(&ph)
                .ok_or_else(|| missing("sparse_prefill", ph, prefill_run, self.prefill_heads()))?,
            gather: &self.gather,
        })
    }

    /// Both routes' predicted times for a step. Errors: a step the planner
    /// refuses, a BF16 cache (one route only), a profile of another
    /// configuration.
    pub fn predict(&self, step: Step<'_>, cfg: &StepConfig) -> Result<Prediction> {
        let (mixed, separate) = self.plan_routes(step, cfg)?;
        Ok(Prediction { mixed: mixed.map(|(t, ..)| t), separate: separate.map(|(t, ..)| t) })
    }

    /// The faster route that fits the budget: decodes take the decode kernel
    /// on both routes, so the choice is how the prefill tokens run (the
    /// separate route at the cheaper of its padded and native prefill heads,
    /// where the profile prices native ones). When the
    /// two are predicted equal (a decode-only step), vLLM's rule decides; when
    /// neither fits, the error is that of vLLM's route.
    pub fn choose_route(&self, step: Step<'_>, cfg: &StepConfig) -> Result<RouteChoice> {
        let (mixed, separate) = self.plan_routes(step, cfg)?;
        let vllm = vllm_step_mode(cfg.num_heads, KvDtype::Fp8)?;
        let take_mixed = match (&mixed, &separate) {
            (Ok((m, ..)), Ok((s, ..))) if m.total_us() == s.total_us() => vllm == StepMode::MixedBatch,
            (Ok((m, ..)), Ok((s, ..))) => m.total_us() < s.total_us(),
            (Ok(_), Err(_)) => true,
            (Err(_), Ok(_)) => false,
            (Err(e), Err(_)) if vllm == StepMode::MixedBatch => return Err(e.clone()),
            (Err(_), Err(e)) => return Err(e.clone()),
        };
        let split = |r: Result<Priced>| match r {
            Ok((t, p, c)) => (Ok(t), Some((p, c))),
            Err(e) => (Err(e), None),
        };
        let ((mixed, mixed_plan), (separate, separate_plan)) = (split(mixed), split(separate));
        let (mode, plan) = if take_mixed {
            (StepMode::MixedBatch, mixed_plan)
        } else {
            (StepMode::SeparatePrefillDecode, separate_plan)
        };
        let (plan, config) = plan.expect("the chosen route was planned");
        Ok(RouteChoice { mode, prediction: Prediction { mixed, separate }, plan, config })
    }

    /// Plan the step both ways and price each plan.
    fn plan_routes(&self, step: Step<'_>, cfg: &StepConfig) -> Result<(Result<Priced>, Result<Priced>)> {
        if cfg.kv_dtype != KvDtype::Fp8 {
            return Err(PlanError::InvalidArgument {
                what: "kv_dtype",
                rule: "fp8 for a route choice (a BF16 cache has one route, the prefill kernel)",
                got: cfg.kv_dtype.name().into(),
            });
        }
        let tables = self.tables(cfg)?;
        let route = |cfg: StepConfig, prefill: &Table| -> Result<Priced> {
            let plan = plan_step(step, &cfg)?;
            Ok((price(&Tables { prefill, ..tables }, &plan), plan, cfg))
        };
        let mixed = route(cfg.with_mode(StepMode::MixedBatch), tables.prefill);
        let separate_cfg = cfg.with_mode(StepMode::SeparatePrefillDecode);
        let mut separate = route(separate_cfg, tables.prefill);
        // The separate route at native prefill heads, where the profile says this kernel build
        // runs them: taken only when strictly cheaper, or when padded does not fit and it does.
        let native_table =
            self.prefill.get(&cfg.num_heads).filter(|_| self.prices_native_prefill(cfg.gpu, cfg.num_heads));
        if let (false, Some(table)) = (cfg.execution.native_prefill_heads, native_table) {
            let native = route(separate_cfg.with_native_prefill_heads(true), table);
            separate = match (separate, native) {
                (Ok(padded), Ok(native)) if native.0.total_us() < padded.0.total_us() => Ok(native),
                (Err(_), Ok(native)) => Ok(native),
                (padded, _) => padded,
            };
        }
        // A step the planner refuses outright is refused by both routes alike.
        if let (Err(e), Err(_)) = (&mixed, &separate) {
            if !matches!(
                e,
                PlanError::BudgetTooSmall { .. }
                    | PlanError::TooManyLaunches { .. }
                    | PlanError::WorkspaceTooSmall { .. }
            ) {
                return Err(e.clone());
            }
        }
        Ok((mixed, separate))
    }
}

fn price(t: &Tables<'_>, plan: &StepPlan) -> RouteTime {
    let mut time = RouteTime::default();
    for launch in &plan.launches {
        let tokens = launch.tokens.end - launch.tokens.start;
        match launch.kernel {
            Kernel::SparseDecode => {
                time.decode_us += t.decode.micros(tokens);
                time.decode_launches += 1;
            }
            Kernel::SparsePrefill => {
                time.prefill_us += t.prefill.micros(tokens);
                time.prefill_launches += 1;
            }
        }
    }
    for chunk in &plan.gather_chunks {
        time.gather_us += t.gather.micros(chunk.rows());
        time.gathers += 1;
    }
    if time.prefill_launches > 0 {
        time.prefill_heads = plan.prefill_heads;
    }
    time
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::MaskConfig;
    use serde_json::json;

    const GIB: u64 = 1 << 30;

    /// Exactly linear kernels: decode 10 + T us, prefill 200 + T/2 us (at 64
    /// heads; 200 + 4T at 128), gather 5 + R/1000 us.
    fn synthetic() -> serde_json::Value {
        json!({
            "format": PROFILE_FORMAT,
            "arch": "sm90",
            "num_sms": 132,
            "topk": 2048,
            "environment": {"gpu": "Test GPU", "driver": "1", "cuda": "1", "torch": "1", "kernels": "test 1", "gather": "test 1"},
            "sparse_decode": {"64": [[1, 11], [65536, 65546]], "128": [[1, 11], [65536, 65546]]},
            "sparse_prefill": {"64": [[2, 201], [65536, 32968]], "128": [[1, 204], [65536, 262344]]},
            "gather_upconvert": [[1000, 6], [1000000, 1005]],
        })
    }

    fn model() -> CostModel {
        CostModel::from_json(&synthetic().to_string()).unwrap()
    }

    fn cfg(num_heads: u32) -> StepConfig {
        StepConfig {
            gpu: Gpu::h200(),
            num_heads,
            topk: 2048,
            kv_dtype: KvDtype::Fp8,
            scratch_budget_bytes: 64 * GIB,
            gather_workspace_rows: 163_840 * 5,
            indexer_workspace_rows: 163_840 * 40,
            indexer_logits_bytes: 512 << 20,
            mask: MaskConfig::vllm_default(2048, false),
            mode: None,
            execution: crate::config::Execution::default(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    /// One prefill of `t` tokens after 10,000 of context (sparse: past top-k).
    fn prefill(t: u64) -> ([u64; 1], [u64; 1]) {
        ([t], [10_000])
    }

    #[test]
    fn route_flips_where_the_tables_cross() {
        // Mixed: 10 + T. Separate: gather (5 + (T + 10,000)/1000) + prefill
        // (200 + T/2) = 215 + 0.501 T. Equal at T = 205 / 0.499 = 410.8.
        let m = model();
        for (t, mixed) in [(410, true), (411, false), (32_768, false), (16, true)] {
            let (q, c) = prefill(t);
            let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
            let choice = m.choose_route(step, &cfg(16)).unwrap();
            let (pm, ps) = (choice.prediction.mixed.clone().unwrap(), choice.prediction.separate.clone().unwrap());
            assert!(close(pm.total_us(), 10.0 + t as f64), "{pm:?}");
            assert!(close(ps.total_us(), 215.0 + 0.501 * t as f64), "{ps:?}");
            assert_eq!((ps.gathers, ps.prefill_launches, pm.decode_launches), (1, 1, 1));
            assert_eq!(choice.mode == StepMode::MixedBatch, mixed, "T = {t}: {pm:?} vs {ps:?}");
            assert_eq!(choice.plan.mode, choice.mode);
            assert_eq!(choice.plan, plan_step(step, &choice.config).unwrap());
            assert_eq!(choice.config, cfg(16).with_mode(choice.mode), "no native table: vLLM's padding");
        }
    }

    #[test]
    fn slow_prefill_table_keeps_mixed_at_128_heads() {
        // At 100 heads both kernels pad to 128; there the prefill kernel
        // costs 4 us per token, more than the decode kernel's 1.
        let (q, c) = prefill(32_768);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        assert_eq!(model().choose_route(step, &cfg(100)).unwrap().mode, StepMode::MixedBatch);
        assert_eq!(model().choose_route(step, &cfg(64)).unwrap().mode, StepMode::SeparatePrefillDecode);
    }

    #[test]
    fn prediction_sums_the_planned_launches() {
        let m = model();
        let (q, c) = ([1, 1, 1, 40_000], [100, 200, 300, 5_000]);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 3 };
        let mut config = cfg(16);
        config.scratch_budget_bytes = GIB;
        config.gather_workspace_rows = 20_000;
        let p = m.predict(step, &config).unwrap();
        let mixed_plan = plan_step(step, &config.with_mode(StepMode::MixedBatch)).unwrap();
        let sep_plan = plan_step(step, &config.with_mode(StepMode::SeparatePrefillDecode)).unwrap();
        let by_launch = |plan: &StepPlan, kernel: Kernel, f: fn(f64) -> f64| -> f64 {
            plan.launches.iter().filter(|l| l.kernel == kernel).map(|l| f((l.tokens.end - l.tokens.start) as f64)).sum()
        };
        let mixed = p.mixed.unwrap();
        assert!(mixed_plan.launches.len() > 1, "the 1 GiB budget splits it");
        assert_eq!(mixed.decode_launches, mixed_plan.launches.len());
        assert!(close(mixed.total_us(), by_launch(&mixed_plan, Kernel::SparseDecode, |t| 10.0 + t)));
        let sep = p.separate.unwrap();
        assert!(sep.gathers > 1, "45,000 rows do not fit a 20,000-row workspace");
        assert_eq!(sep.gathers, sep_plan.gather_chunks.len());
        let gather: f64 = sep_plan.gather_chunks.iter().map(|g| 5.0 + g.rows() as f64 / 1000.0).sum();
        assert!(close(sep.gather_us, gather));
        assert!(close(sep.decode_us, by_launch(&sep_plan, Kernel::SparseDecode, |t| 10.0 + t)));
        assert!(close(sep.prefill_us, by_launch(&sep_plan, Kernel::SparsePrefill, |t| 200.0 + t / 2.0)));
    }

    #[test]
    fn a_route_over_the_budget_is_not_taken() {
        // 8 MiB is below one decode launch's o_accum (16.7 MiB at 132 SMs)
        // but holds prefill launches of ~100 tokens.
        let (q, c) = prefill(300);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        let mut config = cfg(16);
        config.scratch_budget_bytes = 8 << 20;
        let choice = model().choose_route(step, &config).unwrap();
        assert!(matches!(choice.prediction.mixed, Err(PlanError::BudgetTooSmall { .. })));
        assert_eq!(choice.mode, StepMode::SeparatePrefillDecode, "mixed would be faster, but does not fit");
        config.scratch_budget_bytes = (64 << 10) + (1 << 10);
        assert!(matches!(model().choose_route(step, &config), Err(PlanError::BudgetTooSmall { .. })));
    }

    #[test]
    fn decode_only_steps_follow_vllm() {
        let step = Step { query_lens: &[1, 1, 1], context_lens: &[10, 20, 30], num_decodes: 3 };
        assert_eq!(model().choose_route(step, &cfg(16)).unwrap().mode, StepMode::MixedBatch);
        assert_eq!(model().choose_route(step, &cfg(64)).unwrap().mode, StepMode::SeparatePrefillDecode);
    }

    #[test]
    fn refuses_other_configurations() {
        let m = model();
        let (q, c) = prefill(100);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        let mut sm100 = cfg(16);
        sm100.gpu = Gpu::new(Arch::Sm100, 148).unwrap();
        let mut topk = cfg(16);
        topk.topk = 512;
        let mut bf16 = cfg(16);
        bf16.kv_dtype = KvDtype::Bf16;
        for (config, needle) in [(sm100, "sm100"), (topk, "topk 512"), (bf16, "fp8")] {
            let err = m.predict(step, &config).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        // A profile with no 128-head tables cannot price 100 heads.
        let mut only64 = synthetic();
        only64["sparse_decode"].as_object_mut().unwrap().remove("128");
        let err = CostModel::from_json(&only64.to_string()).unwrap().predict(step, &cfg(100)).unwrap_err().to_string();
        assert!(err.contains("no sparse_decode table at 128 padded heads"), "{err}");
        // A step the planner refuses is refused, not priced.
        let bad = Step { query_lens: &[1, 2], context_lens: &[0], num_decodes: 0 };
        assert!(matches!(m.predict(bad, &cfg(16)), Err(PlanError::LengthMismatch { .. })));
    }

    #[test]
    fn malformed_profiles_are_refused() {
        let edit = |f: fn(&mut serde_json::Value)| {
            let mut v = synthetic();
            f(&mut v);
            CostModel::from_json(&v.to_string()).unwrap_err().to_string()
        };
        let cases = [
            (CostModel::from_json("{not json").unwrap_err().to_string(), "not valid JSON"),
            (CostModel::from_json("[]").unwrap_err().to_string(), "not a cost profile"),
            (edit(|v| v["format"] = json!("mla-planner.cost-profile/0")), "re-run"),
            (edit(|v| v["arch"] = json!("sm80")), "sm80"),
            (
                edit(|v| v["environment"].as_object_mut().unwrap().remove("driver").map(drop).unwrap()),
                "environment.driver",
            ),
            (edit(|v| v["sparse_prefill"]["64"] = json!([[64, 5], [128, 4]])), "sparse_prefill at 64 heads: point 1"),
            (edit(|v| v["sparse_decode"] = json!({"32": [[1, 1], [2, 2]]})), "64 or 128"),
            (edit(|v| v["gather_upconvert"] = json!([[1, 1]])), "gather_upconvert: needs at least 2"),
            (edit(|v| v["extra"] = json!(1)), "unknown field"),
            (edit(|v| v["topk"] = json!(100)), "topk must be a positive multiple of 128"),
            (edit(|v| v["sparse_decode"]["64"] = json!([[1, 11], [65536, 1e308]])), "between 0 and 3.6e9"),
        ];
        for (err, needle) in cases {
            assert!(err.starts_with("cost profile: ") && err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }

    /// [`synthetic`] with a native prefill table at `heads`: `fixed + per_token * T` us.
    fn with_native(heads: u32, fixed: f64, per_token: f64) -> CostModel {
        let mut v = synthetic();
        v["sparse_prefill"][heads.to_string()] = json!([[1, fixed + per_token], [65536, fixed + per_token * 65536.0]]);
        CostModel::from_json(&v.to_string()).unwrap()
    }

    fn separate_at(step: Step<'_>, config: &StepConfig, native: bool) -> StepPlan {
        plan_step(step, &config.with_mode(StepMode::SeparatePrefillDecode).with_native_prefill_heads(native)).unwrap()
    }

    #[test]
    fn native_prefill_heads_are_taken_where_cheaper() {
        // Padded (64 heads): 200 + T/2 us. Native: 50 + T/10, cheaper at every length.
        let (q, c) = prefill(100_000);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        for heads in [16, 32] {
            let m = with_native(heads, 50.0, 0.1);
            let mut config = cfg(heads);
            config.scratch_budget_bytes = GIB;
            let choice = m.choose_route(step, &config).unwrap();
            assert_eq!(choice.mode, StepMode::SeparatePrefillDecode);
            let sep = choice.prediction.separate.clone().unwrap();
            assert_eq!((sep.prefill_heads, choice.plan.prefill_heads), (heads, heads));
            assert_eq!(choice.prediction.mixed.clone().unwrap().prefill_heads, 0, "mixed runs no prefill kernel");
            // The plan chosen is the native plan, launch for launch; the padded one is tighter.
            let (native, padded) = (separate_at(step, &config, true), separate_at(step, &config, false));
            assert_eq!(choice.plan, native);
            assert_eq!(
                choice.config,
                config.with_mode(StepMode::SeparatePrefillDecode).with_native_prefill_heads(true)
            );
            assert!(native.longest_launch(Kernel::SparsePrefill) > padded.longest_launch(Kernel::SparsePrefill));
            assert!(native.launches.len() < padded.launches.len(), "1 GiB splits 100,000 tokens at 64 padded heads");
            let per_token = |p: &StepPlan| p.peak_bytes as f64 / p.longest_launch(Kernel::SparsePrefill) as f64;
            assert!(per_token(&native) < per_token(&padded));
            let expected: f64 = native.launches.iter().map(|l| 50.0 + 0.1 * l.len() as f64).sum();
            assert!(close(sep.prefill_us, expected), "{sep:?}");
        }
    }

    #[test]
    fn padded_prefill_heads_are_kept_where_cheaper_or_equal() {
        let (q, c) = prefill(32_768);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        // Native 16 heads at 500 + T us: slower than padded 64 (200 + T/2), as on the H200.
        let choice = with_native(16, 500.0, 1.0).choose_route(step, &cfg(16)).unwrap();
        assert_eq!(choice.prediction.separate.unwrap().prefill_heads, 64);
        // Equal tables: a tie keeps vLLM's padding.
        let mut tie = synthetic();
        tie["sparse_prefill"]["16"] = tie["sparse_prefill"]["64"].clone();
        let tie = CostModel::from_json(&tie.to_string()).unwrap();
        let p = tie.predict(step, &cfg(16)).unwrap().separate.unwrap();
        assert_eq!(p.prefill_heads, 64, "{p:?}");
        // A native table prices 16 heads only, never 32 (nor 32 the other way round).
        let other = with_native(32, 1.0, 0.0).predict(step, &cfg(16)).unwrap().separate.unwrap();
        assert_eq!(other.prefill_heads, 64);
    }

    #[test]
    fn native_prefill_heads_fit_where_padded_do_not() {
        // 64 KiB reserve + 120 KiB: one padded token holds 136 KiB of padded q and output; a
        // native one writes in place and holds its statistics and indices only.
        let (q, c) = prefill(300);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        let mut config = cfg(16);
        config.scratch_budget_bytes = (64 << 10) + (120 << 10);
        config.execution.translated_indices = true;
        assert!(matches!(model().predict(step, &config).unwrap().separate, Err(PlanError::BudgetTooSmall { .. })));
        let choice = with_native(16, 500.0, 1.0).choose_route(step, &config).unwrap();
        assert_eq!((choice.mode, choice.plan.prefill_heads), (StepMode::SeparatePrefillDecode, 16));
        assert!(choice.plan.peak_bytes <= config.launch_budget_bytes());
    }

    #[test]
    fn asking_for_native_heads_prices_them_only() {
        let (q, c) = prefill(32_768);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 0 };
        let native = cfg(16).with_native_prefill_heads(true);
        // Native slower than padded, but asked for: priced and planned native.
        let choice = with_native(16, 500.0, 1.0).choose_route(step, &native).unwrap();
        assert_eq!(choice.prediction.separate.unwrap().prefill_heads, 16);
        // A profile with no native table cannot price what is asked.
        let err = model().check(&native).unwrap_err().to_string();
        assert!(err.contains("no sparse_prefill table at 16 native heads"), "{err}");
        model().check(&cfg(16)).unwrap();
    }

    #[test]
    fn native_tables_are_for_sm90_prefill_only() {
        let parse = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = synthetic();
            f(&mut v);
            CostModel::from_json(&v.to_string())
        };
        let m = parse(&|v| v["sparse_prefill"]["32"] = json!([[1, 5], [2, 6]])).unwrap();
        assert_eq!(m.prefill_heads(), vec![32, 64, 128]);
        assert!(m.prices_native_prefill(Gpu::h200(), 32) && !m.prices_native_prefill(Gpu::h200(), 16));
        type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
        let cases: [(Edit<'_>, &str); 4] = [
            (
                &|v| {
                    v["arch"] = json!("sm100");
                    v["sparse_prefill"]["16"] = json!([[1, 5], [2, 6]]);
                },
                "sparse_prefill at 16 heads: native-head tables are for sm90 only",
            ),
            (&|v| v["sparse_prefill"]["48"] = json!([[1, 5], [2, 6]]), "heads must be 64 or 128 (or 16 or 32 on sm90"),
            (&|v| v["sparse_prefill"]["8"] = json!([[1, 5], [2, 6]]), "got 8"),
            (
                &|v| v["sparse_decode"]["16"] = json!([[1, 5], [2, 6]]),
                "sparse_decode: padded heads must be 64 or 128, got 16",
            ),
        ];
        for (edit, needle) in cases {
            let err = parse(edit).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Whatever the step, budget and native table: the separate route is priced at the
        /// cheaper of padded and native heads, its plan is exactly `plan_step` at those heads and
        /// fits the budget, and a profile without a native table never runs native heads.
        #[test]
        fn separate_route_takes_the_cheaper_heads(
            reqs in proptest::collection::vec((1u64..40_000, 0u64..40_000), 1..5),
            decodes in 0usize..3,
            heads in proptest::prelude::prop_oneof![proptest::prelude::Just(16u32), proptest::prelude::Just(32)],
            fixed in 0.0f64..1_000.0,
            per_token in 0.0f64..2.0,
            budget_mib in 8u64..4096,
        ) {
            let mut q: Vec<u64> = reqs.iter().map(|r| r.0).collect();
            let c: Vec<u64> = reqs.iter().map(|r| r.1).collect();
            let d = decodes.min(q.len());
            for x in &mut q[..d] { *x = 1; }
            let step = Step { query_lens: &q, context_lens: &c, num_decodes: d };
            let mut config = cfg(heads);
            config.scratch_budget_bytes = budget_mib << 20;
            let native_model = with_native(heads, fixed, per_token);
            for (m, has_native) in [(&native_model, true), (&model(), false)] {
                let p = m.predict(step, &config).unwrap();
                let Ok(sep) = p.separate else { continue };
                if sep.prefill_launches == 0 {
                    continue;
                }
                proptest::prop_assert!(has_native || sep.prefill_heads == 64, "{:?}", sep);
                let plan = separate_at(step, &config, sep.prefill_heads == heads);
                proptest::prop_assert!(plan.peak_bytes <= config.launch_budget_bytes());
                let time = |native: bool| plan_step(step, &config.with_mode(StepMode::SeparatePrefillDecode).with_native_prefill_heads(native))
                    .ok()
                    .map(|plan| price(&m.tables(&config.with_native_prefill_heads(native && has_native)).unwrap(), &plan).total_us());
                let (padded_us, native_us) = (time(false), if has_native { time(true) } else { None });
                let best = padded_us.into_iter().chain(native_us).fold(f64::INFINITY, f64::min);
                proptest::prop_assert!(close(sep.total_us(), best), "{:?} vs padded {:?} native {:?}", sep, padded_us, native_us);
                if sep.prefill_heads == heads {
                    proptest::prop_assert!(padded_us.map_or(true, |p| native_us.unwrap() < p), "a tie keeps padding");
                }
            }
        }
    }

    #[test]
    fn tables_are_exact_at_their_points() {
        let m = model();
        let t = m.kernel_table(Kernel::SparsePrefill, 64).unwrap();
        assert_eq!(t.micros(2), 201.0);
        assert_eq!(t.micros(65536), 32968.0);
        assert_eq!(m.gather_table().micros(1000), 6.0);
        assert_eq!(m.decode_heads(), vec![64, 128]);
    }
}
