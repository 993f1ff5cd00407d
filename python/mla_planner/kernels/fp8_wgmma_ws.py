# Gluon kernels take untyped arguments (Gluon reads their annotations itself: gl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""The warpgroup-MMA FP8-direct kernel with specialised warps (Triton's Gluon dialect).

:mod:`mla_planner.kernels.fp8_wgmma`'s kernel, split over two partitions of one program, so that
the gather overlaps the MMAs: a producer partition (4 warps) gathers each block of 64 top-k rows,
dequantises them and stores them into one of two shared stages; the default partition (one
warpgroup) runs the two ``wgmma`` dots, the softmax and the epilogue on the other stage. Two
mbarriers a stage hand the tiles over: ``ready`` (producer -> MMA warps: the stage is full) and
``empty`` (MMA warps -> producer: the stage's dots are done). Same inputs, outputs and
semantics as the other kernels (:mod:`mla_planner.kernels.fp8_direct`).

Shared memory: two stages of a 64 x 576 bf16 tile (144 KB), the query (18 KB) and P^T: one
program an SM, 8 warps.

This module imports torch and triton only; nothing here runs at import time.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

__all__ = ["BLOCK_N", "launch"]

BLOCK_N = 64
"""Top-k rows a stage holds: the MMA's M side (``wgmma``'s M is 64 a warpgroup)."""
CHUNK = 16
"""Rows the producer dequantises at a time (its registers)."""
STAGES = 2
NUM_WARPS = 4  # the MMA warpgroup (the default partition)
PRODUCER_WARPS = 4
PRODUCER_REGS = 192
# Gluon's CTA barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` later.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _produce(kv_u8, kv_f32, kv_bf16, idx_row, n_end, num_rows, page_stride_u8, page_stride_f32, page_stride_bf16,
             k_bufs, kr_bufs, ready, empty,
             PAGE: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr,
             PRODUCER_WARPS: gl.constexpr):
    """Block j into stage j % STAGES, once the MMA warps have released it."""
    # A warp takes 8 rows x 64 columns of the gather: one swizzle atom, conflict-free stores.
    gather3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [PRODUCER_WARPS // 2, 2, 1], [2, 1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gather3))
    chunks = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, gather3)))
    lanes = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gather3)))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    j = 0
    for start in range(0, n_end, BLOCK_N):
        stage = j % STAGES
        # A fresh barrier passes a wait for parity 1: the first STAGES blocks do not wait.
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
        k_smem = k_bufs.index(stage)
        for c in gl.static_range(BLOCK_N // CHUNK):
            n = start + c * CHUNK + gl.arange(0, CHUNK, layout=rows_l)
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
        n_r = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_l))
        idx_r = gl.load(idx_row + n_r, mask=n_r < n_end, other=-1)
        valid_r = (n_r < n_end) & (idx_r >= 0) & (idx_r < num_rows)
        row_b = (idx_r // PAGE).to(gl.int64) * page_stride_bf16 + (idx_r % PAGE).to(gl.int64) * 328
        kr_bufs.index(stage).store(gl.load(kv_bf16 + row_b[:, None] + 264 + dr[None, :], mask=valid_r[:, None], other=0.0))
        # Every producer thread's stores, visible to the MMA's async proxy, before one thread arrives.
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(ready.index(stage))
        j += 1


@gluon.jit
def _consume(q_ptr, idx_row, sink_ptr, out_ptr, lse_ptr, t, h0, n_end, num_heads, num_rows,
             stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
             k_bufs, kr_bufs, q_smem, qr_smem, p_smem, ready, empty,
             BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_SINK: gl.constexpr):
    """The MMA warpgroup: the query into shared memory, then per block the two dots and the online
    softmax on the stage the producer filled; then lse and the output."""
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])

    hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, q_l))
    q_row = q_ptr + t * stride_qt + hq[:, None] * stride_qh
    q_smem.store(gl.load(q_row + dq[None, :], mask=(hq < num_heads)[:, None], other=0.0))
    hr = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_l))
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    qr_smem.store(gl.load(q_ptr + t * stride_qt + hr[:, None] * stride_qh + 512 + dr[None, :],
                          mask=(hr < num_heads)[:, None], other=0.0))
    fence_async_shared()
    _cta_barrier()

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([512, BLOCK_H], gl.float32, layout=mma)
    j = 0
    for start in range(0, n_end, BLOCK_N):
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        k_smem = k_bufs.index(stage)
        # S^T (keys, heads) = K Q^T over 576 dims.
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
        s = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s, use_acc=False)
        s = warpgroup_mma(kr_bufs.index(stage), qr_smem.permute((1, 0)), s)
        n_s = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        idx_s = gl.load(idx_row + n_s, mask=n_s < n_end, other=-1)
        valid_s = (n_s < n_end) & (idx_s >= 0) & (idx_s < num_rows)
        s = gl.where(valid_s[:, None], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        # A head with no valid key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        l = l * alpha + gl.sum(p, axis=0)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()
        # O^T (512, heads) += V^T P^T; V^T is the stage's transposed view.
        acc = warpgroup_mma(k_smem.permute((1, 0)), p_smem, acc * alpha[None, :])
        m = m_new
        _cta_barrier()  # every MMA warp's dots are done: the stage and p_smem are free
        mbarrier.arrive(empty.index(stage))
        j += 1

    has_keys = l > 0.0
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma))
    head_ok = heads < num_heads
    denom = l
    if HAS_SINK:
        sink = gl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
        m_fin = gl.where(has_keys, m, 0.0)
        denom = l + gl.exp2(sink * 1.4426950408889634 - m_fin)
    inv = gl.where(has_keys, 1.0 / denom, 0.0)
    lse = gl.where(has_keys, (m + gl.log2(gl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("inf"))
    gl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)
    o = gl.convert_layout((acc * inv[None, :]).to(gl.bfloat16), out_l)
    ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, out_l))
    do = gl.arange(0, 512, layout=gl.SliceLayout(1, out_l))
    gl.store(out_ptr + t * stride_ot + ho[None, :] * stride_oh + do[:, None], o, mask=(ho < num_heads)[None, :])


@gluon.jit
def _ws_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, topk, num_rows,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt, stride_lh,
    page_stride_u8, page_stride_f32, page_stride_bf16,
    scale_log2,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    HAS_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_end = topk
    if HAS_LENGTH:
        n_end = gl.minimum(gl.load(len_ptr + t), topk)
    idx_row = idx_ptr + t * stride_it

    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], k_sl)
    kr_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], k_sl)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 512], k_sl)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], k_sl)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], p_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_consume, (q_ptr, idx_row, sink_ptr, out_ptr, lse_ptr, t, h0, n_end, num_heads, num_rows,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
                    k_bufs, kr_bufs, q_smem, qr_smem, p_smem, ready, empty, BLOCK_H, BLOCK_N, STAGES, HAS_SINK)),
        (_produce, (kv_u8, kv_f32, kv_bf16, idx_row, n_end, num_rows, page_stride_u8, page_stride_f32, page_stride_bf16,
                    k_bufs, kr_bufs, ready, empty, PAGE, BLOCK_N, CHUNK, STAGES, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def launch(q: torch.Tensor, cache3: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None,
           attn_sink: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, page_stride: int,
           scale_log2: float, block_h: int) -> None:
    """As :func:`mla_planner.kernels.fp8_wgmma.launch`."""
    num_tokens, num_heads, _ = q.shape
    num_pages, page_size, _ = cache3.shape
    kv_f32 = cache3.view(torch.float32)
    kv_bf16 = cache3.view(torch.bfloat16)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _ws_kernel[grid](
        q, cache3, kv_f32, kv_bf16, indices,
        topk_length if topk_length is not None else indices,
        attn_sink if attn_sink is not None else kv_f32,
        out, lse,
        num_heads, indices.shape[1], num_pages * page_size,
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        page_stride, page_stride // 4, page_stride // 2,
        scale_log2,
        PAGE=page_size, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        HAS_LENGTH=topk_length is not None, HAS_SINK=attn_sink is not None, CHUNK=CHUNK, STAGES=STAGES,
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=NUM_WARPS,
    )
