"""The backend's sizes that follow from a step configuration alone, with neither vLLM nor torch:
vLLM's decode threshold, what the backend holds back from the KV cache, and the smallest budget an
engine starts with. The engine's setup sizes and checks itself with them at start-up;
``mla-planner doctor`` predicts both with the same."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mla_planner

from .settings import Settings, SettingsError

MIB = 1 << 20

ROUTES = ("mixed_batch", "separate_prefill_decode")
"""The FP8 routes a step may take where a cost profile routes it."""

OUTPUT_ROW_BYTES = 512 * 2
"""One token's output per head: the kernels' 512 latent values in bf16."""


def route_configs(config: mla_planner.StepConfig, *, profiled: bool, native_kernels: bool) -> list[mla_planner.StepConfig]:
    """The configuration of every route (and prefill-head variant) an engine's FP8 steps may take:
    ``config``'s own alone, unless a cost profile routes them (``profiled``); then both routes,
    and where the installed FlashMLA runs the prefill kernel at ``config``'s heads unpadded
    (``native_kernels``), the separate route at native heads too, which a profile may price."""
    if not profiled:
        return [config]
    configs = [config.replace(mode=route) for route in ROUTES]
    if native_kernels and config.native_prefill_heads_possible:
        configs.append(config.replace(mode="separate_prefill_decode", native_prefill_heads=True))
    return configs


def builder_decode_threshold(num_heads: int, arch: str) -> int:
    """The longest request vLLM's FlashMLA sparse builder counts as a decode, by heads per rank and
    architecture (the same table in every supported release), before speculative decoding raises
    it (the release's ``decode_threshold``)."""
    if arch == "sm100":
        return {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}.get(num_heads, 1024)
    return {16: 128, 32: 128, 64: 256, 128: 256}.get(num_heads, 256)


def decode_threshold(num_heads: int, arch: str, verification_len: int | None) -> int:
    """vLLM's decode threshold: the builder's table (:func:`builder_decode_threshold`), raised to a
    speculative verification's length where the engine runs speculative decoding
    (``verification_len``; ``None``: it does not)."""
    threshold = builder_decode_threshold(num_heads, arch)
    return threshold if verification_len is None else max(threshold, verification_len)


def verification_len(num_speculative_tokens: int, parallel_drafting_doubles: bool) -> int:
    """The query tokens of one speculative verification: the target's token and the drafts, and as
    many mask slots again where the model runner appends them for parallel drafting."""
    return 1 + (2 if parallel_drafting_doubles else 1) * num_speculative_tokens


def padded_heads(num_heads: int, multiple: int) -> int:
    """``num_heads`` rounded up to ``multiple``: the heads vLLM pads the prefill kernel's q to."""
    return -(-num_heads // multiple) * multiple


def largest_launch_bytes(configs: Iterable[mla_planner.StepConfig], max_step_tokens: int, max_decode: int,
                         served_heads: int | None) -> int:
    """The most one launch of any plan of any of ``configs`` allocates beyond vLLM's workspace
    (which holds the padded q and the kernel's output where ``served_heads`` is given)."""
    return max(c.largest_launch_bytes(max_step_tokens, max_decode, served_heads) for c in configs)


def step_output_bytes(max_step_tokens: int, num_heads: int) -> int:
    """The output of a step of ``max_step_tokens`` tokens: held in the reservation where the release
    has no workspace view for it."""
    return max_step_tokens * num_heads * OUTPUT_ROW_BYTES


def reservation(configs: Iterable[mla_planner.StepConfig], max_step_tokens: int, max_decode: int, num_heads: int,
                workspace_heads: int | None) -> tuple[int, int]:
    """``(allowance, reserved)``: the most one launch of any plan of ``configs`` allocates beyond
    vLLM's workspace, and what the reservation holds: that, and where vLLM has no workspace view
    for the step's output (``workspace_heads`` is ``None``) the output of a whole step."""
    allowance = largest_launch_bytes(configs, max_step_tokens, max_decode, workspace_heads)
    output = 0 if workspace_heads is not None else step_output_bytes(max_step_tokens, num_heads)
    return allowance, allowance + output


def check_budget(configs: Sequence[mla_planner.StepConfig], settings: Settings, max_step_tokens: int,
                 max_decode: int) -> None:
    """:class:`.SettingsError` where some step of an engine could not be planned in the budget:
    its smallest unit (one token, one whole decode request) must fit every route it may take."""
    needed = max(c.min_scratch_budget(max_step_tokens, max_decode) for c in configs)
    if settings.scratch_bytes >= needed:
        return
    needed_mb = -(-needed // MIB)
    given = (f"the default budget of {settings.scratch_mb} MiB" if settings.source == "default"
             else f"{settings.source}={settings.scratch_mb}")
    routes = dict.fromkeys(c.mode for c in configs)
    raise SettingsError(
        f"{given} is below the {needed_mb} MiB this engine needs ({configs[0].num_heads} heads per rank, routes "
        f"{' and '.join(routes)}, decodes of up to {max_decode} tokens); set MLA_PLANNER_SCRATCH_MB={needed_mb} or more"
    )
