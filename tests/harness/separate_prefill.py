"""Execute the FP8 separate path's prefill by the planner's gather chunks
(``mla_planner.plan_gather_chunks``): gather and up-convert each chunk's KV rows into a BF16
workspace (the calibration's torch gather, ``mla_planner.executor.reference.gather_upconvert``),
then run the BF16 sparse prefill kernel on the chunk's query tokens. The GPU tests check the
kernels' accuracy on split requests with it; the vLLM backend runs its own separate route.

A chunk row is ``[req_start, req_end, query_start, query_end, key_start, key_end, rows]``:

* whole requests (the four middle columns ``-1``): their rows laid end to end in the workspace;
* one piece of a request too long for the workspace: its queries ``[query_start, query_end)``
  (relative to the request's first new token) against the key window ``[key_start, key_end)``
  of request positions. Consecutive rows with the same query piece cover its keys window by
  window and are merged by log-sum-exp (:mod:`.lse_merge`).

Top-k indices are request positions (``0 .. context + query - 1``, ``-1`` unused), as the
indexer produces them, and causal: a query at position ``p`` only names keys ``<= p``.

Memory: the workspace is sized by the largest chunk (``gather_workspace_bytes``); the padded-q
buffer (zeroed once) and the workspace-index buffer ``(tokens, topk)`` int32 by the chunk with
the most query tokens; the kernel allocates ``out`` (unless written in place), ``max_logits`` and
``lse`` per launch -- ``prefill_scratch`` predicts those and ``q_padded``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

import mla_planner
from mla_planner.executor.reference import gather_upconvert
from mla_planner.executor.layout import D_QK, D_V
from mla_planner.executor.providers import KernelProvider

from .lse_merge import merge_window, start_merge

IntArray = npt.NDArray[np.int64]
TRANSLATE_BLOCK_TOKENS = 1024
"""Query tokens :func:`to_workspace_indices` translates at a time: three bool masks of
``tokens x topk``, 6 MiB at topk 2048."""


def to_workspace_indices(positions: torch.Tensor, key_start: int, key_end: int, row_offset: int, out: torch.Tensor) -> None:
    """Translate request positions ``(s, topk)`` to workspace rows, in place into ``out``: a
    position in ``[key_start, key_end)`` lands on row ``position - key_start + row_offset``;
    anything else (``-1``, or a key outside this window) becomes ``-1``."""
    for start in range(0, positions.shape[0], TRANSLATE_BLOCK_TOKENS):
        src = positions[start : start + TRANSLATE_BLOCK_TOKENS]
        outside = (src < key_start) | (src >= key_end)
        dst = out[start : start + src.shape[0]]
        dst.copy_(src).add_(row_offset - key_start).masked_fill_(outside, -1)


@dataclass(frozen=True)
class Window:
    """One launch: query tokens ``tokens`` (rows of the step's prefill q) against workspace rows
    gathered from ``(request, key_start, key_end)`` pieces laid end to end."""

    tokens: slice
    pieces: tuple[tuple[int, int, int], ...]
    rows: int


@dataclass(frozen=True)
class QueryLaunch:
    """Windows that share one query range: one window writes out directly; several merge."""

    tokens: slice
    windows: tuple[Window, ...]


def launches(chunks: IntArray, query_lens: IntArray, context_lens: IntArray) -> Iterator[QueryLaunch]:
    """Group a gather-chunk plan into launches over global query-token rows."""
    query_starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    i = 0
    while i < len(chunks):
        req_start, req_end, q_start, q_end = (int(v) for v in chunks[i, :4])
        if q_start < 0:
            pieces = tuple(
                (r, 0, int(context_lens[r] + query_lens[r])) for r in range(req_start, req_end)
            )
            tokens = slice(int(query_starts[req_start]), int(query_starts[req_end]))
            yield QueryLaunch(tokens, (Window(tokens, pieces, int(chunks[i, 6])),))
            i += 1
            continue
        base = int(query_starts[req_start])
        tokens = slice(base + q_start, base + q_end)
        windows = []
        while i < len(chunks) and tuple(int(v) for v in chunks[i, :4]) == (req_start, req_end, q_start, q_end):
            key_start, key_end = int(chunks[i, 4]), int(chunks[i, 5])
            windows.append(Window(tokens, ((req_start, key_start, key_end),), key_end - key_start))
            i += 1
        yield QueryLaunch(tokens, tuple(windows))


class SeparatePrefillExecutor:
    def __init__(
        self,
        provider: KernelProvider,
        num_heads: int,
        *,
        softmax_scale: float = D_QK**-0.5,
        arch: str = "sm90",
    ) -> None:
        self.provider = provider
        self.num_heads = num_heads
        self.kernel_heads = mla_planner.padded_heads(num_heads, kernel="sparse_prefill", arch=arch)
        self.softmax_scale = softmax_scale
        self.arch = arch

    def plan(self, query_lens: npt.ArrayLike, context_lens: npt.ArrayLike, workspace_rows: int) -> IntArray:
        return mla_planner.plan_gather_chunks(query_lens, context_lens, workspace_rows)

    def predicted_peak_bytes(
        self, chunks: IntArray, query_lens: npt.ArrayLike, context_lens: npt.ArrayLike, *, topk: int | None = None
    ) -> int:
        """The planner's bytes for this run: the workspace of the largest chunk, the largest
        launch's ``prefill_scratch`` and the workspace-index buffer of the longest launch (held for
        the run; the planner's ``workspace_indices``). Not included (see docs/executor.md): the
        bounded gather/translate temporaries and the merge's."""
        qlens, clens = np.asarray(query_lens, np.int64), np.asarray(context_lens, np.int64)
        scratch = held_indices = 0
        for launch in launches(chunks, qlens, clens):
            in_place = self._writes_in_place(launch)
            tokens = launch.tokens.stop - launch.tokens.start
            launch_scratch = mla_planner.prefill_scratch(
                tokens, self.num_heads, arch=self.arch, topk=topk, out_preallocated=in_place, translated_indices=True
            )
            held_indices = max(held_indices, launch_scratch.buffers["workspace_indices"])
            scratch = max(scratch, launch_scratch.total_bytes - launch_scratch.buffers["workspace_indices"]
                          - launch_scratch.buffers["topk_length"])
        return mla_planner.gather_workspace_bytes(int(chunks[:, 6].max())) + held_indices + scratch

    def _writes_in_place(self, launch: QueryLaunch) -> bool:
        return self.provider.prefill_takes_out and self.num_heads == self.kernel_heads and len(launch.windows) == 1

    def run(
        self,
        chunks: IntArray,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_lens: npt.ArrayLike,
        context_lens: npt.ArrayLike,
        indices: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """q ``(T, H, 576)`` (the prefill requests' new tokens, request by request); kv_cache
        ``(pages, page_size, 1, 656)`` uint8; block_table ``(requests, max_pages)`` int32;
        indices ``(T, topk)`` int32 request positions; out ``(T, H, 512)``. ``workspace``
        ``(>= max rows, 576)`` BF16, allocated here when not given."""
        qlens, clens = np.asarray(query_lens, np.int64), np.asarray(context_lens, np.int64)
        t = int(qlens.sum())
        if q.shape != (t, self.num_heads, D_QK) or out.shape != (t, self.num_heads, D_V) or indices.shape[0] != t:
            raise ValueError(f"q, out and indices must have {t} token rows and {self.num_heads} heads")
        if len(chunks) == 0:
            return
        plan = list(launches(chunks, qlens, clens))
        max_rows = int(chunks[:, 6].max())
        max_tokens = max(launch.tokens.stop - launch.tokens.start for launch in plan)
        if workspace is None:
            workspace = torch.empty((max_rows, D_QK), dtype=torch.bfloat16, device=q.device)
        elif workspace.shape[0] < max_rows or workspace.shape[1:] != (D_QK,) or workspace.dtype != torch.bfloat16:
            raise ValueError(f"workspace must be (>= {max_rows}, {D_QK}) bfloat16, got {tuple(workspace.shape)} {workspace.dtype}")
        q_padded = None
        if self.kernel_heads != self.num_heads:
            q_padded = q.new_zeros((max_tokens, self.kernel_heads, D_QK))
        kernel_indices = torch.empty((max_tokens, indices.shape[1]), dtype=torch.int32, device=q.device)
        query_starts = np.concatenate([[0], np.cumsum(qlens)])

        for launch in plan:
            q_kernel = q[launch.tokens]
            if q_padded is not None:
                q_kernel = q_padded[: q_kernel.shape[0]]
                q_kernel[:, : self.num_heads].copy_(q[launch.tokens])
            target = out[launch.tokens]
            if len(launch.windows) == 1:
                self._window(launch.windows[0], q_kernel, kv_cache, block_table, indices, query_starts, workspace,
                             kernel_indices, target, in_place=self._writes_in_place(launch))
                continue
            lse = start_merge(target)
            for window in launch.windows:
                self._window(window, q_kernel, kv_cache, block_table, indices, query_starts, workspace,
                             kernel_indices, target, in_place=False, merge_lse=lse)

    def _window(
        self,
        window: Window,
        q_kernel: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        indices: torch.Tensor,
        query_starts: IntArray,
        workspace: torch.Tensor,
        kernel_indices: torch.Tensor,
        target: torch.Tensor,
        *,
        in_place: bool,
        merge_lse: torch.Tensor | None = None,
    ) -> None:
        # Gather the window's rows and translate each request's indices to them. The kernel's
        # outputs are locals, so they are freed before the next window allocates its own.
        s = window.tokens.stop - window.tokens.start
        row = 0
        for request, key_start, key_end in window.pieces:
            gather_upconvert(kv_cache, block_table[request], key_start, key_end, workspace[row : row + key_end - key_start])
            first = max(int(query_starts[request]), window.tokens.start)
            last = min(int(query_starts[request + 1]), window.tokens.stop)
            to_workspace_indices(indices[first:last], key_start, key_end, row,
                                 kernel_indices[first - window.tokens.start : last - window.tokens.start])
            row += key_end - key_start
        kv = workspace[:row].unsqueeze(1)
        idx = kernel_indices[:s].unsqueeze(1)
        if in_place:
            self.provider.sparse_prefill(q_kernel, kv, idx, self.softmax_scale, out=target)
            return
        o, lse = self.provider.sparse_prefill(q_kernel, kv, idx, self.softmax_scale)
        if merge_lse is None:
            target.copy_(o[:, : self.num_heads])
        else:
            merge_window(target, merge_lse, o[:, : self.num_heads], lse[:, : self.num_heads])
