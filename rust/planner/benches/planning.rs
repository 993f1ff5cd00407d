//! Planning time of the pure-Rust planners, by request count.
//! Run: `cargo bench -p mla-planner`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mla_planner::geometry::{Gpu, KvDtype};
use mla_planner::plan::{plan_mixed_batch, split_prefill_chunks, MixedBatchConfig};
use mla_planner::step::{plan_step, Step, StepConfig};
use std::hint::black_box;

/// Deterministic pseudo-random lengths (no RNG crate needed for a bench).
fn lengths(n: usize, max: u64, seed: u64) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            1 + (x >> 33) % max
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("split_prefill_chunks");
    for n in [256usize, 4096] {
        let seq = lengths(n, 8192, 7);
        group.bench_with_input(BenchmarkId::from_parameter(n), &seq, |b, seq| {
            b.iter(|| split_prefill_chunks(black_box(seq), 350_000).unwrap())
        });
    }
    group.finish();

    let mut group = c.benchmark_group("plan_step");
    for n in [256usize, 4096] {
        let q = lengths(n, 64, 11);
        let ctx = lengths(n, 30_000, 13);
        let cfg = StepConfig::vllm(Gpu::h200(), 16, 2048, KvDtype::Fp8, 1 << 30, 163_840, false, false).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(n), &(q, ctx), |b, (q, ctx)| {
            b.iter(|| plan_step(Step { query_lens: black_box(q), context_lens: ctx, num_decodes: 0 }, &cfg).unwrap())
        });
    }
    group.finish();

    let cfg = MixedBatchConfig {
        gpu: Gpu::h200(),
        num_heads: 16,
        topk: 2048,
        budget_bytes: 1 << 30,
        out_preallocated: true,
        translated_indices: false,
        align_waves: false,
    };
    c.bench_function("plan_mixed_batch/32768", |b| b.iter(|| plan_mixed_batch(black_box(32768), &cfg).unwrap()));
}

criterion_group!(benches, bench);
criterion_main!(benches);
