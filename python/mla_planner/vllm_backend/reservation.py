"""Make vLLM's KV-cache sizing leave room for the scratch budget.

vLLM 0.26 sizes the KV cache from what model loading allocated plus the peak of a profile run in
which the attention layers return before calling the kernels, so kernel scratch is never seen
(stock never reserves it: that is the OOM). This module allocates the budget while the model is
built -- vLLM counts it as model memory -- and frees it when the first real step is planned,
after the KV cache exists: the caching allocator then hands those bytes to the kernels' scratch.
One reservation per process, whatever the number of layers, since layers run one at a time.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_held: torch.Tensor | None = None
_reserved_bytes = 0


def reserve(num_bytes: int, device: torch.device) -> bool:
    """Hold ``num_bytes`` on ``device`` until :func:`release`. Only the first call in a process
    allocates; it returns whether this call did."""
    global _held, _reserved_bytes
    with _lock:
        if _reserved_bytes:
            return False
        _held = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        _reserved_bytes = num_bytes
        return True


def release() -> bool:
    """Give the reserved bytes to the allocator's cache (not back to the driver). Returns
    whether anything was held."""
    global _held
    with _lock:
        held, _held = _held, None
    return held is not None


def reserved_bytes() -> int:
    """Bytes reserved in this process so far (kept after :func:`release`)."""
    return _reserved_bytes
