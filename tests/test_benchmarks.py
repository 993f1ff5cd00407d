"""Every benchmark the docs name runs: ``python benchmarks/X.py --help`` exits 0 on a machine with
no GPU (a benchmark checks for one after reading its options), so an import that rots fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_found() -> None:
    assert {"kernel_bench.py", "route_bench.py"} <= {p.name for p in BENCHMARKS}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_help_runs(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=script.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
