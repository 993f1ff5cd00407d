"""Fault injection for an in-process engine (run_cases.py ``--faults``): a test hook, never a setting, that
patches the plugin's modules in this process before the engine is built, armed per case with ``arm``; its
patch points exist in builds before the bounded path too, so one driver measures both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

MODES = ("none", "plan", "tokens", "oom2", "launch")


@dataclasses.dataclass
class Faults:
    mode: str = "none"
    launches: int = 0  # kernel launches of the plugin's provider since the step's metadata was built
    kernel_launches: int = 0  # the same since ``arm`` (vLLM's own calls not counted)
    counts_at_arm: dict[str, int] = dataclasses.field(default_factory=dict)
    fired: int = 0  # faults injected since ``arm``
    layer_calls: int = 0
    peak_bytes: int = 0  # the largest layer call's peak since ``arm``
    depth: int = 0

    def fire(self, mode: str, when: bool = True) -> bool:
        if self.mode == mode and when:
            self.fired += 1
        return self.mode == mode and when


STATE = Faults()


def arm(mode: str) -> None:
    global STATE
    if mode not in MODES:
        raise ValueError(f"unknown fault mode {mode!r}; one of {', '.join(MODES)}")
    STATE = Faults(mode, counts_at_arm=step_counts())


def read() -> dict[str, Any]:
    """What happened since ``arm``, with the engine's step counters' gains (``StepStats.counts``)."""
    return {"mode": STATE.mode, "faults_fired": STATE.fired, "attention_layer_calls": STATE.layer_calls,
            "attention_peak_bytes": STATE.peak_bytes, "kernel_launches": STATE.kernel_launches,
            "step_counts": {name: n - STATE.counts_at_arm.get(name, 0) for name, n in step_counts().items()}}


def newest_engine_state() -> Any | None:
    """The plugin's state of the newest engine here (None: none, or a build before per-engine state)."""
    from mla_planner.vllm_backend import engine

    states = getattr(engine, "_states", None)
    return states[-1][1] if states else None


def step_counts() -> dict[str, int]:
    stats = getattr(newest_engine_state(), "stats", None)
    return dict(stats.counts()) if stats is not None else {}


def reserved_bytes() -> int | None:
    """What the engine reserved (its state's, or earlier builds' process-wide); None where none did."""
    from mla_planner.vllm_backend import reservation

    state = newest_engine_state()
    if state is not None:
        return int(state.reservation.reserved_bytes)
    process_wide = getattr(reservation, "reserved_bytes", None)
    return int(process_wide()) if callable(process_wide) else None


def install() -> None:
    """Patch the plugin (before the engine is built) and vLLM's FP8 forwards (to read peaks)."""
    import torch

    from mla_planner import routing
    from mla_planner.vllm_backend import backend, vllm_api

    choose_plan, make_provider = routing.choose_plan, backend.kernel_provider
    builder_cls = backend.PlannedFlashMLASparseMetadataBuilder
    attach, build = builder_cls.attach_plan, builder_cls.build

    def choose(*args: Any, **kwargs: Any) -> Any:
        if STATE.fire("plan"):
            raise ValueError("injected: the builder cannot plan")
        return choose_plan(*args, **kwargs)

    def attach_plan(self: Any, metadata: Any, common: Any) -> None:
        attach(self, metadata, common)
        planned: Any = getattr(metadata, "planned", None)
        if STATE.fire("tokens", hasattr(planned, "sparse_tokens")):
            planned.sparse_tokens += 1

    def build_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        STATE.launches = 0
        return build(self, *args, **kwargs)

    routing.choose_plan = choose  # the builder calls routing.choose_plan
    setattr(builder_cls, "attach_plan", attach_plan)
    setattr(builder_cls, "build", build_step)
    backend.kernel_provider = lambda: FaultyProvider(make_provider(), torch.OutOfMemoryError)
    for cls in (backend.PlannedFlashMLASparseImpl, vllm_api.FlashMLASparseImpl):
        for name in ("_forward_fp8_kv_mixed_batch", "_forward_fp8_kv_separate_prefill_decode"):
            if name in vars(cls):
                setattr(cls, name, measured(vars(cls)[name], torch))


def measured(forward: Callable[..., Any], torch: Any) -> Callable[..., Any]:
    """``forward`` with the allocator's peak over the outermost call read into ``STATE``."""
    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        if STATE.depth:
            return forward(*args, **kwargs)
        STATE.depth += 1
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            return forward(*args, **kwargs)
        finally:
            STATE.depth -= 1
            STATE.layer_calls += 1
            STATE.peak_bytes = max(STATE.peak_bytes, torch.cuda.max_memory_allocated() - start)
    return call


class FaultyProvider:
    """The plugin's kernel provider, failing its launches where the armed mode says."""

    def __init__(self, inner: Any, oom: type[BaseException]) -> None:
        self.inner, self.oom = inner, oom

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in ("sparse_decode", "sparse_prefill"):
            return attr

        def launch(*args: Any, **kwargs: Any) -> Any:
            STATE.launches += 1
            STATE.kernel_launches += 1
            if STATE.fire("oom2", STATE.launches == 2):
                raise self.oom("injected: CUDA out of memory in the second launch")
            if STATE.fire("launch", STATE.launches == 1):
                raise RuntimeError("injected: the launch failed")
            return attr(*args, **kwargs)
        return launch
