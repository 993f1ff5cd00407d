"""Merge attention computed over disjoint key windows by log-sum-exp.

For windows w with outputs ``o_w`` and ``lse_w``: ``lse = log(sum_w exp(lse_w))`` and
``o = sum_w exp(lse_w - lse) * o_w``. A query with no valid key in a window contributes
nothing; the kernels mark it with a non-finite lse (FlashMLA returns ``+inf``), which is read as
``-inf``. A query with no valid key anywhere ends with ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def start_merge(out: torch.Tensor) -> torch.Tensor:
    """Zero ``out`` ``(s, h, d)`` and return the running lse ``(s, h)`` (float32, all ``-inf``)."""
    out.zero_()
    return torch.full(out.shape[:2], float("-inf"), dtype=torch.float32, device=out.device)


def merge_window(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one window's ``part_out`` ``(s, h, d)`` / ``part_lse`` ``(s, h)`` into the running
    ``out`` / ``lse``, in place and without a temporary the size of ``out``."""
    part_lse = part_lse.float()
    part_lse = torch.where(torch.isfinite(part_lse), part_lse, float("-inf"))
    new_lse = torch.logaddexp(lse, part_lse)
    # exp(-inf - -inf) is NaN; where nothing is attended yet, both weights are 0.
    nothing = new_lse == float("-inf")
    safe = new_lse.masked_fill(nothing, 0.0)
    keep = torch.exp(lse - safe).unsqueeze(-1).to(out.dtype)
    take = torch.exp(part_lse - safe).unsqueeze(-1).to(out.dtype)
    out.mul_(keep).addcmul_(part_out, take)
    lse.copy_(new_lse)


# --- Accuracy of a merged split request (docs/executor.md, "Accuracy of split requests") ---

_F32_U = 2.0**-24
_GUARD = 1e-6
"""FlashMLA's relative criterion divides by ``|ref| + 1e-6``; the bound keeps that guard."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """The relative error of one rounding to ``dtype`` (round to nearest) as the merge does it.

    A bf16 / fp16 result the merge computes through a float32 intermediate (``addcmul_``) is
    rounded twice: ``|fl16(fl32(x)) - x| <= (u16 + 2^-24 (1 + u16)) |x|``, so those dtypes get
    ``u16 + 2^-23``. Underflow is covered separately (the bound's ``eta``).
    """
    units = {
        torch.float64: 2.0**-53,
        torch.float32: _F32_U,
        torch.bfloat16: 2.0**-8 + 2.0**-23,
        torch.float16: 2.0**-11 + 2.0**-23,
    }
    if dtype not in units:
        raise ValueError(f"no unit roundoff for {dtype}")
    return units[dtype]


@dataclass(frozen=True)
class MergeBound:
    """``merged`` = sum_i w_i o_i of the windows' exact outputs and ``bound`` >= |merged output
    - merged|, both ``(s, h, d)`` float64."""

    merged: torch.Tensor
    bound: torch.Tensor


def merge_error_bound(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    out_abs: float = 0.0,
    out_rel: float = 0.0,
    lse_abs: float | torch.Tensor = 0.0,
    lse_rel: float = 0.0,
) -> MergeBound:
    """Element-wise bound on the error of :func:`merge_window` run over a split request.

    ``part_out`` ``(k, s, h, d)`` and ``part_lse`` ``(k, s, h)`` are the exact (float32
    reference) outputs and lse of the ``k`` key windows, **in the order they are merged**; a
    non-finite lse marks an empty window. The kernel's window ``i`` is assumed to return ``o_i``,
    ``l_i`` with ``|o_i - ô_i| <= max(out_abs, out_rel (|ô_i| + 1e-6))`` and ``|l_i - λ_i| <=
    max(lse_abs, lse_rel |λ_i|)`` (FlashMLA's own criteria for one call; a kernel that only
    rounds the exact output to bf16 has ``out_rel = 2^-8``; ``lse_abs`` may be a tensor
    broadcastable to ``(k, s, h)``, e.g. measured errors); the merge runs in ``out_dtype``
    (the output's dtype) with a float32 lse. With ``w_i = exp(λ_i - logsumexp(λ))``,
    ``M = sum_i w_i ô_i`` and ``u = unit_roundoff(out_dtype)``::

        E_i   = max(out_abs, out_rel (|ô_i| + 1e-6))          kernel output error, window i
        ω_i   = expm1(β_i + max_j β_j + ε_i)                  relative error of w_i
        β_i   = max(lse_abs, lse_rel |λ_i|)                   kernel lse error, window i
        ε_i   = 2^-24 (|ln w_i| + k (max_j |λ_j| + 16))       float32 lse arithmetic
        n_i   = 2 + 3 #{nonempty windows merged after i}      roundings that touch window i
        γ_n   = n u / (1 - n u)
        D     = sum_i w_i ((1 + ω_i) E_i + ω_i |ô_i|)
        bound = (1 + u) D + u |M| + (1 + u) sum_i γ_{n_i} w_i (1 + ω_i) (|ô_i| + E_i) + η

    with ``η = 2^-96 (1 + sum_i |ô_i|)`` for underflow. Why it holds: docs/executor.md.
    """
    if part_out.dim() != 4 or part_lse.shape != part_out.shape[:3]:
        raise ValueError(f"part_out (k, s, h, d) and part_lse (k, s, h), got {tuple(part_out.shape)} and {tuple(part_lse.shape)}")
    k = part_out.shape[0]
    u = unit_roundoff(out_dtype)
    lam = part_lse.double()
    nonempty = torch.isfinite(lam)
    lam = lam.masked_fill(~nonempty, float("-inf"))
    total = torch.logsumexp(lam, dim=0)
    total = total.masked_fill(~torch.isfinite(total), 0.0)  # every window empty: all w_i = 0
    w = torch.exp(lam - total)
    o = part_out.double()
    mag = o.abs()
    merged = (w.unsqueeze(-1) * o).sum(0)

    err = (out_rel * (mag + _GUARD)).clamp_min(out_abs)
    abs_lam = lam.abs().masked_fill(~nonempty, 0.0)
    beta = torch.maximum(lse_rel * abs_lam, torch.as_tensor(lse_abs, dtype=torch.float64, device=lam.device))
    beta = beta.masked_fill(~nonempty, 0.0)
    neg_log_w = (total - lam).masked_fill(~nonempty, 0.0)
    eps32 = _F32_U * (neg_log_w + k * (abs_lam.amax(0) + 16.0))
    omega = torch.expm1(beta + beta.amax(0) + eps32).masked_fill(~nonempty, 0.0)

    later = nonempty.flip(0).cumsum(0).flip(0) - nonempty.long()
    n = (2 + 3 * later).double()
    if float((n * u).max()) >= 1:
        raise ValueError(f"{k} windows are too many for a merge in {out_dtype}")
    gamma = n * u / (1 - n * u)

    w_hi = (w * (1 + omega)).unsqueeze(-1)
    d_term = (w_hi * err + (w * omega).unsqueeze(-1) * mag).sum(0)
    rounding = (gamma.unsqueeze(-1) * w_hi * (mag + err)).sum(0)
    eta = 2.0**-96 * (1 + mag.sum(0))
    bound = (1 + u) * d_term + u * merged.abs() + (1 + u) * rounding + eta
    return MergeBound(merged, bound)
