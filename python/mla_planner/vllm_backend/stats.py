"""What one engine's FP8 steps did in this worker, counted as they are built and run, and said in one
line at vLLM's stats interval: how many steps were planned and split, their launches, the largest
launch against the reservation, and the steps that fell back, by reason.

Counts are since the engine started. The largest launch is the byte model's (the planner's exact
count of every buffer a launch allocates), not a reading of the allocator: reading it would cost
each layer call a query of the allocator and reset the peak vLLM's own profiling reads.

The same counts go to vLLM's Prometheus ``/metrics`` (``mla_planner_*``) where a worker's metrics
reach it: vLLM's API server serves the metrics of other processes only in prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set: vLLM sets it itself for more than one API
server, or the operator exports it to an empty folder before ``vllm serve``); otherwise a worker's
metrics stay in the worker, and there are none (docs/vllm.md, "Seeing what the plugin did").
Counters of several workers (tensor parallel ranks) add up there; the gauges take the largest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from mla_planner.vllm_backend import log

MIB = 1 << 20


@dataclasses.dataclass
class StepStats:
    """One engine's counters in this worker process (the builder and every layer's impl add to
    them); :meth:`maybe_say` returns the summary line once an interval has passed and something
    changed since the last."""

    interval_s: float
    """vLLM's stats interval (``VLLM_LOG_STATS_INTERVAL``); 0 or less: never said."""
    reserved_bytes: int = 0
    clock: Callable[[], float] = time.monotonic
    planned: int = 0
    """Steps the builder planned."""
    split: int = 0
    """Planned steps of more than one launch."""
    launches: int = 0
    """Launches of the planned steps, one layer call's worth each."""
    stock_calls: int = 0
    """Steps left to vLLM's one call, which fits the reservation (decode-only steps within it)."""
    largest_launch_bytes: int = 0
    """The largest launch a plan or a fallback held beyond vLLM's workspace (what of it the
    reservation holds), by the byte model."""
    fallbacks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Steps that left their plan for the bounded path, by reason (once per step)."""
    unavoidable: int = 0
    """Layer calls that no bounded path could run: the error reached vLLM."""
    _said_at: float | None = None
    _said: tuple[object, ...] = ()
    _published: dict[str, int] = dataclasses.field(default_factory=dict)

    def planned_step(self, launches: int, peak_bytes: int) -> None:
        self.planned += 1
        self.split += launches > 1
        self.launches += launches
        self.largest_launch_bytes = max(self.largest_launch_bytes, peak_bytes)

    def stock_step(self) -> None:
        self.stock_calls += 1

    def fell_back(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def bounded_launch(self, peak_bytes: int) -> None:
        self.largest_launch_bytes = max(self.largest_launch_bytes, peak_bytes)

    def failed(self) -> None:
        self.unavoidable += 1

    def _snapshot(self) -> tuple[object, ...]:
        return (self.planned, self.stock_calls, self.largest_launch_bytes, self.unavoidable,
                tuple(sorted(self.fallbacks.items())))

    def maybe_say(self) -> str | None:
        """The summary line, where ``interval_s`` has passed since the last one (or since the
        first call) and a count changed; ``None`` otherwise."""
        if self.interval_s <= 0:
            return None
        now = self.clock()
        if self._said_at is None:
            self._said_at = now
            return None
        if now - self._said_at < self.interval_s:
            return None
        snapshot = self._snapshot()
        if snapshot == self._said:
            return None
        self._said_at, self._said = now, snapshot
        try:
            self.publish()
        except Exception as exc:  # prometheus_client's files (multiprocess mode): the step and the line go on
            log.once(logging.WARNING, "mla-planner: the plugin's metrics could not be published (%s: %s); its summary "
                                      "line goes on", type(exc).__name__, exc)
        return self.line()

    def counts(self) -> dict[str, int]:
        """Every count by its metric's name (fallbacks by reason: ``fallbacks:REASON``)."""
        counts = {"steps_planned": self.planned, "steps_split": self.split, "launches": self.launches,
                  "steps_on_vllms_call": self.stock_calls, "unavoidable_failures": self.unavoidable}
        counts.update({f"fallbacks:{reason}": n for reason, n in self.fallbacks.items()})
        return counts

    def publish(self) -> None:
        """Add what the counts gained since the last call to the Prometheus metrics, if any."""
        metrics = prometheus_metrics()
        if metrics is None:
            return
        for name, value in self.counts().items():
            gained = value - self._published.get(name, 0)
            if gained:
                metric, _, reason = name.partition(":")
                counter = metrics[metric]
                (counter.labels(reason=reason) if reason else counter).inc(gained)
        self._published = self.counts()
        metrics["largest_launch_bytes"].set(self.largest_launch_bytes)
        metrics["reserved_bytes"].set(self.reserved_bytes)

    def line(self) -> str:
        fallbacks = sum(self.fallbacks.values())
        reasons = "; ".join(f"{reason}: {n:,}" for reason, n in sorted(self.fallbacks.items()))
        return (f"mla-planner: since start-up {self.planned:,} steps planned ({self.split:,} split, {self.launches:,} "
                f"launches), {self.stock_calls:,} on vLLM's call; largest launch beyond vLLM's workspace "
                f"{self.largest_launch_bytes / MIB:,.1f} MiB of the {self.reserved_bytes / MIB:,.1f} MiB reserved; "
                f"{fallbacks:,} fallbacks" + (f" ({reasons})" if reasons else "")
                + (f"; {self.unavoidable:,} layer calls failed beyond any bounded path" if self.unavoidable else ""))


METRICS = {
    "steps_planned": "FP8 sparse-MLA steps the plugin planned",
    "steps_split": "Planned steps of more than one kernel launch",
    "launches": "Kernel launches of the planned steps, per layer call",
    "steps_on_vllms_call": "Steps left to vLLM's one kernel call, which fits the reservation",
    "unavoidable_failures": "Layer calls no bounded path could run (the error reached vLLM)",
}


@functools.cache
def prometheus_metrics() -> dict[str, Any] | None:
    """This process's ``mla_planner_*`` metrics, made once, in multiprocess mode only (see the
    module's doc); ``None`` otherwise, or without prometheus_client (vLLM's dependency)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        import prometheus_client as prom
    except ImportError:
        return None
    made: dict[str, Any] = {name: prom.Counter(f"mla_planner_{name}", doc) for name, doc in METRICS.items()}
    made["fallbacks"] = prom.Counter("mla_planner_fallbacks", "Steps that fell back to the bounded path, by reason",
                                     ["reason"])
    made["largest_launch_bytes"] = prom.Gauge("mla_planner_largest_launch_bytes",
                                              "The largest launch a step planned or fell back to, beyond vLLM's workspace, by the byte model",
                                              multiprocess_mode="max")
    made["reserved_bytes"] = prom.Gauge("mla_planner_reserved_bytes", "Bytes reserved from the KV cache for the "
                                        "launches", multiprocess_mode="max")
    return made
