# Triton kernels take untyped arguments (Triton reads their annotations itself: tl.constexpr).
# mypy: disable-error-code="untyped-decorator, no-untyped-def"
"""Gather-only probe kernels for ``fp8_direct_bench.py --gather-probe``: how fast Triton gathers
each query token's top-k ``fp8_ds_mla`` rows when nothing else is done with them.

The kernel has the launch and the loads of ``mla_planner.kernels.fp8_direct``'s attention kernel
and none of its work: one program per query token loops over the token's top-k cache slots in
blocks of ``block_n`` and, for every valid slot (``0 <= slot < num_rows``; others are never read),
loads the row's 656 bytes as the attention kernel does -- the 512 NoPE bytes and the 128 RoPE
bytes as 16-byte vectors, the four tile scales as one masked ``(block_n, 4)`` 4-byte-element load
-- through an int32 view of the cache (how Triton spreads the scale block over the threads
depends on the config, as in the attention kernel: one 4-byte word a thread at 32 rows and 4
warps, wider loads at larger blocks). The loaded words are summed (int32, wrapping) column by
column over the token's valid rows, which keeps every load live at one integer add a word and a
few dozen registers a thread; each token's 164 column sums are written out (``(T, 164)``
int32), and :func:`reference_sums` computes them with torch from the same rows, so a test can
tell that the kernel read every valid row's bytes and no others (tests/test_gather_probe.py runs
it under Triton's interpreter). A config with ``programs_per_sm`` launches that many programs an
SM instead, each looping over tokens: the same loads at a capped residency.

Triton pipelines (``num_stages``) only loads whose results feed a dot, so here ``num_stages`` may
change nothing: Triton 3.8 compiles 1, 2 and 3 stages to the same code; the bench reports a hash
of each launched kernel, so equal code shows.

Not attention and not part of mla_planner: a timing probe. Run it with
``python benchmarks/fp8_direct_bench.py --gather-probe``; this file has no command line of its
own beyond ``--help`` (it prints this text).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from mla_planner.kernels.fp8_direct import check_launch, paged_cache

WORDS = 164
"""int32 words in a 656-byte ``fp8_ds_mla`` row: 128 NoPE, 4 scales, 32 RoPE (the kernel's
offsets 128 and 132)."""


@dataclass(frozen=True)
class GatherConfig:
    """Launch knobs of :func:`gather_rows`: top-k entries a loop iteration loads, Triton's
    ``num_warps`` and ``num_stages``, and ``programs_per_sm``: ``None`` launches one program per
    query token (as the attention kernel does, as many resident an SM as registers and shared
    memory allow); ``c`` launches ``c`` programs per SM (at most one a token), each looping over
    tokens ``pid, pid + grid, ...``, which caps the warps resident on an SM at ``c x num_warps``
    (if the hardware spreads the programs over the SMs, as it does a grid that fits at once):
    ``c = 2`` at 4 warps is the attention kernel's residency at ``n32 w4 s2`` (about 255 registers
    a thread, 88 KB of shared memory: two programs an SM)."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int | None = None

    def __post_init__(self) -> None:
        check_launch(self.block_n, self.num_warps, self.num_stages)
        if self.programs_per_sm is not None and self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")

    def label(self) -> str:
        """``n64 w8 s2``, then ``c2`` for two programs an SM."""
        label = f"n{self.block_n} w{self.num_warps} s{self.num_stages}"
        return label if self.programs_per_sm is None else f"{label} c{self.programs_per_sm}"

    @classmethod
    def parse(cls, label: str) -> GatherConfig:
        """The inverse of :meth:`label`, e.g. ``"n64 w8 s2"`` or ``"n32 w4 s1 c2"``."""
        keys = {"n": "block_n", "w": "num_warps", "s": "num_stages", "c": "programs_per_sm"}
        fields: dict[str, int] = {}
        for part in label.split():
            name, value = part[:1], part[1:]
            if name not in keys or not value.isdigit():
                raise ValueError(f"cannot parse {part!r} in gather config label {label!r}")
            fields[keys[name]] = int(value)
        return cls(**fields)


GATHER_SWEEP = (tuple(GatherConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3))
                + tuple(GatherConfig(n, 4, 1, programs_per_sm=2) for n in (32, 64, 128)))
"""The configs ``--gather-probe`` times by default: block_n 32/64/128 x 4/8 warps x 1/2/3 stages,
one program a token; then block_n 32/64/128 at 4 warps with two programs an SM (the attention
kernel's residency)."""


@triton.jit
def _fold(block, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """``(BLOCK_N, C)`` -> ``(G, C)``: row ``g`` the sum of block rows ``g, g + G, ...``."""
    if G == BLOCK_N:
        folded = block  # no reshape: Triton would give the trivial first axis a layout of its own
    else:
        folded = tl.sum(tl.reshape(block, (BLOCK_N // G, G, block.shape[1])), axis=0)
    return folded


@triton.jit
def _gather_token(t, kv_i32, idx_ptr, out_ptr, topk, num_rows, stride_it, stride_ot, page_stride_i32,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  G_NOPE: tl.constexpr, G_SCALE: tl.constexpr, G_ROPE: tl.constexpr):
    """Sums, column by column, the int32 words of token ``t``'s valid top-k rows into
    ``out[t, 0:128]`` (NoPE words), ``out[t, 128:132]`` (scale words), ``out[t, 132:164]`` (RoPE
    words). Addressing as the attention kernel's (``page * page_stride + offset * 164`` words, a
    multiple of 16 bytes), so the NoPE and RoPE loads are 16-byte vectors.

    Each loaded ``(BLOCK_N, C)`` block is folded into a ``(G, C)`` accumulator: viewed as
    ``(BLOCK_N / G, G, C)`` and summed over its first axis. With ``G`` the rows one tile of
    Triton's load layout covers (:func:`fold_rows`), block row ``r`` and ``r + G`` sit in the same
    thread, so the fold is one add a word in registers, with no shuffle, shared memory or barrier
    in the loop; any other ``G`` gives the same sums (a layout conversion costs time only). The
    ``(G, C)`` accumulators are summed over ``G`` once, after the loop."""
    nope_cols = tl.arange(0, 128)
    scale_cols = tl.arange(0, 4)
    rope_cols = tl.arange(0, 32)
    acc_nope = tl.zeros((G_NOPE, 128), tl.int32)
    acc_scale = tl.zeros((G_SCALE, 4), tl.int32)
    acc_rope = tl.zeros((G_ROPE, 32), tl.int32)
    for start in range(0, topk, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_row = n < topk
        idx = tl.load(idx_ptr + t * stride_it + n, mask=in_row, other=-1)
        valid = in_row & (idx >= 0) & (idx < num_rows)
        page = (idx // PAGE).to(tl.int64)
        offset = (idx % PAGE).to(tl.int64)
        row = page * page_stride_i32 + offset * 164
        # As the attention kernel: NoPE (bytes [0, 512)), the four scales ([512, 528)) as one
        # (BLOCK_N, 4) load of 4-byte elements, RoPE ([528, 656)); invalid rows are not read.
        nope = tl.load(kv_i32 + row[:, None] + nope_cols[None, :], mask=valid[:, None], other=0)
        scales = tl.load(kv_i32 + row[:, None] + 128 + scale_cols[None, :], mask=valid[:, None], other=0)
        rope = tl.load(kv_i32 + row[:, None] + 132 + rope_cols[None, :], mask=valid[:, None], other=0)
        acc_nope += _fold(nope, BLOCK_N, G_NOPE)
        acc_scale += _fold(scales, BLOCK_N, G_SCALE)
        acc_rope += _fold(rope, BLOCK_N, G_ROPE)
    out = out_ptr + t * stride_ot
    tl.store(out + nope_cols, tl.sum(acc_nope, axis=0))
    tl.store(out + 128 + scale_cols, tl.sum(acc_scale, axis=0))
    tl.store(out + 132 + rope_cols, tl.sum(acc_rope, axis=0))


@triton.jit
def gather_rows_kernel(kv_i32, idx_ptr, out_ptr, num_tokens, topk, num_rows, stride_it, stride_ot, page_stride_i32,
                        PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        G_NOPE: tl.constexpr, G_SCALE: tl.constexpr, G_ROPE: tl.constexpr, PERSISTENT: tl.constexpr):
    """Program ``pid`` gathers token ``pid`` (:func:`_gather_token`), or with ``PERSISTENT``
    tokens ``pid, pid + grid, ...``."""
    if PERSISTENT:
        for t in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
            _gather_token(tl.cast(t, tl.int64), kv_i32, idx_ptr, out_ptr, topk, num_rows, stride_it, stride_ot,
                          page_stride_i32, PAGE, BLOCK_N, G_NOPE, G_SCALE, G_ROPE)
    else:
        _gather_token(tl.program_id(0).to(tl.int64), kv_i32, idx_ptr, out_ptr, topk, num_rows, stride_it, stride_ot,
                      page_stride_i32, PAGE, BLOCK_N, G_NOPE, G_SCALE, G_ROPE)


def fold_rows(config: GatherConfig) -> dict[str, int]:
    """The kernel's ``G_*`` constants: rows of a block that one tile of Triton's load layout
    covers (each thread holds 4 words of a row: 32 threads a NoPE row, 8 a RoPE row; the
    ``(block_n, 4)`` scale block spreads over all threads), so the in-loop fold stays in
    registers. Read off Triton 3.8's sm90 layouts (``fp8_direct_bench.py --compile-report
    --gather-probe`` counts the layout conversions left in the loop); the sums do not depend on
    them."""
    return {"G_NOPE": min(config.block_n, config.num_warps), "G_SCALE": config.block_n,
            "G_ROPE": min(config.block_n, 4 * config.num_warps)}


def cache_words(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(pages, page_size, [1,] 656)`` uint8 -> its int32 view ``(pages, page_size, 164)`` and
    the page stride in words, under the attention kernel's launcher checks (:func:`paged_cache`)."""
    cache3, page_stride = paged_cache(kv_cache)
    return cache3.view(torch.int32), page_stride // 4


def gather_rows(kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None = None,
                config: GatherConfig | None = None, num_sms: int | None = None) -> tuple[torch.Tensor, Any]:
    """Loads every valid row ``indices`` names (``(T, topk)`` int32 slots ``page * page_size +
    offset``; ``-1`` or out of range = unused, never read) into ``out`` ``(T, 164)`` int32: per
    token the wrapping column sums of its valid rows' int32 words (:func:`reference_sums`).
    Returns ``(out, what Triton's launch returned)`` (the compiled kernel on a GPU: its
    ``n_regs`` and ``asm``; None where nothing was launched). ``num_sms``: the SMs a
    ``programs_per_sm`` config's grid counts (default: the GPU's; 1 off the GPU)."""
    config = GatherConfig() if config is None else config
    words, page_stride_i32 = cache_words(kv_cache)
    num_pages, page_size, _ = words.shape
    if indices.dim() != 2 or indices.dtype != torch.int32 or indices.stride(1) != 1:
        raise ValueError(f"indices must be (tokens, topk) int32 with a contiguous last dim, got {tuple(indices.shape)} {indices.dtype}")
    num_tokens, topk = indices.shape
    if out is None:
        out = torch.empty((num_tokens, WORDS), dtype=torch.int32, device=indices.device)
    if tuple(out.shape) != (num_tokens, WORDS) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out must be ({num_tokens}, {WORDS}) int32, got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0:
        return out, None
    grid = num_tokens
    if config.programs_per_sm is not None:
        if num_sms is None:
            on_gpu = indices.is_cuda
            num_sms = torch.cuda.get_device_properties(indices.device).multi_processor_count if on_gpu else 1
        grid = min(num_tokens, config.programs_per_sm * num_sms)
    compiled = gather_rows_kernel[(grid,)](
        words, indices, out, num_tokens, topk, num_pages * page_size, indices.stride(0), out.stride(0), page_stride_i32,
        PAGE=page_size, BLOCK_N=config.block_n, **fold_rows(config), PERSISTENT=config.programs_per_sm is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out, compiled


def valid_mask(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Which top-k entries name a row (the kernels' validity: ``0 <= slot < num_rows``)."""
    return (indices >= 0) & (indices < num_rows)


def reference_sums(kv_cache: torch.Tensor, indices: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """What :func:`gather_rows` returns, computed with torch: per token the column sums of its
    valid rows' int32 words, modulo 2^32 (``chunk`` tokens at a time)."""
    cache3 = kv_cache.select(2, 0) if kv_cache.dim() == 4 else kv_cache
    rows = cache3.reshape(-1, WORDS * 4).view(torch.int32)
    num_rows = rows.shape[0]
    out = torch.empty((indices.shape[0], WORDS), dtype=torch.int32, device=indices.device)
    for start in range(0, indices.shape[0], chunk):
        idx = indices[start : start + chunk].long()
        valid = valid_mask(idx, num_rows)
        picked = rows[idx.clamp(0, num_rows - 1)].long() * valid.unsqueeze(-1)
        total = picked.sum(dim=1) & 0xFFFFFFFF
        out[start : start + chunk] = torch.where(total >= 2**31, total - 2**32, total).to(torch.int32)
    return out


def sequential_slots(indices: torch.Tensor, num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """The same validity pattern as ``indices`` with sequential addresses: token ``t``'s entry
    ``j`` names slot ``(start_t + j) mod num_rows`` (``start_t`` drawn at random) where ``indices``
    names a row, and stays unused (-1) where it does not. Same valid rows a token, same bytes;
    the rows are a contiguous run of the cache (in slot order) instead of scattered pages."""
    t, topk = indices.shape
    start = torch.randint(0, num_rows, (t, 1), generator=gen, device=gen.device).to(indices.device)
    run = (start + torch.arange(topk, device=indices.device)) % num_rows
    return torch.where(valid_mask(indices, num_rows), run, -1).to(torch.int32)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit("gather_probe.py is a module of fp8_direct_bench.py: run fp8_direct_bench.py --gather-probe")
