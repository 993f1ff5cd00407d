"""The backend's sizes that follow from a step configuration alone, with neither vLLM nor torch:
vLLM's decode threshold and what the backend holds back from the KV cache. The engine's setup
sizes its reservation with them at start-up; ``mla-planner doctor`` predicts it with the same."""

from __future__ import annotations

from collections.abc import Iterable

import mla_planner

ROUTES = ("mixed_batch", "separate_prefill_decode")
"""The FP8 routes a step may take where a cost profile routes it."""

OUTPUT_ROW_BYTES = 512 * 2
"""One token's output per head: the kernels' 512 latent values in bf16."""


def builder_decode_threshold(num_heads: int, arch: str) -> int:
    """The longest request vLLM's FlashMLA sparse builder counts as a decode, by heads per rank and
    architecture (F:366-372 on 0.33; the same table on 0.26), before speculative decoding raises
    it (:func:`.vllm_api.decode_threshold`)."""
    if arch == "sm100":
        return {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}.get(num_heads, 1024)
    return {16: 128, 32: 128, 64: 256, 128: 256}.get(num_heads, 256)


def largest_launch_bytes(configs: Iterable[mla_planner.StepConfig], max_step_tokens: int, max_decode: int,
                         served_heads: int | None) -> int:
    """The most one launch of any plan of any of ``configs`` allocates beyond vLLM's workspace
    (which holds the padded q and the kernel's output where ``served_heads`` is given)."""
    return max(c.largest_launch_bytes(max_step_tokens, max_decode, served_heads) for c in configs)


def step_output_bytes(max_step_tokens: int, num_heads: int) -> int:
    """The output of a step of ``max_step_tokens`` tokens: held in the reservation on vLLM 0.26,
    which has no workspace view for it."""
    return max_step_tokens * num_heads * OUTPUT_ROW_BYTES
