"""What an FP8 query costs in accuracy (no GPU): the float32 reference on e4m3-quantised queries
against the float32 reference, under the FP8-direct kernel's GPU test criteria (FlashMLA's sparse
prefill tolerances, the probability rounding bound, lse within 1e-3).

A score dot run in FP8 on the cache's bytes (``wgmma`` takes e4m3 on both sides) needs the query
in e4m3 too: its 512 NoPE dims quantised with one scale per (token, head) or per token, or split
into two e4m3 parts (one FP8 MMA each; with power-of-two scales they hold a bf16 query exactly);
the 64 RoPE dims stay bf16, as in the cache. This is the error of that quantisation alone, before
any kernel's own roundings, on test_matches_the_reference's cases (docs/fp8-direct.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "gpu")]  # tests/harness and gpu_helpers: not in the wheel

from gpu_helpers import PREFILL_OUT, cosine_difference, flashmla_tolerance  # noqa: E402
from harness.fp8_direct import make_case, probability_rounding_bound, reference  # noqa: E402

E4M3_MAX = 448.0
CASES = ((16, 2048, False), (16, 2048, True), (32, 2048, False), (16, 512, True), (32, 512, False))
"""(heads, top-k, sinks and lengths on) of the GPU test's cases: 256 tokens over 8,192 slots."""


def e4m3(x: torch.Tensor, per: str, pow2: bool) -> torch.Tensor:
    """``x`` (T, H, D) through e4m3 at amax scaling, ``per`` "token-head" or "token"; with ``pow2``
    the scale is rounded up to a power of two, so that scaling itself is exact."""
    amax = x.abs().amax(-1, keepdim=True) if per == "token-head" else x.abs().amax((-1, -2), keepdim=True)
    scale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def quantised_query(q: torch.Tensor, per: str, parts: int, pow2: bool) -> torch.Tensor:
    """``q`` (T, H, 576) with its NoPE part as the sum of ``parts`` e4m3 parts, each the remainder
    of the parts before at a scale of its own (a score dot would run one FP8 MMA a part, each into
    its own accumulator, and add them scaled)."""
    nope, rope = q.float()[..., :512], q.float()[..., 512:]
    total = torch.zeros_like(nope)
    for _ in range(parts):
        total = total + e4m3(nope - total, per, pow2)
    return torch.cat([total, rope], -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print("| heads | top-k | sink, lengths | query scale | e4m3 parts | scales | 1 - cos (limit 1e-5) "
          "| outside FlashMLA's element-wise criterion | worst error / allowed (limit 1) | lse max abs error (limit 1e-3) |")
    print("|---:|---:|---|---|---:|---|---:|---:|---:|---:|")
    for heads, topk, sink in CASES:
        case = make_case(256, heads, topk, 128, gen, lengths=sink, sink=sink)
        ref_out, ref_lse = reference(case)
        tol = flashmla_tolerance(ref_out, abs_tol=PREFILL_OUT["abs_tol"], rel_tol=PREFILL_OUT["rel_tol"])
        allowed = torch.maximum(tol, probability_rounding_bound(case))
        finite = torch.isfinite(ref_lse)
        for per, parts, pow2 in (("token-head", 1, False), ("token", 1, False), ("token-head", 2, False),
                                 ("token-head", 2, True)):
            out, lse = reference(dataclasses.replace(case, q=quantised_query(case.q, per, parts, pow2)))
            err = (out - ref_out).abs()
            scales = "power of two" if pow2 else "amax"
            print(f"| {heads} | {topk:,} | {'on' if sink else 'off'} | {per} | {parts} | {scales} "
                  f"| {cosine_difference(out, ref_out):.2e} "
                  f"| {float((err >= tol).float().mean()):.1%} | {float((err / allowed).max()):.2f} "
                  f"| {float((lse - ref_lse)[finite].abs().max()):.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
