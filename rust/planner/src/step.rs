//! A whole scheduler step: which kernel each request's tokens go through,
//! the launches, and the bytes each launch allocates. The plan is exactly
//! what the executor runs: one kernel call per launch, buffers sized from it.

use std::ops::Range;

pub use crate::config::{vllm_step_mode, Execution, StepConfig, StepMode, MIN_HEADS_FOR_BF16_PREFILL};
use crate::error::{add, check_launches, PlanError, Result};
use crate::geometry::KvDtype;
use crate::plan::{
    plan_gather_chunks, plan_mixed_batch, plan_prefill_groups, prefill_launch_tokens, split_indexer_prefill_chunks,
    Bound, GatherChunk, IndexerChunk, MaskConfig, MixedBatchConfig, MixedBatchPlan, PrefillGroup, PrefillPath,
    PrefillRequest,
};
use crate::scratch::{
    decode_scratch, gather_workspace_bytes, prefill_scratch, Breakdown, Buffer, DecodeShape, PrefillShape,
};

/// A breakdown's bytes all live at once, summed with overflow checked.
trait Total {
    fn total(&self) -> Result<u64>;
}

impl Total for Breakdown {
    fn total(&self) -> Result<u64> {
        self.buffers.iter().try_fold(0u64, |acc, b| add("launch bytes", acc, b.bytes))
    }
}

/// `own` with its buffers the step shares across launches (`shared`, by name) at the sizes the
/// step holds them at: those of its longest launch.
fn with_shared(own: Breakdown, shared: &Breakdown, names: &[&str]) -> Breakdown {
    let buffers = own
        .buffers
        .into_iter()
        .map(|b| if names.contains(&b.name) { Buffer { bytes: shared.get(b.name), ..b } } else { b })
        .collect();
    Breakdown { buffers }
}

/// The kernel a launch calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

/// One attention kernel call of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLaunch {
    pub kernel: Kernel,
    /// Query tokens of the step this launch computes.
    pub tokens: Range<u64>,
    /// Requests whose tokens it computes.
    pub requests: Range<usize>,
    /// Separate path, prefill launches: the gather chunk whose workspace the
    /// launch reads (an index into [`StepPlan::gather_chunks`]).
    pub gather_chunk: Option<usize>,
    /// The buffers live while it runs, by name. Those the step allocates once
    /// and reuses in every launch of the kernel are at the longest launch's
    /// size: on the mixed path the padded q, on the separate path the prefill
    /// launches' padded q and kernel output. The rest (and all of a separate
    /// path decode launch's or a BF16 call's) are the launch's own.
    pub buffers: Breakdown,
    /// Their bytes together.
    pub bytes: u64,
}

impl KernelLaunch {
    pub fn len(&self) -> u64 {
        self.tokens.end - self.tokens.start
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// A planned step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub mode: StepMode,
    pub num_tokens: u64,
    pub num_decodes: usize,
    /// The decodes' query length: 1, or 1 + the speculative tokens (0 when no decode has tokens;
    /// CUDA-graph padding adds decodes of length 0). A decode launch of the separate route runs
    /// its tokens as `tokens / decode_query_len` requests of this length.
    pub decode_query_len: u64,
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
    /// The largest indexer call's logits (bound by the indexer's own budget).
    pub indexer_peak_bytes: u64,
    /// The gather workspace's bytes (allocated once, reserved by vLLM).
    pub gather_workspace_bytes: u64,
    /// Heads the prefill launches run the kernel at: vLLM's padding, or the
    /// query heads themselves where the plan was made for native heads. The
    /// executor pads q (and sizes the kernel's output) to exactly this.
    pub prefill_heads: u32,
    /// The prefill launches write straight into the step's output (the
    /// kernel takes `out=` and runs the query heads unpadded).
    pub prefill_writes_in_place: bool,
}

impl StepPlan {
    /// Tokens of the longest launch of `kernel` (0 when none): the step's
    /// shared buffers of that kernel are sized for it.
    pub fn longest_launch(&self, kernel: Kernel) -> u64 {
        self.launches.iter().filter(|l| l.kernel == kernel).map(KernelLaunch::len).max().unwrap_or(0)
    }
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
        // vLLM's decodes share one query length (FlashMLA sparse requires uniform decodes); a
        // decode batch padded up to a captured CUDA-graph size carries requests of length 0.
        let decodes = &self.query_lens[..self.num_decodes];
        if let Some(first) = decodes.iter().position(|&q| q > 0) {
            let len = decodes[first];
            let bad = |got: String| PlanError::InvalidArgument {
                what: "decode query lengths",
                rule: "one length for every decode (CUDA-graph padding of length 0 aside), between 1 and 1024 \
                       (vLLM's decode threshold); longer requests are prefills",
                got,
            };
            if len > MAX_DECODE_QUERY_LEN {
                return Err(bad(format!("{len} at request {first}")));
            }
            if let Some(other) = decodes.iter().position(|&q| q > 0 && q != len) {
                return Err(bad(format!("{len} at request {first} and {} at request {other}", decodes[other])));
            }
        }
        if let Some(i) = self.query_lens[self.num_decodes..].iter().position(|&q| q == 0) {
            return Err(PlanError::InvalidArgument {
                what: "prefill query lengths",
                rule: "at least 1 (a request with no new tokens is not part of the step)",
                got: format!("0 at request {}", self.num_decodes + i),
            });
        }
        Ok(())
    }

    /// The decodes' query length (0 when no decode has tokens).
    pub fn decode_query_len(&self) -> u64 {
        self.query_lens[..self.num_decodes].iter().copied().find(|&q| q > 0).unwrap_or(0)
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

/// The longest decode query vLLM schedules. A FlashMLA sparse builder with a decode threshold by
/// heads and architecture counts a request as a decode up to 128 to 1,024 query tokens (128 at 16
/// heads on SM90), one length for all (its start-up warm-up: 1,024 requests of 32); one without,
/// up to 1 + speculative tokens.
pub const MAX_DECODE_QUERY_LEN: u64 = 1024;

/// Balanced cut of `total` items into the fewest pieces of at most `max_len`
/// (lengths differ by at most one).
pub fn balanced(total: u64, max_len: u64) -> impl Iterator<Item = Range<u64>> {
    let n = if total == 0 { 0 } else { total.div_ceil(max_len.max(1)) };
    // u128: `total * i` may not fit u64 for huge totals.
    (0..n).map(move |i| {
        let cut = |k: u64| (u128::from(total) * u128::from(k) / u128::from(n)) as u64;
        cut(i)..cut(i + 1)
    })
}

/// Appends launches, refusing a plan past the launch cap as soon as it
/// would cross it, not after allocating it.
struct Launches {
    list: Vec<KernelLaunch>,
}

impl Launches {
    fn reserve(&mut self, more: u64, what: &'static str) -> Result<()> {
        check_launches(what, (self.list.len() as u64).saturating_add(more), "give a larger budget or a shorter step")?;
        self.list.reserve(more as usize);
        Ok(())
    }
}

/// Plan one step exactly as the executor runs it.
pub fn plan_step(step: Step<'_>, cfg: &StepConfig) -> Result<StepPlan> {
    plan_following(step, cfg, None)
}

/// [`plan_step`] on the separate route with the prefills gathered in `gather_chunks`, request
/// ranges of the step (decodes first) that cover its prefills in order: vLLM's own
/// `split_prefill_chunks` of the step, which the plan follows where it differs from the
/// planner's (a workspace vLLM sized otherwise, a chunking a test patched).
pub fn plan_step_in_chunks(step: Step<'_>, cfg: &StepConfig, gather_chunks: &[Range<usize>]) -> Result<StepPlan> {
    plan_following(step, cfg, Some(gather_chunks))
}

fn plan_following(step: Step<'_>, cfg: &StepConfig, gather_chunks: Option<&[Range<usize>]>) -> Result<StepPlan> {
    plan_launches(step, cfg, gather_chunks).map_err(|e| match e {
        // The planners see the launch budget; the operator gave the scratch budget, which also
        // holds the allocator's reserve: speak of that one.
        PlanError::BudgetTooSmall { budget, minimum, tokens, num_heads, arch, detail } => PlanError::BudgetTooSmall {
            budget: crate::Bytes(cfg.scratch_budget_bytes),
            minimum: crate::Bytes(minimum.0.saturating_add(budget_reserve(cfg, budget.0))),
            tokens,
            num_heads,
            arch,
            detail,
        },
        other => other,
    })
}

/// What separates the scratch budget from the launch budget a planner saw.
fn budget_reserve(cfg: &StepConfig, launch_budget: u64) -> u64 {
    cfg.scratch_budget_bytes.saturating_sub(launch_budget.min(cfg.launch_budget_bytes()))
}

fn plan_launches(step: Step<'_>, cfg: &StepConfig, given_chunks: Option<&[Range<usize>]>) -> Result<StepPlan> {
    cfg.validate()?;
    step.validate()?;
    let starts = step.token_starts()?;
    let d = step.num_decodes;
    let n = step.query_lens.len();
    let prefills: Vec<PrefillRequest> =
        (d..n).map(|i| PrefillRequest { query_len: step.query_lens[i], context_len: step.context_lens[i] }).collect();
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
    for g in prefill_groups.iter().filter(|g| g.path == PrefillPath::SparseMqa) {
        match sparse_runs.last_mut() {
            Some(last) if last.end == g.requests.start => last.end = g.requests.end,
            _ => sparse_runs.push(g.requests.clone()),
        }
    }
    let tokens = Tokens { starts: &starts };

    let mode = cfg.mode();
    let mut launches = Launches { list: Vec::new() };
    let mut bound = Bound::Unbounded;
    let mut gather_chunks = Vec::new();
    match mode {
        StepMode::MixedBatch => {
            for run in &sparse_runs {
                bound = worse(bound, plan_mixed_run(tokens.of(run), cfg, &tokens, &mut launches)?);
            }
        }
        StepMode::SeparatePrefillDecode => {
            if d > 0 {
                bound = worse(bound, plan_decodes(&step, cfg, &tokens, &mut launches)?);
            }
            for run in sparse_runs.iter().filter(|r| r.end > d) {
                let first = run.start.max(d);
                let chunks = match given_chunks {
                    Some(given) => chunks_over(given, first..run.end, &step)?,
                    None => plan_gather_chunks(&prefills[first - d..run.end - d], cfg.gather_workspace_rows)?
                        .into_iter()
                        .map(|chunk| shift(chunk, first))
                        .collect(),
                };
                for chunk in chunks {
                    let (chunk_tokens, requests) = match &chunk {
                        GatherChunk::Requests { requests, .. } => (tokens.of(requests), requests.clone()),
                        GatherChunk::Split { request, query, .. } => {
                            let t0 = starts[*request];
                            (t0 + query.start..t0 + query.end, *request..*request + 1)
                        }
                    };
                    let index = gather_chunks.len();
                    bound = worse(
                        bound,
                        plan_prefill_launches(chunk_tokens, requests, index, cfg, &tokens, &mut launches)?,
                    );
                    gather_chunks.push(chunk);
                }
            }
            hold_prefill_buffers(cfg, &mut launches.list)?;
        }
        StepMode::Bf16 => {
            // As stock: one prefill-kernel call per run of sparse tokens.
            for run in &sparse_runs {
                let run_tokens = tokens.of(run);
                let shape = prefill_shape(cfg, run_tokens.end - run_tokens.start, false);
                let buffers = prefill_scratch(cfg.gpu.arch, shape)?;
                launches.reserve(1, "the BF16 step")?;
                launches.list.push(KernelLaunch {
                    kernel: Kernel::SparsePrefill,
                    tokens: run_tokens,
                    requests: run.clone(),
                    gather_chunk: None,
                    bytes: buffers.total()?,
                    buffers,
                });
            }
        }
    }

    // The indexer scores every prefill unless all of them run dense MHA.
    let all_dense = prefill_groups.iter().all(|g| g.path == PrefillPath::DenseMha);
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
    let gather_workspace_bytes =
        if mode == StepMode::SeparatePrefillDecode { gather_workspace_bytes(cfg.gather_workspace_rows)? } else { 0 };
    let launches = launches.list;
    Ok(StepPlan {
        mode,
        num_tokens: starts[n],
        num_decodes: d,
        decode_query_len: step.decode_query_len(),
        peak_bytes: launches.iter().map(|l| l.bytes).max().unwrap_or(0),
        indexer_peak_bytes: indexer_chunks.iter().map(IndexerChunk::logits_bytes).max().unwrap_or(0),
        prefill_groups,
        launches,
        bound,
        gather_chunks,
        indexer_chunks,
        gather_workspace_bytes,
        prefill_heads: cfg.prefill_heads(),
        prefill_writes_in_place: cfg.prefill_writes_in_place(),
    })
}

/// Token offsets of the step's requests.
struct Tokens<'a> {
    starts: &'a [u64],
}

impl Tokens<'_> {
    fn of(&self, requests: &Range<usize>) -> Range<u64> {
        self.starts[requests.start]..self.starts[requests.end]
    }

    /// The requests whose tokens `tokens` (non-empty) covers.
    fn requests(&self, tokens: &Range<u64>) -> Range<usize> {
        let request_of = |t: u64| self.starts.partition_point(|&s| s <= t) - 1;
        request_of(tokens.start)..request_of(tokens.end - 1) + 1
    }
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
        GatherChunk::Requests { requests, rows } => {
            GatherChunk::Requests { requests: requests.start + by..requests.end + by, rows }
        }
        GatherChunk::Split { request, query, keys } => GatherChunk::Split { request: request + by, query, keys },
    }
}

/// The given gather chunks (request ranges of the step) that cover `run`, the step's sparse
/// prefills, as the plan's chunks; they must tile it in order.
fn chunks_over(given: &[Range<usize>], run: Range<usize>, step: &Step<'_>) -> Result<Vec<GatherChunk>> {
    let mut next = run.start;
    let mut out = Vec::with_capacity(given.len());
    for chunk in given {
        if chunk.start != next || chunk.end <= chunk.start || chunk.end > run.end {
            return Err(PlanError::InvalidArgument {
                what: "gather_chunks",
                rule: "non-empty request ranges that cover the step's sparse prefills in order",
                got: format!("{given:?} for prefills {run:?}"),
            });
        }
        let rows = chunk.clone().try_fold(0u64, |acc, r| {
            add("gather chunk rows", acc, add("seq_len", step.query_lens[r], step.context_lens[r])?)
        })?;
        out.push(GatherChunk::Requests { requests: chunk.clone(), rows });
        next = chunk.end;
    }
    if next != run.end {
        return Err(PlanError::InvalidArgument {
            what: "gather_chunks",
            rule: "non-empty request ranges that cover the step's sparse prefills in order",
            got: format!("{given:?} for prefills {run:?}"),
        });
    }
    Ok(out)
}

pub(crate) fn mixed_config(cfg: &StepConfig, budget_bytes: u64) -> MixedBatchConfig {
    MixedBatchConfig {
        gpu: cfg.gpu,
        num_heads: cfg.num_heads,
        topk: cfg.topk,
        budget_bytes,
        out_preallocated: cfg.decode_writes_in_place(),
        translated_indices: cfg.execution.translated_indices,
        align_waves: cfg.execution.align_waves,
    }
}

/// The buffers of a mixed-batch plan's launches as the executor runs them: each launch's kernel
/// buffers, the zero-padded q among them allocated once for the longest launch and reused by
/// every launch.
fn held_mixed_buffers(plan: &MixedBatchPlan, mixed: &MixedBatchConfig) -> Result<Vec<(Breakdown, u64)>> {
    let longest = plan.launches.iter().map(|l| l.len()).max().unwrap_or(0);
    let shared = mixed.launch_scratch(longest)?;
    plan.launches
        .iter()
        .map(|l| {
            let buffers = with_shared(mixed.launch_scratch(l.len())?, &shared, &["q_padded"]);
            let bytes = buffers.total()?;
            Ok((buffers, bytes))
        })
        .collect()
}

/// One run of tokens through the decode kernel as `b = 1, s_q = launch`.
/// Below 133 tokens scratch is not monotonic in length, so launch lengths
/// may differ by more than one and the held q of the longest launch can push
/// a shorter launch over the budget: then plan again, tighter.
fn plan_mixed_run(run: Range<u64>, cfg: &StepConfig, tokens: &Tokens<'_>, out: &mut Launches) -> Result<Bound> {
    let budget = cfg.launch_budget_bytes();
    let mut mixed = mixed_config(cfg, budget);
    for _ in 0..8 {
        let plan = plan_mixed_batch(run.end - run.start, &mixed)?;
        let held = held_mixed_buffers(&plan, &mixed)?;
        let peak = held.iter().map(|(_, bytes)| *bytes).max().unwrap_or(0);
        if peak <= budget {
            out.reserve(plan.launches.len() as u64, "the mixed-batch step")?;
            for (l, (buffers, bytes)) in plan.launches.iter().zip(held) {
                let range = run.start + l.start..run.start + l.end;
                out.list.push(KernelLaunch {
                    kernel: Kernel::SparseDecode,
                    requests: tokens.requests(&range),
                    tokens: range,
                    gather_chunk: None,
                    buffers,
                    bytes,
                });
            }
            return Ok(plan.bound);
        }
        mixed.budget_bytes = plan.peak_bytes - (peak - budget);
    }
    Err(PlanError::BudgetTooSmall {
        budget: crate::Bytes(budget),
        minimum: crate::Bytes(budget + 1),
        tokens: run.end - run.start,
        num_heads: cfg.num_heads,
        arch: cfg.gpu.arch.name(),
        detail: "mixed-batch launches with their shared padded q".into(),
    })
}

/// Decodes in the separate mode: the decode kernel over batches of
/// requests (scratch grows with the batch), balanced under the budget.
/// Decodes of length 0 (CUDA-graph padding) have no tokens and are in no
/// launch: a launch of `n` tokens runs `n / s_q` requests of `s_q` tokens.
fn plan_decodes(step: &Step<'_>, cfg: &StepConfig, tokens: &Tokens<'_>, out: &mut Launches) -> Result<Bound> {
    let s_q = step.decode_query_len();
    if s_q == 0 {
        return Ok(Bound::Unbounded);
    }
    let d = step.query_lens[..step.num_decodes].iter().filter(|&&q| q > 0).count() as u64;
    let buffers = |batch: u64| -> Result<Breakdown> { decode_scratch(cfg.gpu, decode_shape(cfg, batch, s_q)) };
    let bytes = |batch: u64| buffers(batch)?.total();
    let budget = cfg.launch_budget_bytes();
    if bytes(1)? > budget {
        return Err(PlanError::BudgetTooSmall {
            budget: crate::Bytes(budget),
            minimum: crate::Bytes(bytes(1)?),
            tokens: s_q,
            num_heads: cfg.num_heads,
            arch: cfg.gpu.arch.name(),
            detail: "one decode request, mostly its split-KV o_accum".into(),
        });
    }
    // Bytes grow with the batch (num_sm_parts depends on s_q only): the
    // largest batch that fits, by bisection.
    let (mut lo, mut hi) = (1u64, d);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if bytes(mid)? <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    out.reserve(d.div_ceil(lo), "the decode launches")?;
    for r in balanced(d, lo) {
        // Decode tokens come first, request after request: the batch's tokens.
        let range = r.start * s_q..r.end * s_q;
        let buffers = buffers(r.end - r.start)?;
        out.list.push(KernelLaunch {
            kernel: Kernel::SparseDecode,
            requests: tokens.requests(&range),
            tokens: range,
            gather_chunk: None,
            bytes: buffers.total()?,
            buffers,
        });
    }
    Ok(if lo < d { Bound::Budget } else { Bound::Unbounded })
}

/// One call of the decode kernel over `batch` decodes of `s_q` tokens, as the executor makes it.
pub(crate) fn decode_shape(cfg: &StepConfig, batch: u64, s_q: u64) -> DecodeShape {
    DecodeShape {
        batch,
        s_q,
        num_heads: cfg.num_heads,
        topk: cfg.topk,
        out_preallocated: cfg.decode_writes_in_place(),
        translated_indices: cfg.execution.translated_indices,
    }
}

pub(crate) fn prefill_shape(cfg: &StepConfig, s_q: u64, in_place: bool) -> PrefillShape {
    PrefillShape {
        s_q,
        num_heads: cfg.num_heads,
        topk: cfg.topk,
        out_preallocated: in_place,
        translated_indices: cfg.execution.translated_indices,
        native_heads: cfg.execution.native_prefill_heads,
        padding: cfg.prefill_padding(),
    }
}

/// Whether a prefill launch writes straight into the step's output: only
/// when it is the one window of its query tokens (split requests merge).
pub(crate) fn prefill_in_place(cfg: &StepConfig) -> bool {
    cfg.prefill_writes_in_place()
}

/// Prefill-kernel launches over one gather chunk's tokens: as many tokens
/// per launch as the budget and the int32 stride limit allow, balanced.
fn plan_prefill_launches(
    chunk_tokens: Range<u64>,
    requests: Range<usize>,
    gather_chunk: usize,
    cfg: &StepConfig,
    tokens: &Tokens<'_>,
    out: &mut Launches,
) -> Result<Bound> {
    let total = chunk_tokens.end - chunk_tokens.start;
    let (max_len, cap) =
        prefill_launch_tokens(cfg.gpu.arch, prefill_shape(cfg, 1, prefill_in_place(cfg)), cfg.launch_budget_bytes())?;
    out.reserve(total.div_ceil(max_len), "the prefill launches")?;
    for piece in balanced(total, max_len) {
        let range = chunk_tokens.start + piece.start..chunk_tokens.start + piece.end;
        let reqs = if requests.len() == 1 { requests.clone() } else { tokens.requests(&range) };
        out.list.push(KernelLaunch {
            kernel: Kernel::SparsePrefill,
            tokens: range,
            requests: reqs,
            // Sized by `hold_prefill_buffers` once every prefill launch of the step is known.
            gather_chunk: Some(gather_chunk),
            buffers: Breakdown::default(),
            bytes: 0,
        });
    }
    Ok(if total <= max_len { Bound::Unbounded } else { cap })
}

/// The separate path's prefill launches share one zero-padded q and one
/// kernel output, sized for the longest launch: each launch's buffers are
/// those held ones plus its own (softmax statistics, translated indices).
fn hold_prefill_buffers(cfg: &StepConfig, launches: &mut [KernelLaunch]) -> Result<()> {
    let in_place = prefill_in_place(cfg);
    let longest =
        launches.iter().filter(|l| l.kernel == Kernel::SparsePrefill).map(KernelLaunch::len).max().unwrap_or(0);
    let shared = prefill_scratch(cfg.gpu.arch, prefill_shape(cfg, longest, in_place))?;
    for l in launches.iter_mut().filter(|l| l.kernel == Kernel::SparsePrefill) {
        let own = prefill_scratch(cfg.gpu.arch, prefill_shape(cfg, l.len(), in_place))?;
        l.buffers = with_shared(own, &shared, &["q_padded", "out"]);
        l.bytes = l.buffers.total()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Arch, Gpu};
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
            mode: None,
            execution: Execution::default(),
        }
    }

    #[test]
    fn mixed_batch_step() {
        let q = [1, 1, 32768, 4000];
        let c = [100, 5000, 0, 3000];
        let plan =
            plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: 2 }, &cfg(16, KvDtype::Fp8)).unwrap();
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
    fn native_prefill_heads_size_the_separate_plan() {
        // One 65,536-token prefill on 1 GiB: at 64 padded heads a launch holds padded q and the
        // kernel's output; at 16 or 32 native heads it writes in place and holds neither.
        let step = Step { query_lens: &[1, 65536], context_lens: &[10, 0], num_decodes: 1 };
        for heads in [16, 32] {
            let padded_cfg = cfg(heads, KvDtype::Fp8).with_mode(StepMode::SeparatePrefillDecode);
            let native_cfg = padded_cfg.with_native_prefill_heads(true);
            let padded = plan_step(step, &padded_cfg).unwrap();
            let native = plan_step(step, &native_cfg).unwrap();
            assert_eq!((padded.prefill_heads, native.prefill_heads), (64, heads));
            assert!(!padded.prefill_writes_in_place && native.prefill_writes_in_place);
            let longest = |p: &StepPlan| p.longest_launch(Kernel::SparsePrefill);
            assert!(longest(&native) > longest(&padded), "{heads}: {} <= {}", longest(&native), longest(&padded));
            let prefill_bytes = |p: &StepPlan| {
                p.launches.iter().filter(|l| l.kernel == Kernel::SparsePrefill).map(|l| l.bytes).max().unwrap()
            };
            let per_token = |p: &StepPlan| prefill_bytes(p) as f64 / longest(p) as f64;
            assert!(
                per_token(&native) * 2.0 < per_token(&padded),
                "{heads}: {} vs {}",
                per_token(&native),
                per_token(&padded)
            );
            assert!(native.peak_bytes <= native_cfg.scratch_budget_bytes);
            // The launches' bytes are those of the kernel at native heads, not re-derived elsewhere.
            let l = native.launches.iter().find(|l| l.kernel == Kernel::SparsePrefill).unwrap();
            let own = prefill_scratch(Gpu::h200().arch, prefill_shape(&native_cfg, l.len(), true)).unwrap();
            assert_eq!(own.get("q_padded") + own.get("out"), 0);
            assert_eq!(l.bytes, own.total().unwrap());
        }
        // The mixed route runs no prefill kernel; a plan still says what a prefill launch would run.
        let mixed = plan_step(step, &cfg(16, KvDtype::Fp8).with_native_prefill_heads(true)).unwrap();
        assert_eq!((mixed.mode, mixed.prefill_heads), (StepMode::MixedBatch, 16));
        let err = plan_step(step, &cfg(64, KvDtype::Fp8).with_native_prefill_heads(true)).unwrap_err().to_string();
        assert!(err.contains("native_prefill_heads"), "{err}");
    }

    #[test]
    fn launches_name_the_buffers_they_hold() {
        // A 65,536-token prompt cut into launches of unequal length: each launch holds the padded
        // q (and, on the separate route, the kernel output) sized for the longest, the rest its own.
        let step = Step { query_lens: &[65_535], context_lens: &[0], num_decodes: 0 };
        for mode in [StepMode::MixedBatch, StepMode::SeparatePrefillDecode] {
            let config = cfg(16, KvDtype::Fp8).with_mode(mode);
            let plan = plan_step(step, &config).unwrap();
            let kernel = plan.launches[0].kernel;
            let longest = plan.longest_launch(kernel);
            let (short, long) = (plan.launches.iter().map(KernelLaunch::len).min().unwrap(), longest);
            assert!(short < long, "{mode:?}: launches of equal length ({short}) prove nothing here");
            let own = |len: u64| match kernel {
                Kernel::SparseDecode => {
                    mixed_config(&config, config.launch_budget_bytes()).launch_scratch(len).unwrap()
                }
                Kernel::SparsePrefill => {
                    prefill_scratch(config.gpu.arch, prefill_shape(&config, len, config.prefill_writes_in_place()))
                        .unwrap()
                }
            };
            let shared: &[&str] = if kernel == Kernel::SparseDecode { &["q_padded"] } else { &["q_padded", "out"] };
            for l in &plan.launches {
                let mine = own(l.len());
                assert_eq!(l.buffers.buffers.len(), mine.buffers.len(), "{mode:?}: the same buffers, by name");
                for b in &l.buffers.buffers {
                    let expected = if shared.contains(&b.name) { own(longest).get(b.name) } else { mine.get(b.name) };
                    assert_eq!(b.bytes, expected, "{mode:?}: {} of a {}-token launch", b.name, l.len());
                }
                assert_eq!(l.bytes, l.buffers.total_bytes());
            }
            assert!(plan.launches.iter().all(|l| l.buffers.get("q_padded") == own(longest).get("q_padded")));
            assert!(own(short).get("q_padded") < own(longest).get("q_padded"));
        }
    }

    #[test]
    fn dense_prefills_leave_only_decodes_sparse() {
        let plan =
            plan_step(Step { query_lens: &[1, 500], context_lens: &[9, 0], num_decodes: 1 }, &cfg(16, KvDtype::Fp8))
                .unwrap();
        assert_eq!(plan.prefill_groups[0].path, PrefillPath::DenseMha);
        assert_eq!(plan.launches.len(), 1);
        assert_eq!(plan.launches[0].tokens, 0..1);
        assert!(plan.indexer_chunks.is_empty());
    }

    #[test]
    fn a_small_budget_is_reported_as_the_operator_gave_it() {
        let mut config = cfg(16, KvDtype::Fp8);
        config.scratch_budget_bytes = 1 << 20;
        let err = plan_step(Step { query_lens: &[100], context_lens: &[5000], num_decodes: 0 }, &config).unwrap_err();
        let PlanError::BudgetTooSmall { budget, minimum, .. } = err.clone() else { panic!("{err}") };
        assert_eq!(budget.0, 1 << 20, "{err}");
        // The minimum named is enough: that budget plans the step.
        config.scratch_budget_bytes = minimum.0;
        plan_step(Step { query_lens: &[100], context_lens: &[5000], num_decodes: 0 }, &config).unwrap();
    }

    #[test]
    fn bad_steps() {
        let err = plan_step(Step { query_lens: &[1], context_lens: &[], num_decodes: 0 }, &cfg(16, KvDtype::Fp8))
            .unwrap_err();
        assert!(err.to_string().contains("context_lens"));
        assert!(
            plan_step(Step { query_lens: &[1], context_lens: &[0], num_decodes: 2 }, &cfg(16, KvDtype::Fp8)).is_err()
        );
    }

    #[test]
    fn cuda_graph_padding_and_speculative_decodes_plan() {
        // vLLM pads a uniform decode batch up to a captured graph size with requests of length 0;
        // with speculative decoding the real decodes carry 1 + k tokens each.
        for mode in [StepMode::MixedBatch, StepMode::SeparatePrefillDecode] {
            let config = cfg(16, KvDtype::Fp8).with_mode(mode);
            for (q, d) in [(vec![1, 1, 0, 0], 4), (vec![2, 2, 2, 0], 4), (vec![0, 0], 2), (vec![3, 3, 0, 5000], 3)] {
                let c = vec![100; q.len()];
                let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &config).unwrap();
                let tokens: u64 = q.iter().sum();
                assert_eq!(plan.num_tokens, tokens);
                assert_eq!(plan.launches.iter().map(KernelLaunch::len).sum::<u64>(), tokens, "{mode:?} {q:?}");
                assert_eq!(plan.decode_query_len, q[..d].iter().copied().find(|&x| x > 0).unwrap_or(0));
                // The separate route's decode launches run whole requests (the mixed route cuts tokens).
                let separate_decodes = plan.launches.iter().filter(|l| l.kernel == Kernel::SparseDecode);
                for l in separate_decodes.filter(|_| mode == StepMode::SeparatePrefillDecode) {
                    assert_eq!(l.len() % plan.decode_query_len, 0, "{mode:?}: a decode launch runs whole requests");
                }
            }
        }
    }

    #[test]
    fn mixed_decode_lengths_are_refused_naming_the_lengths_that_differ() {
        let q = [2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 0];
        let c = [9; 11];
        let err = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: 11 }, &cfg(16, KvDtype::Fp8))
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 at request 0 and 3 at request 9"), "{err}");
    }

    #[test]
    fn the_plan_follows_given_gather_chunks() {
        let (q, c) = ([1, 3000, 2500, 2100], [9, 0, 50, 0]);
        let step = Step { query_lens: &q, context_lens: &c, num_decodes: 1 };
        let config = cfg(32, KvDtype::Fp8).with_mode(StepMode::SeparatePrefillDecode);
        let own = plan_step(step, &config).unwrap();
        assert_eq!(own.gather_chunks.len(), 1, "the planner's own: one chunk");
        let given = [1..2, 2..4];
        let plan = plan_step_in_chunks(step, &config, &given).unwrap();
        assert_eq!(
            plan.gather_chunks,
            vec![
                GatherChunk::Requests { requests: 1..2, rows: 3000 },
                GatherChunk::Requests { requests: 2..4, rows: 4650 }
            ]
        );
        for l in plan.launches.iter().filter(|l| l.kernel == Kernel::SparsePrefill) {
            let chunk = &given[l.gather_chunk.unwrap()];
            assert!(chunk.start <= l.requests.start && l.requests.end <= chunk.end, "{l:?}");
        }
        for bad in [&[1..2][..], &[1..3, 2..4][..], &[2..4][..]] {
            let err = plan_step_in_chunks(step, &config, bad).unwrap_err().to_string();
            assert!(err.contains("gather_chunks"), "{err}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// A decode's context length shapes no plan (a prefill's does: its gather): the vLLM
        /// backend plans a step of decodes whose CPU sequence lengths vLLM did not keep with
        /// contexts of 0, and gets the plan the real ones give.
        #[test]
        fn decode_context_lens_shape_no_plan(
            k in 1u64..4,
            decodes in 0usize..40,
            pads in 0usize..8,
            prefills in prop::collection::vec((1u64..20_000, 0u64..40_000), 0..4),
            decode_contexts in prop::collection::vec(0u64..200_000, 48),
            heads in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
            separate in any::<bool>(),
            budget in (64u64 << 20)..(4 * GIB),
        ) {
            let d = decodes + pads;
            let q: Vec<u64> = std::iter::repeat(k).take(decodes).chain(std::iter::repeat(0).take(pads))
                .chain(prefills.iter().map(|p| p.0)).collect();
            let mut c: Vec<u64> = decode_contexts[..d].iter().copied().chain(prefills.iter().map(|p| p.1)).collect();
            let mode = if separate { StepMode::SeparatePrefillDecode } else { StepMode::MixedBatch };
            let mut config = cfg(heads, KvDtype::Fp8).with_mode(mode);
            config.scratch_budget_bytes = budget;
            config.gather_workspace_rows = 30_000;
            let real = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &config);
            for x in &mut c[..d] { *x = 0; }
            let zeros = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &config);
            prop_assert_eq!(real.map_err(|e| e.to_string()), zeros.map_err(|e| e.to_string()));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// Every token of a sparse-routed request is computed exactly once
        /// (split requests: once per key window), in order, within budget.
        #[test]
        fn launches_cover_sparse_tokens(
            reqs in prop::collection::vec((1u64..20_000, 0u64..40_000), 1..12),
            decodes in 0usize..4,
            heads in prop_oneof![Just(16u32), Just(32), Just(64), Just(128)],
            fp8 in any::<bool>(),
            sm100 in any::<bool>(),
            budget in (256u64 << 20)..(4 * GIB),
            translated in any::<bool>(),
            align_waves in any::<bool>(),
            takes_out in any::<bool>(),
            native in any::<bool>(),
            prefill_padding in prop_oneof![Just(None), Just(Some(64u32)), Just(Some(128))],
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
            let native_prefill_heads = native && crate::geometry::prefill_runs_native(heads, config.gpu.arch);
            config.execution = Execution {
                translated_indices: translated,
                align_waves,
                decode_takes_out: takes_out,
                prefill_takes_out: takes_out,
                native_prefill_heads,
                prefill_padding,
            };
            let plan = plan_step(Step { query_lens: &q, context_lens: &c, num_decodes: d }, &config).unwrap();
            let total: u64 = q.iter().sum();
            prop_assert_eq!(plan.num_tokens, total);
            let padding = prefill_padding.unwrap_or(if sm100 { 128 } else { 64 });
            prop_assert_eq!(plan.prefill_heads, if native_prefill_heads { heads } else { heads.div_ceil(padding) * padding });
            let mut count = vec![0u32; total as usize];
            for l in &plan.launches {
                prop_assert!(!l.tokens.is_empty());
                if plan.mode != StepMode::Bf16 {
                    prop_assert!(l.bytes <= config.launch_budget_bytes());
                }
                prop_assert_eq!(l.bytes, l.buffers.total_bytes());
                prop_assert_eq!(l.gather_chunk.is_some(), plan.mode == StepMode::SeparatePrefillDecode && l.kernel == Kernel::SparsePrefill);
                for t in l.tokens.clone() { count[t as usize] += 1; }
            }
            let starts: Vec<u64> = std::iter::once(0).chain(q.iter().scan(0, |s, &x| { *s += x; Some(*s) })).collect();
            let sparse = |r: usize| r < d || plan.prefill_groups.iter().any(|g| g.requests.contains(&r) && g.path == PrefillPath::SparseMqa);
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
