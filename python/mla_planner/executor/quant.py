"""Quantise BF16/FP32 MLA rows into the 656-byte ``fp8_ds_mla`` layout (see :mod:`.layout`).

Same recipe as FlashMLA's test quantiser: per 128-value tile, the scale is the tile's absolute
maximum over 448 rounded *up* to a power of two (floored at 1e-4), so ``x / scale`` always fits
float8_e4m3 and dequantisation is an exact multiply.
"""

from __future__ import annotations

import torch

from mla_planner.executor.layout import D_NOPE, D_QK, FP8_BYTES_PER_TOKEN, FP8_MAX, NUM_TILES, ROPE_START, SCALES_START, TILE

_MIN_SCALE = 1e-4


def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """``(n, 576)`` float rows -> ``(n, 656)`` uint8 rows in the ``fp8_ds_mla`` layout."""
    if kv.dim() != 2 or kv.shape[1] != D_QK or not kv.is_floating_point():
        raise ValueError(f"expected (n, {D_QK}) floating-point rows, got {tuple(kv.shape)} {kv.dtype}")
    n = kv.shape[0]
    tiles = kv[:, :D_NOPE].float().reshape(n, NUM_TILES, TILE)
    amax = tiles.abs().amax(dim=-1)
    scales = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / FP8_MAX, _MIN_SCALE))))

    packed = torch.empty((n, FP8_BYTES_PER_TOKEN), dtype=torch.uint8, device=kv.device)
    nope = (tiles / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, D_NOPE)
    packed[:, :SCALES_START] = nope.view(torch.uint8)
    packed[:, SCALES_START:ROPE_START] = scales.contiguous().view(torch.uint8)
    packed[:, ROPE_START:] = kv[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return packed
