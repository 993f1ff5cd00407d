"""Execute a separate-route FP8 step plan: the decodes through the FlashMLA sparse decode kernel,
then, gather chunk by gather chunk, the chunk's FP8 cache rows gathered to BF16 and its prefill
launches through the BF16 sparse prefill kernel. One kernel call per planned launch, every call
through a :class:`~mla_planner.executor.KernelProvider`; nothing here decides a launch boundary.

Memory, as the plan's ``launch_bytes`` count it:

* decode launches -- ``batch`` requests of ``decode_query_len`` tokens each, run as
  ``(batch, s_q)``; where heads need padding (16 -> 64), the zero-padded q and the kernel's output
  go in the caller's buffers (vLLM's workspace views, where the release has them), or are allocated per launch;
* prefill launches -- one zero-padded q and one kernel output for the plan's longest prefill
  launch, reused by every launch (in the caller's buffers where given); none where the kernel
  runs the query heads themselves and writes the step's output in place;
* the kernels' own accumulators, LSE and softmax statistics, and the translated indices of one
  launch at a time.

The caller's buffers are shared by both kinds of launch where both run the same heads (they run one
after the other: every launch writes its real heads, the padded heads are zeroed once per run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

import mla_planner
from mla_planner.executor.layout import D_QK, D_V
from mla_planner.executor.buffers import Buffers
from mla_planner.executor.providers import KernelProvider

Translate = Callable[[slice], tuple[torch.Tensor, "torch.Tensor | None"]]
"""A launch's rows of request-relative top-k positions -> their kernel indices (cache slots for
decode rows, rows of the chunk's gather workspace for prefill rows) and, for prefill rows, each
row's count of valid indices."""


class GatherChunk(Protocol):
    """One gather chunk as vLLM's separate-route metadata describes it."""

    block_table: torch.Tensor
    workspace_starts: torch.Tensor
    chunk_tot_seqlen: int


@dataclasses.dataclass(frozen=True)
class SeparateLaunches:
    """A separate-route plan's launches as the executor walks them, derived from the plan once per
    step (plain Python values: a layer's run reads no plan array)."""

    decodes: tuple[tuple[slice, int], ...]
    """Each decode launch's rows and requests."""
    prefills: tuple[tuple[slice, int], ...]
    """Each prefill launch's rows and gather chunk."""
    decode_query_len: int
    longest_decode: int
    longest_prefill: int
    prefill_heads: int
    """The heads the prefill kernel runs: vLLM's padding, or the query heads of a native plan."""
    prefill_in_place: bool

    @classmethod
    def of(cls, plan: mla_planner.StepPlan, launches: Sequence[mla_planner.Launch] | None = None) -> SeparateLaunches:
        """``launches``: the plan's, where the caller already iterated it."""
        if plan.mode != "separate_prefill_decode":
            raise ValueError(f"a separate-route executor runs separate_prefill_decode plans, got a {plan.mode} plan")
        s_q = plan.decode_query_len
        decodes, prefills = [], []
        for launch in plan if launches is None else launches:
            rows = launch.tokens
            if launch.kernel == "sparse_decode":
                decodes.append((rows, (rows.stop - rows.start) // s_q))
            else:
                assert launch.gather_chunk is not None, "a separate-route prefill launch reads a gather chunk"
                prefills.append((rows, launch.gather_chunk))
        return cls(tuple(decodes), tuple(prefills), s_q, plan.longest_launch("sparse_decode"),
                   plan.longest_launch("sparse_prefill"), plan.prefill_heads, plan.prefill_writes_in_place)


def rows_of(buffer: torch.Tensor | None, rows: int, heads: int, width: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The first ``rows`` rows of ``buffer`` where it is ``(>= rows, heads, width)`` of ``dtype``."""
    if buffer is None or buffer.dtype != dtype or tuple(buffer.shape[1:]) != (heads, width) or buffer.shape[0] < rows:
        return None
    return buffer[:rows]


class SeparateExecutor:
    def __init__(self, provider: KernelProvider, config: mla_planner.StepConfig) -> None:
        self.provider = provider
        self.num_heads = config.num_heads
        self.decode_heads = config.decode_heads
        self.decode_in_place = config.decode_writes_in_place

    def run(
        self,
        launches: SeparateLaunches,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        translate: Translate,
        chunks: Sequence[GatherChunk],
        gather_workspace: torch.Tensor,
        out: torch.Tensor,
        *,
        schedules: dict[Any, Any],
        buffers: Buffers = Buffers(),
        softmax_scale: float,
        gather_cache: torch.Tensor | None = None,
    ) -> None:
        """q ``(T, H, 576)``; kv_cache ``(pages, 64, 1, 656)`` uint8 (the kernels' page view);
        ``chunks``: the step's gather chunks, which the plan's prefill launches name by index;
        ``gather_workspace`` ``(>= rows of the largest chunk, 576)`` BF16; out ``(T, H, 512)``.
        ``schedules`` holds FlashMLA's decode schedules by launch shape, shared by the step's layers.
        ``gather_cache``: the cache as its blocks are allocated, ``(blocks, block size, ...)``, where
        a block spans several pages (default: kv_cache): the gather reads the chunks' block tables,
        whose ids are of blocks, and takes the block size from the cache's second dimension."""
        # Decode launches pad in the caller's buffers, or each in its own (the plan counts each
        # launch's own); prefill launches share one pair for the longest (the plan holds those).
        decode_buffers = self.callers(buffers, launches.longest_decode, self.decode_heads, q)
        for rows, batch in launches.decodes:
            self.decode(q, rows, batch, kv_cache, translate, out, softmax_scale, schedules, *decode_buffers)
        del decode_buffers
        prefill_buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if launches.prefills and not launches.prefill_in_place:
            prefill_buffers = self.callers(buffers, launches.longest_prefill, launches.prefill_heads, q)
            if prefill_buffers[0] is None or prefill_buffers[1] is None:
                prefill_buffers = (q.new_zeros((launches.longest_prefill, launches.prefill_heads, D_QK)),
                                   q.new_empty((launches.longest_prefill, launches.prefill_heads, D_V)))
        gathered = -1
        for rows, chunk_index in launches.prefills:
            chunk = chunks[chunk_index]
            workspace = gather_workspace[: chunk.chunk_tot_seqlen]
            if chunk_index != gathered:
                self.provider.gather_upconvert(kv_cache if gather_cache is None else gather_cache, workspace,
                                               chunk.block_table, chunk.workspace_starts, len(chunk.block_table))
                gathered = chunk_index
            self.prefill(q, rows, launches, workspace, translate, out, softmax_scale, *prefill_buffers)

    def callers(self, buffers: Buffers, rows: int, heads: int,
                q: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The caller's padded q ``(rows, heads, 576)`` (padded heads zeroed: launches write the real
        ones) and kernel output ``(rows, heads, 512)``, both or neither, where they fit."""
        q_padded = rows_of(buffers.q_padded, rows, heads, D_QK, q.dtype)
        kernel_out = rows_of(buffers.kernel_out, rows, heads, D_V, q.dtype)
        if q_padded is None or kernel_out is None:
            return None, None
        q_padded[:, self.num_heads :].zero_()
        return q_padded, kernel_out

    def decode(self, q: torch.Tensor, rows: slice, batch: int, kv_cache: torch.Tensor, translate: Translate,
               out: torch.Tensor, softmax_scale: float, schedules: dict[Any, Any], q_padded: torch.Tensor | None,
               kernel_out: torch.Tensor | None) -> None:
        """One decode launch: ``batch`` requests of equal query length. A function of its own so the
        kernel's accumulators and the launch's indices die on return, before the next launch."""
        n = rows.stop - rows.start
        s_q = n // batch
        slots = translate(rows)[0].view(batch, s_q, -1)
        schedule = schedules.setdefault(("decode", batch, s_q), self.provider.new_decode_schedule())
        if self.decode_in_place:
            self.provider.sparse_decode(q[rows].view(batch, s_q, self.num_heads, D_QK), kv_cache, slots, schedule,
                                        softmax_scale, out=out[rows].view(batch, s_q, self.num_heads, D_V))
            return
        heads = self.decode_heads
        if q_padded is None or kernel_out is None:  # this launch's own, as the plan counts them
            q_padded, kernel_out = q.new_zeros((n, heads, D_QK)), q.new_empty((n, heads, D_V))
        q_kernel = q_padded[:n]
        q_kernel[:, : self.num_heads].copy_(q[rows])
        o = kernel_out[:n].view(batch, s_q, heads, D_V)
        if self.provider.decode_takes_out:
            self.provider.sparse_decode(q_kernel.view(batch, s_q, heads, D_QK), kv_cache, slots, schedule,
                                        softmax_scale, out=o)
        else:
            o, _lse = self.provider.sparse_decode(q_kernel.view(batch, s_q, heads, D_QK), kv_cache, slots, schedule,
                                                  softmax_scale)
        out[rows].copy_(o.reshape(n, heads, D_V)[:, : self.num_heads])

    def prefill(self, q: torch.Tensor, rows: slice, launches: SeparateLaunches, workspace: torch.Tensor,
                translate: Translate, out: torch.Tensor, softmax_scale: float, q_padded: torch.Tensor | None,
                kernel_out: torch.Tensor | None) -> None:
        """One prefill launch over its chunk's gathered rows."""
        n = rows.stop - rows.start
        indices, lengths = translate(rows)
        kv = workspace.view(-1, 1, workspace.shape[-1])
        idx = indices.view(n, 1, -1)
        if launches.prefill_in_place:  # the kernel runs the query heads: straight into the output
            self.provider.sparse_prefill(q[rows], kv, idx, softmax_scale, out=out[rows], topk_length=lengths)
            return
        assert q_padded is not None and kernel_out is not None
        q_kernel = q_padded[:n]
        q_kernel[:, : self.num_heads].copy_(q[rows])
        o = kernel_out[:n]
        if self.provider.prefill_takes_out:
            self.provider.sparse_prefill(q_kernel, kv, idx, softmax_scale, out=o, topk_length=lengths)
        else:
            o, _lse = self.provider.sparse_prefill(q_kernel, kv, idx, softmax_scale, topk_length=lengths)
        out[rows].copy_(o[:, : self.num_heads])
