"""Both FP8 routes of a prefill step on the real kernels: the cost model's prediction against the
measured time, each route's output against the float32 reference, and the chosen route against
stock vLLM's.

For heads per rank in {16, 128} (kernels padded to 64 and 128) and T in {512, 2K, 8K, 32K}: one
prefill request of T tokens after ``max(0, topk + 1 - T)`` tokens of context (so the request is
longer than top-k and vLLM runs it as sparse MQA, not dense MHA), planned on each route by
``mla_planner.plan_step`` under ``--budget-mib`` (:func:`plan_routes`, which needs no GPU):

* mixed: the planned sparse-decode launches over the paged FP8 cache;
* separate: the gather of the request's rows into a BF16 workspace (vLLM's
  ``cp_gather_and_upconvert_fp8_kv_cache``), then the planned sparse-prefill launches, at the heads
  the profile priced them at (padded, or 16/32 native where it prices those cheaper).

Each route is timed as a whole (CUDA events, L2 flushed before, median of ``--runs``, routes
interleaved), the launches exactly as planned and priced. "Stock" is vLLM's rule with no budget:
one mixed call at 16 heads (separate at 128, where vLLM's rule already picks it). Outputs
are checked on ``--check-rows`` random rows against the float32 reference with FlashMLA's
tolerances (decode kernel: abs 1e-3 / rel 2.01/128; prefill kernel: abs 8e-4 / rel 3.01/128;
both cos diff 1e-5) and the fraction of elements outside them is printed.

    python benchmarks/route_bench.py --out route_bench.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mla_planner
from mla_planner.calibration.kernel_timing import GatherOp, Timer
from mla_planner.calibration.synthetic import PrefillCase, prefill_case
from mla_planner.executor import get_provider
from mla_planner.executor.layout import D_QK, D_V, PAGE_SIZE, as_slots
from mla_planner.executor.providers import KernelProvider
from mla_planner.executor.reference import sparse_attention
from mla_planner.profiles import REFERENCE_GPU, packaged_for_gpu

MiB = 1 << 20
STOCK_BUDGET = 1 << 50
"""vLLM's rule has no budget: one the planner accepts that no step reaches."""
SCALE = D_QK**-0.5
TOLERANCE = {"sparse_decode": (1e-3, 2.01 / 128), "sparse_prefill": (8e-4, 3.01 / 128)}
COS_DIFF_TOL = 1e-5


@dataclass
class Route:
    name: str
    plan: mla_planner.StepPlan
    predicted_us: float | None
    run: Callable[[], torch.Tensor] | None = None
    times_us: list[float] = field(default_factory=list)
    check: str = ""

    @property
    def measured_us(self) -> float:
        return statistics.median(self.times_us) if self.times_us else float("nan")


class Step:
    """One prefill request on the GPU and the buffers both routes use."""

    def __init__(self, provider: KernelProvider, gather: GatherOp, heads: int, tokens: int, topk: int,
                 gen: torch.Generator) -> None:
        self.provider, self.gather, self.heads, self.tokens = provider, gather, heads, tokens
        self.context = max(0, topk + 1 - tokens)
        self.case: PrefillCase = prefill_case([tokens], [self.context], heads, topk, gen, dtype=torch.bfloat16)
        self._q_padded: dict[int, torch.Tensor] = {}
        pos = self.case.indices.long()
        pages = self.case.block_table[0].long()[pos.clamp(min=0) // PAGE_SIZE]
        self.slots = torch.where(pos >= 0, pages * PAGE_SIZE + pos.clamp(min=0) % PAGE_SIZE, -1).to(torch.int32)
        self.rows = self.context + tokens
        self.workspace = torch.empty((self.rows, D_QK), dtype=torch.bfloat16, device=gen.device)
        self.out = torch.empty((tokens, heads, D_V), dtype=torch.bfloat16, device=gen.device)

    def q_padded(self, kernel_heads: int) -> torch.Tensor:
        """q zero-padded to the heads a kernel runs, made once per head count."""
        if kernel_heads not in self._q_padded:
            q = self.case.q.new_zeros((self.tokens, kernel_heads, D_QK))
            q[:, : self.heads] = self.case.q
            self._q_padded[kernel_heads] = q
        return self._q_padded[kernel_heads]

    def mixed(self, plan: mla_planner.StepPlan, kernel_heads: int) -> Callable[[], torch.Tensor]:
        launches = [(launch.tokens.start, launch.tokens.stop) for launch in plan]
        schedules = {b - a: self.provider.new_decode_schedule() for a, b in launches}
        q_padded = self.q_padded(kernel_heads)

        def run() -> torch.Tensor:
            for a, b in launches:
                o, _ = self.provider.sparse_decode(q_padded[a:b].unsqueeze(0), self.case.kv_cache,
                                                   self.slots[a:b].unsqueeze(0), schedules[b - a], SCALE)
                self.out[a:b] = o[0, :, : self.heads]
            return self.out

        return run

    def separate(self, plan: mla_planner.StepPlan, kernel_heads: int) -> Callable[[], torch.Tensor]:
        launches = [(launch.tokens.start, launch.tokens.stop) for launch in plan]
        positions = self.case.indices.unsqueeze(1)  # one request from row 0: positions are rows
        q_padded = self.q_padded(kernel_heads)

        def run() -> torch.Tensor:
            self.gather(self.case, self.rows, self.workspace)
            kv = self.workspace.unsqueeze(1)
            for a, b in launches:
                o, _ = self.provider.sparse_prefill(q_padded[a:b], kv, positions[a:b], SCALE)
                self.out[a:b] = o[:, : self.heads]
            return self.out

        return run

    def check(self, out: torch.Tensor, kernel: str, rows: torch.Tensor) -> str:
        expected, _ = sparse_attention(self.case.q[rows], as_slots(self.case.kv_cache), self.slots[rows], SCALE)
        got = out[rows].float()
        abs_tol, rel_tol = TOLERANCE[kernel]
        err = (got - expected).abs()
        outside = ~((err < abs_tol) | (err / (expected.abs() + 1e-6) < rel_tol))
        x, y = got.double(), expected.double()
        cos_diff = 1 - 2 * float((x * y).sum()) / max(float((x * x + y * y).sum()), 1e-12)
        verdict = "ok" if not bool(outside.any()) and cos_diff < COS_DIFF_TOL else "OFF"
        return f"{verdict}: {int(outside.sum())}/{outside.numel()} outside, max abs {float(err.max()):.2g}, cos diff {cos_diff:.2g}"


def plan_routes(model: mla_planner.CostModel, heads: int, tokens: int, context: int, budget: int,
                topk: int) -> tuple[list[Route], mla_planner.RouteChoice]:
    """The step's three routes, planned and (but stock's) priced -- mixed and separate under the
    budget, stock as vLLM's rule runs it with no budget -- and the route the model chooses."""
    rows = tokens + context
    config = mla_planner.StepConfig(heads, scratch_budget_bytes=budget, topk=topk, gather_workspace_rows=rows,
                                    indexer_workspace_rows=rows * 40)
    step = ([tokens], [context], 0)
    prediction = model.predict(*step, config)
    choice = model.choose_route(*step, config)
    separate = config.replace(mode="separate_prefill_decode")
    if prediction.separate is not None:  # at the heads the profile priced the prefill launches at
        separate = separate.replace(native_prefill_heads=prediction.separate.prefill_heads != config.prefill_padded_heads)
    stock = config.replace(mode=mla_planner.step_mode(heads, kv_dtype="fp8"), scratch_budget_bytes=STOCK_BUDGET)
    routes = [
        Route("mixed", mla_planner.plan_step(*step, config.replace(mode="mixed_batch")),
              prediction.mixed.total_us if prediction.mixed else None),
        Route("separate", mla_planner.plan_step(*step, separate),
              prediction.separate.total_us if prediction.separate else None),
        Route("stock", mla_planner.plan_step(*step, stock), None),
    ]
    return routes, choice


def kernel_heads(route: Route, config_heads: int) -> int:
    """Heads the route's kernel runs: the decode kernel's padding, or the plan's prefill heads."""
    plan = route.plan
    return plan.prefill_heads if plan.mode == "separate_prefill_decode" else mla_planner.padded_heads(config_heads)


def bench(model: mla_planner.CostModel, provider: KernelProvider, gather: GatherOp, heads: int, tokens: int,
          args: argparse.Namespace, gen: torch.Generator, timer: Timer) -> list[str]:
    step = Step(provider, gather, heads, tokens, args.topk, gen)
    if step.rows <= args.topk:
        raise ValueError(f"{tokens} tokens after {step.context} of context run as dense MHA in vLLM")
    routes, choice = plan_routes(model, heads, tokens, step.context, args.budget_mib * MiB, args.topk)
    for route in routes:
        mixed = route.plan.mode == "mixed_batch"
        route.run = (step.mixed if mixed else step.separate)(route.plan, kernel_heads(route, heads))
        for _ in range(args.warmup):
            route.run()
        rows = torch.randperm(tokens, device=gen.device)[: args.check_rows]
        route.check = step.check(route.run(), "sparse_decode" if mixed else "sparse_prefill", rows)
    order = list(routes)
    for _ in range(args.runs):
        random.shuffle(order)
        for route in order:
            assert route.run is not None
            route.times_us.append(timer(route.run))
    stock = routes[2].measured_us
    chosen = routes[0] if choice.mixed_batch else routes[1]
    lines = []
    for route in routes:
        predicted = f"{route.predicted_us / 1000:.3f}" if route.predicted_us is not None else "–"
        error = (f"{(route.predicted_us / route.measured_us - 1) * 100:+.1f}%"
                 if route.predicted_us is not None else "–")
        mark = " (chosen)" if route is chosen else (" (vLLM's rule, no budget)" if route.name == "stock" else "")
        lines.append(
            f"| {tokens} | {heads} ({kernel_heads(route, heads)}) | {route.name}{mark} | {len(route.plan.launches)} "
            f"| {predicted} | {route.measured_us / 1000:.3f} | {error} | {stock / route.measured_us:.2f}x | {route.check} |"
        )
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="vllm", choices=["vllm", "flash_mla"])
    parser.add_argument("--gather", default="vllm", choices=["vllm", "torch"])
    parser.add_argument("--profile", type=Path, help="cost profile (default: the packaged one)")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--tokens", default="512,2048,8192,32768")
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("route_bench.py needs a CUDA GPU")
    path = args.profile or packaged_for_gpu("sm90", torch.cuda.get_device_name(), None) or packaged_for_gpu("sm90", REFERENCE_GPU, None)
    if path is None:
        sys.exit("no packaged cost profile for this vLLM: pass --profile (mla-planner calibrate writes one)")
    model = mla_planner.CostModel.from_json(path.read_text())
    provider, gather = get_provider(args.provider), GatherOp(args.gather)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    random.seed(args.seed)
    timer = Timer(gen.device)
    header = [
        f"FP8 routes of one prefill request, {args.provider} kernels, {args.gather} gather, on "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; budget {args.budget_mib} MiB, topk {args.topk}, "
        f"median of {args.runs} (interleaved, L2 flushed); profile {path.name}.",
        "",
        f"Command: `python benchmarks/route_bench.py {' '.join(sys.argv[1:])}`",
        "",
        "| tokens | heads (padded) | route | launches | predicted ms | measured ms | model error | stock / route | output vs float32 |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    print("\n".join(header), flush=True)
    lines = list(header)
    for heads in (int(h) for h in args.heads.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            lines += bench(model, provider, gather, heads, tokens, args, gen, timer)
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
