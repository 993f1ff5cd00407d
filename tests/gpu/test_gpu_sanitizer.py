"""``compute-sanitizer --tool memcheck`` on sanitizer_case.py: no invalid access in a chunked run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import PROVIDER

pytestmark = pytest.mark.gpu

CASE = Path(__file__).with_name("sanitizer_case.py")


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None
    )


def test_memcheck_is_clean_on_a_small_chunked_run() -> None:
    sanitizer = _sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH (nor in /usr/local/cuda/bin)")
    done = subprocess.run(
        [sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, str(CASE), PROVIDER],
        capture_output=True, text=True, timeout=1200,
    )
    report = done.stdout + done.stderr
    print(report[-4000:])
    assert done.returncode == 0, report[-4000:]
    assert "ERROR SUMMARY: 0 errors" in report
