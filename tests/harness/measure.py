"""Allocator measurements shared by the GPU tests and the kernel benchmark."""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_delta_bytes(fn: Callable[[], object]) -> int:
    """How far the allocator's peak rose above what was allocated when ``fn`` started."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
