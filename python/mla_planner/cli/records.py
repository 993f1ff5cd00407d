"""Per-step figures of a simulation, and their summary per policy."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .policies import FAILURES, PATHS, Outcome

POLICIES = ("stock", "planned")
PERCENTILES = (50, 90, 99, 99.9)
NO_FAILURE = ""


@dataclass
class PolicyRecords:
    """Columns, one entry per step; `array` keeps 100k steps cheap."""

    peak_bytes: array[int] = field(default_factory=lambda: array("q"))
    launches: array[int] = field(default_factory=lambda: array("q"))
    failures: list[str] = field(default_factory=list)
    path_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))

    def add(self, o: Outcome) -> None:
        self.peak_bytes.append(o.peak_bytes)
        self.launches.append(o.num_launches)
        self.failures.append(o.failure or NO_FAILURE)
        for route, n in o.path_tokens.items():
            self.path_tokens[route] += n


@dataclass
class Records:
    tokens: array[int] = field(default_factory=lambda: array("q"))
    prefill_tokens: array[int] = field(default_factory=lambda: array("q"))
    policies: dict[str, PolicyRecords] = field(default_factory=lambda: {p: PolicyRecords() for p in POLICIES})

    def __len__(self) -> int:
        return len(self.tokens)


def summarise(r: PolicyRecords, *, budget_bytes: int, headroom_bytes: int) -> dict[str, Any]:
    """The figures the terminal, the report and the JSON summary show."""
    peaks = np.frombuffer(r.peak_bytes, dtype=np.int64) if len(r.peak_bytes) else np.zeros(1, np.int64)
    launches = np.frombuffer(r.launches, dtype=np.int64) if len(r.launches) else np.zeros(1, np.int64)
    failed = np.array([f != NO_FAILURE for f in r.failures], dtype=bool)
    over_headroom = peaks > headroom_bytes
    prefill_total = sum(r.path_tokens.values())
    return {
        "steps": len(r.peak_bytes),
        "peak_bytes": {
            "max": int(peaks.max()),
            "mean": float(peaks.mean()),
            **{f"p{p:g}": int(np.percentile(peaks, p, method="higher")) for p in PERCENTILES},
        },
        "over_budget_steps": int((peaks > budget_bytes).sum()),
        "over_headroom_steps": int(over_headroom.sum()),
        "hard_failure_steps": {f: r.failures.count(f) for f in FAILURES},
        "failed_steps": int((over_headroom | failed).sum()),
        "launches_per_step": {"mean": float(launches.mean()), "max": int(launches.max()), "total": int(launches.sum())},
        "prefill_tokens_by_path": dict(r.path_tokens),
        "prefill_share_by_path": {k: (v / prefill_total if prefill_total else 0.0) for k, v in r.path_tokens.items()},
    }
