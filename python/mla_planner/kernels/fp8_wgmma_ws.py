# Gluon kernels take untyped arguments (Gluon reads their annotations itself: gl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""The warpgroup-MMA FP8-direct kernel with specialised warps (Triton's Gluon dialect).

:mod:`mla_planner.kernels.fp8_wgmma`'s kernel, split over two partitions of one program, so that
the gather overlaps the MMAs: a producer partition (8 warps) gathers each block of 64 top-k rows,
dequantises them and stores them into one of two shared stages; the default partition (one
warpgroup) runs the two ``wgmma`` dots, the softmax and the epilogue on the other stage. Two
mbarriers a stage hand the tiles over: ``ready`` (producer -> MMA warps: the stage is full) and
``empty`` (MMA warps -> producer: the stage's dots are done). Same inputs, outputs and
semantics as the other kernels (:mod:`mla_planner.kernels.fp8_direct`).

Shared memory: two stages of a 64 x 576 bf16 tile (144 KB), the query (18 KB) and P^T: one
program an SM, 12 warps.

This module imports torch and triton only; nothing here runs at import time.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from mla_planner.kernels.fp8_wgmma import _cta_barrier, attend_block, epilogue, gather_block, launch_kernel, load_query

__all__ = ["BLOCK_N", "launch"]

BLOCK_N = 64
"""Top-k rows a stage holds: the MMA's M side (``wgmma``'s M is 64 a warpgroup)."""
CHUNK = 64
"""Rows the producer gathers and dequantises at a time: the whole block, so that its 32 KB of
loads are in flight together."""
STAGES = 2
NUM_WARPS = 4  # the MMA warpgroup (the default partition)
PRODUCER_WARPS = 8
PRODUCER_REGS = 120
"""Registers a producer thread keeps (``setmaxnreg``); the MMA warps take the rest. Measured on an
H100 at 32,768 tokens x 16 heads (docs/fp8-direct.md): 8 producer warps gathering 64 rows at a
time took 17.2-17.5 ms; 8 warps x 32 rows 19.6; 4 warps x 32 rows 21.2, x 16 rows 26.7; two
producers of 4 warps on alternate blocks 19.5-19.8; 152 registers in place of 120, 18.2."""


@gluon.jit
def _produce(kv_u8, kv_f32, kv_bf16, idx_row, n_end, num_rows, page_stride_u8, page_stride_f32, page_stride_bf16,
             k_bufs, kr_bufs, ready, empty,
             PAGE: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr,
             PRODUCER_WARPS: gl.constexpr):
    """Block j into stage j % STAGES, once the MMA warps have released it."""
    j = 0
    for start in range(0, n_end, BLOCK_N):
        stage = j % STAGES
        # A fresh barrier passes a wait for parity 1: the first STAGES blocks do not wait.
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
        gather_block(kv_u8, kv_f32, kv_bf16, idx_row, start, n_end, num_rows, page_stride_u8, page_stride_f32,
                     page_stride_bf16, k_bufs.index(stage), kr_bufs.index(stage), PAGE, BLOCK_N, CHUNK,
                     PRODUCER_WARPS)
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
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh, q_smem, qr_smem, BLOCK_H)
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
        acc, m, l = attend_block(s, m, l, acc, k_smem, p_smem, idx_row, start, n_end, num_rows, scale_log2, BLOCK_N)
        mbarrier.arrive(empty.index(stage))  # every MMA warp's dots are done: the stage is free
        j += 1

    epilogue(acc, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
             BLOCK_H, HAS_SINK)


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
    """This module's kernel, as :func:`mla_planner.kernels.fp8_wgmma.launch_kernel` says."""
    launch_kernel(_ws_kernel, q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, scale_log2, block_h,
                  CHUNK=CHUNK, STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                  num_warps=NUM_WARPS)
