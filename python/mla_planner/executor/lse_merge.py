"""Merge attention computed over disjoint key windows by log-sum-exp.

For windows w with outputs ``o_w`` and ``lse_w``: ``lse = log(sum_w exp(lse_w))`` and
``o = sum_w exp(lse_w - lse) * o_w``. A query with no valid key in a window contributes
nothing; the kernels mark it with a non-finite lse (FlashMLA returns ``+inf``), which is read as
``-inf``. A query with no valid key anywhere ends with ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

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
