"""Inputs and the float32 yardstick for the FP8-direct kernel (mla_planner.kernels.fp8_direct),
shared by its CPU test (under Triton's interpreter), its GPU test and its benchmark.

The yardstick is :func:`mla_planner.executor.reference.sparse_attention` on the ``fp8_ds_mla``
rows, with ``topk_length`` applied as :func:`~mla_planner.executor.reference.sparse_prefill_reference`
does (indices past a row's length become ``-1``) and, since the repo's reference has no attention
sink, FlashMLA's sink (``flash_mla_sparse_fwd``'s docstring): the output times
``exp(lse) / (exp(lse) + exp(sink))`` = ``sigmoid(lse - sink)``, ``lse`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_planner.calibration.synthetic import random_kv_rows
from mla_planner.executor.layout import D_QK, D_V, PAGE_SIZE, as_pages, as_slots
from mla_planner.executor.quant import quantize_fp8_ds_mla
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

SCALE = D_QK**-0.5


@dataclass(frozen=True)
class Fp8Case:
    q: torch.Tensor  # (T, H, 576) bf16
    kv_cache: torch.Tensor  # (pages, 64, 1, 656) uint8
    indices: torch.Tensor  # (T, topk) int32 cache slots, some -1 or out of range
    topk_length: torch.Tensor | None  # (T,) int32
    attn_sink: torch.Tensor | None  # (H,) float32


def make_case(
    num_tokens: int,
    num_heads: int,
    topk: int,
    num_pages: int,
    gen: torch.Generator,
    *,
    lengths: bool = False,
    sink: bool = False,
    unused_fraction: float = 0.1,
    spread: float = 0.0,
) -> Fp8Case:
    """Distinct random slots per row (as the indexer's top-k: no repeats), ``unused_fraction`` of
    them ``-1``; row 1 (where there is one) has no valid index at all, row 2 an out-of-range one.
    ``lengths``: ``topk_length`` random in ``[0, topk]``, row 0 at 0 and the last row at topk.
    ``sink``: Gaussian sinks, with head 0 at ``-inf`` (no effect) and head 1 at ``+inf`` (zeroes
    the head's output)."""
    dev = gen.device
    num_slots = num_pages * PAGE_SIZE
    if num_slots < topk:
        raise ValueError(f"{num_slots} slots cannot give {topk} distinct indices")
    kv_cache = as_pages(quantize_fp8_ds_mla(random_kv_rows(num_slots, gen, spread)))
    indices = torch.rand((num_tokens, num_slots), generator=gen, device=dev).topk(topk, dim=1).indices.to(torch.int32)
    indices.masked_fill_(torch.rand((num_tokens, topk), generator=gen, device=dev) < unused_fraction, -1)
    if num_tokens > 1:
        indices[1] = -1
    if num_tokens > 2:
        indices[2, 0] = num_slots + 5  # out of range: unused, like -1
    q = torch.randn((num_tokens, num_heads, D_QK), generator=gen, device=dev).to(torch.bfloat16)
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, topk + 1, (num_tokens,), generator=gen, device=dev, dtype=torch.int32)
        topk_length[0] = 0
        topk_length[-1] = topk
    attn_sink = None
    if sink:
        attn_sink = torch.randn((num_heads,), generator=gen, device=dev)
        attn_sink[0], attn_sink[1] = float("-inf"), float("inf")
    return Fp8Case(q, kv_cache, indices, topk_length, attn_sink)


def reference(case: Fp8Case, softmax_scale: float = SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 out ``(T, H, 512)`` and lse ``(T, H)`` of the case (see the module docstring)."""
    indices = case.indices
    if case.topk_length is not None:
        past = torch.arange(indices.shape[1], device=indices.device) >= case.topk_length.view(-1, 1)
        indices = indices.masked_fill(past, -1)
    out, lse = sparse_attention(case.q, as_slots(case.kv_cache), indices, softmax_scale)
    if case.attn_sink is not None:
        # A query with no valid key (lse = +inf) has out = 0 whatever the factor; keep it finite.
        factor = torch.where(lse == float("inf"), 1.0, torch.sigmoid(lse - case.attn_sink))
        out = out * factor.unsqueeze(-1)
    return out, lse


def probability_rounding_bound(case: Fp8Case, softmax_scale: float = SCALE, block_tokens: int = 64) -> torch.Tensor:
    """``2^-8 (sum_i w_i |v_i| + |out|)`` per output element ``(T, H, 512)`` float32, ``w`` the
    reference's softmax weights (sink included): twice the error of rounding each probability to
    bfloat16 before the value dot (relative ``2^-9`` each, as FlashMLA's kernels and this one do)
    and the output to bfloat16 once. FlashMLA's element-wise tolerance is set for top-k 2,048;
    where few keys share the weight (small top-k) these roundings alone can exceed it."""
    indices = case.indices
    if case.topk_length is not None:
        past = torch.arange(indices.shape[1], device=indices.device) >= case.topk_length.view(-1, 1)
        indices = indices.masked_fill(past, -1)
    slots = as_slots(case.kv_cache)
    bounds = []
    for start in range(0, case.q.shape[0], block_tokens):
        idx = indices[start : start + block_tokens].long()
        valid = (idx >= 0) & (idx < slots.shape[0])
        keys = dequantize_fp8_ds_mla(slots[idx.clamp(0, slots.shape[0] - 1)])
        keys.masked_fill_(~valid.unsqueeze(-1), 0.0)
        scores = torch.einsum("shd,skd->shk", case.q[start : start + block_tokens].float(), keys) * softmax_scale
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        if case.attn_sink is not None:
            lse = torch.logaddexp(lse, case.attn_sink.view(1, -1, 1).expand_as(lse))
        weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
        weights = torch.nan_to_num(weights, nan=0.0)
        out = torch.einsum("shk,skd->shd", weights, keys[..., :D_V])
        bounds.append(2.0**-8 * (torch.einsum("shk,skd->shd", weights, keys[..., :D_V].abs()) + out.abs()))
    return torch.cat(bounds)


def check_output(name: str, out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, *,
                 abs_tol: float, rel_tol: float, cos_diff_tol: float) -> float:
    """The kernel's ``out`` against the float32 ``ref``: NaNs and infinities at the same places,
    FlashMLA's cosine criterion, and every element within FlashMLA's element-wise tolerance or
    :func:`probability_rounding_bound`'s ``bound``, whichever is larger (asserted). Prints and
    returns the fraction of elements outside FlashMLA's element-wise criterion alone (FlashMLA's
    own sparse prefill kernel misses it on about 0.02 % at top-k 2,048: tests/gpu/gpu_helpers.py).

    Needs tests/gpu on ``sys.path`` (gpu_helpers: FlashMLA's criteria and tolerances, ``PREFILL_OUT``, shared
    with the GPU tests).
    """
    from gpu_helpers import cosine_difference, flashmla_tolerance, judged_elements

    a, r, b = judged_elements(name, out, ref, bound)
    err = (a - r).abs()
    tol = flashmla_tolerance(r, abs_tol=abs_tol, rel_tol=rel_tol)
    allowed = torch.maximum(tol, b)
    outside = int((err >= tol).sum())
    fraction = outside / max(1, err.numel())
    cos_diff = cosine_difference(a, r)
    worst = float((err / allowed).max()) if err.numel() else 0.0
    print(f"{name}: {outside} of {err.numel()} ({fraction:.4%}) outside FlashMLA's element-wise criterion; "
          f"worst error / allowed {worst:.3g}; max abs error {float(err.max()) if err.numel() else 0.0:.3g}; cos diff {cos_diff:.3g}")
    assert worst <= 1.0, f"{name}: {int((err > allowed).sum())} elements beyond FlashMLA's tolerance and the rounding bound"
    assert cos_diff <= cos_diff_tol, f"{name}: cos diff {cos_diff:.3g} > {cos_diff_tol}"
    return fraction


def lse_max_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |lse - ref|`` where the reference is finite, after checking that the kernel's lse is
    ``+inf`` exactly where the reference's is."""
    inf = ref == float("inf")
    assert torch.equal(lse == float("inf"), inf), "lse is +inf at other places than the reference's"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse is finite at other places than the reference's"
    return float((lse.double() - ref.double())[finite].abs().max()) if bool(finite.any()) else 0.0
