//! Every public planner entry point on sizes anywhere in `u64`: each returns
//! `Ok` or `Err` (never panics, also with overflow checks on), returns
//! quickly, holds at most `MAX_LAUNCHES` entries, returns no count past
//! `i64::MAX`, and on `Ok` keeps its usual invariants.
//!
//! The bindings turn Python ints into `u64` and store what comes back in
//! int64 arrays, so these are the inputs a caller can really pass.

use std::ops::Range;
use std::time::{Duration, Instant};

use mla_planner::error::{LaunchCount, MAX_LAUNCHES};
use mla_planner::geometry::{decode_padded_heads, prefill_kernel_heads, Arch, Gpu};
use mla_planner::limits::{max_tokens_per_launch, MAX_ROWS};
use mla_planner::plan::{
    masked_mha_workspace_fits, plan_gather_chunks, plan_mixed_batch, plan_prefill_groups, prefill_launch_tokens,
    prefill_masks, request_offset, split_indexer_prefill_chunks, split_prefill_chunks, stock_prefill_groups,
    GatherChunk, MaskConfig, MixedBatchConfig, PrefillPath, PrefillRequest,
};
use mla_planner::scratch::{
    decode_scratch, gather_workspace_bytes, indexer_logits_bytes, prefill_scratch, topk_mask_bytes, topk_mask_shape,
    Breakdown, DecodeShape, PrefillShape,
};
use mla_planner::PlanError;
use proptest::prelude::*;

const I64_MAX: u64 = i64::MAX as u64;
/// Generous for a debug build on a loaded machine; a runaway loop or a
/// plan of billions of entries takes far longer.
const FAST: Duration = Duration::from_secs(3);

/// Sizes from everywhere in `u64`, weighted towards the edges: 0 and 1,
/// realistic sizes, the physical bound, `i64::MAX` and `2^63` and around
/// them, and `u64::MAX` and below it.
fn huge() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => any::<u64>(),
        3 => prop::sample::select(vec![
            0,
            1,
            2,
            3,
            40,
            4096,
            100_000,
            100_000_000,
            MAX_ROWS - 1,
            MAX_ROWS,
            MAX_ROWS + 1,
            1 << 62,
            I64_MAX - 1,
            I64_MAX,
            1 << 63,
            (1 << 63) + 1,
            u64::MAX - 1,
            u64::MAX,
        ]),
        2 => 0u64..200_000,
        1 => (I64_MAX - 1_000)..=(I64_MAX + 1_000),
        1 => (u64::MAX - 1_000)..=u64::MAX,
    ]
}

fn heads() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 1u32..=128, 1 => any::<u32>(), 1 => prop::sample::select(vec![0u32, 129, u32::MAX])]
}

fn topk() -> impl Strategy<Value = u32> {
    prop_oneof![3 => prop::sample::select(vec![64u32, 128, 512, 640, 2048, 4096]), 1 => any::<u32>()]
}

fn gpu() -> impl Strategy<Value = Gpu> {
    (
        prop_oneof![Just(Arch::Sm90), Just(Arch::Sm100)],
        prop_oneof![3 => prop::sample::select(vec![1u32, 78, 132, 148]), 1 => 1u32..=u32::MAX],
    )
        .prop_map(|(arch, sms)| Gpu::new(arch, sms).unwrap())
}

fn requests(max: usize) -> impl Strategy<Value = Vec<PrefillRequest>> {
    prop::collection::vec((huge(), huge()), 0..max)
        .prop_map(|v| v.into_iter().map(|(query_len, context_len)| PrefillRequest { query_len, context_len }).collect())
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    let took = start.elapsed();
    assert!(took < FAST, "{what} took {took:?}");
    out
}

fn fits_i64(values: &[u64]) -> bool {
    values.iter().all(|&v| v <= I64_MAX)
}

/// Consecutive, non-empty ranges from 0: the request ranges of a plan.
fn check_tiles(ranges: impl IntoIterator<Item = Range<usize>>, n: usize) -> std::result::Result<(), TestCaseError> {
    let mut next = 0;
    for r in ranges {
        prop_assert_eq!(r.start, next);
        prop_assert!(r.end > r.start);
        next = r.end;
    }
    prop_assert_eq!(next, n);
    Ok(())
}

/// The breakdown's total is the exact sum of its buffers and fits an i64.
fn check_breakdown(bd: &Breakdown) -> std::result::Result<(), TestCaseError> {
    let exact = bd.buffers.iter().try_fold(0u64, |acc, b| acc.checked_add(b.bytes));
    prop_assert_eq!(exact, Some(bd.total_bytes()));
    prop_assert!(bd.total_bytes() <= I64_MAX);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn split_prefill_chunks_any_sizes(seq_lens in prop::collection::vec(huge(), 0..8), w in huge()) {
        if let Ok(runs) = timed("split_prefill_chunks", || split_prefill_chunks(&seq_lens, w)) {
            prop_assert!(runs.len() as u64 <= MAX_LAUNCHES);
            check_tiles(runs.iter().cloned(), seq_lens.len())?;
            for r in runs {
                let rows = seq_lens[r].iter().try_fold(0u64, |a, &s| a.checked_add(s));
                prop_assert!(rows.is_some_and(|rows| rows <= w));
            }
        }
    }

    #[test]
    fn plan_gather_chunks_any_sizes(reqs in requests(6), w in huge()) {
        let Ok(chunks) = timed("plan_gather_chunks", || plan_gather_chunks(&reqs, w)) else { return Ok(()) };
        prop_assert!(chunks.len() as u64 <= MAX_LAUNCHES);
        let mut next = 0;
        let mut i = 0;
        while i < chunks.len() {
            match &chunks[i] {
                GatherChunk::Requests { requests, rows } => {
                    prop_assert!(requests.start >= next && !requests.is_empty());
                    prop_assert_eq!(*rows, reqs[requests.clone()].iter().map(|r| r.seq_len()).sum::<u64>());
                    prop_assert!(*rows <= w && *rows <= I64_MAX);
                    next = requests.end;
                    i += 1;
                }
                GatherChunk::Split { request, .. } => {
                    let (r, req) = (*request, reqs[*request]);
                    prop_assert!(r >= next && req.seq_len() > w);
                    // Pieces tile the request's queries; each piece's keys
                    // are consecutive windows from 0 through its last query.
                    let mut q = 0;
                    while let Some(GatherChunk::Split { request, query, .. }) = chunks.get(i) {
                        if *request != r {
                            break;
                        }
                        prop_assert_eq!(query.start, q);
                        prop_assert!(query.end > query.start);
                        let query = query.clone();
                        let mut k = 0;
                        while let Some(GatherChunk::Split { request, query: same, keys }) = chunks.get(i) {
                            if *request != r || *same != query {
                                break;
                            }
                            prop_assert_eq!(keys.start, k);
                            prop_assert!(keys.end > keys.start && keys.end - keys.start <= w);
                            prop_assert!(fits_i64(&[query.start, query.end, keys.start, keys.end]));
                            k = keys.end;
                            i += 1;
                        }
                        prop_assert_eq!(k, req.context_len + query.end);
                        q = query.end;
                    }
                    prop_assert_eq!(q, req.query_len);
                    next = r + 1;
                }
            }
        }
        // Requests left out are oversize ones with nothing to compute, or empty ones inside a run.
        prop_assert!(reqs[next..].iter().all(|r| r.query_len == 0 && r.seq_len() > w));
    }

    #[test]
    fn split_indexer_prefill_chunks_any_sizes(
        lens in prop::collection::vec((huge(), huge()), 0..6),
        ordered in any::<bool>(),
        w in huge(),
        budget in huge(),
    ) {
        // Half the cases keep query <= seq (the valid inputs), half do not.
        let lens: Vec<(u64, u64)> = if ordered { lens.iter().map(|&(a, b)| (a.max(b), a.min(b))).collect() } else { lens };
        let seq: Vec<u64> = lens.iter().map(|l| l.0).collect();
        let q: Vec<u64> = lens.iter().map(|l| l.1).collect();
        let Ok(chunks) = timed("split_indexer_prefill_chunks", || split_indexer_prefill_chunks(&seq, &q, w, budget)) else { return Ok(()) };
        prop_assert!(chunks.len() as u64 <= MAX_LAUNCHES);
        let budget = budget.min(I64_MAX);
        let mut next = 0;
        let mut i = 0;
        while i < chunks.len() {
            let range = chunks[i].requests.clone();
            prop_assert!(range.start >= next && !range.is_empty());
            prop_assert!(q[next..range.start].iter().all(|&q| q == 0));
            let m: u64 = q[range.clone()].iter().sum();
            let kv: u64 = seq[range.clone()].iter().sum();
            let mut row = 0;
            while i < chunks.len() && chunks[i].requests == range {
                let c = &chunks[i];
                prop_assert_eq!(c.query.start, row);
                prop_assert!(c.query.end > c.query.start);
                prop_assert_eq!(c.kv_rows, kv);
                prop_assert!(fits_i64(&[c.query.start, c.query.end, c.kv_rows, c.logits_bytes()]));
                if range.len() > 1 {
                    prop_assert!(c.kv_rows <= w && c.logits_bytes() <= budget);
                } else if c.kv_rows <= budget / 4 {
                    prop_assert!(c.logits_bytes() <= budget);
                }
                row = c.query.end;
                i += 1;
            }
            prop_assert_eq!(row, m);
            next = range.end;
        }
        prop_assert!(q[next..].iter().all(|&q| q == 0));
    }

    #[test]
    fn plan_mixed_batch_any_sizes(
        num_tokens in huge(),
        gpu in gpu(),
        num_heads in heads(),
        topk in topk(),
        budget_bytes in huge(),
        flags in any::<(bool, bool, bool)>(),
    ) {
        let (out_preallocated, translated_indices, align_waves) = flags;
        let cfg = MixedBatchConfig { gpu, num_heads, topk, budget_bytes, out_preallocated, translated_indices, align_waves };
        let Ok(plan) = timed("plan_mixed_batch", || plan_mixed_batch(num_tokens, &cfg)) else { return Ok(()) };
        prop_assert!(plan.launches.len() as u64 <= MAX_LAUNCHES);
        let cap = max_tokens_per_launch(decode_padded_heads(num_heads).unwrap()).0;
        let mut next = 0;
        for l in &plan.launches {
            prop_assert_eq!(l.start, next);
            prop_assert!(l.end > l.start && l.len() <= cap);
            prop_assert!(l.bytes <= budget_bytes && fits_i64(&[l.start, l.end, l.bytes]));
            next = l.end;
        }
        prop_assert_eq!(next, num_tokens);
        prop_assert_eq!(plan.peak_bytes, plan.launches.iter().map(|l| l.bytes).max().unwrap_or(0));
    }

    #[test]
    fn prefill_groups_any_sizes(
        reqs in requests(6),
        topk in topk(),
        workspace_bytes in huge(),
        context_chunk_rows in huge(),
        flags in any::<(bool, bool, bool)>(),
    ) {
        let (available, force_mqa, stock) = flags;
        let cfg = MaskConfig { topk, workspace_bytes, context_chunk_rows, available, force_mqa };
        let planned = timed("plan_prefill_groups", || {
            if stock { stock_prefill_groups(&reqs, &cfg) } else { plan_prefill_groups(&reqs, &cfg) }
        });
        let masks = timed("prefill_masks", || prefill_masks(&reqs, &cfg));
        prop_assert_eq!(planned.is_ok(), masks.is_ok(), "both refuse the same requests");
        if let Ok(set) = masks {
            if let Ok(peak) = set.peak_bytes() {
                prop_assert!(peak <= I64_MAX);
            }
        }
        let Ok(groups) = planned else { return Ok(()) };
        prop_assert!(groups.len() as u64 <= MAX_LAUNCHES);
        check_tiles(groups.iter().map(|g| g.requests.clone()), reqs.len())?;
        for g in &groups {
            if g.path == PrefillPath::MaskedMha {
                prop_assert!(g.mask_bytes <= workspace_bytes && g.mask_bytes <= I64_MAX);
            } else {
                prop_assert_eq!(g.mask_bytes, 0);
            }
        }
    }

    #[test]
    fn mask_sizes_any_sizes(batch in huge(), q in huge(), k in huge(), reserve in any::<bool>(), workspace in huge()) {
        if let Ok(shape) = topk_mask_shape(batch, q, k, reserve) {
            prop_assert!(fits_i64(&[shape.batch, shape.rows, shape.words]));
            prop_assert!(shape.rows >= q && u128::from(shape.words) * 32 >= u128::from(k));
            if let Ok(bytes) = topk_mask_bytes(batch, q, k, reserve) {
                prop_assert!(bytes <= I64_MAX);
                prop_assert_eq!(Some(bytes), batch.checked_mul(shape.rows).and_then(|b| b.checked_mul(shape.words)).and_then(|b| b.checked_mul(4)));
            }
        }
        let _ = masked_mha_workspace_fits(batch, q, k, workspace);
    }

    #[test]
    fn scratch_any_sizes(
        gpu in gpu(),
        batch in huge(),
        s_q in huge(),
        num_heads in heads(),
        topk in topk(),
        flags in any::<(bool, bool)>(),
    ) {
        let (out_preallocated, translated_indices) = flags;
        let shape = DecodeShape { batch, s_q, num_heads, topk, out_preallocated, translated_indices };
        if let Ok(bd) = decode_scratch(gpu, shape) {
            check_breakdown(&bd)?;
        }
        let shape = PrefillShape { s_q, num_heads, topk, out_preallocated, translated_indices, native_heads: mla_planner::geometry::prefill_runs_native(num_heads, gpu.arch), padding: 64 };
        if let Ok(bd) = prefill_scratch(gpu.arch, shape) {
            check_breakdown(&bd)?;
        }
        if let Ok(b) = indexer_logits_bytes(batch, s_q) {
            prop_assert!(b <= I64_MAX && Some(b) == batch.checked_mul(s_q).and_then(|x| x.checked_mul(4)));
        }
        if let Ok(b) = gather_workspace_bytes(s_q) {
            prop_assert!(b <= I64_MAX && b == s_q * 1152);
        }
    }

    #[test]
    fn prefill_launch_tokens_any_sizes(arch in prop_oneof![Just(Arch::Sm90), Just(Arch::Sm100)], num_heads in heads(), topk in topk(), budget in huge(), flags in any::<(bool, bool, bool)>(), padding in prop_oneof![Just(64u32), Just(128)]) {
        let (out_preallocated, translated_indices, native_heads) = flags;
        let shape = PrefillShape { s_q: 0, num_heads, topk, out_preallocated, translated_indices, native_heads, padding };
        if let Ok((tokens, _)) = prefill_launch_tokens(arch, shape, budget) {
            let cap = max_tokens_per_launch(prefill_kernel_heads(num_heads, arch, native_heads, padding).unwrap()).0;
            prop_assert!(tokens >= 1 && tokens <= cap);
            let bytes = prefill_scratch(arch, PrefillShape { s_q: tokens, ..shape }).unwrap().total_bytes();
            prop_assert!(bytes <= budget);
        }
    }

    #[test]
    fn request_offset_any_sizes(offset in huge(), n in 0usize..1_000) {
        match request_offset(offset, n) {
            Ok(o) => prop_assert!(o >= 0 && (o as u64).checked_add(n as u64).is_some_and(|last| last <= I64_MAX)),
            Err(e) => prop_assert!(offset.saturating_add(n as u64) > I64_MAX, "{}", e),
        }
    }

    #[test]
    fn launch_count_never_passes_the_cap(parts in prop::collection::vec(huge(), 0..6)) {
        let mut count = LaunchCount::new();
        for &p in &parts {
            let before = count.total();
            match count.add("a part", p, "a hint") {
                Ok(()) => prop_assert_eq!(count.total(), before + p),
                Err(e) => {
                    prop_assert!(too_many_launches(e));
                    prop_assert_eq!(count.total(), before, "a refused part is not counted");
                }
            }
            prop_assert!(count.total() <= MAX_LAUNCHES && count.remaining() == MAX_LAUNCHES - count.total());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Budgets where the lengths that fit are irregular (tens of MiB), so
    /// the partition search runs, on steps up to the launch cap. Fewer
    /// cases: a plan near the cap is a million launches.
    #[test]
    fn plan_mixed_batch_irregular_budgets(
        num_tokens in prop_oneof![1u64..1_000_000, 1u64..=(MAX_LAUNCHES * 200)],
        gpu in gpu(),
        num_heads in 1u32..=128,
        budget_mib in 1u64..200,
        flags in any::<(bool, bool, bool)>(),
    ) {
        let (out_preallocated, translated_indices, align_waves) = flags;
        let cfg = MixedBatchConfig { gpu, num_heads, topk: 2048, budget_bytes: budget_mib << 20, out_preallocated, translated_indices, align_waves };
        if let Ok(plan) = timed("plan_mixed_batch", || plan_mixed_batch(num_tokens, &cfg)) {
            prop_assert!(plan.launches.len() as u64 <= MAX_LAUNCHES);
            prop_assert_eq!(plan.launches.last().map(|l| l.end), Some(num_tokens));
            prop_assert!(plan.launches.iter().all(|l| l.bytes <= cfg.budget_bytes));
        }
    }
}

// Inputs that once got past the checks, each kept as a case by name.

fn too_many_launches(e: PlanError) -> bool {
    matches!(e, PlanError::TooManyLaunches { .. })
}

#[test]
fn indexer_at_zero_budget_refuses_instead_of_allocating_a_chunk_per_row() {
    let err =
        timed("indexer", || split_indexer_prefill_chunks(&[100_000_000], &[100_000_000], 1_000_000, 0)).unwrap_err();
    let msg = err.to_string();
    assert!(too_many_launches(err) && msg.contains("max_logits_bytes"), "{msg}");
}

#[test]
fn indexer_refuses_queries_longer_than_their_sequence() {
    let half = 1u64 << 63;
    let err = split_indexer_prefill_chunks(&[0, 0, 0], &[half - 1, half - 1, 2], 10, 10).unwrap_err();
    assert!(err.to_string().contains("query_lens[0]"), "{err}");
}

#[test]
fn indexer_refuses_more_rows_than_any_gpu_holds() {
    let err = split_indexer_prefill_chunks(&[MAX_ROWS, 1], &[1, 1], u64::MAX, u64::MAX).unwrap_err();
    assert!(matches!(err, PlanError::InvalidArgument { .. }) && err.to_string().contains("2^40"), "{err}");
}

#[test]
fn gather_with_a_workspace_past_i64_max_terminates() {
    let big = I64_MAX;
    let reqs = [PrefillRequest { query_len: big, context_len: big }];
    let err = timed("gather", || plan_gather_chunks(&reqs, (1 << 63) + 1)).unwrap_err();
    assert!(matches!(err, PlanError::InvalidArgument { .. }), "{err}");
    // Within the physical bound, a workspace of any size plans one chunk.
    let reqs = [PrefillRequest { query_len: 1 << 39, context_len: 1 << 39 }];
    let chunks = plan_gather_chunks(&reqs, u64::MAX).unwrap();
    assert_eq!(chunks, vec![GatherChunk::Requests { requests: 0..1, rows: MAX_ROWS }]);
}

#[test]
fn gather_never_returns_rows_past_i64_max() {
    let reqs = [PrefillRequest { query_len: 2, context_len: I64_MAX }];
    assert!(plan_gather_chunks(&reqs, I64_MAX).is_err());
}

#[test]
fn gather_refuses_a_quadratic_split_by_its_exact_count() {
    // 2^12 windows of new tokens take about 2^23 gathers: refused before any is stored.
    let reqs = [PrefillRequest { query_len: 1 << 22, context_len: 0 }];
    let err = timed("gather", || plan_gather_chunks(&reqs, 1 << 10)).unwrap_err();
    assert!(too_many_launches(err.clone()) && err.to_string().contains("gather workspace"), "{err}");
    // A long context with few new tokens needs few gathers, and is planned.
    let reqs = [PrefillRequest { query_len: 10, context_len: 1 << 30 }];
    let chunks = plan_gather_chunks(&reqs, 1 << 20).unwrap();
    assert_eq!(chunks.len(), (1 << 10) + 1);
}

#[test]
fn scratch_totals_are_exact_or_refused() {
    let decode = DecodeShape {
        batch: 1,
        s_q: 50_000_000_000_000,
        num_heads: 16,
        topk: 2048,
        out_preallocated: false,
        translated_indices: false,
    };
    let err = decode_scratch(Gpu::h200(), decode).unwrap_err();
    assert!(matches!(err, PlanError::Overflow { .. }), "{err}");
    let prefill = PrefillShape {
        s_q: 200_000_000_000_000,
        num_heads: 16,
        topk: 2048,
        out_preallocated: false,
        translated_indices: false,
        native_heads: false,
        padding: 64,
    };
    let err = prefill_scratch(Arch::Sm90, prefill).unwrap_err();
    assert!(matches!(err, PlanError::Overflow { .. }), "{err}");
}

#[test]
fn request_offsets_past_i64_are_refused() {
    assert_eq!(request_offset(5, 3).unwrap(), 5);
    assert_eq!(request_offset(I64_MAX - 3, 3).unwrap(), (I64_MAX - 3) as i64);
    let err = request_offset(1 << 63, 1).unwrap_err();
    assert!(err.to_string().contains("request_offset"), "{err}");
    assert!(request_offset(I64_MAX - 2, 3).is_err());
}

#[test]
fn mixed_batch_past_the_hard_limit_says_to_plan_fewer_tokens() {
    let cfg = MixedBatchConfig {
        gpu: Gpu::h200(),
        num_heads: 16,
        topk: 2048,
        budget_bytes: u64::MAX,
        out_preallocated: true,
        translated_indices: false,
        align_waves: true,
    };
    let err = timed("mixed", || plan_mixed_batch(u64::MAX, &cfg)).unwrap_err();
    assert!(too_many_launches(err.clone()) && err.to_string().contains("fewer tokens"), "{err}");
    let err = plan_mixed_batch(1 << 32, &MixedBatchConfig { budget_bytes: 1 << 30, ..cfg }).unwrap_err();
    assert!(err.to_string().contains("larger budget"), "{err}");
}

#[test]
fn huge_prefills_route_to_sparse_mqa_or_are_refused() {
    let cfg = MaskConfig::vllm_default(2048, true);
    let reqs = [PrefillRequest { query_len: 1 << 39, context_len: 1 << 38 }];
    let groups = plan_prefill_groups(&reqs, &cfg).unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].path, PrefillPath::SparseMqa);
    let reqs = [PrefillRequest { query_len: u64::MAX, context_len: u64::MAX }];
    assert!(plan_prefill_groups(&reqs, &cfg).is_err());
}

#[test]
fn prefill_groups_take_linear_time_in_the_requests() {
    // 200,000 requests that all fit one masked-MHA group: the group grows
    // one request at a time without rescanning what it holds.
    let cfg = MaskConfig { workspace_bytes: 1 << 40, ..MaskConfig::vllm_default(2048, true) };
    let reqs = vec![PrefillRequest { query_len: 3000, context_len: 0 }; 200_000];
    let groups = timed("plan_prefill_groups", || plan_prefill_groups(&reqs, &cfg)).unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].path, PrefillPath::MaskedMha);
}
