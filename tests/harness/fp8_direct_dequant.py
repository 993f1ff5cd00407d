# Triton kernels take untyped arguments (Triton reads their annotations itself: tl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""The FP8-direct kernel's dequantisation alone, on given rows: a Triton kernel that calls the very
``@triton.jit`` functions the attention kernel calls (``_dequant_f32``, ``_dequant_bits``), so their
BF16 values can be compared bit for bit with the float32 reference's. Imported by
tests/harness/fp8_direct_interpret.py under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_planner.kernels.fp8_direct import DEQUANT_MODES, _dequant_bits, _dequant_f32

ROWS = 16  # rows a program takes; callers pass a multiple of it


@triton.jit
def _dequant_kernel(nope_ptr, scales_ptr, out_ptr, ROWS: tl.constexpr, MODE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 512)
    nope = tl.load(nope_ptr + rows[:, None] * 512 + cols[None, :])
    tile_scales = tl.load(scales_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
    if MODE == 1:
        k = _dequant_bits(nope, tile_scales, ROWS)
    else:
        k = _dequant_f32(nope, tile_scales, ROWS)
    tl.store(out_ptr + rows[:, None] * 512 + cols[None, :], k)


def dequant_rows(nope: torch.Tensor, scales: torch.Tensor, mode: str) -> torch.Tensor:
    """``(R, 512)`` uint8 FP8 bytes and ``(R, 4)`` float32 tile scales -> ``(R, 512)`` bfloat16,
    by the kernel's dequantisation ``mode`` (a key of ``DEQUANT_MODES``); R a multiple of 16."""
    if nope.shape[0] % ROWS:
        raise ValueError(f"rows must be a multiple of {ROWS}, got {nope.shape[0]}")
    out = torch.empty(nope.shape, dtype=torch.bfloat16, device=nope.device)
    _dequant_kernel[(nope.shape[0] // ROWS,)](nope.contiguous(), scales.contiguous(), out, ROWS=ROWS,
                                              MODE=DEQUANT_MODES[mode])
    return out
