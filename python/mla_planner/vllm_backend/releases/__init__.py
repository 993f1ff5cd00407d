"""One module per supported vLLM release, each implementing :class:`Release`.

Everything the backend touches that differs between vLLM releases lives in the installed release's
module, and so does every private vLLM name the backend reads or calls; the rest of the backend
asks :data:`release` what it can do (``release.stock_workspace``, ``release.masked_mha``) and never
tests a version. :mod:`..vllm_api` holds what every supported release has in common.

Adding a release: a module here (usually a subclass of the newest one, overriding what changed),
its line in :data:`MODULES`, its cost profiles under ``data/profiles``, its byte-model variant in
the Rust planner, its test facts (``tests/releases``), and its build and test lines (docs/vllm.md,
"Adding a vLLM release").
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Protocol

import torch

from mla_planner.engine_model import minor_of
from mla_planner.vllm_backend.workspace import WorkspaceLayout, WorkspaceViews

MODULES = {"0.26": "v0_26", "0.33": "v0_33"}
"""Supported vLLM releases (major.minor) and their modules here."""


class MaskedMha(Protocol):
    """What masked-MHA prefill asks of vLLM's layer and metadata, where a release has it
    (:mod:`..masked_mha` plans and runs it)."""

    def layer_takes_masked_mha(self, builder: Any, metadata: Any) -> bool: ...
    def masked_mha_set_fits(self, prefill: Any) -> bool: ...
    def stock_masked_mha_workspace_fits(self, prefill: Any) -> bool: ...
    def topk_mask_workspace_bytes(self, prefill: Any) -> int: ...
    def clone_prefill_backend(self, builder: Any) -> Any: ...
    def prefill_metadata_of(self, builder: Any, metadata: Any, common: Any, r0: int, r1: int, backend: Any) -> Any: ...
    def link_sparse_mqa_layers(self, builder: Any) -> str | None: ...
    def sparse_mqa_rows(self, impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_rows: slice, metadata: Any,
                        out: torch.Tensor) -> None: ...


class Release(Protocol):
    """The backend's view of one vLLM release (each member's docstring is in the oldest module
    that implements it)."""

    version: str
    forward_returns_lse: bool
    stock_workspace: bool
    prefill_padding: int | None
    native_prefill_kernels: bool
    masked_mha: MaskedMha | None

    def forward_result(self, out: torch.Tensor) -> Any: ...
    def stock_route_reason(self, vllm_config: Any) -> str | None: ...
    def prefills_run_dense(self, metadata: Any) -> bool: ...
    def build_fp8_mixed(self, builder: Any, common: Any) -> Any: ...
    def build_fp8_separate(self, builder: Any, common: Any, metadata: Any) -> Any: ...
    def dense_prefill_backend(self, builder: Any) -> Any: ...
    def stock_fp8_forward(self, impl: Any, mixed: bool, q: torch.Tensor, kv_cache: torch.Tensor,
                          topk_indices: torch.Tensor, metadata: Any) -> Any: ...
    def model_topk(self, vllm_config: Any) -> int: ...
    def prefill_workspace_rows(self, vllm_config: Any) -> int: ...
    def split_indexer_prefill_chunks(self) -> Any: ...
    def fp8_kv_pages(self, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int | None]: ...
    def convert_indices(self, req_id: torch.Tensor, block_table: torch.Tensor, topk: torch.Tensor, *,
                        block_size: int, block_stride_rows: int | None, **workspace: Any) -> Any: ...
    def fill_group_topk(self, impl: Any, topk_indices: torch.Tensor, metadata: Any, kv_cache: torch.Tensor) -> None: ...
    def decode_threshold(self, vllm_config: Any, num_heads: int, arch: str) -> int: ...
    def with_cpu_seq_lens(self, common: Any) -> Any: ...
    def release_from_sleep_mode_pool(self, address: int) -> bool: ...
    def workspace_padded_heads(self, vllm_config: Any, num_heads: int) -> int | None: ...
    def workspace_layout(self, impl: Any) -> WorkspaceLayout | None: ...
    def workspace_views(self, impl: Any, memo: dict[Any, WorkspaceViews] | None = None) -> WorkspaceViews: ...


def installed() -> Release:
    """The installed vLLM's release module's :class:`Release`; an ``ImportError`` naming the
    supported releases for any other: a release's internals are unknown until its module exists,
    and refusing beats running a plan through methods whose shapes may have changed."""
    version = importlib.metadata.version("vllm")
    module = MODULES.get(minor_of(version))
    if module is None:
        raise ImportError(f"mla-planner's vLLM backend supports vLLM {' and '.join(m + '.x' for m in MODULES)}; "
                          f"vLLM {version} is installed")
    made: Release = importlib.import_module(f"{__name__}.{module}").RELEASE
    return made


release: Release = installed()
"""The installed vLLM's release."""
