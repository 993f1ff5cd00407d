# Gluon kernels take untyped arguments (Gluon reads their annotations itself: gl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""The FP8-direct sparse MLA kernel written for Hopper's warpgroup MMA (Triton's Gluon dialect).

Same inputs, outputs and semantics as :mod:`mla_planner.kernels.fp8_direct`'s Triton kernel (its
docstring); selected by a :class:`~mla_planner.kernels.fp8_direct.KernelConfig` with ``wgmma``.

Why a second kernel: Triton lays the 16-head dots out for ``mma.sync`` and stages the
dequantised key block through shared memory twice (once per dot, in two layouts), reloading the
query every block (docs/fp8-direct.md). Here the layouts are explicit. A program is one token x
16 or 32 heads in one warpgroup. Each block of 64 top-k rows is gathered (16-byte loads),
dequantised in registers and stored once to a 128-byte-swizzled shared tile; both dots read
that tile through ``wgmma`` descriptors, with the keys as the MMA's M side (``wgmma`` needs
M >= 64, and the heads are only 16): S^T = K Q^T, then O^T += V^T P^T with V^T the tile's
transposed view. The query sits in shared memory once per program.

Also here: :func:`_wgmma_ra_kernel`, the same kernel with the score dot's A operand gathered
straight into registers (measured slower), and the parts both share with
:mod:`mla_planner.kernels.fp8_wgmma_ws` (the query load, the gather, a block's softmax and value
dot, the epilogue, the launch).

This module imports torch and triton only; nothing here runs at import time.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

__all__ = ["BLOCK_N", "attend_block", "epilogue", "gather_block", "gather_rope", "launch", "launch_kernel", "load_query", "softmax_step",
           "store_lse"]

BLOCK_N = 64
"""Top-k rows a loop iteration takes: the key block is the MMA's M side, and ``wgmma``'s M is 64
a warpgroup."""
CHUNK = 32
"""Rows gathered and dequantised at a time: two chunks a block. Measured on an H100 at 32,768
tokens x 16 heads (docs/fp8-direct.md): 16 rows took 22.3 ms, 32 rows 19.1 ms, 64 rows 21.9 ms;
holding the next block's bytes in registers while the score MMA runs spills and is slower."""
NUM_WARPS = 4  # one warpgroup
# Gluon's CTA barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` later.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh, q_smem, qr_smem, BLOCK_H: gl.constexpr,
               PERMUTED: gl.constexpr = False):
    """The query's (heads, 576) into q_smem (512) and qr_smem (64); padded heads are 0. ``PERMUTED``:
    q_smem's column 128 c + k holds the query's column 128 c + :func:`_tile_column` (k), the order
    in which :func:`_score_tile` hands the key tile to the MMA."""
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (heads, 64) bf16
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])    # (heads, 512) bf16
    hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, q_l))
    if PERMUTED:
        dq = (dq // 128) * 128 + _tile_column(dq % 128)
    q_row = q_ptr + t * stride_qt + hq[:, None] * stride_qh
    q_smem.store(gl.load(q_row + dq[None, :], mask=(hq < num_heads)[:, None], other=0.0))
    hr = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_l))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    qr_smem.store(gl.load(q_ptr + t * stride_qt + hr[:, None] * stride_qh + 512 + dr[None, :],
                          mask=(hr < num_heads)[:, None], other=0.0))


@gluon.jit
def gather_block(kv_u8, kv_f32, kv_bf16, idx_row, start, n_end, num_rows, page_stride_u8, page_stride_f32,
                 page_stride_bf16, k_smem, kr_smem,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, WARPS: gl.constexpr):
    """Top-k rows [start, start + BLOCK_N) into the shared tiles, by WARPS warps: the NoPE part
    dequantised to bf16 in chunks of CHUNK rows (fewer live registers), the RoPE part as stored.
    Rows past n_end or out of range are 0."""
    # The gather: (rows, 32, 16) bytes, a thread's 16 consecutive bytes one 16-byte load. A warp
    # takes 8 rows x 64 columns: in the 128-byte-swizzled tile that is one 8-row swizzle atom,
    # so its shared stores hit every bank once (a warp taking a whole row would write 8 column
    # blocks 8 KiB apart, the same banks 8 times).
    gather3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [WARPS // 2, 2, 1], [2, 1, 0])
    chunks = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, gather3)))
    lanes = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gather3)))
    for c in gl.static_range(BLOCK_N // CHUNK):
        n = start + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, gl.SliceLayout(2, gather3)))
        idx = gl.load(idx_row + n, mask=n < n_end, other=-1)
        valid = (n < n_end) & (idx >= 0) & (idx < num_rows)
        page = (idx // PAGE).to(gl.int64)
        offset = (idx % PAGE).to(gl.int64)
        row_u8 = page * page_stride_u8 + offset * 656
        row_f32 = page * page_stride_f32 + offset * 164
        # Chunk i of a row is its columns [16i, 16i + 16), in tile i // 8.
        nope = gl.load(kv_u8 + row_u8[:, None, None] + chunks[None, :, None] * 16 + lanes[None, None, :],
                       mask=valid[:, None, None], other=0)
        scale = gl.load(kv_f32 + row_f32[:, None] + 128 + chunks[None, :] // 8, mask=valid[:, None], other=0.0)
        k = nope.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 2)
        k_smem.slice(c * CHUNK, CHUNK, dim=0).store(gl.reshape(k.to(gl.bfloat16), CHUNK, 512))
    gather_rope(kv_bf16, idx_row, start, n_end, num_rows, page_stride_bf16, kr_smem, PAGE, BLOCK_N, WARPS)


@gluon.jit
def gather_rope(kv_bf16, idx_row, start, n_end, num_rows, page_stride_bf16, kr_smem,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """The RoPE part (64 bf16, as stored) of top-k rows [start, start + BLOCK_N) into kr_smem, by
    WARPS warps; rows past n_end or out of range are 0."""
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # (keys, 64) bf16
    n_r = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_l))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    idx_r = gl.load(idx_row + n_r, mask=n_r < n_end, other=-1)
    valid_r = (n_r < n_end) & (idx_r >= 0) & (idx_r < num_rows)
    row_b = (idx_r // PAGE).to(gl.int64) * page_stride_bf16 + (idx_r % PAGE).to(gl.int64) * 328
    kr_smem.store(gl.load(kv_bf16 + row_b[:, None] + 264 + dr[None, :], mask=valid_r[:, None], other=0.0))


@gluon.jit
def softmax_step(s, m, l, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N: gl.constexpr):
    """One block of the online softmax over S^T (keys, heads): (P^T, the accumulator's rescale
    alpha, the new running max, the new running sum). Invalid keys get no weight."""
    n_s = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s.type.layout))
    idx_s = gl.load(idx_row + n_s, mask=n_s < n_end, other=-1)
    valid_s = (n_s < n_end) & (idx_s >= 0) & (idx_s < num_rows)
    s = gl.where(valid_s[:, None], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=0))
    # A head with no valid key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    return p, alpha, m_new, l * alpha + gl.sum(p, axis=0)


@gluon.jit
def attend_block(s, m, l, acc, k_smem, p_smem, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N: gl.constexpr):
    """The rest of a block once its scores S^T are in: the online softmax step, P^T to p_smem, then
    O^T (512, heads) += V^T P^T with V^T the key tile's transposed view. Returns (acc, m, l); every
    warp's dots are done on return, so the caller may overwrite the tiles."""
    p, alpha, m, l = softmax_step(s, m, l, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()
    acc = warpgroup_mma(k_smem.permute((1, 0)), p_smem, acc * alpha[None, :])
    _cta_barrier()
    return acc, m, l


@gluon.jit
def store_lse(m, l, heads, sink_ptr, lse_ptr, t, num_heads, stride_lt, stride_lh, HAS_SINK: gl.constexpr):
    """Stores the heads' lse (natural log; +inf for a head with no valid key) from the softmax's
    running max m and sum l (base 2), and returns the output's factor 1 / (l + the sink's weight),
    0 for a head with no valid key."""
    has_keys = l > 0.0
    head_ok = heads < num_heads
    denom = l
    if HAS_SINK:
        sink = gl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
        m_fin = gl.where(has_keys, m, 0.0)
        denom = l + gl.exp2(sink * 1.4426950408889634 - m_fin)
    lse = gl.where(has_keys, (m + gl.log2(gl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("inf"))
    gl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)
    return gl.where(has_keys, 1.0 / denom, 0.0)


@gluon.jit
def epilogue(acc, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
             BLOCK_H: gl.constexpr, HAS_SINK: gl.constexpr):
    """lse and the output O = acc / (l + the sink's weight) from O^T's (512, heads) accumulator."""
    mma: gl.constexpr = acc.type.layout
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])  # (512, heads)
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma))
    inv = store_lse(m, l, heads, sink_ptr, lse_ptr, t, num_heads, stride_lt, stride_lh, HAS_SINK)
    o = gl.convert_layout((acc * inv[None, :]).to(gl.bfloat16), out_l)
    ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_l))
    do = gl.arange(0, 512, layout=gl.SliceLayout(1, out_l))
    gl.store(out_ptr + t * stride_ot + ho[None, :] * stride_oh + do[:, None], o, mask=(ho < num_heads)[None, :])


@gluon.jit
def _one_warpgroup_tiles(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
    """The one-warpgroup kernels' shared tiles: the key block (NoPE, RoPE), the query (NoPE, RoPE)
    and P^T, swizzled as ``wgmma`` reads them through descriptors."""
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    return (gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 512], k_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 64], k_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 512], k_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], k_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], p_sl))


@gluon.jit
def _wgmma_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, topk, num_rows,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt, stride_lh,
    page_stride_u8, page_stride_f32, page_stride_bf16,
    scale_log2,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    HAS_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, CHUNK: gl.constexpr,
):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_end = topk
    if HAS_LENGTH:
        n_end = gl.minimum(gl.load(len_ptr + t), topk)
    idx_row = idx_ptr + t * stride_it
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])

    # Shared tiles: the key block once (both dots read it), the query once, P^T per block.
    k_smem, kr_smem, q_smem, qr_smem, p_smem = _one_warpgroup_tiles(BLOCK_H, BLOCK_N)
    load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh, q_smem, qr_smem, BLOCK_H)

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([512, BLOCK_H], gl.float32, layout=mma)
    for start in range(0, n_end, BLOCK_N):
        gather_block(kv_u8, kv_f32, kv_bf16, idx_row, start, n_end, num_rows, page_stride_u8, page_stride_f32,
                     page_stride_bf16, k_smem, kr_smem, PAGE, BLOCK_N, CHUNK, 4)  # one warpgroup gathers
        fence_async_shared()
        _cta_barrier()
        # S^T (keys, heads) = K Q^T over 576 dims.
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
        s = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s, use_acc=False)
        s = warpgroup_mma(kr_smem, qr_smem.permute((1, 0)), s)
        acc, m, l = attend_block(s, m, l, acc, k_smem, p_smem, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N)

    epilogue(acc, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
             BLOCK_H, HAS_SINK)


_TILE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 2, 1, 1, 32], [1, 1, 8, 4, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0]))
"""The ``ra`` kernel's gather of a 64-row key tile, (warp, half, lane // 4, lane % 4, 32 bytes): row
16 w + 8 h + i, column 32 (lane % 4) + b. These are the registers wgmma's A operand keeps for rows
16 w + i and 16 w + 8 + i once the columns are renamed (:func:`_tile_column`), so
:func:`_score_tile`'s conversion moves no data."""


@gluon.jit
def _tile_column(k):
    """The cache column (within a 128-column scale tile) that the MMA's column k of the tile reads in
    :func:`_score_tile`: k = 8 j + 2 c + e takes column 32 c + 2 j + e. The score dot sums over the
    columns, so it may take them in any order that the query's copy follows (``load_query``'s
    ``PERMUTED``)."""
    return 32 * ((k % 8) // 2) + 2 * (k // 8) + k % 2


@gluon.jit
def _load_tile(kv_u8, kv_f32, row_u8, row_f32, valid, c: gl.constexpr):
    """Tile c (columns [128 c, 128 c + 128)) of the 64-row key block, as bytes (32 a row a thread,
    two 16-byte loads), and its rows' scales. ``row_u8``/``row_f32``/``valid``: the block's rows in
    the gather layout's (4, 2, 8, 1, 1) shape."""
    ld: gl.constexpr = _TILE_LAYOUT
    c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, ld)))))
    b = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, ld)))))
    col = c * 128 + 32 * c4[None, None, None, :, None] + b[None, None, None, None, :]
    x = gl.load(kv_u8 + row_u8 + col, mask=valid, other=0)
    scale = gl.load(kv_f32 + row_f32 + 128 + c, mask=valid, other=0.0)
    return x, scale


@gluon.jit
def _score_tile(x, scale, k_smem, q_smem, s, c: gl.constexpr, mma: gl.constexpr):
    """Tile c of the key block (:func:`_load_tile`), dequantised, stored to k_smem for the value dot,
    and multiplied into s from registers (``wgmma``'s A operand), not from k_smem."""
    k = (x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)
    k_smem.slice(c * 128, 128, dim=1).store(gl.reshape(k, [64, 128]))
    a = gl.reshape(gl.permute(gl.reshape(k, [64, 4, 16, 2]), [0, 2, 1, 3]), [64, 128])
    a = gl.convert_layout(a, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    return warpgroup_mma(a, q_smem.slice(c * 128, 128, dim=1).permute((1, 0)), s)


@gluon.jit
def _wgmma_ra_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, topk, num_rows,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt, stride_lh,
    page_stride_u8, page_stride_f32, page_stride_bf16,
    scale_log2,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    HAS_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr,
):
    """:func:`_wgmma_kernel` with the score dot's A operand (the key block) in registers: the key
    tile is written to shared memory once and read once (by the value dot), not twice. Measured
    slower than :func:`_wgmma_kernel` on an H100 (docs/fp8-direct.md): each 128-column tile's
    gather is waited for before its MMA."""
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_end = topk
    if HAS_LENGTH:
        n_end = gl.minimum(gl.load(len_ptr + t), topk)
    idx_row = idx_ptr + t * stride_it
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])

    k_smem, kr_smem, q_smem, qr_smem, p_smem = _one_warpgroup_tiles(BLOCK_H, BLOCK_N)
    load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh, q_smem, qr_smem, BLOCK_H, True)
    fence_async_shared()
    _cta_barrier()

    ld: gl.constexpr = _TILE_LAYOUT
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, ld)))))
    hh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, ld)))))
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, ld)))))
    rows = 16 * w[:, None, None] + 8 * hh[None, :, None] + i[None, None, :]
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([512, BLOCK_H], gl.float32, layout=mma)
    for start in range(0, n_end, BLOCK_N):
        n = start + rows
        idx = gl.load(idx_row + n, mask=n < n_end, other=-1)
        valid = (n < n_end) & (idx >= 0) & (idx < num_rows)
        row_u8 = ((idx // PAGE).to(gl.int64) * page_stride_u8 + (idx % PAGE).to(gl.int64) * 656)[:, :, :, None, None]
        row_f32 = ((idx // PAGE).to(gl.int64) * page_stride_f32 + (idx % PAGE).to(gl.int64) * 164)[:, :, :, None, None]
        valid = valid[:, :, :, None, None]
        gather_rope(kv_bf16, idx_row, start, n_end, num_rows, page_stride_bf16, kr_smem, PAGE, BLOCK_N, 4)
        fence_async_shared()
        _cta_barrier()
        # S^T (keys, heads) = K Q^T: the RoPE part from shared memory, the NoPE part tile by tile
        # from registers.
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
        s = warpgroup_mma(kr_smem, qr_smem.permute((1, 0)), s, use_acc=False)
        # (Loading tile c + 1 before tile c's MMA spills at 16 heads and measured slower.)
        for c in gl.static_range(4):
            x, scale = _load_tile(kv_u8, kv_f32, row_u8, row_f32, valid, c)
            s = _score_tile(x, scale, k_smem, q_smem, s, c, mma)
        acc, m, l = attend_block(s, m, l, acc, k_smem, p_smem, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N)

    epilogue(acc, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
             BLOCK_H, HAS_SINK)


def launch_kernel(kernel: Any, q: torch.Tensor, cache3: torch.Tensor, indices: torch.Tensor,
                  topk_length: torch.Tensor | None, attn_sink: torch.Tensor | None, out: torch.Tensor,
                  lse: torch.Tensor, page_stride: int, scale_log2: float, block_h: int, block_n: int = BLOCK_N,
                  **constexprs: Any) -> None:
    """Launches ``kernel`` (this module's, fp8_wgmma_ws's or fp8_mma's: the same arguments) on
    arguments :func:`mla_planner.kernels.fp8_direct.sparse_attention_fp8` has checked: ``cache3``
    ``(pages, page_size, 656)`` uint8, ``page_stride`` in bytes, ``block_h`` 16 or 32 heads a
    program, ``block_n`` top-k rows a loop step; ``constexprs``: the kernel's own."""
    num_tokens, num_heads, _ = q.shape
    num_pages, page_size, _ = cache3.shape
    kv_f32 = cache3.view(torch.float32)
    kv_bf16 = cache3.view(torch.bfloat16)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    kernel[grid](
        q, cache3, kv_f32, kv_bf16, indices,
        topk_length if topk_length is not None else indices,
        attn_sink if attn_sink is not None else kv_f32,
        out, lse,
        num_heads, indices.shape[1], num_pages * page_size,
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        page_stride, page_stride // 4, page_stride // 2,
        scale_log2,
        PAGE=page_size, BLOCK_H=block_h, BLOCK_N=block_n,
        HAS_LENGTH=topk_length is not None, HAS_SINK=attn_sink is not None,
        **constexprs,
    )


def launch(q: torch.Tensor, cache3: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None,
           attn_sink: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, page_stride: int,
           scale_log2: float, block_h: int, a_in_registers: bool = False) -> None:
    """This module's kernel, as :func:`launch_kernel` says; ``a_in_registers``: the variant whose
    score dot takes the key block from registers (:func:`_wgmma_ra_kernel`)."""
    if a_in_registers:
        launch_kernel(_wgmma_ra_kernel, q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, scale_log2,
                      block_h, num_warps=NUM_WARPS)
        return
    launch_kernel(_wgmma_kernel, q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, scale_log2,
                  block_h, CHUNK=CHUNK, num_warps=NUM_WARPS)
