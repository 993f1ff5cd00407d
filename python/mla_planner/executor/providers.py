"""Kernel providers: the two FlashMLA sparse kernels behind one small interface.

* ``flash_mla`` -- PyPI ``sgl-flash-mla`` (import name ``flash_mla``), its legacy kernels, which
  are the ones that run on SM90 and read the 656-byte V3.2 cache. Neither of its kernels takes
  ``out=``: the executors copy out of the kernel's own output, and plan for it.
* ``vllm`` -- vLLM's bundled FlashMLA (``vllm.v1.attention.ops.flashmla``); both kernels take
  ``out=``.
* ``reference`` -- :mod:`.reference` in float32; runs anywhere, including the CPU.

Kernel modules are imported when a provider is built, never at import time, so the planner and
the executors import on a machine with neither CUDA nor FlashMLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from mla_planner import NATIVE_PREFILL_HEADS
from mla_planner.executor.layout import D_V
from mla_planner.executor.reference import gather_upconvert_reference, sparse_decode_reference, sparse_prefill_reference


class ProviderUnavailable(RuntimeError):
    """The provider's kernels cannot be loaded here; the message says why."""


class KernelProvider(Protocol):
    name: str
    decode_takes_out: bool
    """Whether :meth:`sparse_decode` writes into a caller's ``out`` instead of allocating one."""
    prefill_takes_out: bool

    def new_decode_schedule(self) -> Any:
        """A fresh split-KV schedule, filled by its first decode call and valid for reuse only by
        calls of the same shape (FlashMLA's ``FlashMLASchedMeta`` contract)."""
        ...

    def sparse_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        schedule: Any,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 sparse decode. q ``(b, s_q, h, 576)`` with h in {64, 128}; kv_cache
        ``(pages, page_size, 1, 656)`` uint8; indices ``(b, s_q, topk)`` int32 slots, ``-1`` unused.
        Returns out ``(b, s_q, h, 512)`` and lse ``(b, h, s_q)``."""
        ...

    def sparse_prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BF16 sparse prefill. q ``(s_q, h, 576)``; kv ``(rows, 1, 576)``; indices
        ``(s_q, 1, topk)`` int32 rows, ``-1`` unused; ``topk_length`` ``(s_q,)`` int32: only each
        query's first that many indices count. Returns out ``(s_q, h, 512)`` and the natural-log
        lse ``(s_q, h)``."""
        ...

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        """The FP8 cache rows of ``num_requests`` requests (their block-table rows), each from
        position 0, into ``workspace`` as BF16 ``(rows, 576)``, request ``r`` from row
        ``workspace_starts[r]`` to the next request's start (the last to the end): vLLM's
        ``cp_gather_and_upconvert_fp8_kv_cache``."""
        ...


class FlashMLAProvider:
    """``sgl-flash-mla``. Installs with ``--no-deps`` next to torch 2.11 (docs/executor.md, "Tests")."""

    name = "flash_mla"
    decode_takes_out = False
    prefill_takes_out = False

    def __init__(self, use_legacy: bool = True) -> None:
        try:
            import flash_mla
        except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: torch.ops.load_library
            raise ProviderUnavailable(f"cannot import flash_mla (pip install --no-deps sgl-flash-mla==1.0.0): {exc}") from exc
        if use_legacy and not flash_mla.has_legacy():
            raise ProviderUnavailable("this flash_mla build has no legacy (SM90 / V3.2-layout) kernels")
        self._fm: Any = flash_mla
        self._use_legacy = use_legacy

    def new_decode_schedule(self) -> Any:
        return self._fm.get_mla_metadata()[0]

    def sparse_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        schedule: Any,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is not None:
            raise TypeError("sgl-flash-mla's flash_mla_with_kvcache takes no out=")
        result: tuple[torch.Tensor, torch.Tensor] = self._fm.flash_mla_with_kvcache(
            q, kv_cache, None, None, D_V, schedule,
            softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=indices, use_legacy=self._use_legacy,
        )
        return result

    def sparse_prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is not None or topk_length is not None:
            raise TypeError("sgl-flash-mla's flash_mla_sparse_fwd takes no out= or topk_length=")
        o, _max_logits, lse = self._fm.flash_mla_sparse_fwd(q, kv, indices, softmax_scale, D_V, use_legacy=self._use_legacy)
        return o, lse

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        gather_upconvert_reference(kv_cache, workspace, block_table, workspace_starts, num_requests)


class VllmProvider:
    """vLLM's own FlashMLA build (``vllm._flashmla_C``)."""

    name = "vllm"
    decode_takes_out = True
    prefill_takes_out = True

    def __init__(self) -> None:
        try:
            from vllm.v1.attention.ops import flashmla
        except (ImportError, OSError, RuntimeError) as exc:
            raise ProviderUnavailable(f"cannot import vllm.v1.attention.ops.flashmla: {exc}") from exc
        supported, reason = flashmla.is_flashmla_sparse_supported()
        if not supported:
            raise ProviderUnavailable(f"vLLM's FlashMLA sparse kernels are unavailable: {reason}")
        self._ops: Any = flashmla  # re-exports that mypy cannot see through

    def new_decode_schedule(self) -> Any:
        return self._ops.get_mla_metadata()[0]

    def sparse_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        schedule: Any,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result: tuple[torch.Tensor, torch.Tensor] = self._ops.flash_mla_with_kvcache(
            q, kv_cache, None, None, D_V, schedule,
            softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=indices, out=out,
        )
        return result

    def sparse_prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, _max_logits, lse = self._ops.flash_mla_sparse_fwd(q, kv, indices, softmax_scale, D_V, topk_length=topk_length,
                                                             out=out)
        return o, lse

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        from vllm import _custom_ops

        ops: Any = _custom_ops
        ops.cp_gather_and_upconvert_fp8_kv_cache(kv_cache, workspace, block_table, workspace_starts, num_requests)


@dataclasses.dataclass
class ReferenceSchedule:
    """Stands in for ``FlashMLASchedMeta``: remembers the shape of its first call and, like the
    real one, refuses a call of another shape."""

    shape: tuple[int, ...] | None = None


class ReferenceProvider:
    """:mod:`.reference` behind the provider interface. ``takes_out=False`` makes it behave like
    sgl-flash-mla (allocate and return ``out``), so both executor paths run on the CPU.
    ``native_prefill_heads``: the prefill kernel also takes 16 and 32 heads, as later vLLM releases'
    SM90 builds do; otherwise 64 and 128 only, as the legacy kernel."""

    name = "reference"

    def __init__(self, takes_out: bool = True, native_prefill_heads: bool = False) -> None:
        self.decode_takes_out = takes_out
        self.prefill_takes_out = takes_out
        self.prefill_heads = (*(NATIVE_PREFILL_HEADS if native_prefill_heads else ()), 64, 128)

    def new_decode_schedule(self) -> ReferenceSchedule:
        return ReferenceSchedule()

    def sparse_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        schedule: Any,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(schedule, ReferenceSchedule)
        shape = (*q.shape, indices.shape[-1])
        if schedule.shape is None:
            schedule.shape = shape
        elif schedule.shape != shape:
            raise AssertionError(f"schedule made for shape {schedule.shape} reused for {shape}")
        if q.shape[2] not in (64, 128):
            raise ValueError(f"the sparse decode kernel takes 64 or 128 heads, got {q.shape[2]}")
        o, lse = sparse_decode_reference(q, kv_cache, indices, softmax_scale)
        return _into(out, o, self.decode_takes_out), lse

    def sparse_prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[1] not in self.prefill_heads:
            raise ValueError(f"this sparse prefill kernel takes {', '.join(map(str, self.prefill_heads))} heads, got {q.shape[1]}")
        o, lse = sparse_prefill_reference(q, kv, indices, softmax_scale, topk_length)
        return _into(out, o, self.prefill_takes_out), lse

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        gather_upconvert_reference(kv_cache, workspace, block_table, workspace_starts, num_requests)


def _into(out: torch.Tensor | None, result: torch.Tensor, takes_out: bool) -> torch.Tensor:
    if out is None:
        return result
    if not takes_out:
        raise TypeError("this provider was built without out= support")
    if out.shape != result.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(result.shape)}, got {tuple(out.shape)}")
    return out.copy_(result)


PROVIDER_NAMES = ("flash_mla", "vllm", "reference")


def get_provider(name: str) -> KernelProvider:
    """Build a provider by name; :class:`ProviderUnavailable` says why one cannot load here."""
    if name == "flash_mla":
        return FlashMLAProvider()
    if name == "vllm":
        return VllmProvider()
    if name == "reference":
        return ReferenceProvider()
    raise ValueError(f"unknown kernel provider {name!r}; choose one of {', '.join(PROVIDER_NAMES)}")
