"""Execute a mixed-batch FP8 step plan: every sparse token of a step through the FlashMLA sparse
decode kernel as ``b = 1, s_q = launch length``, one kernel call per planned launch.

The plan is :func:`mla_planner.plan_step`'s under the executor's :class:`~mla_planner.StepConfig`;
memory, launch by launch, is what the plan's ``launch_bytes`` says:

* ``q_padded`` -- when heads need padding (16 -> 64), one zeroed buffer sized for the plan's
  longest launch, allocated once per run and reused: each launch writes its real heads into a
  prefix view, the padded heads stay zero.
* ``o_accum``, ``lse_accum``, ``lse`` -- the kernel's, freed when the launch returns.
* ``out`` -- absent when the kernel writes straight into the caller's output (it takes ``out=``
  and sees no head padding); otherwise the kernel allocates it and its real heads are copied.
* ``slot_indices`` -- only when the configuration translates indices per launch: the caller
  passes a function that turns a launch's rows of request-relative top-k positions into cache
  slots in a fresh tensor (vLLM's Triton conversion), so they exist for one launch at a time.

A caller that already holds memory for the padded q and the kernel's padded output (vLLM's
workspace views, where the release has them) passes it as :class:`.buffers.Buffers`, as it does to
the separate route's executor: nothing is allocated for them then.
A caller that passes no ``out`` gets, for a plan of one launch whose heads are padded or whose
kernel allocates its output, the kernel's output itself (its real heads, as stock's call returns
it: a view, strided where heads are padded), so a step the plan runs whole costs no copy and no
second output; otherwise a new ``out``.

Plus one FlashMLA schedule per distinct launch length: a schedule may only be reused by calls of
the same shape; pass ``schedules`` to share them across calls with the same plan (vLLM's layers of
one step). A caller that runs one plan on several layers derives its :class:`Launches` once and
hands them to :meth:`MixedBatchExecutor.run` on each layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

import mla_planner
from mla_planner.executor.layout import D_QK, D_V, FP8_BYTES_PER_TOKEN
from mla_planner.executor.buffers import Buffers
from mla_planner.executor.providers import KernelProvider

IndexSource = torch.Tensor | Callable[[slice], torch.Tensor]
"""Top-k cache slots ``(T, topk)`` int32, or a function giving a launch's rows of them."""


@dataclasses.dataclass(frozen=True)
class Launches:
    """A mixed-batch plan's launches as the executor walks them: each launch's rows, in order, and
    the longest launch (what the padded q is sized for). Plain Python values, derived from the
    plan once, so a run reads no plan array."""

    rows: tuple[slice, ...]
    longest: int

    @classmethod
    def of(cls, plan: mla_planner.StepPlan, launches: Sequence[mla_planner.Launch] | None = None) -> Launches:
        """``launches``: the plan's, where the caller already iterated it."""
        if plan.mode != "mixed_batch":
            raise ValueError(f"a mixed-batch executor runs mixed_batch plans, got a {plan.mode} plan")
        return cls(tuple(launch.tokens for launch in (plan if launches is None else launches)),
                   plan.longest_launch("sparse_decode"))

    @property
    def covered(self) -> tuple[int, int]:
        """The token range the launches cover, ``(0, 0)`` for none."""
        return (self.rows[0].start, self.rows[-1].stop) if self.rows else (0, 0)


class MixedBatchExecutor:
    def __init__(self, provider: KernelProvider, config: mla_planner.StepConfig, *, softmax_scale: float = D_QK**-0.5) -> None:
        if config.decode_takes_out and not provider.decode_takes_out:
            raise ValueError("the configuration says the decode kernel takes out=, this provider's does not: "
                             "build the StepConfig with decode_takes_out=provider.decode_takes_out")
        self.provider = provider
        self.config = config.replace(mode="mixed_batch") if config.kv_dtype == "fp8" else config
        self.num_heads = config.num_heads
        self.kernel_heads = config.decode_heads
        self.softmax_scale = softmax_scale

    @property
    def writes_in_place(self) -> bool:
        """The kernel writes the caller's output directly."""
        return self.config.decode_writes_in_place

    @property
    def translates_indices(self) -> bool:
        return self.config.translated_indices

    @property
    def pads_heads(self) -> bool:
        """The kernel runs more heads than the layer has (16 -> 64): launches pad q, and take the
        kernel's padded output."""
        return self.kernel_heads != self.num_heads

    def writes_out(self, launches: Launches) -> bool:
        """Whether a run of ``launches`` writes a step output (several launches, or a kernel that
        writes in place); otherwise, run without ``out``, it returns the kernel's own."""
        return len(launches.rows) != 1 or self.writes_in_place

    def run(
        self,
        launches: Launches,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: IndexSource,
        out: torch.Tensor | None = None,
        *,
        schedules: dict[int, Any] | None = None,
        buffers: Buffers = Buffers(),
        softmax_scale: float | None = None,
    ) -> torch.Tensor:
        """Attend q ``(T, H, 576)`` over kv_cache ``(pages, page_size, 1, 656)`` uint8 at indices
        ``(T, topk)`` int32 slots (``-1`` unused), launch by launch as ``launches``
        (``Launches.of(plan)``, derived once by a caller that runs the plan on several layers),
        writing out ``(T, H, 512)``. With ``translates_indices``, ``indices`` is a function from a
        launch's row slice to its slots. ``schedules`` (launch length -> FlashMLA schedule) is
        filled and reused when given. ``buffers``: the caller's memory for the padded q and the
        kernel's output. ``softmax_scale``: the layer's (default: the executor's). Returns the
        output: ``out``, or without it the kernel's own for one launch (see the module's doc), a
        new tensor otherwise."""
        if callable(indices) != self.translates_indices:
            raise ValueError("indices must be a function of a row slice exactly when the executor translates indices")
        self._check(launches, q, kv_cache, None if callable(indices) else indices, out)
        if out is None and self.writes_out(launches):
            out = q.new_empty((q.shape[0], self.num_heads, D_V))
        if not launches.rows:
            assert out is not None
            return out
        q_padded = kernel_out = None
        if self.pads_heads:
            longest = launches.longest
            q_padded = self._buffer(buffers.q_padded, longest, D_QK, q)
            if q_padded is None:
                q_padded = q.new_zeros((1, longest, self.kernel_heads, D_QK))
            else:
                q_padded[:, :, self.num_heads :].zero_()  # launches write only the real heads
            if not self.writes_in_place and self.provider.decode_takes_out:
                kernel_out = self._buffer(buffers.kernel_out, longest, D_V, q)
        if schedules is None:
            schedules = {}
        scale = self.softmax_scale if softmax_scale is None else softmax_scale
        for rows in launches.rows:
            length = rows.stop - rows.start
            if length not in schedules:
                schedules[length] = self.provider.new_decode_schedule()
            result = self._launch(rows, q, q_padded, kv_cache, indices, out, schedules[length], scale, kernel_out)
        return result

    def _buffer(self, buffer: torch.Tensor | None, rows: int, width: int, q: torch.Tensor) -> torch.Tensor | None:
        """``(1, rows, kernel heads, width)`` of ``buffer`` where it is a contiguous ``(>= rows,
        kernel heads, width)`` of q's dtype; ``None`` otherwise (the run allocates its own)."""
        if (buffer is None or buffer.dim() != 3 or buffer.shape[0] < rows
                or tuple(buffer.shape[1:]) != (self.kernel_heads, width) or buffer.dtype != q.dtype
                or not buffer.is_contiguous()):
            return None
        return (buffer if buffer.shape[0] == rows else buffer[:rows]).unsqueeze(0)

    def _launch(
        self,
        rows: slice,
        q: torch.Tensor,
        q_padded: torch.Tensor | None,
        kv_cache: torch.Tensor,
        indices: IndexSource,
        out: torch.Tensor | None,
        schedule: Any,
        softmax_scale: float,
        kernel_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One launch: its rows of ``out``, or without ``out`` (a plan of one launch) the kernel's
        output of the real heads, which it returns; ``out`` otherwise."""
        # A function of its own so the kernel's out and lse (and translated indices) die on
        # return, before the next launch allocates its own: holding them would raise the peak.
        # Whole tensors are taken as they are, not sliced: each slice costs the host a dispatch.
        n = rows.stop - rows.start
        q_rows = q if n == q.shape[0] else q[rows]
        if q_padded is None:
            q_kernel = q_rows.unsqueeze(0)
        else:
            q_kernel = q_padded if n == q_padded.shape[1] else q_padded[:, :n]
            q_kernel[0, :, : self.num_heads].copy_(q_rows)
        idx = (indices(rows) if callable(indices) else indices[rows]).unsqueeze(0)
        if self.writes_in_place:
            assert out is not None
            self.provider.sparse_decode(q_kernel, kv_cache, idx, schedule, softmax_scale, out=out[rows].unsqueeze(0))
            return out
        if kernel_out is not None:
            o = kernel_out if n == kernel_out.shape[1] else kernel_out[:, :n]
            self.provider.sparse_decode(q_kernel, kv_cache, idx, schedule, softmax_scale, out=o)
        else:
            o, _lse = self.provider.sparse_decode(q_kernel, kv_cache, idx, schedule, softmax_scale)
        if out is None:
            return o[0, :, : self.num_heads]
        out[rows].copy_(o[0, :, : self.num_heads])
        return out

    def _check(
        self,
        launches: Launches,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> None:
        t = q.shape[0]
        if q.shape != (t, self.num_heads, D_QK) or not q.is_contiguous():
            raise ValueError(f"q must be contiguous ({t}, {self.num_heads}, {D_QK}), got {tuple(q.shape)}")
        if out is not None and (out.shape != (t, self.num_heads, D_V) or out.dtype != q.dtype or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous ({t}, {self.num_heads}, {D_V}) {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        if indices is not None and (indices.dim() != 2 or indices.shape[0] != t or indices.dtype != torch.int32 or not indices.is_contiguous()):
            raise ValueError(f"indices must be contiguous ({t}, topk) int32, got {tuple(indices.shape)} {indices.dtype}")
        if kv_cache.dim() != 4 or kv_cache.shape[2:] != (1, FP8_BYTES_PER_TOKEN) or kv_cache.dtype != torch.uint8:
            raise ValueError(f"kv_cache must be (pages, page_size, 1, {FP8_BYTES_PER_TOKEN}) uint8, got {tuple(kv_cache.shape)}")
        covered = launches.covered
        if covered != (0, t):
            raise ValueError(f"the plan covers tokens [{covered[0]}, {covered[1]}), the batch has {t}")
