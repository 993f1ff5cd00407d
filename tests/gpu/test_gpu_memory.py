"""On the GPU: the allocator's peak per mixed-batch run against the planner's bytes, and budgets
holding at 32K and 64K tokens. Inputs and the output are allocated before the measurement, so
the delta is exactly what executor + kernel allocate."""

from __future__ import annotations

import pytest
import torch

import mla_planner
from mla_planner.calibration.synthetic import mixed_case
from mla_planner.executor import KernelProvider, MixedBatchExecutor

from gpu_helpers import MiB, peak_delta_bytes, prediction_tolerance
from harness.mixed import mixed_for_heads, plan_tokens, run_plan

pytestmark = pytest.mark.gpu

TOPK = 2048
CACHE_SLOTS = 65536  # as in docs/kernels.md, "Measured: kernels"
UNBOUNDED = 1 << 50
GiB = 1 << 30


def _measure(executor: MixedBatchExecutor, plan: mla_planner.StepPlan, num_tokens: int, gen: torch.Generator) -> int:
    case = mixed_case(num_tokens, executor.num_heads, TOPK, CACHE_SLOTS, gen, dtype=torch.bfloat16)
    out = torch.empty((num_tokens, executor.num_heads, 512), dtype=torch.bfloat16, device="cuda")
    run_plan(executor, plan, case.q, case.kv_cache, case.indices, out)  # warm-up: kernel loading, lazy init
    peak = peak_delta_bytes(lambda: run_plan(executor, plan, case.q, case.kv_cache, case.indices, out))
    assert bool(torch.isfinite(out).all())
    return peak


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("num_tokens", [1, 67, 1024, 4096, 16384, 32768])
def test_one_call_peak_matches_the_prediction(provider: KernelProvider, gen: torch.Generator, num_tokens: int, heads: int) -> None:
    max_tokens, bound = mla_planner.max_tokens_per_launch(heads)
    if num_tokens > max_tokens:
        pytest.skip(f"{num_tokens} tokens x {heads} heads cannot run in one call ({bound}: at most {max_tokens})")
    executor = mixed_for_heads(provider, heads, UNBOUNDED, topk=TOPK)
    plan = plan_tokens(executor, num_tokens)
    assert len(plan) == 1
    measured = _measure(executor, plan, num_tokens, gen)
    predicted = plan.peak_bytes
    assert predicted == plan.peak_bytes  # one launch
    print(f"T={num_tokens} heads={heads}: measured {measured} B, predicted {predicted} B, diff {measured - predicted} B")
    assert abs(measured - predicted) <= prediction_tolerance(predicted)


@pytest.mark.parametrize("budget", [2 * GiB, 1 * GiB, 256 * MiB], ids=["2GiB", "1GiB", "256MiB"])
@pytest.mark.parametrize("num_tokens", [32768, 65536])
def test_budget_holds(provider: KernelProvider, gen: torch.Generator, num_tokens: int, budget: int) -> None:
    executor = mixed_for_heads(provider, 16, budget, topk=TOPK)  # DeepSeek-V3.2 at TP 8
    plan = plan_tokens(executor, num_tokens)
    predicted = plan.peak_bytes
    measured = _measure(executor, plan, num_tokens, gen)
    print(f"T={num_tokens} budget={budget}: {len(plan)} launches of {sorted(set((plan.launches[:, 1] - plan.launches[:, 0]).tolist()))}, "
          f"measured {measured} B, predicted {predicted} B, headroom {budget - measured} B")
    assert measured <= budget
    assert abs(measured - predicted) <= prediction_tolerance(predicted)
