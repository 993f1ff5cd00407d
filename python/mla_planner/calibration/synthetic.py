"""Random inputs shaped like a real step, for `mla-planner calibrate` (:func:`prefill_case`), the
benchmarks and the tests: never zeros, drawn from a seeded generator, on the generator's device
(so large GPU cases never pass through host memory). Importing it needs torch, never CUDA.

``kv`` rows are Gaussian, by default times a per-row magnitude ``e^(spread * N(0, 1))`` so the
quantiser's per-tile scales differ; indices are a mix of valid slots and ``-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from mla_planner.executor.layout import D_QK, PAGE_SIZE, as_pages
from mla_planner.executor.quant import quantize_fp8_ds_mla


@dataclass(frozen=True)
class MixedCase:
    q: torch.Tensor  # (T, H, 576)
    kv_cache: torch.Tensor  # (pages, 64, 1, 656) uint8
    indices: torch.Tensor  # (T, topk) int32 slots, some -1


@dataclass(frozen=True)
class PrefillCase:
    q: torch.Tensor  # (T, H, 576), requests' new tokens back to back
    kv_cache: torch.Tensor  # (pages, 64, 1, 656) uint8
    block_table: torch.Tensor  # (requests, max_pages) int32, pages shuffled
    indices: torch.Tensor  # (T, topk) int32 request positions, causal, some -1
    query_lens: npt.NDArray[np.int64]
    context_lens: npt.NDArray[np.int64]


def random_kv_rows(num_rows: int, gen: torch.Generator, spread: float = 1.0) -> torch.Tensor:
    """``(num_rows, 576)`` float32 rows."""
    rows = torch.randn((num_rows, D_QK), generator=gen, device=gen.device)
    if spread:
        rows *= torch.exp(spread * torch.randn((num_rows, 1), generator=gen, device=gen.device))
    return rows


def random_q(num_tokens: int, num_heads: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn((num_tokens, num_heads, D_QK), generator=gen, device=gen.device, dtype=dtype)


def mixed_case(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_slots: int,
    gen: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    unused_fraction: float = 0.1,
    spread: float = 1.0,
) -> MixedCase:
    """A mixed batch: ``num_slots`` (a multiple of 64) quantised cache slots, top-k slots drawn
    uniformly per token, ``unused_fraction`` of them ``-1``."""
    dev = gen.device
    kv_cache = as_pages(quantize_fp8_ds_mla(random_kv_rows(num_slots, gen, spread)))
    indices = torch.randint(0, num_slots, (num_tokens, topk), generator=gen, device=dev, dtype=torch.int32)
    indices.masked_fill_(torch.rand((num_tokens, topk), generator=gen, device=dev) < unused_fraction, -1)
    return MixedCase(random_q(num_tokens, num_heads, gen, dtype), kv_cache, indices)


_DRAW_BLOCK_ELEMENTS = 1 << 26


def distinct_causal_positions(positions: torch.Tensor, topk: int, gen: torch.Generator) -> torch.Tensor:
    """``(len(positions), topk)`` int32: for a query at ``p``, ``min(topk, p + 1)`` distinct
    positions of ``[0, p]`` in random order, then ``-1``. Distinct because a repeated key is
    not what the indexer produces, and repeats make the kernels' bf16 rounding coherent (every
    copy rounds the same way), which a real step never sees."""
    dev = positions.device
    out = torch.empty((len(positions), topk), dtype=torch.int32, device=dev)
    width = int(positions.max().item()) + 1 if len(positions) else 1
    block = max(1, _DRAW_BLOCK_ELEMENTS // max(width, topk))
    for start in range(0, len(positions), block):
        pos = positions[start : start + block]
        keys = torch.rand((len(pos), max(width, topk)), generator=gen, device=dev)
        keys[torch.arange(keys.shape[1], device=dev).unsqueeze(0) > pos.unsqueeze(1)] = -1.0  # not causal
        score, picked = keys.topk(topk, dim=1)
        out[start : start + block] = picked.to(torch.int32).masked_fill_(score < 0, -1)
    return out


def prefill_case(
    query_lens: npt.ArrayLike,
    context_lens: npt.ArrayLike,
    num_heads: int,
    topk: int,
    gen: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    unused_fraction: float = 0.1,
    spread: float = 1.0,
) -> PrefillCase:
    """Prefill requests whose KV (context + new tokens) sits on shuffled pages of one cache; a
    token at position ``p`` names ``topk`` distinct positions of ``[0, p]`` (all of them, then
    ``-1``, while ``p < topk``), as the indexer's top-k does."""
    qlens, clens = np.asarray(query_lens, np.int64), np.asarray(context_lens, np.int64)
    seq_lens = qlens + clens
    pages_per_request = -(-seq_lens // PAGE_SIZE)
    num_pages = int(pages_per_request.sum())
    dev = gen.device
    kv_cache = as_pages(quantize_fp8_ds_mla(random_kv_rows(num_pages * PAGE_SIZE, gen, spread)))
    order = torch.randperm(num_pages, generator=gen, device=dev).to(torch.int32).cpu()
    block_table = torch.full((len(qlens), int(pages_per_request.max(initial=1))), -1, dtype=torch.int32)
    first = 0
    for r, n in enumerate(pages_per_request.tolist()):
        block_table[r, :n] = order[first : first + n]
        first += n
    positions = torch.cat([torch.arange(c, c + n, device=dev) for c, n in zip(clens.tolist(), qlens.tolist())])
    indices = distinct_causal_positions(positions, topk, gen)
    indices.masked_fill_(torch.rand((len(positions), topk), generator=gen, device=dev) < unused_fraction, -1)
    q = random_q(len(positions), num_heads, gen, dtype)
    return PrefillCase(q, kv_cache, block_table.to(dev), indices, qlens, clens)
