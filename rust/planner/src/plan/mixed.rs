//! FP8 mixed-batch mode: all `T` tokens of a step go through the sparse
//! decode kernel as `b = 1, s_q = T`. Cut them into the fewest contiguous
//! launches whose whole transient fits the budget and no hard limit.

use super::{Bound, MixedLaunch};
use crate::error::{check_launches, Bytes, PlanError, Result, MAX_LAUNCHES};
use crate::geometry::{decode_padded_heads, Gpu};
use crate::limits::max_tokens_per_launch;
use crate::scratch::{decode_scratch, Breakdown, DecodeShape};

/// What a mixed-batch plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedBatchConfig {
    pub gpu: Gpu,
    /// Query heads per rank, before padding.
    pub num_heads: u32,
    pub topk: u32,
    /// Bytes one launch may allocate, all buffers together.
    pub budget_bytes: u64,
    /// The executor passes `out=` (one output for the whole step), so no
    /// launch allocates its own.
    pub out_preallocated: bool,
    /// Each launch translates its own tokens' top-k indices to cache slots
    /// (see [`DecodeShape::translated_indices`]).
    pub translated_indices: bool,
    /// Prefer launch lengths that fill whole waves of the GPU (see
    /// [`wave_tokens`]) when that costs at most one extra launch.
    pub align_waves: bool,
}

impl MixedBatchConfig {
    /// The breakdown of one launch of `tokens` tokens.
    pub fn launch_scratch(&self, tokens: u64) -> Result<Breakdown> {
        decode_scratch(
            self.gpu,
            DecodeShape {
                batch: 1,
                s_q: tokens,
                num_heads: self.num_heads,
                topk: self.topk,
                out_preallocated: self.out_preallocated,
                translated_indices: self.translated_indices,
            },
        )
    }

    fn launch_bytes(&self, tokens: u64) -> Result<u64> {
        Ok(self.launch_scratch(tokens)?.total_bytes())
    }
}

/// Contiguous launches covering `[0, T)` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixedBatchPlan {
    pub launches: Vec<MixedLaunch>,
    /// The largest launch's transient.
    pub peak_bytes: u64,
    /// What stopped the step from running as one launch.
    pub bound: Bound,
}

impl MixedBatchPlan {
    /// Distinct launch lengths; at most two, so one FlashMLA scheduler
    /// metadata object per length serves every launch.
    pub fn distinct_lengths(&self) -> Vec<u64> {
        let mut lens: Vec<u64> = self.launches.iter().map(MixedLaunch::len).collect();
        lens.sort_unstable();
        lens.dedup();
        lens
    }
}

/// Which launch lengths fit. Scratch falls and rises with length while
/// `num_sm_parts > 1` (up to `num_sms` tokens) and grows linearly after, and
/// every length up to `num_sms` costs less than any longer one. So the
/// feasible set is the interval `[1, max]` once a length past `num_sms` fits,
/// and an irregular subset of `1..=num_sms` otherwise.
struct Feasible {
    small: Vec<bool>,
    /// Largest feasible length; 0 when none fits.
    max: u64,
}

impl Feasible {
    fn new(cfg: &MixedBatchConfig, cap: u64) -> Result<Self> {
        let knee = u64::from(cfg.gpu.num_sms).min(cap);
        let small = (1..=knee).map(|s| Ok(cfg.launch_bytes(s)? <= cfg.budget_bytes)).collect::<Result<Vec<bool>>>()?;
        let mut max = small.iter().rposition(|&f| f).map_or(0, |i| i as u64 + 1);
        // Past the knee the transient grows with length: binary search.
        if cap > knee && cfg.launch_bytes(knee + 1)? <= cfg.budget_bytes {
            let (mut lo, mut hi) = (knee + 1, cap);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if cfg.launch_bytes(mid)? <= cfg.budget_bytes {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            max = lo;
        }
        Ok(Feasible { small, max })
    }

    fn fits(&self, len: u64) -> bool {
        match usize::try_from(len) {
            Ok(0) => false,
            Ok(i) if i <= self.small.len() => self.small[i - 1],
            _ => len <= self.max,
        }
    }

    /// Feasible lengths, longest first, no longer than `limit`.
    fn descending(&self, limit: u64) -> impl Iterator<Item = u64> + '_ {
        (1..=self.max.min(limit)).rev().filter(|&s| self.fits(s))
    }
}

/// Split `n` launches totalling `total` tokens into at most two lengths that
/// fit, balanced first (lengths differing by one), else any two lengths.
/// Returns `(length, count)` pairs, longest first.
fn split_into(total: u64, n: u64, feasible: &Feasible) -> Option<Vec<(u64, u64)>> {
    // n <= total, so q >= 1: n - r launches of q tokens and r of q + 1.
    let (q, r) = (total / n, total % n);
    if feasible.fits(q) && (r == 0 || feasible.fits(q + 1)) {
        return Some([(q + 1, r), (q, n - r)].into_iter().filter(|&(_, c)| c > 0).collect());
    }
    // Only reached when the feasible set is irregular (at most num_sms
    // lengths), so this search is small.
    for long in feasible.descending(total) {
        for k in 1..=n {
            let Some(rest) = total.checked_sub(k * long) else { break };
            if k == n {
                if rest == 0 {
                    return Some(vec![(long, n)]);
                }
                continue;
            }
            let short = rest / (n - k);
            if rest % (n - k) == 0 && short >= 1 && short < long && feasible.fits(short) {
                return Some(vec![(long, k), (short, n - k)]);
            }
        }
    }
    None
}

/// Query tokens one wave of the decode kernel takes: a CTA per token and
/// 64-head block, one CTA per SM at a time (past `num_sms` tokens the kernel
/// does not split keys across SMs).
pub fn wave_tokens(gpu: Gpu, padded_heads: u32) -> u64 {
    (u64::from(gpu.num_sms) * 64 / u64::from(padded_heads)).max(1)
}

/// Launches of the longest whole-wave length that fits, then the rest: as
/// many waves in total as one call would take. `None` when not even one
/// wave fits. Lengths below `max_len` always fit once one longer than
/// `num_sms` does (see [`Feasible`]).
fn wave_aligned(total: u64, max_len: u64, wave: u64) -> Option<Vec<(u64, u64)>> {
    let len = max_len - max_len % wave;
    if len == 0 {
        return None;
    }
    let (full, rest) = (total / len, total % len);
    Some([(len, full), (rest, u64::from(rest > 0))].into_iter().filter(|&(_, c)| c > 0).collect())
}

/// Plan `num_tokens` tokens of one step.
pub fn plan_mixed_batch(num_tokens: u64, cfg: &MixedBatchConfig) -> Result<MixedBatchPlan> {
    let padded = decode_padded_heads(cfg.num_heads)?;
    // Validates topk too, before any search.
    cfg.launch_scratch(1)?;
    if num_tokens == 0 {
        return Ok(MixedBatchPlan { launches: vec![], peak_bytes: 0, bound: Bound::Unbounded });
    }
    let (max_tokens, limit) = max_tokens_per_launch(padded);
    let cap = num_tokens.min(max_tokens);
    let feasible = Feasible::new(cfg, cap)?;
    if feasible.max == 0 {
        return Err(budget_too_small(cfg, cap)?);
    }
    let bound = if feasible.fits(num_tokens) {
        Bound::Unbounded
    } else if feasible.max == max_tokens {
        Bound::Limit(limit)
    } else {
        Bound::Budget
    };
    // No budget helps once the hard limit alone needs too many launches.
    let hint = if num_tokens.div_ceil(max_tokens) > MAX_LAUNCHES {
        "plan fewer tokens at once: even launches at the kernel's hard limit are too many"
    } else {
        "give a larger budget"
    };
    let first = num_tokens.div_ceil(feasible.max);
    check_launches("the mixed-batch step", first, hint)?;
    let mut groups = (first..=num_tokens.min(MAX_LAUNCHES))
        .find_map(|n| split_into(num_tokens, n, &feasible))
        .ok_or(PlanError::TooManyLaunches { what: "the mixed-batch step", launches: MAX_LAUNCHES + 1, hint })?;
    let count = |groups: &[(u64, u64)]| groups.iter().fold(0u64, |acc, &(_, c)| acc.saturating_add(c));
    if cfg.align_waves && bound != Bound::Unbounded {
        let launches = count(&groups);
        if let Some(aligned) = wave_aligned(num_tokens, feasible.max, wave_tokens(cfg.gpu, padded)) {
            let aligned_launches = count(&aligned);
            if aligned_launches <= launches.saturating_add(1) && aligned_launches <= MAX_LAUNCHES {
                groups = aligned;
            }
        }
    }

    // At most MAX_LAUNCHES, checked above, so this is the only allocation.
    let mut launches = Vec::with_capacity(count(&groups) as usize);
    let mut start = 0;
    let mut peak_bytes = 0;
    for (len, count) in groups {
        let bytes = cfg.launch_bytes(len)?;
        peak_bytes = peak_bytes.max(bytes);
        for _ in 0..count {
            launches.push(MixedLaunch { start, end: start + len, bytes });
            start += len;
        }
    }
    debug_assert_eq!(start, num_tokens);
    Ok(MixedBatchPlan { launches, peak_bytes, bound })
}

/// The error for a budget below every launch length, naming the cheapest.
fn budget_too_small(cfg: &MixedBatchConfig, cap: u64) -> Result<PlanError> {
    let knee = (u64::from(cfg.gpu.num_sms) + 1).min(cap);
    let mut best = (u64::MAX, 1);
    for s in 1..=knee {
        best = best.min((cfg.launch_bytes(s)?, s));
    }
    let (minimum, tokens) = best;
    let bd = cfg.launch_scratch(tokens)?;
    let padded = decode_padded_heads(cfg.num_heads)?;
    let parts = crate::scratch::num_sm_parts(cfg.gpu, tokens, padded);
    Ok(PlanError::BudgetTooSmall {
        budget: Bytes(cfg.budget_bytes),
        minimum: Bytes(minimum),
        tokens,
        num_heads: cfg.num_heads,
        arch: cfg.gpu.arch.name(),
        detail: format!("mostly o_accum ({}) split over {} SM parts", Bytes(bd.get("o_accum")), parts),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Arch;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn cfg(num_heads: u32, budget_bytes: u64) -> MixedBatchConfig {
        MixedBatchConfig {
            gpu: Gpu::h200(),
            num_heads,
            topk: 2048,
            budget_bytes,
            out_preallocated: true,
            translated_indices: false,
            align_waves: false,
        }
    }

    #[test]
    fn one_launch_when_it_fits() {
        let plan = plan_mixed_batch(2048, &cfg(16, GIB)).unwrap();
        assert_eq!(plan.launches, vec![MixedLaunch { start: 0, end: 2048, bytes: plan.peak_bytes }]);
        assert_eq!(plan.bound, Bound::Unbounded);
    }

    /// The README's default: 32K tokens, 16 heads, 1 GiB.
    #[test]
    fn default_step() {
        let plan = plan_mixed_batch(32768, &cfg(16, GIB)).unwrap();
        // Per token: o_accum (b + P = 2 rows) + lse_accum + q_padded + lse,
        // all at 64 padded heads; 3,189 tokens at most per GiB.
        let per_token = 2 * 64 * 512 * 4 + 2 * 64 * 4 + 64 * 576 * 2 + 64 * 4;
        let max_len = GIB / per_token;
        assert_eq!(max_len, 3189);
        assert_eq!(plan.launches.len() as u64, 32768u64.div_ceil(max_len));
        assert!(plan.peak_bytes <= GIB);
        assert_eq!(plan.bound, Bound::Budget);
        assert_eq!(plan.distinct_lengths().len(), 2);
    }

    #[test]
    fn int32_stride_bounds_an_unlimited_budget() {
        let plan = plan_mixed_batch(65536, &cfg(64, u64::MAX)).unwrap();
        assert_eq!(plan.launches.len(), 2);
        assert_eq!(plan.bound, Bound::Limit(crate::limits::HardLimit::Int32Stride));
        let plan = plan_mixed_batch(32768, &cfg(128, u64::MAX)).unwrap();
        assert_eq!(plan.launches.len(), 2);
        assert!(plan.launches.iter().all(|l| l.len() <= 29_127));
    }

    #[test]
    fn too_small_budget_names_the_minimum() {
        let err = plan_mixed_batch(4096, &cfg(16, 8 * MIB)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, PlanError::BudgetTooSmall { tokens: 1, .. }), "{msg}");
        assert!(msg.contains("8.0 MiB") && msg.contains("16.7 MiB") && msg.contains("132 SM parts"), "{msg}");
        // The minimum it names is enough.
        let PlanError::BudgetTooSmall { minimum, .. } = err else { unreachable!() };
        assert!(plan_mixed_batch(4096, &cfg(16, minimum.0)).is_ok());
        assert!(plan_mixed_batch(4096, &cfg(16, minimum.0 - 1)).is_err());
    }

    #[test]
    fn empty_step() {
        let plan = plan_mixed_batch(0, &cfg(16, GIB)).unwrap();
        assert!(plan.launches.is_empty());
    }

    fn fitting_lengths(t: u64, c: &MixedBatchConfig) -> Vec<u64> {
        let cap = t.min(max_tokens_per_launch(decode_padded_heads(c.num_heads).unwrap()).0);
        (1..=cap).filter(|&s| c.launch_bytes(s).unwrap() <= c.budget_bytes).collect()
    }

    /// Fewest launches over any lengths that fit (coin change).
    fn brute_force_any_lengths(t: u64, c: &MixedBatchConfig) -> Option<u64> {
        let lens = fitting_lengths(t, c);
        let mut best = vec![u64::MAX; t as usize + 1];
        best[0] = 0;
        for total in 1..=t as usize {
            for &s in lens.iter().take_while(|&&s| s as usize <= total) {
                if best[total - s as usize] != u64::MAX {
                    best[total] = best[total].min(best[total - s as usize] + 1);
                }
            }
        }
        (best[t as usize] != u64::MAX).then(|| best[t as usize])
    }

    /// Fewest launches over plans of at most two lengths: every pair, every count.
    fn brute_force_two_lengths(t: u64, c: &MixedBatchConfig) -> Option<u64> {
        let lens = fitting_lengths(t, c);
        let mut best = None::<u64>;
        for &long in &lens {
            for &short in lens.iter().filter(|&&s| s <= long) {
                for k in 1..=t / long {
                    let rest = t - k * long;
                    let m = if rest == 0 {
                        0
                    } else if rest % short == 0 {
                        rest / short
                    } else {
                        continue;
                    };
                    best = Some(best.map_or(k + m, |b| b.min(k + m)));
                }
            }
        }
        best
    }

    fn check_plan(t: u64, c: &MixedBatchConfig, plan: &MixedBatchPlan) {
        let mut next = 0;
        for l in &plan.launches {
            assert_eq!(l.start, next, "launches are contiguous and in order");
            assert!(l.end > l.start);
            assert_eq!(l.bytes, c.launch_bytes(l.len()).unwrap());
            assert!(l.bytes <= c.budget_bytes, "launch fits the budget");
            assert!(l.len() <= max_tokens_per_launch(decode_padded_heads(c.num_heads).unwrap()).0);
            next = l.end;
        }
        assert_eq!(next, t, "every token exactly once");
        assert!(plan.distinct_lengths().len() <= 2);
        assert_eq!(plan.peak_bytes, plan.launches.iter().map(|l| l.bytes).max().unwrap_or(0));
    }

    #[test]
    fn wave_aligned_plans_take_as_many_waves_as_one_call() {
        let wave = wave_tokens(Gpu::h200(), 64);
        assert_eq!(wave, 132);
        assert_eq!(wave_tokens(Gpu::h200(), 128), 66);
        let aligned = MixedBatchConfig { align_waves: true, out_preallocated: false, ..cfg(16, 1 << 30) };
        let plain = plan_mixed_batch(32768, &MixedBatchConfig { align_waves: false, ..aligned }).unwrap();
        let plan = plan_mixed_batch(32768, &aligned).unwrap();
        let waves = |p: &MixedBatchPlan| p.launches.iter().map(|l| l.len().div_ceil(wave)).sum::<u64>();
        assert_eq!(plain.launches.len(), 13);
        assert_eq!(waves(&plain), 13 * 20);
        assert_eq!(waves(&plan), 32768u64.div_ceil(wave));
        // Here the longest launch that fits is 20 waves or more, so alignment costs no launch.
        assert_eq!(plan.launches.len(), 13);
        let lengths = plan.distinct_lengths();
        assert_eq!(lengths.len(), 2);
        assert_eq!(lengths[1] % wave, 0, "{lengths:?}");
        assert_eq!(plan.launches.last().unwrap().len(), lengths[0]);
        assert!(plan.peak_bytes <= aligned.budget_bytes);
        // Never more than one launch over the minimum: at a small budget it keeps the plain plan.
        let small = MixedBatchConfig { budget_bytes: 60 << 20, ..aligned };
        let (a, p) = (
            plan_mixed_batch(32768, &small).unwrap(),
            plan_mixed_batch(32768, &MixedBatchConfig { align_waves: false, ..small }).unwrap(),
        );
        assert!(a.launches.len() <= p.launches.len() + 1);
        // Unbounded steps stay one call.
        assert_eq!(
            plan_mixed_batch(4096, &MixedBatchConfig { budget_bytes: 1 << 40, ..aligned }).unwrap().launches.len(),
            1
        );
    }

    fn small_config() -> impl Strategy<Value = MixedBatchConfig> {
        (
            prop_oneof![Just(Arch::Sm90), Just(Arch::Sm100)],
            1u32..=140,
            1u32..=128,
            prop_oneof![Just(512u32), Just(2048)],
            any::<bool>(),
            // Budgets around the irregular region: 15-60 MiB.
            (15 * MIB)..(60 * MIB),
            any::<bool>(),
        )
            .prop_map(
                |(arch, num_sms, num_heads, topk, out_preallocated, budget_bytes, translated_indices)| {
                    MixedBatchConfig {
                        align_waves: false,
                        gpu: Gpu::new(arch, num_sms).unwrap(),
                        num_heads,
                        topk,
                        budget_bytes,
                        out_preallocated,
                        translated_indices,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// Small steps, budgets around the non-monotonic region: the plan
        /// is valid, as short as any plan of at most two lengths, and as
        /// short as any plan at all once a launch longer than `num_sms`
        /// tokens fits (there the lengths that fit are an interval).
        #[test]
        fn minimal_against_brute_force(t in 1u64..400, c in small_config()) {
            match plan_mixed_batch(t, &c) {
                Ok(plan) => {
                    check_plan(t, &c, &plan);
                    let n = Some(plan.launches.len() as u64);
                    prop_assert_eq!(n, brute_force_two_lengths(t, &c));
                    let knee = u64::from(c.gpu.num_sms) + 1;
                    if c.launch_bytes(knee).unwrap() <= c.budget_bytes {
                        prop_assert_eq!(n, brute_force_any_lengths(t, &c));
                    }
                }
                Err(PlanError::BudgetTooSmall { minimum, .. }) => {
                    prop_assert!(minimum.0 > c.budget_bytes);
                    prop_assert_eq!(brute_force_any_lengths(t, &c), None);
                }
                Err(e) => prop_assert!(false, "unexpected error {}", e),
            }
        }

        /// Real step sizes and budgets (above the irregular region, where
        /// the lengths that fit are an interval): valid, and one launch
        /// fewer would need a length that does not fit.
        #[test]
        fn large_steps(t in 1u64..300_000, heads in 1u32..=128, budget in (128 * MIB)..(16 * GIB)) {
            let c = cfg(heads, budget);
            let plan = plan_mixed_batch(t, &c).unwrap();
            check_plan(t, &c, &plan);
            let n = plan.launches.len() as u64;
            if n > 1 {
                let cap = max_tokens_per_launch(decode_padded_heads(heads).unwrap()).0;
                let shortest_longest = t.div_ceil(n - 1);
                prop_assert!(shortest_longest > cap || c.launch_bytes(shortest_longest).unwrap() > budget);
            }
        }

        /// Wave-aligned plans: valid, at most one launch over the minimal
        /// plan, and when aligned as few waves as one call would take.
        #[test]
        fn wave_aligned_steps(t in 1u64..300_000, heads in 1u32..=128, budget in (128 * MIB)..(16 * GIB)) {
            let c = MixedBatchConfig { align_waves: true, ..cfg(heads, budget) };
            let plan = plan_mixed_batch(t, &c).unwrap();
            check_plan(t, &c, &plan);
            let plain = plan_mixed_batch(t, &MixedBatchConfig { align_waves: false, ..c }).unwrap();
            prop_assert!(plan.launches.len() <= plain.launches.len() + 1);
            if plan != plain {
                let wave = wave_tokens(c.gpu, decode_padded_heads(heads).unwrap());
                let waves: u64 = plan.launches.iter().map(|l| l.len().div_ceil(wave)).sum();
                prop_assert_eq!(waves, t.div_ceil(wave));
            }
        }
    }
}
