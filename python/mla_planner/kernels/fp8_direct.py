# Triton kernels take untyped arguments (Triton reads their annotations itself: tl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""Sparse MLA attention that reads the ``fp8_ds_mla`` cache directly, at the native head count.

The separate route today gathers a request's FP8 cache rows, up-converts them to a BF16 workspace
and runs FlashMLA's sparse prefill kernel on it, with the query padded to 64 heads on SM90. This
kernel skips both: it gathers each query's top-k 656-byte rows straight from the paged cache,
dequantises them in registers and attends with the query's real heads (16 or 32 per rank for
DeepSeek-V3.2). Its only outputs are ``out`` (the caller's) and ``lse``; there is no workspace and
no split-KV scratch (docs/fp8-direct.md).

Semantics are those of :func:`mla_planner.executor.reference.sparse_attention` on ``fp8_ds_mla``
rows, plus FlashMLA's ``attn_sink`` and ``topk_length`` (``flash_mla_sparse_fwd``'s docstring):

* an index is valid iff ``0 <= i < num_pages * page_size`` and it is among the row's first
  ``topk_length[t]`` entries; an invalid entry weighs nothing (its row is never read);
* ``lse`` is the natural-log log-sum-exp of the scaled scores, ``+inf`` for a query with no valid
  index (whose output is all zeros);
* ``attn_sink[h]`` multiplies head ``h``'s output by ``exp(lse) / (exp(lse) + exp(sink))``, i.e.
  adds ``exp(sink)`` to the softmax denominator with no value; it does not change ``lse``.

Precision matches FlashMLA's BF16 path: dequantisation is exact in BF16 (an e4m3 value times a
power-of-two scale), the score dots take BF16 operands with FP32 accumulation, the softmax runs in
FP32, and the probabilities enter the value dot as BF16.

Why not FP8 tensor-core dots: the FP8 MMA needs *both* operands in FP8, so the query would have
to be quantised too (3 mantissa bits, a relative error near 2^-4 per element), which FlashMLA's
tolerances (rel 3/128 on the output) do not allow. The cache's FP8 bytes are therefore converted
to BF16 in registers, once per key row per program, and shared by all the program's heads.

This module imports torch and triton only; nothing here runs at import time.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mla_planner.executor.layout import D_NOPE, D_QK, D_ROPE, D_V, FP8_BYTES_PER_TOKEN, NUM_TILES, ROPE_START, SCALES_START, TILE

__all__ = ["DEFAULT_CONFIG", "DEQUANT_MODES", "DV_SPLITS", "MMA_CONFIG", "SCALE_LOADS", "WGMMA_CONFIG", "WGMMA_RA_CONFIG", "WGMMA_WS_CONFIG", "KernelConfig", "sparse_attention_fp8"]

LOG2E = 1.4426950408889634  # log2(e): the kernel's softmax runs in base 2

DEQUANT_MODES = {"f32": 0, "bits": 1}
"""The exact dequantisations a :class:`KernelConfig` can ask for, and the kernel's ``DEQUANT`` code
of each."""
SCALE_LOADS = ("f32", "v4")
"""How a row's four tile scales are fetched (:class:`KernelConfig`'s ``scales``)."""
DV_SPLITS = (1, 2)
"""Programs a (token, head group)'s 512 output columns can be split over (``dv_split``)."""
SCALES_V4_ASM = tl.constexpr("""{
    .reg .pred p;
    setp.ne.b32 p, $5, 0;
    mov.b32 $0, 0;
    mov.b32 $1, 0;
    mov.b32 $2, 0;
    mov.b32 $3, 0;
    @p ld.global.v4.b32 {$0, $1, $2, $3}, [$4];
}""")
"""One 16-byte load of a row's four tile scales (bytes [512, 528)): ``$4`` the address, ``$5``
nonzero where the row is valid; an invalid row reads nothing and gets four zeros, as the masked
loads give. The address is 16-byte aligned: the launcher checks the cache's base and page stride,
and a row starts at a multiple of 656 = 16 x 41 bytes, so byte 512 = 16 x 32 of it is too.
(A ``tl.constexpr``: a kernel reads no other module global.)"""
BOUND_PROBES = {"none": 2, "widen": 3}
"""The kernel's ``DEQUANT`` codes of :func:`no_dequant_bound_probe`'s two probes (wrong results by
design): not :class:`KernelConfig` modes, so nothing that takes a config can select them."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_launch(block_n: int, num_warps: int, num_stages: int) -> None:
    """``ValueError`` unless the launch knobs are ones the kernel's loop and Triton take: a
    power-of-two block of at least 16 entries, 1 to 16 warps, at least one stage."""
    _check(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}")
    _check(num_warps in (1, 2, 4, 8, 16), f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    _check(num_stages >= 1, f"num_stages must be >= 1, got {num_stages}")


_WGMMA_FIXED: dict[str, object] = {
    "block_n": 64, "num_warps": 4, "num_stages": 1, "keys_as_m": True, "dequant": "f32", "scales": "f32",
    "dv_split": 1, "max_regs": None,
}
"""The warpgroup-MMA kernel's layout, fixed: 64 keys a block, one warpgroup, keys as M."""
_MMA_FIXED: dict[str, object] = {**_WGMMA_FIXED, "keys_as_m": False, "head_block": 16}
"""The register-operand ``mma.sync`` kernel's layout, fixed: 64 keys a softmax step, four warps
(one a scale tile), 16 heads a program as M."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The kernel's tuning knobs (all compile-time), so a benchmark can sweep them in one run.

    ``block_n``: top-k entries (key rows) gathered per loop iteration, a power of two >= 16.
    ``num_warps`` / ``num_stages``: Triton's launch options (``num_stages`` > 1 lets Triton's
    software pipeliner prefetch the next block's indices and rows while this block computes).
    ``keys_as_m``: which operand fills the MMA's M side. ``False``: heads x keys (M = heads, the
    straightforward layout; at 16 heads Hopper falls back to ``mma.sync``, since ``wgmma`` needs
    M >= 64). ``True``: the transposed products ``K Q^T`` and ``V^T P^T`` so the key block (or the
    512 value columns) is M and the heads are N, which ``wgmma`` takes down to N = 8/16.
    ``head_block``: heads per program (a power of two >= 16, padded heads masked off), ``None``:
    all heads in one program up to 32 (each gathered row is then read once per token); more heads
    are split over programs that each re-read the rows (the accumulator is heads x 512 floats).
    ``dequant``: how the FP8 bytes become BF16 (:data:`DEQUANT_MODES`), both exact and equal:
    ``"f32"`` converts through Triton's e4m3 -> float32 cast, ``"bits"`` places each byte's
    sign, exponent and mantissa into float32 bits with integer operations and rescales once.
    ``scales``: how each row's four float32 tile scales are read (:data:`SCALE_LOADS`). ``"f32"``:
    one masked ``(block_n, 4)`` float32 load, which Triton spreads one scale per thread (at 32 keys
    and 4 warps there are as many scales as threads), so each scale is its own 4-byte copy;
    ``"v4"``: each row's 16 scale bytes as one 16-byte ``ld.global.v4`` (inline PTX, which
    Triton neither vectorises differently nor pipelines), four values per row handed to the
    dequantisation. Same values either way.
    ``dv_split``: programs per (token, head group) (:data:`DV_SPLITS`). 2: each program keeps only
    its half of the 512 output columns (the accumulator is heads x 256), gathers a row's NoPE bytes
    as two 256-byte halves (its own, kept for the value dot, and the other, used for the scores and
    dropped) and computes the full scores; a row is then gathered by both programs (neighbours in
    launch order, so the second read can come from L2) and the score dot is done twice.
    ``max_regs``: Triton's ``maxnreg`` (registers a thread at most; ptxas spills beyond), ``None``:
    ptxas' own choice. Fewer registers a thread let more programs share an SM.
    ``wgmma``: run :mod:`mla_planner.kernels.fp8_wgmma`'s warpgroup-MMA kernel instead, whose
    layout is fixed: 64 keys a block, one warpgroup, keys as M (:data:`WGMMA_CONFIG`); the other
    knobs must keep those values and their defaults.
    ``warp_specialized``: with ``wgmma``, run its warp-specialised variant
    (:mod:`mla_planner.kernels.fp8_wgmma_ws`, :data:`WGMMA_WS_CONFIG`).
    ``a_in_registers``: with ``wgmma``, run its variant whose score dot takes the key block from
    registers (:data:`WGMMA_RA_CONFIG`).
    ``mma_sync``: run :mod:`mla_planner.kernels.fp8_mma`'s kernel, the heads as ``mma.sync``'s M,
    each block's rows copied into shared memory while the block before runs (:data:`MMA_CONFIG`,
    its only layout).
    """

    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 3
    keys_as_m: bool = True
    head_block: int | None = None
    dequant: str = "f32"
    scales: str = "f32"
    dv_split: int = 1
    max_regs: int | None = None
    wgmma: bool = False
    warp_specialized: bool = False
    a_in_registers: bool = False
    mma_sync: bool = False

    def __post_init__(self) -> None:
        check_launch(self.block_n, self.num_warps, self.num_stages)
        if self.mma_sync and (self.wgmma or any(getattr(self, name) != value for name, value in _MMA_FIXED.items())):
            fixed = KernelConfig(**_MMA_FIXED, mma_sync=True).label()  # type: ignore[arg-type]
            raise ValueError(f"the mma.sync kernel takes only '{fixed}', got {self.label()!r}")
        if self.wgmma and any(getattr(self, name) != value for name, value in _WGMMA_FIXED.items()):
            fixed = KernelConfig(**_WGMMA_FIXED, wgmma=True).label()  # type: ignore[arg-type]
            raise ValueError(f"the wgmma kernel takes only '{fixed}' (+ hb16 or hb32), got {self.label()!r}")
        if self.warp_specialized and not self.wgmma:
            raise ValueError("warp_specialized (ws) is a variant of the wgmma kernel (wg)")
        if self.a_in_registers and (not self.wgmma or self.warp_specialized):
            raise ValueError("a_in_registers (ra) is a variant of the wgmma kernel (wg), not of ws")
        if self.wgmma and self.head_block not in (None, 16, 32):
            raise ValueError(f"the wgmma kernel takes 16 or 32 heads a program, got head_block {self.head_block}")
        if self.head_block is not None and (self.head_block < 16 or self.head_block & (self.head_block - 1)):
            raise ValueError(f"head_block must be a power of two >= 16, got {self.head_block}")
        if self.dequant not in DEQUANT_MODES:
            raise ValueError(f"dequant must be one of {sorted(DEQUANT_MODES)}, got {self.dequant!r}")
        if self.scales not in SCALE_LOADS:
            raise ValueError(f"scales must be one of {SCALE_LOADS}, got {self.scales!r}")
        if self.dv_split not in DV_SPLITS:
            raise ValueError(f"dv_split must be one of {DV_SPLITS}, got {self.dv_split}")
        if self.max_regs is not None and not (32 <= self.max_regs <= 255 and self.max_regs % 8 == 0):
            # 255 is a thread's most; a cap between multiples of 8 buys nothing, since an SM hands
            # registers to a warp 8 a thread at a time.
            raise ValueError(f"max_regs must be a multiple of 8 in [32, 255], got {self.max_regs}")

    def heads_per_program(self, num_heads: int) -> int:
        if self.head_block is not None:
            return self.head_block
        return min(max(16, int(triton.next_power_of_2(num_heads))), 32)

    def label(self) -> str:
        """Short name for tables: ``n64 w8 s2 hm`` (``km`` for keys_as_m), ``hb16`` if set, the
        dequant mode if not the default ``f32`` (``n32 w4 s2 hm bits``), then ``sv4`` for the
        16-byte scale load, ``dv2`` for a split output, ``r168`` for a register cap, ``wg`` for the
        warpgroup-MMA kernel, ``ws`` and ``ra`` for its warp-specialised and register-operand
        variants, ``mma`` for the ``mma.sync`` kernel."""
        parts = [f"n{self.block_n}", f"w{self.num_warps}", f"s{self.num_stages}", "km" if self.keys_as_m else "hm"]
        if self.head_block is not None:
            parts.append(f"hb{self.head_block}")
        if self.dequant != "f32":
            parts.append(self.dequant)
        if self.scales != "f32":
            parts.append(f"s{self.scales}")
        if self.dv_split != 1:
            parts.append(f"dv{self.dv_split}")
        if self.max_regs is not None:
            parts.append(f"r{self.max_regs}")
        if self.wgmma:
            parts.append("wg")
        if self.warp_specialized:
            parts.append("ws")
        if self.a_in_registers:
            parts.append("ra")
        if self.mma_sync:
            parts.append("mma")
        return " ".join(parts)

    @classmethod
    def parse(cls, label: str) -> KernelConfig:
        """The inverse of :meth:`label` (fields left out keep their defaults)."""
        fields: dict[str, object] = {}
        keys = {"n": "block_n", "w": "num_warps", "s": "num_stages", "hb": "head_block", "dv": "dv_split", "r": "max_regs"}
        for part in label.split():
            if part in ("km", "hm"):
                fields["keys_as_m"] = part == "km"
                continue
            if part == "wg":
                fields["wgmma"] = True
                continue
            if part == "ws":
                fields["warp_specialized"] = True
                continue
            if part == "ra":
                fields["a_in_registers"] = True
                continue
            if part == "mma":
                fields["mma_sync"] = True
                continue
            if part in DEQUANT_MODES:
                fields["dequant"] = part
                continue
            if part.startswith("s") and part[1:] in SCALE_LOADS:
                fields["scales"] = part[1:]
                continue
            name = part.rstrip("0123456789")
            if name not in keys or name == part:
                raise ValueError(f"cannot parse {part!r} in config label {label!r}")
            fields[keys[name]] = int(part[len(name):])
        return cls(**fields)  # type: ignore[arg-type]


WGMMA_CONFIG = KernelConfig(**_WGMMA_FIXED, wgmma=True)  # type: ignore[arg-type]
"""The warpgroup-MMA kernel (:mod:`mla_planner.kernels.fp8_wgmma`), the only config it takes."""
WGMMA_WS_CONFIG = KernelConfig(**_WGMMA_FIXED, wgmma=True, warp_specialized=True)  # type: ignore[arg-type]
"""The same kernel with a producer partition gathering into two shared stages
(:mod:`mla_planner.kernels.fp8_wgmma_ws`)."""
WGMMA_RA_CONFIG = KernelConfig(**_WGMMA_FIXED, wgmma=True, a_in_registers=True)  # type: ignore[arg-type]
"""The wgmma kernel with the score dot's key block in registers (one shared read of the tile a
block, not two)."""
MMA_CONFIG = KernelConfig(**_MMA_FIXED, mma_sync=True)  # type: ignore[arg-type]
"""The ``mma.sync`` kernel with every key byte gathered straight into registers
(:mod:`mla_planner.kernels.fp8_mma`), the only config it takes."""

DEFAULT_CONFIG = KernelConfig()
"""Chosen, before any timing, as the config that compiles for sm90 without register spills at both
16 and 32 heads (``benchmarks/fp8_direct_bench.py --compile-report``); the benchmark's sweep is
what decides."""


@triton.jit
def _dequant_f32(nope, scales, BLOCK_N: tl.constexpr):
    """FP8 bytes ``(BLOCK_N, W)`` x tile scales ``(BLOCK_N, W / 128)`` -> BF16 (W = 512, or 256 for
    half a row), through Triton's e4m3
    -> float32 cast (on sm90: a packed e4m3x2 -> f16x2 convert, f16 -> f32, a multiply, a packed
    f32 -> bf16 convert).

    e4m3 -> float32 is exact, times a power of two is exact, -> bfloat16 is exact again (every
    e4m3 value times a power of two in range is a bfloat16 value): the BF16 operand equals the
    float32 reference's dequantised key. (Multiplying in bfloat16 instead needs Triton's e4m3 ->
    bfloat16 cast, which Triton 3.8 compiles for sm90 through a one-value f16 -> bf16 convert per
    element, and its interpreter computes bfloat16 arithmetic on the raw bits.)"""
    k = nope.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    k = tl.reshape(k, (BLOCK_N, nope.shape[1] // 128, 128)) * scales[:, :, None]
    return tl.reshape(k, (BLOCK_N, nope.shape[1])).to(tl.bfloat16)


@triton.jit
def _dequant_bits(nope, scales, BLOCK_N: tl.constexpr):
    """The same values as :func:`_dequant_f32` with no FP8 convert instruction: integer operations
    put each byte's bits into a float32, one multiply rescales it, one packed convert rounds to
    BF16 (exact).

    An e4m3 byte ``s eeee mmm``, sign-extended and shifted left by 20, then masked to bit 31 and
    bits 26..20, is the float32 ``s 0000eeee mmm0...``: exponent field ``e`` and mantissa ``m``,
    i.e. the e4m3 value times 2^-120 (bias 127 against 7). That holds for the e4m3 subnormals too
    (``e = 0``: ``m/8 x 2^-126`` is the float32 subnormal with those bits) and for zero and
    negative zero, so one multiply by ``scale x 2^120`` gives exactly what the f32 path's e4m3
    -> float32 cast times ``scale`` gives (Triton's multiply keeps float32 subnormals: no
    ``.ftz``). Two limits, both outside what the cache holds: a tile scale of 2^8 or more makes
    ``scale x 2^120`` infinite, and the NaN bytes (``0x7F``/``0xFF``, which no quantiser writes)
    come out as +-480 instead of NaN."""
    t = nope.to(tl.int8, bitcast=True).to(tl.int32)
    bits = (t << 20) & -2014314496  # 0x87F00000 as int32: the sign bit and bits 26..20
    k = bits.to(tl.float32, bitcast=True)
    factor = scales * 1.329227995784916e36  # 2^120, exact in float32
    k = tl.reshape(k, (BLOCK_N, nope.shape[1] // 128, 128)) * factor[:, :, None]
    return tl.reshape(k, (BLOCK_N, nope.shape[1])).to(tl.bfloat16)


@triton.jit
def _tile_scales(kv_u8, kv_f32, row_u8, row_f32, valid, BLOCK_N: tl.constexpr, SCALES_V4: tl.constexpr):
    """The four float32 tile scales of rows ``row`` (bytes [512, 528) of each), ``(BLOCK_N, 4)``;
    zeros for invalid rows. ``SCALES_V4``: one 16-byte load a row (:data:`SCALES_V4_ASM`), else
    Triton's masked load of float32 elements 128..131."""
    if SCALES_V4:
        s0, s1, s2, s3 = tl.inline_asm_elementwise(
            SCALES_V4_ASM, "=r,=r,=r,=r,l,r", [kv_u8 + row_u8 + 512, valid.to(tl.int32)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        # join(join(s0, s2), join(s1, s3))[r, j, i] is scale 2j + i, so the reshape is in tile order.
        scales = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (BLOCK_N, 4))
        scales = scales.to(tl.float32, bitcast=True)
    else:
        # One float32 scale per 128-wide tile, at bytes [512, 528): float32 element 128 + tile.
        tiles = tl.arange(0, 4)
        scales = tl.load(kv_f32 + row_f32[:, None] + 128 + tiles[None, :], mask=valid[:, None], other=0.0)
    return scales


@triton.jit
def _convert(nope, scales, BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr):
    """FP8 bytes -> BF16 under ``DEQUANT`` 0 (f32), 1 (bits) or 3 (the widen probe)."""
    if DEQUANT == 3:
        # Byte b -> BF16 bits b << 6: exponent field b >> 1 (<= 127), so finite, at most 2.
        k = (nope.to(tl.int16) << 6).to(tl.bfloat16, bitcast=True)
    elif DEQUANT == 1:
        k = _dequant_bits(nope, scales, BLOCK_N)
    else:
        k = _dequant_f32(nope, scales, BLOCK_N)
    return k


@triton.jit
def _gather_keys(kv_u8, kv_f32, kv_bf16, idx, valid, page_stride_u8, page_stride_f32, page_stride_bf16,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr, SCALES_V4: tl.constexpr):
    """Rows ``idx`` (``(BLOCK_N,)`` slots) of the paged cache -> NoPE ``(BLOCK_N, 512)`` and RoPE
    ``(BLOCK_N, 64)``, both BF16. Invalid rows are not read (masked loads) and come back as zeros,
    so even a NaN-filled slot behind a ``-1`` contributes nothing.

    The same bytes are addressed through three views of one cache (uint8, float32, bfloat16):
    a row starts at ``page * page_stride + offset * 656`` bytes, a multiple of 16 bytes, so each
    thread's 16 consecutive FP8 bytes become one 16-byte load and a row's 512 NoPE bytes are read
    by 32 threads in a coalesced sweep (656 = 16 * 41, which Triton's divisibility analysis sees).

    ``DEQUANT``: 0 and 1 are :data:`DEQUANT_MODES`' ``f32`` and ``bits``; 2 and 3 are the bound
    probes (:func:`no_dequant_bound_probe`, meaningless results): 2 (``none``) reads the row's 512
    NoPE bytes as 256 BF16 values and uses each twice -- the same bytes loaded, no dequantisation
    work at all, but a load of another dtype, which Triton may stage differently; 3 (``widen``)
    loads the bytes as the exact modes do and only widens each into BF16 bits (a shift), no scale
    (so no scale is loaded either). ``SCALES_V4``: :func:`_tile_scales`.
    """
    page = (idx // PAGE).to(tl.int64)
    offset = (idx % PAGE).to(tl.int64)
    row_bf16 = page * page_stride_bf16 + offset * 328
    if DEQUANT == 2:
        raw = tl.load(kv_bf16 + row_bf16[:, None] + tl.arange(0, 256)[None, :], mask=valid[:, None], other=0.0)
        k = tl.reshape(tl.join(raw, raw), (BLOCK_N, 512))
    else:
        cols = tl.arange(0, 512)
        row_u8 = page * page_stride_u8 + offset * 656
        nope = tl.load(kv_u8 + row_u8[:, None] + cols[None, :], mask=valid[:, None], other=0)
        row_f32 = page * page_stride_f32 + offset * 164
        scales = _tile_scales(kv_u8, kv_f32, row_u8, row_f32, valid, BLOCK_N, SCALES_V4)
        k = _convert(nope, scales, BLOCK_N, DEQUANT)
    # The RoPE part: 64 bfloat16 at bytes [528, 656) = bfloat16 elements [264, 328).
    rope_cols = tl.arange(0, 64)
    k_rope = tl.load(kv_bf16 + row_bf16[:, None] + 264 + rope_cols[None, :], mask=valid[:, None], other=0.0)
    return k, k_rope


@triton.jit
def _gather_halves(kv_u8, kv_f32, kv_bf16, idx, valid, page_stride_u8, page_stride_f32, page_stride_bf16, half,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr, SCALES_V4: tl.constexpr):
    """:func:`_gather_keys` with the NoPE part as two ``(BLOCK_N, 256)`` BF16 halves: columns
    ``[256 half, 256 half + 256)`` (the program's own, the value operand) and the other 256
    columns; then the RoPE part. Each half is dequantised with its own two tile scales."""
    page = (idx // PAGE).to(tl.int64)
    offset = (idx % PAGE).to(tl.int64)
    row_bf16 = page * page_stride_bf16 + offset * 328
    own0 = half * 256
    other0 = 256 - own0
    if DEQUANT == 2:
        cols = tl.arange(0, 128)
        raw = tl.load(kv_bf16 + row_bf16[:, None] + half * 128 + cols[None, :], mask=valid[:, None], other=0.0)
        k_own = tl.reshape(tl.join(raw, raw), (BLOCK_N, 256))
        raw = tl.load(kv_bf16 + row_bf16[:, None] + (128 - half * 128) + cols[None, :], mask=valid[:, None], other=0.0)
        k_other = tl.reshape(tl.join(raw, raw), (BLOCK_N, 256))
    else:
        cols = tl.arange(0, 256)
        row_u8 = page * page_stride_u8 + offset * 656
        row_f32 = page * page_stride_f32 + offset * 164
        scales = tl.reshape(_tile_scales(kv_u8, kv_f32, row_u8, row_f32, valid, BLOCK_N, SCALES_V4), (BLOCK_N, 2, 2))
        # Tiles 2 half and 2 half + 1 are the own half's; picked by a select and a sum of one term
        # (exact), since a register tensor cannot be indexed at a runtime position.
        own_tiles = tl.arange(0, 2)[None, :, None] == half
        scales_own = tl.sum(tl.where(own_tiles, scales, 0.0), axis=1)
        scales_other = tl.sum(tl.where(own_tiles, 0.0, scales), axis=1)
        nope = tl.load(kv_u8 + row_u8[:, None] + own0 + cols[None, :], mask=valid[:, None], other=0)
        k_own = _convert(nope, scales_own, BLOCK_N, DEQUANT)
        nope = tl.load(kv_u8 + row_u8[:, None] + other0 + cols[None, :], mask=valid[:, None], other=0)
        k_other = _convert(nope, scales_other, BLOCK_N, DEQUANT)
    rope_cols = tl.arange(0, 64)
    k_rope = tl.load(kv_bf16 + row_bf16[:, None] + 264 + rope_cols[None, :], mask=valid[:, None], other=0.0)
    return k_own, k_other, k_rope


@triton.jit
def _sparse_fp8_kernel(
    q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, topk, num_rows,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh, stride_lt, stride_lh,
    page_stride_u8, page_stride_f32, page_stride_bf16,
    scale_log2,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LENGTH: tl.constexpr,
    HAS_SINK: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
    DEQUANT: tl.constexpr,
    SCALES_V4: tl.constexpr,
    DV_SPLIT: tl.constexpr,
):
    """One program = one query token x ``BLOCK_H`` heads (x one of ``DV_SPLIT`` parts of the 512
    output columns). All of a token's heads share one program so each gathered key row is read and
    dequantised once per token, not once per head; the rows of different tokens differ (each has
    its own top-k), so a program never shares them across tokens. Online softmax over blocks of
    ``BLOCK_N`` top-k entries, in the base-2 domain (``scale_log2`` = softmax scale * log2(e));
    O accumulates in float32 registers. With ``DV_SPLIT`` = 2, programs ``2t`` and ``2t + 1``
    take token ``t``'s two output halves: launched next to each other, so the rows the first
    gathers are still in L2 when the second gathers them."""
    if DV_SPLIT == 1:
        t = tl.program_id(0).to(tl.int64)
        half = 0
    else:
        t = (tl.program_id(0) // DV_SPLIT).to(tl.int64)
        half = tl.program_id(0) % DV_SPLIT
    DV: tl.constexpr = 512 // DV_SPLIT
    h0 = tl.program_id(1) * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    d_rope = tl.arange(0, 64)

    # The query, loaded once: (BLOCK_H, 512) NoPE (or its own half and the other half) and
    # (BLOCK_H, 64) RoPE, bf16; padded heads are 0.
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    if DV_SPLIT == 1:
        d_nope = tl.arange(0, 512)
        q_nope = tl.load(q_row + d_nope[None, :], mask=head_ok[:, None], other=0.0)
    else:
        d_half = tl.arange(0, 256)
        d_nope = half * 256 + d_half  # the output columns this program writes
        q_nope = tl.load(q_row + d_nope[None, :], mask=head_ok[:, None], other=0.0)
        q_other = tl.load(q_row + (256 - half * 256) + d_half[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + 512 + d_rope[None, :], mask=head_ok[:, None], other=0.0)

    n_end = topk
    if HAS_LENGTH:
        n_end = tl.minimum(tl.load(len_ptr + t), topk)

    # Running max m (base 2) and denominator l per head; acc is O (heads x 512), or its transpose.
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    if KEYS_AS_M:
        acc = tl.zeros((DV, BLOCK_H), tl.float32)
        q_nope_t = tl.trans(q_nope)
        q_rope_t = tl.trans(q_rope)
        if DV_SPLIT != 1:
            q_other_t = tl.trans(q_other)
    else:
        acc = tl.zeros((BLOCK_H, DV), tl.float32)

    for start in range(0, n_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_row = n < n_end
        idx = tl.load(idx_ptr + t * stride_it + n, mask=in_row, other=-1)
        valid = in_row & (idx >= 0) & (idx < num_rows)
        if DV_SPLIT == 1:
            k, k_rope = _gather_keys(kv_u8, kv_f32, kv_bf16, idx, valid, page_stride_u8, page_stride_f32,
                                     page_stride_bf16, PAGE, BLOCK_N, DEQUANT, SCALES_V4)
        else:
            # k: this program's half of the columns (the value operand); k_other only scores.
            k, k_other, k_rope = _gather_halves(kv_u8, kv_f32, kv_bf16, idx, valid, page_stride_u8, page_stride_f32,
                                                page_stride_bf16, half, PAGE, BLOCK_N, DEQUANT, SCALES_V4)
        if KEYS_AS_M:
            # S^T (BLOCK_N, heads) = K Q^T: the key block is the MMA's M side.
            if DV_SPLIT == 1:
                s = tl.dot(k, q_nope_t) + tl.dot(k_rope, q_rope_t)
            else:
                s = tl.dot(k, q_nope_t) + tl.dot(k_other, q_other_t) + tl.dot(k_rope, q_rope_t)
            s = tl.where(valid[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            # A head with no valid key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[None, :])
            l = l * alpha + tl.sum(p, axis=0)
            # O^T (DV, heads) += V^T P^T: the value columns (512, or this half's 256) are M.
            acc = acc * alpha[None, :] + tl.dot(tl.trans(k), p.to(tl.bfloat16))
        else:
            # S (heads, BLOCK_N) = Q K^T over the 576 dims: NoPE part + RoPE part.
            if DV_SPLIT == 1:
                s = tl.dot(q_nope, tl.trans(k)) + tl.dot(q_rope, tl.trans(k_rope))
            else:
                s = tl.dot(q_nope, tl.trans(k)) + tl.dot(q_other, tl.trans(k_other)) + tl.dot(q_rope, tl.trans(k_rope))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # O (heads, DV) += P V, V = the dequantised NoPE part (MLA: the value is the latent).
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
        m = m_new

    # Epilogue. lse = ln(sum exp(score)) = (m + log2 l) * ln 2; +inf where no key was valid.
    has_keys = l > 0.0
    denom = l
    if HAS_SINK:
        # exp(sink) / exp(m) in the base-2 domain; a +inf sink zeroes the head, -inf adds nothing.
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
        m_fin = tl.where(has_keys, m, 0.0)
        denom = l + tl.exp2(sink * 1.4426950408889634 - m_fin)
    inv = tl.where(has_keys, 1.0 / denom, 0.0)
    lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) * 0.6931471805599453, float("inf"))
    if DV_SPLIT == 1:
        tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok)
    else:
        # Both halves compute lse, with their score dots summed in another order; one writes it.
        tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_ok & (half == 0))
    out_row = out_ptr + t * stride_ot
    if KEYS_AS_M:
        o = (acc * inv[None, :]).to(tl.bfloat16)
        tl.store(out_row + heads[None, :] * stride_oh + d_nope[:, None], o, mask=head_ok[None, :])
    else:
        o = (acc * inv[:, None]).to(tl.bfloat16)
        tl.store(out_row + heads[:, None] * stride_oh + d_nope[None, :], o, mask=head_ok[:, None])


def paged_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The ``fp8_ds_mla`` cache as the kernel addresses it: ``(pages, page_size, 656)`` uint8 and
    its page stride in bytes; ``ValueError`` unless the rows are contiguous within a page, the page
    size a power of two, and base and page stride 16-byte aligned (the 16-byte row loads)."""
    if kv_cache.dim() == 4:
        _check(kv_cache.shape[2] == 1, f"kv_cache must have one KV head, got shape {tuple(kv_cache.shape)}")
        cache3 = kv_cache.select(2, 0)
    else:
        cache3 = kv_cache
    _check(cache3.dim() == 3 and cache3.shape[2] == FP8_BYTES_PER_TOKEN,
           f"kv_cache must be (pages, page_size, 1, {FP8_BYTES_PER_TOKEN}) fp8_ds_mla rows, got {tuple(kv_cache.shape)}")
    _check(kv_cache.dtype == torch.uint8, f"kv_cache must be uint8 (fp8_ds_mla bytes), got {kv_cache.dtype}")
    num_pages, page_size, _ = cache3.shape
    _check(page_size > 0 and page_size & (page_size - 1) == 0, f"page size must be a power of two, got {page_size}")
    _check(cache3.stride(2) == 1 and cache3.stride(1) == FP8_BYTES_PER_TOKEN,
           "kv_cache's rows must be contiguous within a page (656-byte row stride)")
    page_stride = cache3.stride(0) if num_pages > 1 else page_size * FP8_BYTES_PER_TOKEN
    _check(page_stride % 16 == 0 and cache3.data_ptr() % 16 == 0,
           f"kv_cache must be 16-byte aligned (base and page stride), page stride {page_stride}")
    return cache3, page_stride


def sparse_attention_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over the FP8 cache, argument order as ``flash_mla_sparse_fwd``'s.

    q ``(T, H, 576)`` bfloat16 (last dim contiguous; any H, heads above 32 split over programs);
    kv_cache ``(num_pages, page_size, 1, 656)`` (or ``(num_pages, page_size, 656)``) uint8
    ``fp8_ds_mla`` rows, each page's rows contiguous; indices ``(T, topk)`` (or ``(T, 1, topk)``)
    int32 cache slots ``page * page_size + offset``, ``-1`` or out of range = unused;
    ``topk_length`` ``(T,)`` int32: only each row's first that many indices count;
    ``attn_sink`` ``(H,)`` float32. ``out`` ``(T, H, 512)`` bfloat16 (a strided head slice is
    fine, last dim contiguous) and ``lse`` ``(T, H)`` float32 are written in place where given,
    else allocated. Returns ``(out, lse)``.
    """
    config = DEFAULT_CONFIG if config is None else config
    return _attend(q, kv_cache, indices, softmax_scale, out, topk_length, attn_sink, lse, config,
                   DEQUANT_MODES[config.dequant])


def no_dequant_bound_probe(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    probe: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A timing probe, not attention: :func:`sparse_attention_fp8`'s kernel with the
    dequantisation taken out. ``probe="none"``: each row's NoPE bytes read as BF16 and used as
    they are; ``"widen"``: the bytes loaded as the exact modes load them and only shifted into
    BF16 bits; neither applies the scales (:data:`BOUND_PROBES`). Same launch, gathers, dots and
    softmax; the output is meaningless by design and must never be checked or used.
    ``config.dequant`` is ignored. How much faster it runs than the exact modes bounds what any
    cheaper dequantisation could save (benchmarks/fp8_direct_bench.py --probe)."""
    config = DEFAULT_CONFIG if config is None else config
    if probe not in BOUND_PROBES:
        raise ValueError(f"probe must be one of {sorted(BOUND_PROBES)}, got {probe!r}")
    return _attend(q, kv_cache, indices, softmax_scale, out, None, None, lse, config, BOUND_PROBES[probe])


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    lse: torch.Tensor | None,
    config: KernelConfig,
    dequant: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks the arguments (``ValueError``), allocates ``out``/``lse`` where absent, launches."""
    _check(q.dim() == 3 and q.shape[2] == D_QK, f"q must be (tokens, heads, {D_QK}), got {tuple(q.shape)}")
    _check(q.dtype == torch.bfloat16, f"q must be bfloat16, got {q.dtype}")
    _check(q.stride(2) == 1, "q's last dim must be contiguous")
    num_tokens, num_heads, _ = q.shape
    _check(num_heads > 0, "q has no heads")

    cache3, page_stride = paged_cache(kv_cache)
    num_pages, page_size, _ = cache3.shape

    if indices.dim() == 3:
        _check(indices.shape[1] == 1, f"indices (tokens, 1, topk) must have one KV head, got {tuple(indices.shape)}")
        indices = indices.select(1, 0)
    _check(indices.dim() == 2 and indices.shape[0] == num_tokens,
           f"indices must be ({num_tokens}, topk), got {tuple(indices.shape)}")
    _check(indices.dtype == torch.int32, f"indices must be int32, got {indices.dtype}")
    _check(indices.stride(1) == 1, "indices' last dim must be contiguous")
    topk = indices.shape[1]
    _check(topk > 0, "topk must be at least 1")

    device = q.device
    for name, tensor in (("kv_cache", kv_cache), ("indices", indices), ("out", out), ("lse", lse),
                         ("topk_length", topk_length), ("attn_sink", attn_sink)):
        _check(tensor is None or tensor.device == device, f"{name} is on {tensor.device if tensor is not None else None}, q on {device}")
    if topk_length is not None:
        _check(tuple(topk_length.shape) == (num_tokens,) and topk_length.dtype == torch.int32,
               f"topk_length must be ({num_tokens},) int32, got {tuple(topk_length.shape)} {topk_length.dtype}")
        _check(topk_length.is_contiguous(), "topk_length must be contiguous")
    if attn_sink is not None:
        _check(tuple(attn_sink.shape) == (num_heads,) and attn_sink.dtype == torch.float32,
               f"attn_sink must be ({num_heads},) float32, got {tuple(attn_sink.shape)} {attn_sink.dtype}")
        _check(attn_sink.is_contiguous(), "attn_sink must be contiguous")
    if out is None:
        out = torch.empty((num_tokens, num_heads, D_V), dtype=torch.bfloat16, device=device)
    _check(tuple(out.shape) == (num_tokens, num_heads, D_V) and out.dtype == torch.bfloat16,
           f"out must be ({num_tokens}, {num_heads}, {D_V}) bfloat16, got {tuple(out.shape)} {out.dtype}")
    _check(out.stride(2) == 1, "out's last dim must be contiguous")
    if lse is None:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    _check(tuple(lse.shape) == (num_tokens, num_heads) and lse.dtype == torch.float32,
           f"lse must be ({num_tokens}, {num_heads}) float32, got {tuple(lse.shape)} {lse.dtype}")
    if num_tokens == 0:
        return out, lse

    block_h = config.heads_per_program(num_heads)
    # Three views of the cache's bytes: FP8 NoPE (uint8), scales (float32), RoPE (bfloat16).
    # (Each view's strides are the byte strides over 4 and 2: the page stride is a multiple of 16.)
    kv_f32 = cache3.view(torch.float32)
    kv_bf16 = cache3.view(torch.bfloat16)
    # Absent optional inputs get a stand-in pointer of the same dtype, never read (HAS_* False).
    # Read-only inputs stand in: Triton's interpreter copies every argument back after the run,
    # so passing an output twice would clobber it there.
    if config.mma_sync:
        _check(dequant == DEQUANT_MODES["f32"], "the mma.sync kernel has no bound probes")
        from mla_planner.kernels import fp8_mma  # Gluon: imported only where asked for

        fp8_mma.launch(q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, softmax_scale * LOG2E)
        return out, lse
    if config.wgmma:
        _check(dequant == DEQUANT_MODES["f32"], "the wgmma kernel has no bound probes")
        from mla_planner.kernels import fp8_wgmma, fp8_wgmma_ws  # Gluon: imported only where asked for

        args = (q, cache3, indices, topk_length, attn_sink, out, lse, page_stride, softmax_scale * LOG2E, block_h)
        if config.warp_specialized:
            fp8_wgmma_ws.launch(*args)
        else:
            fp8_wgmma.launch(*args, a_in_registers=config.a_in_registers)
        return out, lse
    grid = (num_tokens * config.dv_split, triton.cdiv(num_heads, block_h))
    # maxnreg only where asked: the default launch stays as it was.
    launch_options = {} if config.max_regs is None else {"maxnreg": config.max_regs}
    _sparse_fp8_kernel[grid](
        q, cache3, kv_f32, kv_bf16, indices,
        topk_length if topk_length is not None else indices,
        attn_sink if attn_sink is not None else kv_f32,
        out, lse,
        num_heads, topk, num_pages * page_size,
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        page_stride, page_stride // 4, page_stride // 2,
        softmax_scale * LOG2E,
        PAGE=page_size,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        HAS_LENGTH=topk_length is not None,
        HAS_SINK=attn_sink is not None,
        KEYS_AS_M=config.keys_as_m,
        DEQUANT=dequant,
        SCALES_V4=config.scales == "v4",
        DV_SPLIT=config.dv_split,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options,
    )
    return out, lse


def flops(num_tokens: int, num_heads: int, topk: int) -> int:
    """Tensor-core FLOPs of one call at its real heads: QK^T over 576 dims plus PV over 512."""
    return 2 * num_tokens * num_heads * topk * (D_QK + D_V)


def gathered_bytes(num_tokens: int, topk: int) -> int:
    """Cache bytes one call reads if nothing is reused across tokens: every valid top-k row once
    per token (per head group)."""
    return num_tokens * topk * FP8_BYTES_PER_TOKEN


# The kernel hard-codes the fp8_ds_mla offsets (Triton constants); they must match layout.py.
assert (D_NOPE, D_ROPE, TILE, NUM_TILES, SCALES_START, ROPE_START) == (512, 64, 128, 4, 512, 528)
