"""The mixed-batch executor outside vLLM (tests, benchmarks): a configuration of some heads,
budget and top-k on an H200, one request's plan, and a run of a whole plan."""

from __future__ import annotations

from typing import Any

import torch

import mla_planner
from mla_planner.executor import KernelProvider, Launches, MixedBatchExecutor


def mixed_for_heads(provider: KernelProvider, num_heads: int, budget_bytes: int, *, topk: int = 2048,
                    align_waves: bool = False, translated_indices: bool = False) -> MixedBatchExecutor:
    """An executor of these heads, budget and top-k, with the provider's ``out=`` handling."""
    config = mla_planner.StepConfig(num_heads, scratch_budget_bytes=budget_bytes, topk=topk, max_model_len=1 << 17,
                                    decode_takes_out=provider.decode_takes_out, align_waves=align_waves,
                                    translated_indices=translated_indices)
    return MixedBatchExecutor(provider, config)


def plan_tokens(executor: MixedBatchExecutor, num_tokens: int) -> mla_planner.StepPlan:
    """The plan of ``num_tokens`` sparse tokens (one request, all through the decode kernel)."""
    requests = [num_tokens] if num_tokens else []
    return mla_planner.plan_step(requests, [0] * len(requests), 0, executor.config.replace(force_mqa=True))


def run_plan(executor: MixedBatchExecutor, plan: mla_planner.StepPlan, q: torch.Tensor, kv_cache: torch.Tensor,
             indices: Any, out: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """:meth:`MixedBatchExecutor.run` of the plan's launches."""
    return executor.run(Launches.of(plan), q, kv_cache, indices, out, **kwargs)
