"""The seam between vLLM's configuration and the planner's: one :class:`~mla_planner.StepConfig`
per engine, read from vLLM's config and builder, and the check that vLLM's own gather chunks are
the plan's. Nothing else in the backend derives a kernel or workspace fact; where vLLM 0.26 and
0.33 differ, this asks :mod:`.vllm_api`."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

import mla_planner
from mla_planner.vllm_backend import vllm_api
from mla_planner.vllm_backend.settings import NATIVE_VAR, SettingsError


def device_arch() -> str:
    return "sm100" if current_platform.is_device_capability_family(100) else "sm90"


def step_config(
    vllm_config: VllmConfig, builder: Any, device: torch.device, scratch_budget_bytes: int, *, has_prefill_backend: bool,
    native_prefill_heads: bool = False,
) -> mla_planner.StepConfig:
    """The engine's step configuration: this GPU, the builder's heads per rank and top-k, the KV
    cache dtype, vLLM's workspaces (its own gather-workspace size), and vLLM's prefill routing:
    short prefills run dense MHA unless ``sparse_mla_force_mqa`` is set or there is no dense
    prefill backend, in which case every prefill token reaches the sparse kernels.
    ``native_prefill_heads`` (``MLA_PLANNER_NATIVE_PREFILL_HEADS=1``): the prefill kernel at the
    rank's own heads; a :class:`.SettingsError` where this vLLM, GPU or head count has no such
    kernel."""
    if native_prefill_heads and not vllm_api.NATIVE_PREFILL_HEADS:
        raise SettingsError(
            f"{NATIVE_VAR}=1: vLLM {vllm_api.VLLM_VERSION}'s FlashMLA runs the prefill kernel at 64 or 128 heads only "
            f"(vLLM 0.33's also at 16 and 32); unset {NATIVE_VAR}"
        )
    config = config_for(vllm_config, builder.num_heads, builder.topk_tokens, builder.use_fp8_kv_cache, device,
                        scratch_budget_bytes, has_prefill_backend=has_prefill_backend)
    if not native_prefill_heads:
        return config
    if not config.native_prefill_heads_possible:
        raise SettingsError(
            f"{NATIVE_VAR}=1: the prefill kernel runs 16 or 32 heads per rank unpadded, on sm90 only; this engine "
            f"has {config.num_heads} heads per rank on {config.arch}; unset {NATIVE_VAR}"
        )
    return config.replace(native_prefill_heads=True)


def config_for(
    vllm_config: VllmConfig, num_heads: int, topk: int, fp8: bool, device: torch.device, scratch_budget_bytes: int, *,
    has_prefill_backend: bool,
) -> mla_planner.StepConfig:
    """:func:`step_config` from the values themselves, for the impl, which has no builder."""
    max_model_len = vllm_config.model_config.max_model_len
    force_mqa = bool(vllm_config.attention_config.sparse_mla_force_mqa) or not has_prefill_backend
    return mla_planner.StepConfig(
        num_heads,
        arch=device_arch(),
        num_sms=num_compute_units(device.index),
        topk=topk,
        kv_dtype="fp8" if fp8 else "bf16",
        scratch_budget_bytes=scratch_budget_bytes,
        max_model_len=max_model_len,
        gather_workspace_rows=vllm_api.prefill_workspace_rows(vllm_config),
        indexer_workspace_rows=vllm_api.indexer_workspace_rows(vllm_config),
        force_mqa=force_mqa,
        execution="vllm",
        prefill_padding=vllm_api.PREFILL_PADDING,
    )


def check_gather_chunks(plan: mla_planner.StepPlan, fp8: Any, num_decodes: int) -> None:
    """vLLM's separate-route metadata gathers by its own ``split_prefill_chunks``; the plan's
    launches name gather chunks by index, so the two must be the same chunks. They are by
    construction (the planner implements vLLM's rule); a difference is a bug, not a step to run.

    A step whose prefills run dense MHA (all of them at most top-k tokens, with a dense prefill
    backend) has no prefill launch and no gather chunk in its plan, while vLLM builds chunks for
    every prefill regardless: neither path gathers them, so there is nothing to compare."""
    assert isinstance(fp8, FlashMLASparseMetadata.FP8SeparatePrefillDecode)
    if "sparse_prefill" not in plan.launch_kernels and len(plan.gather_chunks) == 0:
        return
    vllm_chunks = [] if fp8.prefill is None else [
        (num_decodes + c.req_start_idx, num_decodes + c.req_start_idx + len(c.block_table)) for c in fp8.prefill.chunks
    ]
    planned = [(int(row[0]), int(row[1])) for row in plan.gather_chunks]
    if any(int(row[2]) >= 0 for row in plan.gather_chunks) or planned != vllm_chunks:
        raise RuntimeError(
            f"mla-planner: vLLM gathers requests in chunks {vllm_chunks}, the plan in {planned}; "
            "please report this step (the planner must follow vLLM's split_prefill_chunks)"
        )
