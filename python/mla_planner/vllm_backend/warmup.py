"""Compile, at engine start, the variants of vLLM's Triton index translation
(``triton_convert_req_index_to_global_index``) that planned launches use and vLLM never compiles.

Triton compiles a kernel once per specialization of its arguments: besides the compile-time flags
(prefill workspace, valid counts) it specializes every pointer on 16-byte alignment. Stock
translates a step's rows in one call from row 0, an aligned pointer, and at fewer than 32 heads
per rank (the mixed-batch route) never with the prefill workspace. Planned launches translate
their own rows: a launch after the first starts where the previous one ended (three decodes put
the first prefill launch at row 3, an int32 pointer 12 bytes off), and the separate route -- which
a cost profile may choose at 16 heads -- translates with the prefill workspace and valid counts.
vLLM's kernel warm-up (``model_executor/warmup/``) compiles no unaligned variant of the
translation, and vLLM compiles its
own in the first forward that uses it; the planned variants would compile in the middle of
serving, at the first step that needs each, stalling every request in flight.

So each engine's first FP8 forward -- vLLM's CUDA-graph warm-up runs at start, or the first step
under ``--enforce-eager`` -- translates one row with each variant the engine's routes use, on fresh
tensors shaped like the call's: the block table's width, the block size and the cache's block
stride are compile-time constants or specialized integers. Never inside a CUDA graph capture,
which would record the warm-up into the graph. Once per engine, not per process: a second engine
may have another block size or top-k, which Triton compiles apart (where it has the same, Triton's
cache makes its warm-up a lookup).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable

import torch

from mla_planner.vllm_backend.releases import release
from mla_planner.vllm_backend.log import logger


def variants(routes: Iterable[str]) -> list[tuple[bool, int]]:
    """``(with the prefill workspace, first row)`` of each translation the routes use beyond
    stock's: row 1 stands for every launch whose first row is not a multiple of four (its int32
    request ids start off 16-byte alignment)."""
    routes = set(routes)
    out: list[tuple[bool, int]] = []
    if "mixed_batch" in routes:
        out.append((False, 1))
    if "separate_prefill_decode" in routes:
        out += [(True, 0), (True, 1)]
    return out


class WarmUp:
    """One engine's warm-up: :attr:`pending` until its first FP8 forward outside a capture."""

    def __init__(self) -> None:
        self.pending = True

    def maybe(self, routes: Collection[str], block_table: torch.Tensor, block_size: int,
              block_stride_rows: int | None, topk: int) -> None:
        """:func:`warm_up` the variants of ``routes`` (the engine's FP8 routes where it plans steps,
        none where it does not) on the block table's device, once; nothing off CUDA (no Triton
        there: the CPU tests), nothing while a graph is captured (the next forward tries again)."""
        if not self.pending:
            return
        if block_table.device.type != "cuda":
            self.pending = False
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self.pending = False
        todo = variants(routes)
        if not todo:
            return
        start = time.perf_counter()
        warm_up(todo, block_table, block_size, block_stride_rows, topk)
        # Once per engine, with its cost: a start-up compile to see in the log (and on the first
        # CUDA-graph capture's progress bar), not a stall in the middle of serving.
        logger.info("mla-planner: %d variants of vLLM's Triton index translation compiled (or loaded from Triton's "
                    "cache) in %.0f ms for routes %s", len(todo), (time.perf_counter() - start) * 1e3,
                    ", ".join(sorted(routes)))


def warm_up(variants: list[tuple[bool, int]], block_table: torch.Tensor, block_size: int,
            block_stride_rows: int | None, topk: int) -> None:
    """Translate one row with each variant: no valid position (every top-k entry -1) and, with
    the workspace, a decode row (request id -1), so nothing is read through the block table or
    the workspace starts; the outputs are dropped."""
    device = block_table.device
    request_ids = torch.zeros(2, dtype=torch.int32, device=device)  # a fresh allocation: row 0 is aligned
    prefill_ids = torch.full((2,), -1, dtype=torch.int32, device=device)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    positions = torch.full((1, topk), -1, dtype=torch.int32, device=device)
    for with_workspace, row in variants:
        rows = slice(row, row + 1)
        workspace: dict[str, object] = dict(
            HAS_PREFILL_WORKSPACE=True, prefill_workspace_request_ids=prefill_ids[rows],
            prefill_workspace_starts=starts, return_valid_counts=True,
        ) if with_workspace else {}
        release.convert_indices(request_ids[rows], block_table[:1], positions, block_size=block_size,
                                 block_stride_rows=block_stride_rows, **workspace)
