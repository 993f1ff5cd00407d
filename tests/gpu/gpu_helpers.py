"""Measurement and comparison helpers shared by the GPU tests and the sanitizer case."""

from __future__ import annotations

import os

import torch

from mla_planner.executor.measure import peak_delta_bytes

__all__ = ["MiB", "PROVIDER", "peak_delta_bytes", "prediction_tolerance"]

MiB = 1 << 20
PROVIDER = os.environ.get("MLA_PLANNER_PROVIDER", "flash_mla")
"""The kernels under test: ``flash_mla`` (sgl-flash-mla, the default) or ``vllm``."""


def prediction_tolerance(predicted: int) -> int:
    """The issue's bar: within 1% or 2 MiB, whichever is larger."""
    return max(predicted // 100, 2 * MiB)


def assert_close_flashmla(name: str, ans: torch.Tensor, ref: torch.Tensor, *, abs_tol: float, rel_tol: float, cos_diff_tol: float) -> None:
    """FlashMLA's test criterion: infinities and NaNs must sit at the same places; every other
    element must be within ``abs_tol`` *or* ``rel_tol``; and ``1 - cos_sim`` within ``cos_diff_tol``."""
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} != {tuple(ref.shape)}"
    a, r = ans.double(), ref.double()
    for special in (float("inf"), float("-inf")):
        assert torch.equal(a == special, r == special), f"{name}: {special} at different places"
    assert torch.equal(a.isnan(), r.isnan()), f"{name}: NaN at different places"
    finite = torch.isfinite(r)
    a, r = a[finite], r[finite]
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = (abs_err >= abs_tol) & (rel_err >= rel_tol)
    denominator = float((a * a + r * r).sum())
    cos_diff = 0.0 if denominator == 0 else 1 - 2 * float((a * r).sum()) / denominator
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements off (max abs {float(abs_err.max()):.3g}, "
        f"max rel {float(rel_err.max()):.3g}); cos diff {cos_diff:.3g}"
    )
    assert cos_diff <= cos_diff_tol, f"{name}: cos diff {cos_diff:.3g} > {cos_diff_tol}"
