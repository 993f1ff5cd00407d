"""Test cases of a Triton kernel run under Triton's interpreter, in a subprocess: the interpreter
is chosen when ``@triton.jit`` decorates a kernel (at import), so a test process that has imported
the kernel already cannot switch it on. The worker (a script in this folder) reads the cases from
its first argument and writes its results to its second, both with ``torch.save``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HARNESS = Path(__file__).resolve().parent


def run_interpreted(worker: str, cases: Any, tmp: Path, timeout_s: float = 600) -> Any:
    """``worker``'s results for ``cases`` under ``TRITON_INTERPRET=1``, with this process's module
    path; fails the test with the worker's output if it exits non-zero."""
    torch.save(cases, tmp / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(HARNESS / worker), str(tmp / "cases.pt"), str(tmp / "results.pt")],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(tmp / "results.pt")
