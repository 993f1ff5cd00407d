//! A whole scheduler step: which kernel each request's tokens go through,
//! the launches, and the bytes each launch allocates. Pure data, so the vLLM
//! backend and the CLI read the same plan.

use std::ops::Range;

use crate::error::{add, PlanError, Result};
use crate::geometry::{Gpu, KvDtype};
use crate::plan::{
    plan_gather_chunks, plan_mixed_batch, plan_prefill_groups, prefill_launch_tokens, split_indexer_prefill_chunks, Bound,
    GatherChunk, IndexerChunk, MaskConfig, MixedBatchConfig, PrefillGroup, PrefillRequest, PrefillRoute,
};
use crate::scratch::{decode_scratch, gather_workspace_bytes, prefill_scratch, DecodeShape, PrefillShape};

/// vLLM runs FP8 steps in mixed-batch mode below this many heads per rank.
pub const MIN_HEADS_FOR_BF16_PREFILL: u32 = 32;

/// How a step's sparse tokens reach the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepMode {
    /// FP8 KV: every sparse token through the FP8 decode kernel as one batch.
    MixedBatch,
    /// FP8 KV: decodes through the decode kernel, prefills gathered to BF16
    /// and run through the prefill kernel.
    SeparatePrefillDecode,
    /// BF16 KV: every sparse token through the BF16 prefill kernel.
    Bf16,
}

impl StepMode {
    pub fn name(self) -> &'static str {
        match self {
            StepMode::MixedBatch => "mixed_batch",
            StepMode::SeparatePrefillDecode => "separate_prefill_decode",
            StepMode::Bf16 => "bf16",
        }
    }
}

/// The kernel a launch calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    SparseDecode,
    SparsePrefill,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::SparseDecode => "sparse_decode",
            Kernel::SparsePrefill => "sparse_prefill",
        }
    }
}

/// Everything about the model, the GPU and the budgets a step plan needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepConfig {
    pub gpu: Gpu,
    /// Query heads per rank (total heads / tensor-parallel size).
    pub num_heads: u32,
    pub topk: u32,
    pub kv_dtype: KvDtype,
    /// Bytes one attention launch may allocate.
    pub scratch_budget_bytes: u64,
    /// Rows of the BF16 gather workspace (vLLM: `max_model_len * 5`).
    pub gather_workspace_rows: u64,
    /// KV rows of the indexer workspace (vLLM: `max_model_len * 40`).
    pub indexer_workspace_rows: u64,
    /// Bytes of indexer logits per call (vLLM: 512 MiB).
    pub indexer_logits_bytes: u64,
    pub mask: MaskConfig,
    /// Force the FP8 mode; `None` follows vLLM (mixed below 32 heads).
    pub mixed_batch: Option<bool>,
}

/// vLLM's choice of mode, unless `mixed_batch` forces the FP8 one: BF16 KV
/// runs the prefill kernel; FP8 KV runs mixed batch below 32 heads per rank.
pub fn step_mode(num_heads: u32, kv_dtype: KvDtype, mixed_batch: Option<bool>) -> StepMode {
    match kv_dtype {
        KvDtype::Bf16 => StepMode::Bf16,
        KvDtype::Fp8 if mixed_batch.unwrap_or(num_heads < MIN_HEADS_FOR_BF16_PREFILL) => StepMode::MixedBatch,
        KvDtype::Fp8 => StepMode::SeparatePrefillDecode,
    }
}

impl StepConfig {
    pub fn mode(&self) -> StepMode {
        step_mode(self.num_heads, self.kv_dtype, self.mixed_batch)
    }
}

/// One attention kernel launch of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLaunch {
    pub kernel: Kernel,
    /// Query tokens of the step this launch computes.
    pub tokens: Range<u64>,
    /// Requests whose tokens it computes.
    pub requests: Range<usize>,
    /// Bytes it allocates, all buffers together.
    pub bytes: u64,
}

/// A planned step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub mode: StepMode,
    pub num_tokens: u64,
    pub num_decodes: usize,
    /// Prefill groups and their routes; request indices count from the
    /// step's first request (decodes included).
    pub prefill_groups: Vec<PrefillGroup>,
    /// Sparse attention launches, in execution order.
    pub launches: Vec<KernelLaunch>,
    /// What kept the sparse tokens from fewer launches.
    pub bound: Bound,
    /// Gathers of the separate path, request indices as in `prefill_groups`.
    pub gather_chunks: Vec<GatherChunk>,
    /// Indexer calls over the prefills, request indices as above.
    pub indexer_chunks: Vec<IndexerChunk>,
    /// The largest launch's bytes.
    pub peak_bytes: u64,
    /// The largest indexer call's logits.
    pub indexer_peak_bytes: u64,
    /// The gather workspace's bytes (allocated once, reserved by vLLM).
    pub gather_workspace_bytes: u64,
}

/// A step as vLLM's builder sees it: decodes first, then prefills.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub query_lens: &'a [u64],
    pub context_lens: &'a [u64],
    pub num_decodes: usize,
}

impl Step<'_> {
    fn validate(&self) -> Result<()> {
        if self.query_lens.len() != self.context_lens.len() {
            return Err(PlanError::LengthMismatch {
                what: "context_lens",
                got: self.context_lens.len(),
                other: "query_lens",
                expected: self.query_lens.len(),
            });
        }
        if self.num_decodes > self.query_lens.len() {
            return Err(PlanError::InvalidArgument {
                what: "num_decodes",
                rule: "at most the number of requests",
                got: self.num_decodes.to_string(),
            });
        }
        Ok(())
    }

    /// `[start, end)` token offsets of every request.
    fn token_starts(&self) -> Result<Vec<u64>> {
        let mut starts = Vec::with_capacity(self.query_lens.len() + 1);
        starts.push(0);
        for &q in self.query_lens {
            starts.push(add("step tokens", *starts.last().unwrap(), q)?);
        }
        for (&q, &c) in self.query_lens.iter().zip(self.context_lens) {
            add("seq_len", q, c)?;
        }
        Ok(starts)
    }
}

/// Balanced cut of `total` items into pieces of at most `max_len`.
fn balanced(total: u64, max_len: u64) -> impl Iterator<Item = Range<u64>> {
    let n = if total == 0 { 0 } else { total.div_ceil(max_len.max(1)) };
    (0..n).map(move |i| (total * i / n)..(total * (i + 1) / n))
}

/// Plan one step.
pub fn plan_step(step: Step<'_>, cfg: &StepConfig) -> Result<StepPlan> {
    step.validate()?;
    let starts = step.token_starts()?;
    let d = step.num_decodes;
    let n = step.query_lens.len();
    let prefills: Vec<PrefillRequest> = (d..n)
        .map(|i| PrefillRequest { query_len: step.query_lens[i], context_len: step.context_lens[i] })
        .collect();
    let mask = MaskConfig { available: cfg.mask.available && cfg.kv_dtype == KvDtype::Bf16, ..cfg.mask };
    let mut prefill_groups = plan_prefill_groups(&prefills, &mask)?;
    for g in &mut prefill_groups {
        g.requests = g.requests.start + d..g.requests.end + d;
    }
    // Requests whose tokens go through the sparse kernels, as contiguous runs.
    let mut sparse_runs: Vec<Range<usize>> = Vec::new();
    if d > 0 {
        sparse_runs.push(0..d);
    }
    for g in prefill_groups.iter().filter(|g| g.route == PrefillRoute::SparseMqa) {
        match sparse_runs.last_mut() {
            Some(last) if last.end == g.requests.start => last.end = g.requests.end,
            _ => sparse_runs.push(g.requests.clone()),
        }
    }
    let tokens_of = |r: &Range<usize>| starts[r.start]..starts[r.end];
    let request_of = |t: u64| starts.partition_point(|&s| s <= t) - 1;

    let mode = cfg.mode();
    let mut launches = Vec::new();
    let mut bound = Bound::Unbounded;
    let mut gather_chunks = Vec::new();
    match mode {
        StepMode::MixedBatch => {
            let mixed = MixedBatchConfig {
                gpu: cfg.gpu,
                num_heads: cfg.num_heads,
                topk: cfg.topk,
                budget_bytes: cfg.scratch_budget_bytes,
                out_preallocated: true,
                translated_indices: false,
                align_waves: false,
            };
            for run in &sparse_runs {
                let tokens = tokens_of(run);
                let plan = plan_mixed_batch(tokens.end - tokens.start, &mixed)?;
                bound = worse(bound, plan.bound);
                for l in plan.launches {
                    let range = tokens.start + l.start..tokens.start + l.end;
                    let requests = request_of(range.start)..request_of(range.end - 1) + 1;
                    launches.push(KernelLaunch { kernel: Kernel::SparseDecode, tokens: range, requests, bytes: l.bytes });
                }
            }
        }
        StepMode::SeparatePrefillDecode => {
            if d > 0 {
                bound = worse(bound, plan_decodes(&step, cfg, &starts, &mut launches)?);
            }
            for run in sparse_runs.iter().filter(|r| r.start >= d || r.end > d) {
                let first = run.start.max(d);
                let reqs: Vec<_> = prefills[first - d..run.end - d].to_vec();
                for chunk in plan_gather_chunks(&reqs, cfg.gather_workspace_rows)? {
                    let chunk = shift(chunk, first);
                    let (tokens, requests) = match &chunk {
                        GatherChunk::Requests { requests, .. } => (tokens_of(requests), requests.clone()),
                        GatherChunk::Split { request, query, .. } => {
                            let t0 = starts[*request];
                            (t0 + query.start..t0 + query.end, *request..*request + 1)
                        }
                    };
                    bound = worse(bound, plan_prefill_launches(tokens, requests, cfg, &request_of, &mut launches)?);
                    gather_chunks.push(chunk);
                }
            }
        }
        StepMode::Bf16 => {
            // As stock: one prefill-kernel call per run of sparse tokens.
            for run in &sparse_runs {
                let tokens = tokens_of(run);
                let bytes = prefill_scratch(
                    cfg.gpu.arch,
                    PrefillShape { s_q: tokens.end - tokens.start, num_heads: cfg.num_heads, topk: cfg.topk, out_preallocated: false, translated_indices: false },
                )?
                .total_bytes();
                launches.push(KernelLaunch { kernel: Kernel::SparsePrefill, tokens, requests: run.clone(), bytes });
            }
        }
    }

    // The indexer scores every prefill unless all of them run dense MHA.
    let all_dense = prefill_groups.iter().all(|g| g.route == PrefillRoute::DenseMha);
    let indexer_chunks = if all_dense {
        vec![]
    } else {
        let seq: Vec<u64> = prefills.iter().map(PrefillRequest::seq_len).collect();
        let q: Vec<u64> = prefills.iter().map(|r| r.query_len).collect();
        split_indexer_prefill_chunks(&seq, &q, cfg.indexer_workspace_rows, cfg.indexer_logits_bytes)?
            .into_iter()
            .map(|c| IndexerChunk { requests: c.requests.start + d..c.requests.end + d, ..c })
            .collect()
    };
    let gather_workspace_bytes = if mode == StepMode::SeparatePrefillDecode {
        gather_workspace_bytes(cfg.gather_workspace_rows)?
    } else {
        0
    };
    Ok(StepPlan {
        mode,
        num_tokens: starts[n],
        num_decodes: d,
        peak_bytes: launches.iter().map(|l| l.bytes).max().unwrap_or(0),
        indexer_peak_bytes: indexer_chunks.iter().map(IndexerChunk::logits_bytes).max().unwrap_or(0),
        prefill_groups,
        launches,
        bound,
        gather_chunks,
        indexer_chunks,
        gather_workspace_bytes,
    })
}

fn worse(a: Bound, b: Bound) -> Bound {
    match (a, b) {
        (Bound::Limit(l), _) | (_, Bound::Limit(l)) => Bound::Limit(l),
        (Bound::Budget, _) | (_, Bound::Budget) => Bound::Budget,
        _ => Bound::Unbounded,
    }
}

fn shift(chunk: GatherChunk, by: usize) -> GatherChunk {
    match chunk {
        GatherChunk::Requests { requests, rows } => GatherChunk::Requests { requests: requests.start + by..requests.end + by, rows },
        GatherChunk::Split { request, query, keys } => GatherChunk::Split { request: request + by, query, keys },
    }
}

/// Decodes in the separate mode: the decode kernel over batches of
/// requests (scratch grows with the batch), balanced under the budget.
fn plan_decodes(step: &Step<'_>, cfg: &StepConfig, starts: &[u64], out: &mut Vec<KernelLaunch>) -> Result<Bound> {
    let d = step.num_decodes as u64;
    let s_q = step.query_lens[..step.num_decodes].iter().copied().max().unwrap_or(0);
    let bytes = |batch: u64| -> Result<u64> {
        Ok(decode_scratch(
            cfg.gpu,
            DecodeShape { batch, s_q, num_heads: cfg.num_heads, topk: cfg.topk, out_preallocated: true, translated_indices: false },
        )?
        .total_bytes())
    };
    let mut max_batch = d;
    while max_batch > 0 && bytes(max_batch)? > cfg.scratch_budget_bytes {
        max_batch -= 1;
    }
    if max_batch == 0 {
        return Err(PlanError::BudgetTooSmall {
            budget: crate::Bytes(cfg.scratch_budget_bytes),
            minimum: crate::Bytes(bytes(1)?),
            tokens: s_q,
            num_heads: cfg.num_heads,
            arch: cfg.gpu.arch.name(),
            detail: "one decode request, mostly its split-KV o_accum".into(),
        });
    }
    for r in balanced(d, max_batch) {
        let (r0, r1) = (r.start as usize, r.end as usize);
        out.push(KernelLaunch {
            kernel: Kernel::SparseDecode,
            tokens: starts[r0]..starts[r1],
            requests: r0..r1,
            bytes: bytes(r.end - r.start)?,
        });
    }
    Ok(if max_batch < d { Bound::Budget } else { Bound::Unbounded })
}

/// Prefill-kernel launches over one gather chunk's tokens: as many tokens
/// per launch as the budget and the int32 stride limit allow.
fn plan_prefill_launches(
    tokens: Range<u64>,
    requests: Range<usize>,
    cfg: &StepConfig,
    request_of: &dyn Fn(u64) -> usize,
    out: &mut Vec<KernelLaunch>,
) -> Result<Bound> {
    let shape = PrefillShape { s_q: 1, num_heads: cfg.num_heads, topk: cfg.topk, out_preallocated: true, translated_indices: false };
    let bytes = |s_q: u64| -> Result<u64> { Ok(prefill_scratch(cfg.gpu.arch, PrefillShape { s_q, ..shape })?.total_bytes()) };
    let total = tokens.end - tokens.start;
    let (max_len, cap) = prefill_launch_tokens(cfg.gpu.arch, shape, cfg.scratch_budget_bytes)?;
    crate::error::check_launches("the prefill launches", total.div_ceil(max_len), "give a larger budget")?;
    for piece in balanced(total, max_len) {
        let range = tokens.start + piece.start..tokens.start + piece.end;
        let reqs = if requests.len() == 1 { requests.clone() } else { request_of(range.start)..request_of(range.end - 1) + 1 };
        out.push(KernelLaunch { kernel: Kernel::SparsePrefill, tokens: range, requests: reqs, bytes: bytes(piece.end - piece.start)? });
    }
    Ok(if total <= max_len { Bound::Unbounded } else { cap })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Arch;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn cfg(num_heads: u32, kv_dtype: KvDtype) -> StepConfig {
        StepConfig {
            gpu: Gpu::h200(),
            num_heads,
            topk: 2048,
            kv_dtype,
            scratch_budget_bytes: GIB,
            gather_workspace_rows: 70_000 * 5,
            indexer_workspace_rows: 70_000 * 40,
            indexer_logits_bytes: 512 << 20,
            mask: MaskConfig::vllm_default(2048, false),
            mixed_batch: None,
        }
    }

    #[test]
    fn mixed_batch_step() {
        let q = [1, 1, 32768, 4000];
        let c = [100, 5000, 0, 3000];
        let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: 2 }, &cfg(16, KvDtype::Fp8)).unwrap();
        assert_eq!(plan.mode, StepMode::MixedBatch);
        assert_eq!(plan.num_tokens, 36770);
        assert_eq!(plan.launches.first().unwrap().tokens.start, 0);
        assert_eq!(plan.launches.last().unwrap().tokens.end, 36770);
        assert!(plan.peak_bytes <= GIB);
        assert_eq!(plan.launches.last().unwrap().requests.end, 4);
        assert_eq!(plan.prefill_groups.len(), 1);
        assert_eq!(plan.prefill_groups[0].requests, 2..4);
        assert_eq!(plan.indexer_chunks.first().unwrap().requests.start, 2);
    }

    #[test]
    fn separate_step_splits_decodes_and_prefills() {
        let q = [1, 1, 65536];
        let c = [10, 10, 0];
        let mut config = cfg(64, KvDtype::Fp8);
        config.gather_workspace_rows = 40_000;
        let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: 2 }, &config).unwrap();
        assert_eq!(plan.mode, StepMode::SeparatePrefillDecode);
        assert_eq!(plan.launches[0].kernel, Kernel::SparseDecode);
        assert_eq!(plan.launches[0].requests, 0..2);
        assert!(plan.launches[1..].iter().all(|l| l.kernel == Kernel::SparsePrefill && l.requests == (2..3)));
        assert!(plan.gather_chunks.iter().all(|g| g.rows() <= 40_000));
        assert!(plan.peak_bytes <= GIB);
    }

    #[test]
    fn dense_prefills_leave_only_decodes_sparse() {
        let plan = plan_step(Step { query_lens: &[1, 500], context_lens: &[9, 0], num_decodes: 1 }, &cfg(16, KvDtype::Fp8)).unwrap();
        assert_eq!(plan.prefill_groups[0].route, PrefillRoute::DenseMha);
        assert_eq!(plan.launches.len(), 1);
        assert_eq!(plan.launches[0].tokens, 0..1);
        assert!(plan.indexer_chunks.is_empty());
    }

    #[test]
    fn bad_steps() {
        let err = plan_step(Step { query_lens: &[1], context_lens: &[], num_decodes: 0 }, &cfg(16, KvDtype::Fp8)).unwrap_err();
        assert!(err.to_string().contains("context_lens"));
        assert!(plan_step(Step { query_lens: &[1], context_lens: &[0], num_decodes: 2 }, &cfg(16, KvDtype::Fp8)).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// Every token of a sparse-routed request is computed exactly once
        /// (split requests: once per key window), in order, within budget.
        #[test]
        fn launches_cover_sparse_tokens(
            reqs in prop::collection::vec((1u64..20_000, 0u64..40_000), 1..12),
            decodes in 0usize..4,
            heads in prop_oneof![Just(16u32), Just(64), Just(128)],
            fp8 in any::<bool>(),
            sm100 in any::<bool>(),
            budget in (256u64 << 20)..(4 * GIB),
        ) {
            let mut q: Vec<u64> = reqs.iter().map(|r| r.0).collect();
            let c: Vec<u64> = reqs.iter().map(|r| r.1).collect();
            let d = decodes.min(q.len());
            for x in &mut q[..d] { *x = 1; }
            let mut config = cfg(heads, if fp8 { KvDtype::Fp8 } else { KvDtype::Bf16 });
            config.scratch_budget_bytes = budget;
            config.gather_workspace_rows = 30_000;
            if sm100 {
                config.gpu = Gpu::new(Arch::Sm100, 148).unwrap();
                config.mask.available = true;
            }
            let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &config).unwrap();
            let total: u64 = q.iter().sum();
            prop_assert_eq!(plan.num_tokens, total);
            let mut count = vec![0u32; total as usize];
            for l in &plan.launches {
                prop_assert!(!l.tokens.is_empty());
                if plan.mode != StepMode::Bf16 {
                    prop_assert!(l.bytes <= budget);
                }
                for t in l.tokens.clone() { count[t as usize] += 1; }
            }
            let starts: Vec<u64> = std::iter::once(0).chain(q.iter().scan(0, |s, &x| { *s += x; Some(*s) })).collect();
            let sparse = |r: usize| r < d || plan.prefill_groups.iter().any(|g| g.requests.contains(&r) && g.route == PrefillRoute::SparseMqa);
            for r in 0..q.len() {
                for t in starts[r]..starts[r + 1] {
                    let n = count[t as usize];
                    if !sparse(r) {
                        prop_assert_eq!(n, 0);
                    } else if plan.gather_chunks.iter().any(|g| matches!(g, GatherChunk::Split { request, .. } if *request == r)) {
                        prop_assert!(n >= 1);
                    } else {
                        prop_assert_eq!(n, 1, "token {} of request {}", t, r);
                    }
                }
            }
        }
    }
}
