//! What any step an engine can be handed needs, known before the first step: the smallest
//! scratch budget under which every such step plans, and the most one launch of those plans
//! allocates beyond what the caller's workspace holds. Both follow from the configuration and
//! two limits of the engine: the most tokens of a step and the longest decode.

use crate::config::{StepConfig, StepMode, ALLOCATOR_RESERVE_BYTES};
use crate::error::{add, Bytes, PlanError, Result};
use crate::geometry::decode_padded_heads;
use crate::limits::max_tokens_per_launch;
use crate::plan::prefill_launch_tokens;
use crate::scratch::{decode_scratch, prefill_scratch, Breakdown};
use crate::step::{
    decode_shape, mixed_config, prefill_in_place, prefill_shape, Kernel, KernelLaunch, StepPlan, MAX_DECODE_QUERY_LEN,
};

/// The steps an engine may hand the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// The most query tokens of one step (vLLM's `max_num_batched_tokens`).
    pub max_step_tokens: u64,
    /// The longest decode request: vLLM's decode threshold (its builder counts requests of up to
    /// this many query tokens as decodes; at least 1 + the speculative tokens).
    pub max_decode_query_len: u64,
}

impl EngineLimits {
    /// The longest decode a step can hold.
    fn longest_decode(&self) -> u64 {
        self.max_decode_query_len.min(MAX_DECODE_QUERY_LEN).min(self.max_step_tokens).max(1)
    }
}

/// The smallest scratch budget under which every step within `limits` plans on `cfg`'s route.
/// A plan cuts a step down to the kernels' smallest units, so the budget must hold the largest
/// of those: one token of the decode kernel (mixed batch), one whole decode request and one token
/// of the prefill kernel (separate route). Below 133 tokens the decode kernel's accumulators do
/// not shrink with the tokens, so every decode length up to the longest is a unit of its own.
/// BF16 steps run vLLM's own call, whatever the budget.
pub fn min_scratch_budget(cfg: &StepConfig, limits: EngineLimits) -> Result<u64> {
    cfg.validate()?;
    let unit = match cfg.mode() {
        StepMode::MixedBatch => mixed_config(cfg, u64::MAX).launch_scratch(1)?.total_bytes(),
        StepMode::SeparatePrefillDecode => {
            let prefill = prefill_scratch(cfg.gpu.arch, prefill_shape(cfg, 1, prefill_in_place(cfg)))?;
            (1..=limits.longest_decode()).try_fold(prefill.total_bytes(), |most, s_q| {
                Ok::<u64, crate::PlanError>(most.max(decode_scratch(cfg.gpu, decode_shape(cfg, 1, s_q))?.total_bytes()))
            })?
        }
        StepMode::Bf16 => 1,
    };
    add("the smallest budget", unit, ALLOCATOR_RESERVE_BYTES)
}

/// The most one launch of any plan within `limits` on `cfg`'s route allocates, less its padded
/// q and kernel output where the caller's workspace holds those: `served_heads` is the heads of
/// the workspace's padded q and output (`None`: no such workspace), and a
/// launch whose kernel runs that many heads takes both from it. This is what must be reserved
/// for the launches beyond the workspace; the budget bounds every launch's own bytes.
pub fn largest_launch_bytes(cfg: &StepConfig, limits: EngineLimits, served_heads: Option<u32>) -> Result<u64> {
    cfg.validate()?;
    let budget = cfg.launch_budget_bytes();
    let beyond = |buffers: &Breakdown, kernel_heads: u32| bytes_beyond(buffers, kernel_heads, served_heads);
    match cfg.mode() {
        StepMode::MixedBatch => {
            let heads = decode_padded_heads(cfg.num_heads)?;
            let mixed = mixed_config(cfg, budget);
            let cap = limits.max_step_tokens.min(max_tokens_per_launch(heads).0);
            let fits = |len: u64| Ok::<bool, crate::PlanError>(mixed.launch_scratch(len)?.total_bytes() <= budget);
            // Up to num_sms tokens the bytes rise and fall with the length: each length counts.
            // Past it they grow with it: the longest that fits is the largest.
            let knee = u64::from(cfg.gpu.num_sms).min(cap);
            let mut lengths: Vec<u64> = Vec::new();
            for len in 1..=knee {
                if fits(len)? {
                    lengths.push(len);
                }
            }
            if cap > knee && fits(knee + 1)? {
                let (mut lo, mut hi) = (knee + 1, cap);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if fits(mid)? {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                lengths.push(lo);
            }
            // A launch holds the padded q of its plan's longest launch: where the workspace does
            // not serve it, count the longest one's with every launch.
            let longest = lengths.iter().copied().max().unwrap_or(0);
            let held = if longest == 0 || served_heads == Some(heads) {
                0
            } else {
                mixed.launch_scratch(longest)?.get("q_padded")
            };
            lengths.into_iter().try_fold(0u64, |most, len| {
                let own = mixed.launch_scratch(len)?;
                let bytes = beyond(&own, heads) - own.get("q_padded").min(held) + held;
                Ok(most.max(bytes.min(budget)))
            })
        }
        StepMode::SeparatePrefillDecode => {
            let heads = cfg.decode_heads();
            let mut most = 0u64;
            for s_q in 1..=limits.longest_decode() {
                let bytes = |batch: u64| decode_scratch(cfg.gpu, decode_shape(cfg, batch, s_q));
                let (mut lo, mut hi) = (0u64, limits.max_step_tokens / s_q);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if bytes(mid)?.total_bytes() <= budget {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                if lo > 0 {
                    most = most.max(beyond(&bytes(lo)?, heads));
                }
            }
            let in_place = prefill_in_place(cfg);
            let Ok((per_launch, _)) = prefill_launch_tokens(cfg.gpu.arch, prefill_shape(cfg, 1, in_place), budget)
            else {
                return Ok(most); // no prefill token fits: no plan has a prefill launch
            };
            let longest = per_launch.min(limits.max_step_tokens);
            if longest > 0 {
                let own = prefill_scratch(cfg.gpu.arch, prefill_shape(cfg, longest, in_place))?;
                most = most.max(beyond(&own, cfg.prefill_heads()));
            }
            Ok(most)
        }
        StepMode::Bf16 => Ok(0),
    }
}

/// The most one launch of `plan` allocates beyond a caller's workspace that holds the padded q
/// and kernel output of every launch whose kernel runs `served_heads` heads (`None`: no such
/// workspace): what of the plan's peak the reservation must hold, which
/// [`largest_launch_bytes`] bounds. `decode_heads`: the heads the decode kernel runs
/// ([`StepConfig::decode_heads`]).
pub fn peak_beyond_workspace(plan: &StepPlan, decode_heads: u32, served_heads: Option<u32>) -> u64 {
    let kernel_heads =
        |l: &KernelLaunch| if l.kernel == Kernel::SparseDecode { decode_heads } else { plan.prefill_heads };
    plan.launches.iter().map(|l| bytes_beyond(&l.buffers, kernel_heads(l), served_heads)).max().unwrap_or(0)
}

/// A launch's bytes less its padded q and kernel output where a workspace holds them: where the
/// kernel runs `served_heads` heads, those of the workspace's views.
fn bytes_beyond(buffers: &Breakdown, kernel_heads: u32, served_heads: Option<u32>) -> u64 {
    let served = if served_heads == Some(kernel_heads) { buffers.get("q_padded") + buffers.get("out") } else { 0 };
    buffers.total_bytes() - served
}

/// The configurations of the bounded path: where a step cannot run its plan, its layer calls run
/// their tokens on the mixed-batch route (any subset of a step's tokens can take it, each token
/// attending to its own top-k rows) in launches whose every byte -- padded q and output included
/// -- fits `allowance`, the bytes reserved for one launch. The first rung's budget holds launches
/// of up to `allowance` bytes (or `cfg`'s own budget, where that is smaller); each next rung's
/// launches take at most a `shrink`th of the one before, down to the smallest budget a one-token
/// launch needs, which is the last rung: what an allocation failure retries with.
/// [`PlanError::BudgetTooSmall`] where not even one token fits `allowance`.
pub fn bounded_configs(cfg: &StepConfig, allowance: u64, shrink: u64) -> Result<Vec<StepConfig>> {
    cfg.validate()?;
    if shrink < 2 {
        return Err(PlanError::InvalidArgument { what: "shrink", rule: "at least 2", got: shrink.to_string() });
    }
    let mixed = cfg.with_mode(StepMode::MixedBatch);
    let one_token = mixed_config(&mixed, u64::MAX).launch_scratch(1)?.total_bytes();
    let minimum = add("the smallest budget", one_token, ALLOCATOR_RESERVE_BYTES)?;
    let first = cfg.scratch_budget_bytes.min(add("the bounded budget", allowance, ALLOCATOR_RESERVE_BYTES)?);
    if first < minimum {
        return Err(PlanError::BudgetTooSmall {
            budget: Bytes(allowance),
            minimum: Bytes(one_token),
            tokens: 1,
            num_heads: cfg.num_heads,
            arch: cfg.gpu.arch.name(),
            detail: "the bounded path's launches must fit the reservation".into(),
        });
    }
    let mut budgets = vec![first];
    let mut launch = first - ALLOCATOR_RESERVE_BYTES;
    while launch / shrink + ALLOCATOR_RESERVE_BYTES > minimum {
        launch /= shrink;
        budgets.push(launch + ALLOCATOR_RESERVE_BYTES);
    }
    if budgets.last() != Some(&minimum) {
        budgets.push(minimum);
    }
    Ok(budgets.into_iter().map(|b| StepConfig { scratch_budget_bytes: b, ..mixed }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Execution;
    use crate::geometry::{Gpu, KvDtype};
    use crate::step::{plan_step, Step};
    use proptest::prelude::*;

    fn config(num_heads: u32, budget: u64, mode: StepMode, native: bool) -> StepConfig {
        let cfg = StepConfig::vllm(Gpu::h200(), num_heads, 2048, KvDtype::Fp8, budget, 70_000, false, true).unwrap();
        StepConfig { execution: Execution { native_prefill_heads: native, ..cfg.execution }, ..cfg.with_mode(mode) }
    }

    /// A step of `decodes` requests of `s_q` tokens (`padding` more of length 0, as CUDA-graph
    /// padding adds them) and prefills of `prefills` tokens, each after `context` cached ones.
    fn lengths(
        decodes: usize,
        s_q: u64,
        padding: usize,
        prefills: &[u64],
        context: u64,
    ) -> (Vec<u64>, Vec<u64>, usize) {
        let mut q = vec![s_q; decodes];
        q.extend(std::iter::repeat_n(0, padding));
        let d = q.len();
        q.extend_from_slice(prefills);
        let c = q.iter().map(|_| context).collect();
        (q, c, d)
    }

    #[test]
    fn the_smallest_budget_names_the_largest_unit() {
        let limits = EngineLimits { max_step_tokens: 8192, max_decode_query_len: 128 };
        // Mixed batch: one token of the decode kernel, 132 + 1 split parts of 64 heads.
        let mixed = config(16, 1 << 30, StepMode::MixedBatch, false);
        let one_token = mixed_config(&mixed, u64::MAX).launch_scratch(1).unwrap().total_bytes();
        assert_eq!(min_scratch_budget(&mixed, limits).unwrap(), one_token + ALLOCATOR_RESERVE_BYTES);
        // Separate: the worst decode length up to 90 (66 tokens keep two split parts), not 90.
        let separate = config(64, 1 << 30, StepMode::SeparatePrefillDecode, false);
        let at = |s_q| decode_scratch(Gpu::h200(), decode_shape(&separate, 1, s_q)).unwrap().total_bytes();
        let worst = (1..=90).map(at).max().unwrap();
        assert!(worst > at(90), "the worst decode is not the longest");
        let short = EngineLimits { max_decode_query_len: 90, ..limits };
        assert_eq!(min_scratch_budget(&separate, short).unwrap(), worst + ALLOCATOR_RESERVE_BYTES);
        // Longer decodes need more: 256 tokens (the threshold by heads and architecture at 64 heads) need 64.4 MiB.
        let longer = EngineLimits { max_decode_query_len: 256, ..limits };
        assert!(min_scratch_budget(&separate, longer).unwrap() > 64 << 20);
    }

    #[test]
    fn bounded_rungs_shrink_to_one_token() {
        let cfg = config(16, 1 << 30, StepMode::SeparatePrefillDecode, false);
        let one_token = mixed_config(&cfg.with_mode(StepMode::MixedBatch), u64::MAX).launch_scratch(1).unwrap();
        let minimum = one_token.total_bytes() + ALLOCATOR_RESERVE_BYTES;
        let rungs = bounded_configs(&cfg, 600 << 20, 4).unwrap();
        let budgets: Vec<u64> = rungs.iter().map(|c| c.scratch_budget_bytes).collect();
        assert_eq!(budgets[0], (600 << 20) + ALLOCATOR_RESERVE_BYTES);
        assert_eq!(*budgets.last().unwrap(), minimum);
        assert!(budgets.windows(2).all(|w| w[1] < w[0]), "{budgets:?}");
        assert!(rungs.iter().all(|c| c.mode() == StepMode::MixedBatch));
        // The engine's own budget caps the first rung; an allowance below one token is refused.
        assert_eq!(bounded_configs(&cfg, 4 << 30, 4).unwrap()[0].scratch_budget_bytes, 1 << 30);
        assert!(matches!(bounded_configs(&cfg, one_token.total_bytes() - 1, 4), Err(PlanError::BudgetTooSmall { .. })));
        assert_eq!(bounded_configs(&cfg, one_token.total_bytes(), 4).unwrap().len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3_000))]

        /// At the smallest budget every step within the limits plans (CUDA-graph padding and
        /// speculative decodes among them); one byte less and the step of the largest unit does not.
        #[test]
        fn every_step_plans_at_the_smallest_budget(
            heads in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
            separate in any::<bool>(),
            native in any::<bool>(),
            max_decode in 1u64..300,
            decodes in 0usize..40,
            padding in 0usize..8,
            s_q_draw in 1u64..300,
            prefills in prop::collection::vec(1u64..3000, 0..3),
            context in 0u64..5000,
        ) {
            let mode = if separate { StepMode::SeparatePrefillDecode } else { StepMode::MixedBatch };
            let native = native && separate && crate::geometry::prefill_runs_native(heads, Gpu::h200().arch);
            let limits = EngineLimits { max_step_tokens: 16_384, max_decode_query_len: max_decode };
            let probe = config(heads, 1 << 30, mode, native);
            let min = min_scratch_budget(&probe, limits).unwrap();
            let cfg = StepConfig { scratch_budget_bytes: min, ..probe };
            let s_q = 1 + s_q_draw % limits.longest_decode();
            let (q, c, d) = lengths(decodes, s_q, padding, &prefills, context);
            let step = Step { query_lens: &q, context_lens: &c, num_decodes: d };
            let plan = plan_step(step, &cfg);
            prop_assert!(plan.is_ok(), "{:?} at {} B: {}", (&q, d), min, plan.unwrap_err());
            let below = StepConfig { scratch_budget_bytes: min - 1, ..probe };
            let units: Vec<(Vec<u64>, usize)> = match mode {
                StepMode::MixedBatch => vec![(vec![1], 0)],
                _ => (1..=limits.longest_decode()).map(|s| (vec![s], 1)).chain([(vec![1], 0)]).collect(),
            };
            let fails = units.iter().any(|(q, d)| {
                let c = vec![0; q.len()];
                plan_step(Step { query_lens: q, context_lens: &c, num_decodes: *d }, &below).is_err()
            });
            prop_assert!(fails, "every unit plans one byte below the smallest budget");
        }

        /// Every launch of any bounded plan, at every rung, fits the allowance it was made for,
        /// whatever the engine's routes and budget: the bounded path never takes more than the
        /// reservation.
        #[test]
        fn every_bounded_launch_fits_the_allowance(
            heads in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
            separate in any::<bool>(),
            budget_mib in 40u64..2048,
            allowance_mib in 20u64..2048,
            tokens in 1u64..70_000,
        ) {
            let mode = if separate { StepMode::SeparatePrefillDecode } else { StepMode::MixedBatch };
            let cfg = config(heads, budget_mib << 20, mode, false);
            let Ok(rungs) = bounded_configs(&cfg, allowance_mib << 20, 4) else { return Ok(()) };
            for rung in &rungs {
                let q = [tokens];
                let plan = plan_step(Step { query_lens: &q, context_lens: &[0], num_decodes: 0 }, rung).unwrap();
                prop_assert_eq!(plan.launches.first().map(|l| l.tokens.start), Some(0));
                prop_assert_eq!(plan.launches.last().map(|l| l.tokens.end), Some(tokens));
                for l in &plan.launches {
                    prop_assert!(l.kernel == Kernel::SparseDecode);
                    prop_assert!(l.bytes <= allowance_mib << 20, "{} > {}", l.bytes, allowance_mib << 20);
                }
            }
        }

        /// No launch of any plan within the limits allocates more beyond the workspace than
        /// `largest_launch_bytes` says: what the reservation must hold.
        #[test]
        fn no_launch_outgrows_the_largest(
            heads in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
            separate in any::<bool>(),
            budget_mib in 40u64..2048,
            workspace in any::<bool>(),
            decodes in 0usize..300,
            padding in 0usize..8,
            s_q in 1u64..5,
            prefills in prop::collection::vec(1u64..9000, 0..4),
            context in 0u64..5000,
        ) {
            let mode = if separate { StepMode::SeparatePrefillDecode } else { StepMode::MixedBatch };
            let limits = EngineLimits { max_step_tokens: 16_384, max_decode_query_len: 4 };
            let probe = config(heads, budget_mib << 20, mode, false);
            prop_assume!(min_scratch_budget(&probe, limits).unwrap() <= probe.scratch_budget_bytes);
            let (q, c, d) = lengths(decodes, s_q, padding, &prefills, context);
            prop_assume!(q.iter().sum::<u64>() <= limits.max_step_tokens);
            let served_heads = workspace.then(|| probe.prefill_padded_heads());
            let largest = largest_launch_bytes(&probe, limits, served_heads).unwrap();
            let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &probe).unwrap();
            let beyond = peak_beyond_workspace(&plan, probe.decode_heads(), served_heads);
            prop_assert!(beyond <= largest, "{} > {}", beyond, largest);
            let with_served = peak_beyond_workspace(&plan, probe.decode_heads(), None);
            prop_assert_eq!(with_served, plan.peak_bytes);
        }
    }
}
