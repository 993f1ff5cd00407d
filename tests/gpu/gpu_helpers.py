"""Measurement and comparison helpers shared by the GPU tests and the sanitizer case."""

from __future__ import annotations

import os

import torch

from harness.measure import peak_delta_bytes

__all__ = [
    "MiB",
    "PREFILL_OUT",
    "PROVIDER",
    "assert_close_flashmla",
    "assert_within_split_bound",
    "cosine_difference",
    "flashmla_tolerance",
    "judged_elements",
    "lse_error",
    "peak_delta_bytes",
    "prediction_tolerance",
]

MiB = 1 << 20
PROVIDER = os.environ.get("MLA_PLANNER_PROVIDER", "flash_mla")
"""The kernels under test: ``flash_mla`` (sgl-flash-mla, the default) or ``vllm``."""
PREFILL_OUT = {"abs_tol": 8e-4, "rel_tol": 3.01 / 128, "cos_diff_tol": 1e-5}
"""FlashMLA's sparse prefill tolerances on the output (its tests/test-sparse-prefill.py)."""


def prediction_tolerance(predicted: int) -> int:
    """The bar a byte model's prediction must meet: within 1% or 2 MiB, whichever is larger."""
    return max(predicted // 100, 2 * MiB)


def cosine_difference(ans: torch.Tensor, ref: torch.Tensor) -> float:
    """FlashMLA's ``1 - cos_sim``: ``1 - 2 sum(a r) / sum(a^2 + r^2)`` in float64 (0 for two zeros)."""
    a, r = ans.double(), ref.double()
    denominator = float((a * a + r * r).sum())
    return 0.0 if denominator == 0 else 1 - 2 * float((a * r).sum()) / denominator


def same_special_values(name: str, a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """FlashMLA's anomaly check: infinities and NaNs at the same places. Returns where ``r`` is
    finite, the elements the other criteria judge."""
    for special in (float("inf"), float("-inf")):
        assert torch.equal(a == special, r == special), f"{name}: {special} at different places"
    assert torch.equal(a.isnan(), r.isnan()), f"{name}: NaN at different places"
    return torch.isfinite(r)


def judged_elements(name: str, ans: torch.Tensor, ref: torch.Tensor, *alongside: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The elements FlashMLA's criteria judge, in float64: ``ans``, ``ref`` and each of
    ``alongside`` (same shape) where ``ref`` is finite, after checking the shapes and that
    infinities and NaNs sit at the same places."""
    shapes = [tuple(t.shape) for t in (ans, ref, *alongside)]
    assert len(set(shapes)) == 1, f"{name}: shapes {', '.join(map(str, shapes))}"
    a, r = ans.double(), ref.double()
    finite = same_special_values(name, a, r)
    return tuple(t.double()[finite] for t in (a, r, *alongside))


def assert_close_flashmla(name: str, ans: torch.Tensor, ref: torch.Tensor, *, abs_tol: float, rel_tol: float, cos_diff_tol: float) -> None:
    """FlashMLA's test criterion: infinities and NaNs must sit at the same places; every other
    element must be within ``abs_tol`` *or* ``rel_tol``; and ``1 - cos_sim`` within ``cos_diff_tol``."""
    a, r = judged_elements(name, ans, ref)
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = (abs_err >= abs_tol) & (rel_err >= rel_tol)
    cos_diff = cosine_difference(a, r)
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements off (max abs {float(abs_err.max()):.3g}, "
        f"max rel {float(rel_err.max()):.3g}); cos diff {cos_diff:.3g}"
    )
    assert cos_diff <= cos_diff_tol, f"{name}: cos diff {cos_diff:.3g} > {cos_diff_tol}"


def kernel_call_accuracy(name: str, ans: torch.Tensor, ref: torch.Tensor, *, abs_tol: float, rel_tol: float, cos_diff_tol: float) -> float:
    """One kernel call's own output, which no planning touches: infinities and NaNs at the same
    places and FlashMLA's cosine criterion, asserted; the fraction of elements outside FlashMLA's
    element-wise criterion, printed and returned. On these inputs the sparse prefill kernel
    (sgl-flash-mla's legacy build and vLLM 0.26's alike) misses the element-wise criterion on about
    0.02% of the elements of a single call (docs/benchmarks.md), so that criterion cannot judge the
    planner; the split check compares against it instead."""
    a, r = judged_elements(name, ans, ref)
    err = (a - r).abs()
    outside = int((err >= flashmla_tolerance(r, abs_tol=abs_tol, rel_tol=rel_tol)).sum())
    fraction = outside / max(1, err.numel())
    cos_diff = cosine_difference(a, r)
    print(f"{name}: {outside} of {err.numel()} ({fraction:.4%}) outside FlashMLA's element-wise criterion, "
          f"max abs {float(err.max()) if err.numel() else 0.0:.3g}; cos diff {cos_diff:.3g}")
    assert cos_diff <= cos_diff_tol, f"{name}: cos diff {cos_diff:.3g} > {cos_diff_tol}"
    return fraction


def flashmla_tolerance(ref: torch.Tensor, *, abs_tol: float, rel_tol: float) -> torch.Tensor:
    """The largest error FlashMLA's criterion accepts at each element (it accepts an error below
    ``abs_tol`` or below ``rel_tol * (|ref| + 1e-6)``)."""
    return (rel_tol * (ref.double().abs() + 1e-6)).clamp_min(abs_tol)


def lse_error(name: str, ans: torch.Tensor, ref: torch.Tensor, *, limit: float = 1e-3) -> torch.Tensor:
    """The kernel's lse error ``|ans - ref|`` (0 where the window is empty), for the split bound.

    Where the reference is not finite (no valid key) the kernel's lse must not be finite either
    (the merge reads any non-finite lse as an empty window); elsewhere the error must stay within
    ``limit`` (a weight off by 0.1 %: the same keys, natural log). Prints how many elements are
    outside FlashMLA's own lse criterion (abs 1e-6 or rel 2.01/65536): informative only, since
    1e-6 is below float32 noise for an lse near 0."""
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ans), finite), f"{name}: finite at different places"
    err = (ans.double() - ref.double()).abs().masked_fill(~finite, 0.0)
    outside = int((err[finite] >= flashmla_tolerance(ref[finite], abs_tol=1e-6, rel_tol=2.01 / 65536)).sum())
    worst = float(err.max()) if err.numel() else 0.0
    print(f"{name}: max abs error {worst:.3g}; {outside} of {int(finite.sum())} outside FlashMLA's lse criterion")
    assert worst <= limit, f"{name}: max abs error {worst:.3g} > {limit}"
    return err


def assert_within_split_bound(
    name: str,
    ans: torch.Tensor,
    ref: torch.Tensor,
    bound: torch.Tensor,
    *,
    abs_tol: float,
    rel_tol: float,
    max_extra: float,
) -> None:
    """A split request's merged output against the unsplit float32 reference: infinities and NaNs
    at the same places, and each element's error within the larger of FlashMLA's tolerance and
    ``bound`` (``lse_merge.merge_error_bound``; docs/executor.md, "Accuracy of split requests").

    Not vacuous: the allowance beyond FlashMLA's tolerance (the *extra*) must stay within
    ``max_extra * abs_tol`` at every element. Prints how many elements needed the extra, and the
    rows' ``1 - cos_sim`` (FlashMLA's cosine criterion is checked on the whole output)."""
    a, r, b = judged_elements(name, ans, ref, bound)
    err = (a - r).abs()
    tol = flashmla_tolerance(r, abs_tol=abs_tol, rel_tol=rel_tol)
    allowed = torch.maximum(tol, b)
    extra = (allowed - tol) / abs_tol
    needed = int((err >= tol).sum())
    over = err > allowed
    cos_diff = cosine_difference(a, r)
    print(
        f"{name}: {err.numel()} elements; {needed} ({needed / max(err.numel(), 1):.3%}) outside FlashMLA's tolerance, "
        f"{int(over.sum())} outside the split bound; worst error / allowed {float((err / allowed).max()):.3g}; "
        f"extra / abs_tol: median {float(extra.median()):.3g}, max {float(extra.max()):.3g} (limit {max_extra}); "
        f"max abs error {float(err.max()):.3g}; cos diff {cos_diff:.3g}"
    )
    assert not bool(over.any()), (
        f"{name}: {int(over.sum())} of {over.numel()} elements outside the split bound "
        f"(worst error / allowed {float((err / allowed).max()):.3g})"
    )
    assert float(extra.max()) <= max_extra, f"{name}: the bound is too loose: extra {float(extra.max()):.3g} x abs_tol > {max_extra}"
