"""Execute a mixed-batch FP8 plan: every token of a step through the FlashMLA sparse decode
kernel as ``b = 1, s_q = launch length``, one launch per planned chunk.

Memory, launch by launch, is what ``decode_scratch(1, length, num_heads, out_preallocated=...)``
predicts:

* ``q_padded`` -- when heads need padding (16 -> 64), one zeroed buffer sized for the *longest*
  launch, allocated once per run and reused: each launch writes its real heads into a prefix
  view, the padded heads stay zero.
* ``o_accum``, ``lse_accum``, ``lse`` -- the kernel's, freed when the launch returns.
* ``out`` -- absent when the kernel writes straight into the caller's output (provider takes
  ``out=`` and no head padding); otherwise the kernel allocates it and its real heads are copied.

* ``slot_indices`` -- only with ``translates_indices``: the caller passes a function that turns
  a launch's rows of request-relative top-k positions into cache slots in a fresh tensor (vLLM's
  Triton conversion), so the translated indices exist for one launch at a time.

Plus one FlashMLA schedule per distinct launch length (a plan has at most two): a schedule may
only be reused by calls of the same shape; pass ``schedules`` to share them across calls with
the same plan (vLLM's layers of one step). :meth:`MixedBatchExecutor.predicted_peak_bytes` adds
it up from the planner's per-buffer bytes; :meth:`MixedBatchExecutor.plan` keeps it within the
budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mla_planner
from mla_planner.executor.layout import D_QK, D_V, FP8_BYTES_PER_TOKEN, padded_heads
from mla_planner.executor.providers import KernelProvider

IndexSource = torch.Tensor | Callable[[slice], torch.Tensor]
"""Top-k cache slots ``(T, topk)`` int32, or a function giving a launch's rows of them."""

ALLOCATOR_RESERVE_BYTES = 64 << 10
"""Held back from every budget for what the byte model leaves out: the caching allocator rounds
each block up to 512 B, and each schedule holds two small int32 tensors (< 5 KiB at 132 SMs)."""


class MixedBatchExecutor:
    def __init__(
        self,
        provider: KernelProvider,
        num_heads: int,
        *,
        softmax_scale: float = D_QK**-0.5,
        arch: str = "sm90",
        num_sms: int | None = None,
        translates_indices: bool = False,
        align_waves: bool = False,
    ) -> None:
        self.provider = provider
        self.num_heads = num_heads
        self.kernel_heads = padded_heads(num_heads)
        self.softmax_scale = softmax_scale
        self.arch = arch
        self.num_sms = num_sms
        self.translates_indices = translates_indices
        self.align_waves = align_waves

    @property
    def writes_in_place(self) -> bool:
        """The kernel writes the caller's output directly: it takes ``out=`` and sees the
        caller's own head count."""
        return self.provider.decode_takes_out and self.num_heads == self.kernel_heads

    def plan(self, num_tokens: int, budget_bytes: int, *, topk: int | None = None) -> mla_planner.MixedBatchPlan:
        """The planner's launches for this executor: its ``out`` handling, and its budget less
        :data:`ALLOCATOR_RESERVE_BYTES`, so that :meth:`predicted_peak_bytes` fits the budget."""
        usable = budget_bytes - ALLOCATOR_RESERVE_BYTES
        plan = self._plan(num_tokens, usable, topk)
        # The shared q buffer only matters when launch lengths differ by more than one token,
        # which happens below 133 tokens (non-monotonic scratch); there, tighten and re-plan.
        for _ in range(8):
            excess = self.predicted_peak_bytes(plan, topk=topk) - usable
            if excess <= 0:
                return plan
            plan = self._plan(num_tokens, plan.peak_bytes - excess, topk)
        raise ValueError(f"no plan of {num_tokens} tokens keeps the shared q buffer within {budget_bytes} bytes")

    def _plan(self, num_tokens: int, budget_bytes: int, topk: int | None) -> mla_planner.MixedBatchPlan:
        return mla_planner.plan_mixed_batch(
            num_tokens,
            num_heads=self.num_heads,
            budget_bytes=budget_bytes,
            arch=self.arch,
            num_sms=self.num_sms,
            topk=topk,
            out_preallocated=self.writes_in_place,
            translated_indices=self.translates_indices,
            align_waves=self.align_waves,
        )

    def predicted_peak_bytes(self, plan: mla_planner.MixedBatchPlan, *, topk: int | None = None) -> int:
        """What :meth:`run` allocates at its peak, from the planner's per-buffer bytes: the
        kernel's buffers of each launch plus the padded-q buffer of the *longest* launch, held
        throughout. Equal to ``plan.peak_bytes`` unless the launch lengths differ by more than
        one token below 133 tokens."""
        if not plan.distinct_lengths:
            return 0
        scratch = [
            mla_planner.decode_scratch(1, n, self.num_heads, arch=self.arch, num_sms=self.num_sms, topk=topk,
                                       out_preallocated=self.writes_in_place, translated_indices=self.translates_indices)
            for n in plan.distinct_lengths
        ]
        held_q = scratch[plan.distinct_lengths.index(max(plan.distinct_lengths))].buffers.get("q_padded", 0)
        return held_q + max(s.total_bytes - s.buffers.get("q_padded", 0) for s in scratch)

    def run(
        self,
        plan: mla_planner.MixedBatchPlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: IndexSource,
        out: torch.Tensor,
        *,
        schedules: dict[int, Any] | None = None,
    ) -> None:
        """Attend q ``(T, H, 576)`` over kv_cache ``(pages, page_size, 1, 656)`` uint8 at indices
        ``(T, topk)`` int32 slots (``-1`` unused), writing out ``(T, H, 512)``. With
        ``translates_indices``, ``indices`` is a function from a launch's row slice to its slots.
        ``schedules`` (launch length -> FlashMLA schedule) is filled and reused when given."""
        if callable(indices) != self.translates_indices:
            raise ValueError("indices must be a function of a row slice exactly when the executor translates indices")
        self._check(plan, q, kv_cache, None if callable(indices) else indices, out)
        if len(plan) == 0:
            return
        lengths = plan.chunks[:, 1] - plan.chunks[:, 0]
        q_padded = None
        if self.kernel_heads != self.num_heads:
            q_padded = q.new_zeros((1, int(lengths.max()), self.kernel_heads, D_QK))
        if schedules is None:
            schedules = {}
        for start, end in plan.chunks.tolist():
            length = end - start
            if length not in schedules:
                schedules[length] = self.provider.new_decode_schedule()
            self._launch(slice(start, end), q, q_padded, kv_cache, indices, out, schedules[length])

    def _launch(
        self,
        rows: slice,
        q: torch.Tensor,
        q_padded: torch.Tensor | None,
        kv_cache: torch.Tensor,
        indices: IndexSource,
        out: torch.Tensor,
        schedule: Any,
    ) -> None:
        # A function of its own so the kernel's out and lse (and translated indices) die on
        # return, before the next launch allocates its own: holding them would raise the peak.
        if q_padded is None:
            q_kernel = q[rows].unsqueeze(0)
        else:
            q_kernel = q_padded[:, : rows.stop - rows.start]
            q_kernel[0, :, : self.num_heads].copy_(q[rows])
        idx = (indices(rows) if callable(indices) else indices[rows]).unsqueeze(0)
        if self.writes_in_place:
            self.provider.sparse_decode(q_kernel, kv_cache, idx, schedule, self.softmax_scale, out=out[rows].unsqueeze(0))
        else:
            o, _lse = self.provider.sparse_decode(q_kernel, kv_cache, idx, schedule, self.softmax_scale)
            out[rows].copy_(o[0, :, : self.num_heads])

    def _check(
        self,
        plan: mla_planner.MixedBatchPlan,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        t = q.shape[0]
        if q.shape != (t, self.num_heads, D_QK) or not q.is_contiguous():
            raise ValueError(f"q must be contiguous ({t}, {self.num_heads}, {D_QK}), got {tuple(q.shape)}")
        if out.shape != (t, self.num_heads, D_V) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous ({t}, {self.num_heads}, {D_V}) {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        if indices is not None and (indices.dim() != 2 or indices.shape[0] != t or indices.dtype != torch.int32 or not indices.is_contiguous()):
            raise ValueError(f"indices must be contiguous ({t}, topk) int32, got {tuple(indices.shape)} {indices.dtype}")
        if kv_cache.dim() != 4 or kv_cache.shape[2:] != (1, FP8_BYTES_PER_TOKEN) or kv_cache.dtype != torch.uint8:
            raise ValueError(f"kv_cache must be (pages, page_size, 1, {FP8_BYTES_PER_TOKEN}) uint8, got {tuple(kv_cache.shape)}")
        chunks = plan.chunks
        covered = (int(chunks[0, 0]), int(chunks[-1, 1])) if len(chunks) else (0, 0)
        if covered != (0, t):
            raise ValueError(f"the plan covers tokens [{covered[0]}, {covered[1]}), the batch has {t}")
