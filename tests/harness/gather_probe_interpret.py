"""Runs benchmarks/gather_probe.py's gather-only kernel under Triton's interpreter, in a process of
its own:

    TRITON_INTERPRET=1 python tests/harness/gather_probe_interpret.py CASES.pt RESULTS.pt

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates the kernel (at import), so the
interpreter needs a fresh process; tests/test_gather_probe.py starts this one. CASES.pt: a list of
``{"kv_cache", "indices", "config": GatherConfig label}``; RESULTS.pt: the list of their ``(T, 164)``
int32 outputs. Each output starts filled with a sentinel, so a word the kernel never writes shows
up as a mismatch. The kernel does integer loads and adds only: none of the interpreter fixes
tests/harness/fp8_direct_interpret.py applies for the attention kernel is needed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SENTINEL = 0x5A5A5A5A


def main(cases_path: str, results_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    from gather_probe import GatherConfig, gather_rows

    results = []
    for case in torch.load(cases_path):
        indices = case["indices"]
        out = torch.full((indices.shape[0], 164), SENTINEL, dtype=torch.int32)
        returned, _ = gather_rows(case["kv_cache"], indices, out, GatherConfig.parse(case["config"]))
        assert returned is out
        results.append(out)
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
