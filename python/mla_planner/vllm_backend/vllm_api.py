"""What every supported vLLM release offers the backend alike: the stock classes it subclasses, and
the public configuration and runtime calls it reads. What differs between releases, and every
private vLLM name, is the installed release's (:mod:`.releases`)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata as CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as FlashMLASparseBackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl as FlashMLASparseImpl
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata as FlashMLASparseMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseMetadataBuilder as FlashMLASparseMetadataBuilder,
)

T = TypeVar("T")

PLANNED_KV = "fp8_ds_mla"
"""The one KV-cache dtype whose steps are planned: the planner models fp8_ds_mla's 656-byte rows
and its gather. Other FP8 formats that take vLLM's FP8 path (``nvfp4_ds_mla``) run stock's code."""


def installed_version() -> str:
    """The installed vLLM's version."""
    return importlib.metadata.version("vllm")


def device_arch() -> str:
    """The GPU's architecture as the planner names it."""
    from vllm.platforms import current_platform

    return "sm100" if current_platform.is_device_capability_family(100) else "sm90"


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors, as vLLM counts them."""
    from vllm.utils.platform_utils import num_compute_units

    return int(num_compute_units(device.index))


def current_vllm_config() -> VllmConfig:
    """The configuration of the engine being built (vLLM sets it around model construction)."""
    return get_current_vllm_config()


def stats_interval_s() -> float:
    """vLLM's stats-logging interval (``VLLM_LOG_STATS_INTERVAL``, 10 s by default), as the API
    server reads it: workers inherit its environment."""
    import vllm.envs as envs

    return float(envs.VLLM_LOG_STATS_INTERVAL)


def from_first_tp_rank(make: Callable[[], T]) -> T:
    """``make()`` on the first rank of the engine's tensor-parallel group, its result on every
    rank, by vLLM's ``GroupCoordinator.broadcast_object``; ``make()`` here where there is no group
    of more than one rank (one GPU, the CPU tests). Every rank must call it at the same point:
    each does while it builds the model."""
    from vllm.distributed import parallel_state

    state: Any = parallel_state
    if not state.model_parallel_is_initialized():
        return make()
    group = state.get_tp_group()
    if group.world_size == 1:
        return make()
    made = make() if group.rank_in_group == 0 else None
    return cast(T, group.broadcast_object(made, src=0))


def sleep_mode(vllm_config: VllmConfig) -> bool:
    """``--enable-sleep-mode``: vLLM builds the model in a memory pool of its own, which keeps
    what a start-up measurement frees mapped (``release.release_from_sleep_mode_pool``)."""
    return bool(getattr(vllm_config.model_config, "enable_sleep_mode", False))


def indexer_workspace_rows(vllm_config: VllmConfig) -> int:
    """Rows of the sparse indexer's prefill K buffer (``get_max_prefill_buffer_size``)."""
    from vllm.v1.attention.backends.mla import indexer

    return int(indexer.get_max_prefill_buffer_size(vllm_config))


def give_mtp_draft_the_target_backend(vllm_config: VllmConfig) -> tuple[Any, bool] | None:
    """Name the target's attention backend (this one) as the MTP draft model's where the
    speculative config names none, before the draft is built. ``None`` where there is no MTP draft
    (or the target's backend was autoselected); else the backend the draft runs and whether this
    named it. vLLM's V1 model runner never lets the draft inherit ``--attention-backend``
    (``SpecDecodeBaseProposer._create_draft_vllm_config``, "Never inherit the attention backend
    from base"): the draft's MTP layer autoselects stock FLASHMLA_SPARSE and runs every prompt
    token of a step through the sparse decode kernel unplanned. A V2 runner that keeps the
    target's backend unless one is named (``SpeculativeConfig.apply_draft_overrides``) is left
    unchanged by naming it. A backend the operator named is kept. Other speculative methods'
    drafts are not this model: left to vLLM."""
    spec = vllm_config.speculative_config
    target = vllm_config.attention_config.backend
    if spec is None or spec.method != "mtp" or target is None:
        return None
    if spec.attention_backend is not None:
        return spec.attention_backend, False
    spec.attention_backend = target
    return target, True


def uniform_decode_len(vllm_config: VllmConfig) -> int:
    """The query tokens of each request of a decode step: 1 + the speculative tokens."""
    spec = vllm_config.speculative_config
    return 1 + (spec.num_speculative_tokens or 0) if spec is not None else 1


def profiling_kv_blocks(vllm_config: VllmConfig) -> int:
    """Blocks of the minimal KV cache vLLM captures CUDA graphs against while it profiles memory,
    before it sizes the real one (``_init_minimal_kv_cache_for_profiling``)."""
    compilation = vllm_config.compilation_config
    captures = compilation.max_cudagraph_capture_size or 0
    return min(vllm_config.scheduler_config.max_num_seqs, captures) or 1


def kv_cache_sized(vllm_config: VllmConfig) -> bool:
    """Whether the attention backends now being built serve the KV cache vLLM sized: vLLM sets
    ``cache_config.num_gpu_blocks`` before it builds the sized cache's backends and only after it
    built the minimal profiling cache's, clearing it when that cache goes. The one sign left where
    both caches have the same blocks (``--num-gpu-blocks-override`` at or below
    :func:`profiling_kv_blocks`)."""
    return vllm_config.cache_config.num_gpu_blocks is not None
