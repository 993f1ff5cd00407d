# Gluon kernels take untyped arguments (Gluon reads their annotations itself: gl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""The FP8-direct sparse MLA kernel with both dots from registers (``mma.sync``; Triton's Gluon).

Same inputs, outputs and semantics as :mod:`mla_planner.kernels.fp8_direct`'s Triton kernel (its
docstring); selected by a :class:`~mla_planner.kernels.fp8_direct.KernelConfig` with ``mma``.

Why: the ``wgmma`` kernels write every dequantised key block into a shared tile and read it twice
(docs/fp8-direct.md); their L1/shared unit is the bound. Here each key byte is written to shared
memory once, as the cache holds it, and read once by each dot. A program is one token x 16 heads,
four warps, and warp w owns the cache's scale tile w (columns [128 w, 128 w + 128)) in both dots:

- the rows: while a block of 64 top-k rows runs from one shared stage, the next block's rows are
  copied into the other by ``cp.async`` (NoPE bytes, RoPE part and tile scales; an invalid entry's
  as zeros), so no warp waits on a gather. The indices go one block further ahead, copied into
  shared memory too: starting a block's copies, and masking its invalid keys (flags written as
  the copies start), waits on shared memory only, and the loop loads nothing from global memory;
- the score dot: warp w multiplies its 128 query columns (held in registers as ``mma.sync``'s A
  operand, in f16) by its 128 columns of each key row, loaded by 16-byte shared loads straight
  into the B operand's registers (the dot's columns are renamed so that a thread's bytes are
  contiguous; the query is loaded in the same order). The raw e4m3 bytes become f16 exactly
  with no scale; the tile's scale multiplies the partial score. A quarter of the RoPE part rides
  along in bf16. The four warps' partial scores are summed through shared memory (a score is
  16 floats a key, against 1,152 bytes of key row);
- the value dot: warp w accumulates its 128 output columns (O, 16 x 128 float32 a warp), with
  the probabilities (times the key's tile scale) as the A operand straight from the score's
  accumulator registers, and the same 128 columns of each key row loaded again, in the layout
  of the value dot's B operand, keys paired as the MMA takes them.

Both dots run in f16 with float32 accumulation: e4m3 values are exact in f16, and the query is
scaled by a power of two per head before its cast so that it is exact too. The probabilities enter
the value dot times their key's tile scale over the largest scale of that tile seen so far, so
they stay at most 1. Keys come in chunks of 16 (the value dot's k-step), four chunks a softmax
step; the partial scores of a step meet in one barrier.

Measured on an H100 (docs/fp8-direct.md): correct, and at 16 heads faster than ``fp8_wgmma_ws``
(0.88x its time at 32,768 tokens, 0.94x at 2,048); at 32 heads, two programs a token, slower
(1.50x). 249 registers a thread and 109 KB of shared memory a program each allow two programs an
SM.

This module imports torch and triton only; nothing here runs at import time.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from mla_planner.kernels.fp8_wgmma import _cta_barrier, launch_kernel, store_lse

__all__ = ["BLOCK_H", "BLOCK_N", "launch"]

BLOCK_H = 16
"""Heads a program: the MMA's M. 32 heads run as two programs a token (each copies the rows)."""
BLOCK_N = 64
"""Top-k rows a softmax step takes: four chunks of 16 (the value dot's k-step)."""
NUM_WARPS = 4  # one a scale tile

# Triton 3.8 renamed Gluon's cp.async (3.6: async_copy_global_to_shared).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
"""(warp = scale tile, heads, keys or output columns): ``mma.sync`` m16n8k16, warp w on batch w."""
_A = gl.constexpr(gl.DotOperandLayout(0, _MMA.value, 2))
_B = gl.constexpr(gl.DotOperandLayout(1, _MMA.value, 2))

# The score dot's key chunk as loaded, (tile w, key n, lane % 4 = c, byte b): key n's bytes
# [128 w + 32 c, + 32) in one thread, two 16-byte loads. Once the 32 bytes are renamed to the dot's
# columns (_key_column) these are the registers of the B operand (tile, 128 columns, 16 keys).
_KEY_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 16], [0, 8, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 16, 4, 32]))
# The RoPE part, (warp w, key n, c, 4 bf16): the warp's 16 RoPE columns [16 w, + 16), 8 bytes a
# key a thread.
_ROPE_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 8, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 16, 4, 4]))
# The value dot's chunk as loaded, (tile w, k3, c, k0, g, j): key 8 k3 + 2 c + k0's bytes
# [128 w + 16 g, + 16) in one thread, a 16-byte load. As (tile, key, output column 8 j + g) these
# are the registers of the value dot's B operand.
_VALUE_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 4], [0, 0, 0, 0, 0, 8],
               [0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0]],
    lane_bases=[[0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]], block_bases=[], shape=[4, 2, 4, 2, 8, 16]))

# The four tiles' partial scores of a chunk, (tile, heads, 16 keys), each thread the accumulator's
# elements of all four tiles: summed in registers, they are the summed score in every warp.
_ALL_PARTS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8], [1, 0, 0], [2, 0, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[4, 16, 16]))
# A head's 16 floats padded by 8: a half-warp's 8-byte accesses (4 heads x 4 key pairs) then fall on
# 32 different banks.
_PARTS = gl.constexpr(gl.PaddedSharedLayout([[16, 8]], [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0],
                                                         [0, 2, 0], [0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0]],
                                            [], [4, 16, 16]))


# The shared buffers, a set a stage: a block's 64 rows as the NoPE bytes (u8, 512 a
# key), the RoPE part (bf16, 64 a key) and the tile scales (float32, 4 a key). Each has a view as
# copied, (64 keys, columns), and views for the loads, (4 chunks, the load's shape), the chunk
# outermost (Gluon indexes the leading dimension only). In each, key bits 0..n-1 are XORed into
# the column bits from `shift` on, so that a quarter-warp's 16-byte accesses (keys 512 or 128
# bytes apart) meet distinct banks.
def _staged(dims: list[list[tuple[str, int]]], col_bits: int, key_bits: int, n: int, shift: int) -> gl.SharedLinearLayout:
    """The layout of a view of one stage's (64 keys, 2**col_bits columns), or of one chunk's if
    ``key_bits`` is 4: ``dims`` says, for each dimension of the view and from its lowest bit, which
    bit of the buffer's ("key" or "col") it is."""
    where = {bit: (d, j) for d, bits in enumerate(dims) for j, bit in enumerate(bits)}

    def coords(*bits: tuple[str, int]) -> list[int]:
        c = [0] * len(dims)
        for bit in bits:
            d, j = where[bit]
            c[d] |= 1 << j
        return c

    bases = [coords(("col", i)) for i in range(col_bits)]
    return gl.SharedLinearLayout(bases + [coords(("key", j), *([("col", shift + j)] if j < n else []))
                                          for j in range(key_bits)])


def _bits(space: str, *bits: int) -> list[tuple[str, int]]:
    return [(space, b) for b in bits]


_NOPE = gl.constexpr(_staged([_bits("key", *range(6)), _bits("col", *range(9))], 9, 6, 3, 4))
_NOPE_KEYS = gl.constexpr(_staged([_bits("col", 7, 8), _bits("key", 0, 1, 2, 3), _bits("col", 5, 6),
                                   _bits("col", *range(5))], 9, 4, 3, 4))  # _KEY_LOAD's shape
_NOPE_VALUES = gl.constexpr(_staged([_bits("col", 7, 8), _bits("key", 3), _bits("key", 1, 2), _bits("key", 0),
                                     _bits("col", 4, 5, 6), _bits("col", 0, 1, 2, 3)], 9, 4, 3, 4))  # _VALUE_LOAD's
_ROPE = gl.constexpr(_staged([_bits("key", *range(6)), _bits("col", *range(6))], 6, 6, 2, 4))
_ROPE_KEYS = gl.constexpr(_staged([_bits("col", 4, 5), _bits("key", 0, 1, 2, 3), _bits("col", 2, 3),
                                   _bits("col", 0, 1)], 6, 4, 2, 4))  # _ROPE_LOAD's shape
_SCALES = gl.constexpr(_staged([_bits("key", *range(6)), _bits("col", 0, 1)], 2, 6, 0, 0))
_SCALE_KEYS = gl.constexpr(_staged([_bits("col", 0, 1), _bits("key", 0, 1, 2, 3)], 2, 4, 0, 0))  # (tile, 16 keys)
# The copies' layouts: 16 bytes a thread (8 for the scales), consecutive lanes along a row.
_NOPE_COPY = gl.constexpr(gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0]))
_ROPE_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
_SCALE_COPY = gl.constexpr(gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0]))
# A stage's top-k indices, copied a block ahead of its rows, and which of its entries are valid,
# written as its rows' copies start: both 64 int32 in order, the flags also viewed as (4 chunks, 16
# keys). The index copy is 8 bytes a lane, every warp copying all 64.
_ENTRIES = gl.constexpr(gl.SharedLinearLayout([[1], [2], [4], [8], [16], [32]]))
_CHUNK_FLAGS = gl.constexpr(gl.SharedLinearLayout([[1], [2], [4], [8]]))
_INDEX_COPY = gl.constexpr(gl.BlockedLayout([2], [32], [4], [0]))
_FLAG_STORE = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _key_column(k):
    """The cache column (within a scale tile) that the score dot's column k reads: k's bits are
    (b0, c0, c1, b1, b2, b3, b4) from the lowest, so that a thread's 32 registers of a key are its
    bytes [32 c, 32 c + 32) in order."""
    return 32 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)


@gluon.jit
def _rope_column(k):
    """The RoPE column (within a warp's 16) that the score dot's RoPE column k reads."""
    return 4 * ((k >> 1) & 3) + 2 * (k >> 3) + (k & 1)


@gluon.jit
def _value_column(n):
    """The cache column (within a scale tile) of the value dot's output column n = 8 j + g."""
    return 16 * (n % 8) + n // 8


@gluon.constexpr_function
def _slice_all_but(layout, dim, rank):
    """``layout`` with every dimension but ``dim`` sliced away, the highest first (as
    :func:`_index` expands them back, the lowest first)."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def _index(n: gl.constexpr, layout: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr):
    """0 .. n - 1 along ``dim`` of a rank-``rank`` tensor in ``layout`` (size 1 elsewhere)."""
    x = gl.arange(0, n, layout=_slice_all_but(layout, dim, rank))
    for d in gl.static_range(rank):
        if d != dim:
            x = gl.expand_dims(x, d)
    return x


@gluon.jit
def _valid(idx, n, n_end, num_rows):
    """Top-k entries n holding indices idx (any shape and layout): (their rows, 0 where invalid;
    which are valid)."""
    valid = (n < n_end) & (idx >= 0) & (idx < num_rows)
    return gl.where(valid, idx, 0).to(gl.uint32), valid


@gluon.jit
def _rows(idx, n, n_end, num_rows, page_stride_u8, PAGE: gl.constexpr, CONTIGUOUS: gl.constexpr):
    """Top-k entries n holding indices idx (any shape and layout): (each row's byte offset, valid).
    An invalid entry points at row 0, so that its copy's address stays inside the cache."""
    idx, valid = _valid(idx, n, n_end, num_rows)
    if CONTIGUOUS:  # pages back to back: row idx of the whole cache
        return idx.to(gl.int64) * 656, valid
    return (idx // PAGE).to(gl.int64) * page_stride_u8 + (idx % PAGE).to(gl.int64) * 656, valid


@gluon.jit
def _load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh):
    """The query as the score dot's A operands, (tile, heads, 128) f16 and the RoPE part (tile, heads,
    16) bf16, both scaled per head by a power of two (exact; padded heads are 0), and the inverse
    of that scale (heads,) in the summed score's layout."""
    w = _index(4, _A, 0, 3)
    head = h0 + _index(16, _A, 1, 3)
    row = q_ptr + t * stride_qt + head * stride_qh
    ok = head < num_heads
    q = gl.load(row + 128 * w + _key_column(_index(128, _A, 2, 3)), mask=ok, other=0.0).to(gl.float32)
    amax = gl.max(gl.max(gl.abs(q), axis=2), axis=0)
    # 2^(14 - floor(log2 amax)) puts the largest NoPE value in [2^14, 2^15): every bf16 value of the
    # head down to 2^-24 of it is exact in f16.
    exp = gl.where(amax > 0.0, 14.0 - gl.floor(gl.log2(gl.where(amax > 0.0, amax, 1.0))), 0.0)
    up = gl.expand_dims(gl.expand_dims(gl.exp2(exp), 0), 2)
    q16 = (q * up).to(gl.float16)
    qr = gl.load(row + 512 + 16 * w + _rope_column(_index(16, _A, 2, 3)), mask=ok, other=0.0)
    qr = (qr.to(gl.float32) * up).to(gl.bfloat16)
    down = gl.convert_layout(gl.exp2(-exp), gl.SliceLayout(1, gl.SliceLayout(0, _MMA)))
    return q16, qr, down


@gluon.jit
def _score_dot(q16, qr, x, xr, scale, valid):
    """Each tile's share of 16 keys' scores (tile, heads, keys), in the query's scaled units, -inf
    for an invalid key, from the keys' NoPE bytes x (tile, key, c, byte; :data:`_KEY_LOAD`), RoPE
    xr (:data:`_ROPE_LOAD`) and tile scales (tile, keys)."""
    # NoPE: -> B operand (tile, 128 renamed columns, key); RoPE: -> (tile, 16 renamed columns, key).
    k = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    k = gl.reshape(gl.permute(gl.reshape(k, [4, 16, 4, 8, 2, 2]), [0, 1, 3, 4, 2, 5]), [4, 16, 128])
    k = gl.convert_layout(gl.permute(k, [0, 2, 1]), _B, assert_trivial=True)
    kr = gl.reshape(gl.permute(gl.reshape(xr, [4, 16, 4, 2, 2]), [0, 1, 3, 2, 4]), [4, 16, 16])
    kr = gl.convert_layout(gl.permute(kr, [0, 2, 1]), _B, assert_trivial=True)
    s = mma_v2(q16, k, gl.zeros([4, 16, 16], gl.float32, layout=_MMA))
    s = mma_v2(qr, kr, s * gl.expand_dims(scale, 1))
    return gl.where(gl.expand_dims(valid, 1), s, float("-inf"))


@gluon.jit
def _value_dot(p, o, x):
    """o (tile, heads, 128 output columns in _value_column's order) += p (tile, heads, 16 keys) times
    the e4m3 values x of each tile (:data:`_VALUE_LOAD`)."""
    v = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    v = gl.convert_layout(gl.reshape(gl.permute(v, [0, 1, 2, 3, 5, 4]), [4, 16, 128]), _B, assert_trivial=True)
    return mma_v2(gl.convert_layout(p.to(gl.float16), _A), v, o)


@gluon.jit
def _copy_rows(smem, ptr, entries, keys, cols: gl.constexpr, layout: gl.constexpr, n_end, num_rows,
               page_stride_u8, PAGE: gl.constexpr, CONTIGUOUS: gl.constexpr):
    """Starts copying (``cp.async``) columns [0, cols) of each row of top-k entries ``keys`` (64) on,
    their indices in ``entries`` (shared, 64), from ``ptr`` (the row's start) into ``smem`` (64,
    cols) in ``layout``; an invalid entry's as zeros (its slot may hold NaN bytes, and 0 x NaN is
    NaN)."""
    # The rows a thread copies, before broadcasting over its columns (each index loaded once).
    kl: gl.constexpr = gl.SliceLayout(1, layout)
    row, ok = _rows(entries.load(kl), keys + gl.arange(0, 64, layout=kl), n_end, num_rows, page_stride_u8, PAGE,
                    CONTIGUOUS)
    col = _index(cols, layout, 1, 2)
    rows = (ptr + gl.expand_dims(row, 1)).to(gl.pointer_type(smem.dtype), bitcast=True)
    _async_load(smem, rows + col, mask=gl.expand_dims(ok, 1) & (col < cols))


@gluon.jit
def _score_chunk(q16, qr, nope, rope, scales, flags):
    """A chunk of 16 top-k entries from a stage's chunk views: :func:`_score_dot`'s scores, and the
    keys' tile scales (tile, keys)."""
    ls: gl.constexpr = gl.SliceLayout(1, _MMA)
    scale = scales.load(ls)
    valid = gl.expand_dims(flags.load(gl.SliceLayout(0, ls)) != 0, 0)
    return _score_dot(q16, qr, nope.load(_KEY_LOAD), rope.load(_ROPE_LOAD), scale, valid), scale


@gluon.jit
def _summed(parts):
    """A chunk's partial scores (tile, heads, 16 keys) from shared memory, summed over the tiles."""
    return gl.convert_layout(gl.sum(parts.load(_ALL_PARTS), axis=0), gl.SliceLayout(0, _MMA), assert_trivial=True)


@gluon.jit
def _join(s0, s1, s2, s3):
    """Four (heads, 16 keys) chunks -> (heads, 64 keys), the chunk in the key's register bits 4 and 5
    (no data moves)."""
    x = gl.join(gl.join(s0, s2), gl.join(s1, s3))  # (heads, 16, chunk bit 1, chunk bit 0)
    x = gl.reshape(gl.permute(x, [0, 2, 3, 1]), [16, 64])
    return gl.convert_layout(x, gl.SliceLayout(0, _MMA), assert_trivial=True)


@gluon.jit
def _chunks(p):
    """(heads, 64 keys) -> its four (heads, 16 keys) chunks, in the summed score's layout (the
    chunk is the key's register bits 4 and 5: no data moves)."""
    x = gl.permute(gl.reshape(p, [16, 2, 2, 16]), [0, 3, 1, 2])
    a, b = gl.split(x)
    p0, p2 = gl.split(a)
    p1, p3 = gl.split(b)
    sl: gl.constexpr = gl.SliceLayout(0, _MMA)
    return (gl.convert_layout(p0, sl, assert_trivial=True), gl.convert_layout(p1, sl, assert_trivial=True),
            gl.convert_layout(p2, sl, assert_trivial=True), gl.convert_layout(p3, sl, assert_trivial=True))


@gluon.jit
def _per_tile(x):
    """(tiles,) -> (tiles, 1, 1) in the accumulator's layout."""
    return gl.expand_dims(gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, gl.SliceLayout(2, _MMA))), 1), 2)


@gluon.jit
def _per_head(x):
    """(heads,) -> (1, heads, 1) in the accumulator's layout."""
    return gl.expand_dims(gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(0, gl.SliceLayout(2, _MMA))), 0), 2)


@gluon.jit
def _weights(p, scale, inv_unit):
    """The value dot's A operand for a chunk: its probabilities (heads, 16) times each tile's key
    scales (tile, 16) over the tile's unit."""
    return gl.expand_dims(p, 0) * (gl.expand_dims(scale, 1) * _per_tile(inv_unit))


@gluon.jit
def _program(q_ptr, idx_ptr, len_ptr, num_heads, topk, stride_qt, stride_qh, stride_it, scale_log2,
             BLOCK_H: gl.constexpr, HAS_LENGTH: gl.constexpr):
    """A program's token, first head, top-k end, index row, query (:func:`_load_query`) and the
    factor from a summed score to base-2 logits (heads, 1)."""
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    n_end = topk
    if HAS_LENGTH:
        n_end = gl.minimum(gl.load(len_ptr + t), topk)
    q16, qr, down = _load_query(q_ptr, t, h0, num_heads, stride_qt, stride_qh)
    return t, h0, n_end, idx_ptr + t * stride_it, q16, qr, gl.expand_dims(down * scale_log2, 1)


@gluon.jit
def _parts():
    """Where the tiles' partial scores of a block meet: a buffer a chunk (one buffer's stores need
    no barrier for another's)."""
    return (gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS))


@gluon.jit
def _fresh_state():
    """(m, l, unit, acc) before the first block: :func:`_softmax_step` says what each holds."""
    m = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(0, _MMA)))
    unit = gl.zeros([4], gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(1, _MMA)))
    return m, gl.zeros_like(m), unit, gl.zeros([4, 16, 128], gl.float32, layout=_MMA)


@gluon.jit
def _softmax_step(parts0, parts1, parts2, parts3, down, m, l, unit, acc, scale0, scale1, scale2, scale3):
    """A block's online softmax step (base 2), its four chunks' partial scores in shared memory past
    a barrier: (the chunks' probabilities (heads, 16 keys) each, 1 / the new unit, m, l, unit, and
    acc rescaled to them). O of tile w is acc[w] x unit[w]: the probabilities enter the f16 value
    dot times their key's tile scale over the largest tile scale seen so far (unit), so that they
    stay at most 1."""
    s = _join(_summed(parts0), _summed(parts1), _summed(parts2), _summed(parts3)) * down
    m_new = gl.maximum(m, gl.max(s, axis=1))
    # A head with no valid key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l = l * alpha + gl.sum(p, axis=1)
    unit_new = gl.maximum(gl.maximum(unit, gl.maximum(gl.max(scale0, axis=1), gl.max(scale1, axis=1))),
                          gl.maximum(gl.max(scale2, axis=1), gl.max(scale3, axis=1)))
    inv_unit = gl.where(unit_new > 0.0, 1.0 / unit_new, 0.0)
    acc = acc * (_per_tile(gl.where(unit_new > 0.0, unit * inv_unit, 1.0)) * _per_head(alpha))
    p0, p1, p2, p3 = _chunks(p)
    return p0, p1, p2, p3, inv_unit, m_new, l, unit_new, acc


@gluon.jit
def _stage():
    """One stage's buffers, as the chunk views the loads take: (NoPE keys, NoPE values, RoPE,
    scales, flags), each (4 chunks, ...), and its indices (64)."""
    nope = gl.allocate_shared_memory(gl.uint8, [64, 512], _NOPE)
    rope = gl.allocate_shared_memory(gl.bfloat16, [64, 64], _ROPE)
    scales = gl.allocate_shared_memory(gl.float32, [64, 4], _SCALES)
    flags = gl.allocate_shared_memory(gl.int32, [64], _ENTRIES)
    entries = gl.allocate_shared_memory(gl.int32, [64], _ENTRIES)
    return (nope._reinterpret(gl.uint8, [4, 4, 16, 4, 32], _NOPE_KEYS),
            nope._reinterpret(gl.uint8, [4, 4, 2, 4, 2, 8, 16], _NOPE_VALUES),
            rope._reinterpret(gl.bfloat16, [4, 4, 16, 4, 4], _ROPE_KEYS),
            scales._reinterpret(gl.float32, [4, 4, 16], _SCALE_KEYS), flags._reinterpret(gl.int32, [4, 16], _CHUNK_FLAGS),
            entries)


@gluon.jit
def _fetch_entries(entries, idx_row, start, n_end):
    """Starts copying the indices of top-k entries [start, start + 64) into ``entries`` (those past
    the end as zeros, which the flags then mark invalid)."""
    n = start + gl.arange(0, 64, layout=_INDEX_COPY)
    _async_load(entries, idx_row + n, mask=n < n_end)


@gluon.jit
def _fill(keys, rope, scales, flags, entries, kv_u8, start, n_end, num_rows, page_stride_u8, PAGE: gl.constexpr,
          CONTIGUOUS: gl.constexpr):
    """Starts copying the rows of top-k entries [start, start + 64), their indices landed in
    ``entries``, into the stage of these views (:func:`_stage`'s): NoPE bytes [0, 512), scales
    [512, 528) and RoPE [528, 656) of each row; writes which entries are valid into ``flags``."""
    _copy_rows(keys._reinterpret(gl.uint8, [64, 512], _NOPE), kv_u8, entries, start, 512, _NOPE_COPY, n_end,
               num_rows, page_stride_u8, PAGE, CONTIGUOUS)
    _copy_rows(rope._reinterpret(gl.bfloat16, [64, 64], _ROPE), kv_u8 + 528, entries, start, 64, _ROPE_COPY, n_end,
               num_rows, page_stride_u8, PAGE, CONTIGUOUS)
    _copy_rows(scales._reinterpret(gl.float32, [64, 4], _SCALES), kv_u8 + 512, entries, start, 4, _SCALE_COPY,
               n_end, num_rows, page_stride_u8, PAGE, CONTIGUOUS)
    n = start + gl.arange(0, 64, layout=_FLAG_STORE)
    _, valid = _valid(entries.load(_FLAG_STORE), n, n_end, num_rows)
    flags._reinterpret(gl.int32, [64], _ENTRIES).store(valid.to(gl.int32))


@gluon.jit
def _block(keys, values, rope, scales, flags, entries, next_keys, next_rope, next_scales, next_flags, next_entries,
           parts0, parts1, parts2, parts3, q16, qr, down, m, l, unit, acc, kv_u8, idx_row, start, n_end, num_rows,
           page_stride_u8, PAGE: gl.constexpr, CONTIGUOUS: gl.constexpr):
    """The block of top-k entries [start, start + 64) from its stage (keys, values, rope, scales,
    flags), once it has landed, while the next block's rows are copied into the other stage (their
    indices landed in ``next_entries``) and the indices of the block after that into ``entries``:
    (m, l, unit, acc) after it."""
    # This block's rows and the next block's indices are in, and every warp is done with the other
    # stage (the block before) and with this stage's indices (read when its rows' copies started).
    async_copy.wait_group(0)
    _cta_barrier()
    _fill(next_keys, next_rope, next_scales, next_flags, next_entries, kv_u8, start + 64, n_end, num_rows,
          page_stride_u8, PAGE, CONTIGUOUS)
    _fetch_entries(entries, idx_row, start + 128, n_end)
    async_copy.commit_group()
    s, scale0 = _score_chunk(q16, qr, keys.index(0), rope.index(0), scales.index(0), flags.index(0))
    parts0.store(s)
    s, scale1 = _score_chunk(q16, qr, keys.index(1), rope.index(1), scales.index(1), flags.index(1))
    parts1.store(s)
    s, scale2 = _score_chunk(q16, qr, keys.index(2), rope.index(2), scales.index(2), flags.index(2))
    parts2.store(s)
    s, scale3 = _score_chunk(q16, qr, keys.index(3), rope.index(3), scales.index(3), flags.index(3))
    parts3.store(s)
    _cta_barrier()
    p0, p1, p2, p3, inv_unit, m, l, unit, acc = _softmax_step(parts0, parts1, parts2, parts3, down, m, l, unit, acc,
                                                             scale0, scale1, scale2, scale3)
    acc = _value_dot(_weights(p0, scale0, inv_unit), acc, values.index(0).load(_VALUE_LOAD))
    acc = _value_dot(_weights(p1, scale1, inv_unit), acc, values.index(1).load(_VALUE_LOAD))
    acc = _value_dot(_weights(p2, scale2, inv_unit), acc, values.index(2).load(_VALUE_LOAD))
    acc = _value_dot(_weights(p3, scale3, inv_unit), acc, values.index(3).load(_VALUE_LOAD))
    return m, l, unit, acc


@gluon.jit
def _mma_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, topk, num_rows,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt, stride_lh,
    page_stride_u8, page_stride_f32, page_stride_bf16,
    scale_log2,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    HAS_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, CONTIGUOUS: gl.constexpr,
):
    """:mod:`mla_planner.kernels.fp8_mma`'s kernel, each block's rows copied into shared memory while
    the block before runs (two stages). The loop takes two blocks a step, one
    from each stage, so that each stage is its own allocation: Triton then sees that copying into
    one does not race with reading the other, and adds no barrier between them."""
    gl.static_assert(BLOCK_N == 64, "a stage holds 64 rows")
    t, h0, n_end, idx_row, q16, qr, down = _program(q_ptr, idx_ptr, len_ptr, num_heads, topk, stride_qt, stride_qh,
                                                    stride_it, scale_log2, BLOCK_H, HAS_LENGTH)
    parts0, parts1, parts2, parts3 = _parts()
    keys0, values0, rope0, scales0, flags0, entries0 = _stage()
    keys1, values1, rope1, scales1, flags1, entries1 = _stage()
    # The indices of the first two blocks, then the first block's rows: from here on a block's
    # indices land a block ahead of its rows, so that starting a copy waits on shared memory only.
    _fetch_entries(entries0, idx_row, 0, n_end)
    _fetch_entries(entries1, idx_row, BLOCK_N, n_end)
    async_copy.commit_group()
    async_copy.wait_group(0)
    _cta_barrier()
    _fill(keys0, rope0, scales0, flags0, entries0, kv_u8, 0, n_end, num_rows, page_stride_u8, PAGE, CONTIGUOUS)
    async_copy.commit_group()
    m, l, unit, acc = _fresh_state()
    for start in range(0, n_end, 2 * BLOCK_N):
        m, l, unit, acc = _block(keys0, values0, rope0, scales0, flags0, entries0, keys1, rope1, scales1, flags1,
                                 entries1, parts0, parts1, parts2, parts3, q16, qr, down, m, l, unit, acc, kv_u8,
                                 idx_row, start, n_end, num_rows, page_stride_u8, PAGE, CONTIGUOUS)
        if start + BLOCK_N < n_end:
            m, l, unit, acc = _block(keys1, values1, rope1, scales1, flags1, entries1, keys0, rope0, scales0, flags0,
                                     entries0, parts0, parts1, parts2, parts3, q16, qr, down, m, l, unit, acc, kv_u8,
                                     idx_row, start + BLOCK_N, n_end, num_rows, page_stride_u8, PAGE, CONTIGUOUS)
    async_copy.wait_group(0)  # the copies past the end (all masked) land before the program exits

    _epilogue(acc, unit, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt,
              stride_lh, HAS_SINK)


@gluon.jit
def _epilogue(acc, unit, m, l, sink_ptr, out_ptr, lse_ptr, t, h0, num_heads, stride_ot, stride_oh, stride_lt,
              stride_lh, HAS_SINK: gl.constexpr):
    """lse and O = acc x unit / (l + the sink's weight), each tile's columns back in cache order."""
    heads = h0 + gl.arange(0, 16, layout=m.type.layout)
    inv = store_lse(m, l, heads, sink_ptr, lse_ptr, t, num_heads, stride_lt, stride_lh, HAS_SINK)
    o = (acc * (_per_tile(unit) * _per_head(inv))).to(gl.bfloat16)
    h = h0 + _index(16, _MMA, 1, 3)
    col = 128 * _index(4, _MMA, 0, 3) + _value_column(_index(128, _MMA, 2, 3))
    gl.store(out_ptr + t * stride_ot + h * stride_oh + col, o, mask=h < num_heads)


def launch(q: torch.Tensor, cache3: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None,
           attn_sink: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, page_stride: int,
           scale_log2: float) -> None:
    """This module's kernel, as :func:`mla_planner.kernels.fp8_wgmma.launch_kernel` says, 16 heads a
    program."""
    launch_kernel(_mma_kernel, q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, scale_log2, BLOCK_H,
                  block_n=BLOCK_N, CONTIGUOUS=page_stride == cache3.shape[1] * 656, num_warps=NUM_WARPS)
