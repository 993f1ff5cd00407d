"""vLLM's own sparse-MLA test file on the GPU, with the backend's classes in place of stock's.

Three runs of ``tests/v1/attention/test_sparse_mla_backends.py`` from the installed vLLM's source
distribution (``MLA_PLANNER_VLLM_SDIST``: the sdist, or an unpacked tree with that file), at the
same time, each a pytest of its own (tests/vllm_own_tests_plugin.py in its GPU mode): stock's
classes, the backend's at the default budget, and the backend's at ``MLA_PLANNER_SCRATCH_MB=64``.
At the default budget every test stock passes passes; at 64 MiB every one passes or is refused
when the engine's classes are built, its message naming the minimum (``set
MLA_PLANNER_SCRATCH_MB=N or more``). ``MLA_PLANNER_RESULTS``: a JSON file for every outcome.
``MLA_PLANNER_OWN_TESTS_RUNS``: which runs (``stock,planned,planned-64``, the default; ``planned-N``
is the backend's at ``MLA_PLANNER_SCRATCH_MB=N`` for any N, held to the 64 MiB run's rule: a budget
just above a head count's minimum makes every launch as short as that minimum allows; a comparison
needs stock's outcomes: where ``stock`` is not run, those of a JSON file of an earlier run named by
``MLA_PLANNER_STOCK_RESULTS``). ``MLA_PLANNER_OWN_TESTS_ARGS``: more pytest arguments
for every run, e.g. ``-n 5`` (pytest-xdist: one run alone, one process, takes longer than a device
call) or a ``-k`` selection (a result recorded from a selection says which).
``MLA_PLANNER_OWN_TESTS_DEADLINE_S`` (default 3600): the runs still going then are stopped and
compared on the tests they finished (each run's outcome log, tests/vllm_own_tests_plugin.py), and
the test skips saying so. Model configurations come from an offline stand-in hub
(tests/vllm_hub.py): the GPU machine reaches no network.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import time

import pytest

pytest.importorskip("vllm", reason="vLLM's own tests need vLLM")
pytestmark = pytest.mark.gpu

from test_vllm_own_tests import (  # noqa: E402
    engine_run,
    finished_outcomes,
    outcomes_of,
    start_vllm_tests,
    stop_vllm_tests,
    vllm_test_tree_or_skip,
)

REFUSAL = "or more"  # the start-up refusal's "set MLA_PLANNER_SCRATCH_MB=N or more"
DEADLINE_VAR = "MLA_PLANNER_OWN_TESTS_DEADLINE_S"
DEFAULT_RUNS = "stock,planned,planned-64"


def test_vllm_sparse_mla_tests_on_the_gpu(tmp_path: pathlib.Path) -> None:
    tree = vllm_test_tree_or_skip(tmp_path / "tree")
    chosen = os.environ.get("MLA_PLANNER_OWN_TESTS_RUNS", DEFAULT_RUNS).split(",")
    unknown = [name for name in chosen if engine_run(name) is None]
    assert not unknown, f"MLA_PLANNER_OWN_TESTS_RUNS: {unknown} are not runs (stock, planned, planned-N)"
    args = tuple(shlex.split(os.environ.get("MLA_PLANNER_OWN_TESTS_ARGS", "")))
    started = {}
    for name in chosen:
        engine, env = engine_run(name) or ("", {})
        started[name] = start_vllm_tests(tree, engine, tmp_path / name,
                                         dict(env, MLA_PLANNER_OWN_TESTS_ON="gpu", MLA_PLANNER_COST_PROFILE="none"), args)
    deadline = time.monotonic() + float(os.environ.get(DEADLINE_VAR, "3600"))
    runs, cut = {}, []
    for name, (proc, report) in started.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            runs[name] = outcomes_of(proc, report)
        except subprocess.TimeoutExpired:  # stopped: what it finished is in its outcome log
            stop_vllm_tests(proc)
            runs[name] = finished_outcomes(report)
            cut.append(name)
    if "stock" not in runs:
        earlier = os.environ.get("MLA_PLANNER_STOCK_RESULTS")
        if not earlier:
            pytest.skip("no stock outcomes to compare with: run stock too, or name an earlier run's JSON")
        runs["stock"] = {test: tuple(outcome) for test, outcome in json.loads(pathlib.Path(earlier).read_text())["stock"].items()}
    where = os.environ.get("MLA_PLANNER_RESULTS")
    if where:
        pathlib.Path(where).write_text(json.dumps(dict(runs, cut=cut), indent=1))
    for name, outcomes in runs.items():
        counts: dict[str, int] = {}
        for kind, _ in outcomes.values():
            counts[kind] = counts.get(kind, 0) + 1
        print(f"{name}: {len(outcomes)} tests{' (stopped at the deadline)' if name in cut else ''}, {counts}")
    stock_passed = {test for test, (kind, _) in runs["stock"].items() if kind == "passed"}

    def judged(name: str) -> set[str]:
        """The tests stock passes that run ``name`` is held to: a run stopped at the deadline, those it finished."""
        return stock_passed & set(runs[name]) if name in cut else stock_passed

    if "planned" in runs:
        lost = {test: runs["planned"].get(test) for test in judged("planned")
                if runs["planned"].get(test, ("?",))[0] != "passed"}
        assert not lost, f"stock passes, the backend does not: {lost}"
    for name in (name for name in runs if name.startswith("planned-")):
        small = {test: runs[name].get(test) for test in judged(name)
                 if runs[name].get(test, ("?", ""))[0] != "passed" and REFUSAL not in runs[name].get(test, ("?", ""))[1]}
        assert not small, f"{name}: neither passed nor refused naming the minimum: {small}"
    if cut:
        compared = set.intersection(*(set(outcomes) for outcomes in runs.values()))
        pytest.skip(f"{', '.join(cut)} stopped at the deadline ({DEADLINE_VAR}): the {len(compared)} tests every run "
                    "finished hold the rules above; the rest were not run")
