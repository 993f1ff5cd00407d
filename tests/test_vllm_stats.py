"""The plugin's counters and its summary line (vllm_backend/stats.py), and their Prometheus
metrics in prometheus_client's multiprocess mode."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from mla_planner.vllm_backend.stats import MIB, StepStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_summary_line_comes_once_an_interval_and_only_when_something_changed() -> None:
    clock = Clock()
    stats = StepStats(interval_s=10, reserved_bytes=676 * MIB, clock=clock)
    assert stats.maybe_say() is None, "the first call starts the interval"
    stats.planned_step(1, 100 * MIB)
    stats.planned_step(3, 612 * MIB)
    stats.stock_step()
    clock.now += 9.9
    assert stats.maybe_say() is None, "before the interval"
    clock.now += 0.2
    line = stats.maybe_say()
    assert line == ("mla-planner: since start-up 2 steps planned (1 split, 4 launches), 1 on vLLM's call; largest "
                    "launch beyond vLLM's workspace 612.0 MiB of the 676.0 MiB reserved; 0 fallbacks")
    clock.now += 20
    assert stats.maybe_say() is None, "nothing changed"
    stats.fell_back("the step could not be planned (ValueError)")
    stats.fell_back("the step could not be planned (ValueError)")
    stats.fell_back("an allocation failed in a planned launch")
    stats.bounded_launch(650 * MIB)
    stats.failed()
    clock.now += 10
    line = stats.maybe_say()
    assert line is not None and line.endswith(
        "largest launch beyond vLLM's workspace 650.0 MiB of the 676.0 MiB reserved; 3 fallbacks (an allocation failed in a planned launch: "
        "1; the step could not be planned (ValueError): 2); 1 layer calls failed beyond any bounded path")


def test_the_counts_reach_prometheus_in_multiprocess_mode(tmp_path: pathlib.Path) -> None:
    """Two worker processes publish; the API server's multiprocess collector adds the counters
    and takes the largest gauge. Without multiprocess mode there are no metrics."""
    worker = textwrap.dedent("""
        import sys
        from mla_planner.vllm_backend.stats import StepStats, prometheus_metrics
        stats = StepStats(interval_s=1, reserved_bytes=int(sys.argv[1]))
        stats.planned_step(3, int(sys.argv[1]) // 2)
        stats.fell_back("the step could not be planned (ValueError)")
        stats.publish()
        stats.planned_step(1, 10)
        stats.publish()
        print(prometheus_metrics() is not None)
    """)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for reserved in (600, 800):
        out = subprocess.run([sys.executable, "-c", worker, str(reserved)], env=env, capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() == "True"
    server = textwrap.dedent("""
        import json
        from prometheus_client import CollectorRegistry, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(json.dumps({f"{s.name}{s.labels}": s.value for m in registry.collect() for s in m.samples
                          if s.name.startswith("mla_planner")}))
    """)
    read = json.loads(subprocess.run([sys.executable, "-c", server], env=env, capture_output=True, text=True,
                                     check=True).stdout)
    assert read["mla_planner_steps_planned_total{}"] == 4
    assert read["mla_planner_steps_split_total{}"] == 2
    assert read["mla_planner_launches_total{}"] == 8
    assert read["mla_planner_fallbacks_total{'reason': 'the step could not be planned (ValueError)'}"] == 2
    assert read["mla_planner_reserved_bytes{}"] == 800 and read["mla_planner_largest_launch_bytes{}"] == 400
    plain = subprocess.run([sys.executable, "-c", worker, "1"], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                           text=True, check=True).stdout
    assert plain.strip() == "False", "a worker's metrics would stay in the worker: none"


def test_metrics_that_cannot_be_published_leave_the_line() -> None:
    clock = Clock()
    stats = StepStats(interval_s=1, reserved_bytes=MIB, clock=clock)

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats, "publish", full_disk)
        assert stats.maybe_say() is None
        stats.stock_step()
        clock.now += 1
        line = stats.maybe_say()
    assert line is not None and "1 on vLLM's call" in line
