"""Mixed-batch FP8 sparse decode on the real kernels: one call vs the planner's chunks.

For T in {4K, 16K, 32K, 64K} tokens x budget in {unbounded, 2 GiB, 1 GiB, 256 MiB}: the
planner's predicted peak, the allocator's measured peak (inputs and output excluded), and the
median wall time of the whole executor run over --runs repeats (CUDA events, after warm-up), and
the median host time of issuing it (from the call to its return, no synchronisation: the Python
and launch work a layer call adds, which the GPU hides while it is shorter than the kernels).
Configurations of one T are timed round-robin, so clock and thermal drift hit all of them alike.
"Unbounded" is the single call; 64K tokens cannot run as one call (int32 stride limit): n/a.
Rows marked "waves" plan with ``align_waves``: launch lengths in whole waves of the GPU (one CTA
per token and 64-head block per SM), so the launches take as many waves as one call would.

    python benchmarks/kernel_bench.py --out docs/kernel_bench.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mla_planner
from mla_planner.calibration.synthetic import MixedCase, mixed_case
from mla_planner.executor import MixedBatchExecutor, get_provider

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness.measure import peak_delta_bytes  # noqa: E402  (tests/harness: the test harness, not in the wheel)
from harness.mixed import mixed_for_heads, plan_tokens, run_plan  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
UNBOUNDED = 1 << 50
BUDGETS = {"unbounded": UNBOUNDED, "2 GiB": 2 * GiB, "1 GiB": GiB, "256 MiB": 256 * MiB}


@dataclass
class Row:
    tokens: int
    budget: str
    plan: mla_planner.StepPlan | None
    note: str = ""
    predicted: int = 0
    measured: int = 0
    times_ms: list[float] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")

    @property
    def median_host_us(self) -> float:
        return statistics.median(self.host_us) if self.host_us else float("nan")


def bench_tokens(
    executor: MixedBatchExecutor, tokens: int, args: argparse.Namespace,
    gen: torch.Generator,
) -> list[Row]:
    rows = []
    max_tokens, bound = mla_planner.max_tokens_per_launch(executor.num_heads)
    for name, budget in BUDGETS.items():
        if budget == UNBOUNDED and tokens > max_tokens:
            rows.append(Row(tokens, name, None, f"n/a: one call is over the {bound} limit ({max_tokens} tokens)"))
            continue
        plan = plan_tokens(mixed_for_heads(executor.provider, args.heads, budget, topk=args.topk), tokens)
        rows.append(Row(tokens, name, plan, predicted=plan.peak_bytes))
        if budget != UNBOUNDED:
            plan = plan_tokens(mixed_for_heads(executor.provider, args.heads, budget, topk=args.topk, align_waves=True), tokens)
            rows.append(Row(tokens, f"{name}, waves", plan, predicted=plan.peak_bytes))

    case: MixedCase = mixed_case(tokens, executor.num_heads, args.topk, args.cache_slots, gen, dtype=torch.bfloat16)
    out = torch.empty((tokens, executor.num_heads, 512), dtype=torch.bfloat16, device="cuda")

    def runner(plan: mla_planner.StepPlan) -> Callable[[], None]:
        return lambda: run_plan(executor, plan, case.q, case.kv_cache, case.indices, out)

    runs = [(row, runner(row.plan)) for row in rows if row.plan is not None]
    for row, run in runs:
        for _ in range(args.warmup):
            run()
        row.measured = peak_delta_bytes(run)
    for _ in range(args.runs):
        for row, run in runs:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            issued = time.perf_counter()
            run()
            issued = time.perf_counter() - issued
            end.record()
            end.synchronize()
            row.times_ms.append(start.elapsed_time(end))
            row.host_us.append(issued * 1e6)
    return rows


def markdown(rows: list[Row], header: str) -> str:
    lines = [
        header, "",
        "| tokens | budget | launches (lengths) | predicted peak MiB | measured peak MiB | median ms | vs one call "
        "| host us | host vs one call |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    singles = [row for row in rows if row.budget == "unbounded" and row.plan is not None]
    single = {row.tokens: row.median_ms for row in singles}
    single_host = {row.tokens: row.median_host_us for row in singles}
    for row in rows:
        if row.plan is None:
            lines.append(f"| {row.tokens} | {row.budget} | {row.note} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        lengths = ", ".join(str(n) for n in sorted(set((row.plan.launches[:, 1] - row.plan.launches[:, 0]).tolist())))
        ratio = f"{row.median_ms / single[row.tokens]:.3f}x" if row.tokens in single else "n/a"
        host_ratio = f"{row.median_host_us / single_host[row.tokens]:.2f}x" if row.tokens in single_host else "n/a"
        lines.append(
            f"| {row.tokens} | {row.budget} | {len(row.plan)} ({lengths}) | {row.predicted / MiB:.1f} "
            f"| {row.measured / MiB:.1f} | {row.median_ms:.2f} | {ratio} | {row.median_host_us:.0f} | {host_ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="flash_mla", choices=["flash_mla", "vllm"])
    parser.add_argument("--heads", type=int, default=16, help="query heads per rank (16: DeepSeek-V3.2 at TP 8)")
    parser.add_argument("--tokens", default="4096,16384,32768,65536")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--cache-slots", type=int, default=65536)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = parser.parse_args()
    if args.runs < 10:
        parser.error("--runs must be at least 10")
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA GPU")

    provider = get_provider(args.provider)
    executor = mixed_for_heads(provider, args.heads, 1 << 50, topk=args.topk)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows: list[Row] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows.extend(bench_tokens(executor, tokens, args, gen))
        torch.cuda.empty_cache()

    header = (
        f"Mixed-batch FP8 sparse decode, {args.provider} on {torch.cuda.get_device_name()}, torch {torch.__version__}: "
        f"{args.heads} heads (padded to {executor.kernel_heads}), topk {args.topk}, {args.cache_slots} cache slots, "
        f"median of {args.runs} after {args.warmup} warm-up runs.\n\n"
        f"Command: `python benchmarks/kernel_bench.py {' '.join(sys.argv[1:])}`"
    )
    table = markdown(rows, header)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
