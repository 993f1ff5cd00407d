"""Shapes the FlashMLA sparse kernels fix: MLA head sizes and the ``fp8_ds_mla`` token layout.

One ``fp8_ds_mla`` token is 656 bytes (docs/kernels.md, "FP8 KV layout")::

    [0, 512)    512 x float8_e4m3   NoPE part, quantised in 4 tiles of 128 values
    [512, 528)    4 x float32       one dequantisation scale per tile (a power of two)
    [528, 656)   64 x bfloat16      RoPE part, kept exact

The kernels see the cache as ``(num_pages, page_size, 1, 656)`` uint8 and a token's slot as
``page * page_size + offset``.
"""

from __future__ import annotations

import torch

D_QK = 576
D_V = 512
D_NOPE = 512
D_ROPE = D_QK - D_NOPE
TILE = 128
NUM_TILES = D_NOPE // TILE
SCALES_START = D_NOPE
ROPE_START = SCALES_START + NUM_TILES * 4
FP8_BYTES_PER_TOKEN = ROPE_START + D_ROPE * 2
PAGE_SIZE = 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn

assert FP8_BYTES_PER_TOKEN == 656


def page_of(positions: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """The index into a request's block-table row of each position's page (``-1`` positions get
    page 0, so they can be looked up; :func:`slot_of` marks them unused again)."""
    return positions.long().clamp(min=0) // page_size


def slot_of(pages: torch.Tensor, positions: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Cache slots of request positions whose pages (block-table entries, looked up at
    :func:`page_of`) are ``pages``: ``page * page_size + offset``; a ``-1`` position stays ``-1``."""
    positions = positions.long()
    return torch.where(positions >= 0, pages.long() * page_size + positions.clamp(min=0) % page_size, -1)


def as_pages(rows: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """View ``(num_slots, 656)`` uint8 rows as the kernels' ``(num_pages, page_size, 1, 656)``."""
    if rows.dim() != 2 or rows.shape[1] != FP8_BYTES_PER_TOKEN or rows.dtype != torch.uint8:
        raise ValueError(f"expected (num_slots, {FP8_BYTES_PER_TOKEN}) uint8 rows, got {tuple(rows.shape)} {rows.dtype}")
    if rows.shape[0] % page_size:
        raise ValueError(f"{rows.shape[0]} slots is not a whole number of {page_size}-slot pages")
    return rows.view(-1, page_size, 1, FP8_BYTES_PER_TOKEN)


def as_slots(cache: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`as_pages`: one 656-byte row per slot."""
    return cache.view(torch.uint8).reshape(-1, FP8_BYTES_PER_TOKEN)
