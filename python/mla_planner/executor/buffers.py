"""The memory a caller may hold for an executor's run: both routes take it the same way."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Buffers(NamedTuple):
    """``q_padded`` ``(>= rows, kernel heads, 576)`` and ``kernel_out`` ``(>= rows, kernel heads,
    512)`` in q's dtype, contiguous: memory to pad q and to take the kernel's output in, where heads
    are padded (vLLM's workspace views, where the release has them). ``None``, or a buffer of
    another shape, is allocated per run as the plan counts it; contents are overwritten."""

    q_padded: torch.Tensor | None = None
    kernel_out: torch.Tensor | None = None
