"""Make vLLM's KV-cache sizing leave room for the scratch budget.

vLLM sizes the KV cache from what model loading allocated plus the peak of a profile run in which
the attention layers return before calling the kernels, so kernel scratch is never seen (stock
never reserves it: that is the OOM). vLLM 0.33's ``reserve_workspace()`` hook does not help here:
its DeepSeek-V3.2 layer returns in the profile run before calling it. This module allocates the
bytes the KV cache must leave while the model is built -- vLLM counts them as model memory -- and
the builder frees them for the first step it plans, after vLLM has sized the KV cache: the
caching allocator then hands them to the kernels' scratch. One reservation per process, whatever
the number of layers, since layers run one at a time.

How much: on vLLM 0.26 the whole budget. On 0.33 stock's impl reserves a workspace at
construction whose padded q and output views the backend's launches use, so only the rest of the
largest launch each FP8 route may run (:func:`largest_launches`: the kernel's accumulators, LSE
and the translated indices).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

import mla_planner

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


@dataclasses.dataclass(frozen=True)
class LaunchReservation:
    """The largest launch one FP8 route may run in this engine, as the planner counts it."""

    route: str
    tokens: int
    """Its query tokens."""
    launch_bytes: int
    """What the plan says it allocates (its ``launch_bytes``)."""
    buffers: dict[str, int]
    """The buffers the plan holds while that launch runs (``StepPlan.launch_scratch``)."""
    served: tuple[str, ...]
    """Those the caller's workspace holds already (vLLM 0.33's padded q and output views)."""

    @property
    def served_bytes(self) -> int:
        return sum(self.buffers[name] for name in self.served)

    @property
    def transient_bytes(self) -> int:
        """What the launch allocates beyond the workspace: the kernel's accumulators, LSE and
        the translated indices. The profile run must see this much at once."""
        return self.launch_bytes - self.served_bytes


def largest_launches(config: mla_planner.StepConfig, max_tokens: int, workspace_heads: int | None, *,
                     native_prefill: bool = False) -> list[LaunchReservation]:
    """For each FP8 route the engine may take (a cost profile may route a step either way), the
    largest launch of a step of ``max_tokens`` prefill tokens -- the most one launch can hold,
    since a launch is a slice of one step. ``workspace_heads``: the heads of vLLM's padded q and
    output workspace views (``None``: no such views), which the backend takes a launch's padded
    q and kernel output from where the kernel runs those heads. ``native_prefill``: the separate
    route may also run the prefill kernel at ``config``'s own heads (a cost profile may price a
    step so): that launch holds no padded q or output, but, as its tokens cost fewer bytes, runs
    more of them, so its own buffers may outgrow the padded launch's."""
    sparse = config.replace(force_mqa=True)  # every token through the sparse kernels: the most
    out = []
    routes = [("mixed_batch", False), ("separate_prefill_decode", False)]
    if native_prefill:
        routes.append(("separate_prefill_decode", True))
    for route, native in routes:
        plan = mla_planner.plan_step([max_tokens], [0], 0, sparse.replace(mode=route, native_prefill_heads=native))
        largest = int(plan.launch_bytes.argmax())
        start, end = plan.launches[largest, :2].tolist()
        heads = config.decode_heads if route == "mixed_batch" else plan.prefill_heads
        served = ("q_padded", "out") if heads == workspace_heads else ()
        scratch = plan.launch_scratch(largest)
        buffers = scratch.buffers
        out.append(LaunchReservation(f"{route} (native heads)" if native else route, end - start,
                                     scratch.total_bytes, buffers, tuple(name for name in served if name in buffers)))
    return out
