"""The inputs that once aborted, hung or wrapped the planner, each in its own process with a 3 GiB
address space and a 20 s limit: every one must end in a ``ValueError`` saying what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

CONFIG = "mp.StepConfig({heads}, scratch_budget_bytes={budget}, gather_workspace_rows=819200, indexer_workspace_rows=6553600{extra})"

CASES = {
    "a 10**8-token prompt": ("mp.plan_step([10**8], [0], 0, " + CONFIG.format(heads=16, budget="1 << 30", extra="") + ")",
                             "more than the 1048576 a plan may hold"),
    "an indexer plan of a chunk per row": ("mp.split_indexer_prefill_chunks([10**8], [10**8], 10**6, 0)", "a plan may hold"),
    "1,024 requests of 2**20 tokens": (
        "mp.plan_step([2**20] * 1024, [0] * 1024, 0, " + CONFIG.format(heads=64, budget="1 << 20", extra="") + ")", "a plan may hold"),
    "2**21 decodes at a one-decode budget": (
        "mp.plan_step([1] * 2**21, [0] * 2**21, 2**21, "
        + CONFIG.format(heads=16, budget="(17 << 20) + (64 << 10)", extra=", mode='separate_prefill_decode'") + ")",
        "the decode launches would need 2097152 launches"),
    "a workspace past 2**63": ("mp.plan_gather_chunks([2**63 - 1], [2**63 - 1], 2**63 + 1)", "at most 2^40"),
    "decode scratch past 2**64": ("mp.decode_scratch(1, 5 * 10**13, 16).total_bytes", "overflows 64-bit"),
    "prefill scratch past 2**64": ("mp.prefill_scratch(2 * 10**14, 16).total_bytes", "overflows 64-bit"),
    "a request offset past int64": ("mp.split_prefill_chunks([10], 40, request_offset=2**63)", "request_offset"),
    "rows past int64": ("mp.plan_gather_chunks([2], [2**63 - 1], 2**63 - 1)", "at most 2^40"),
    "query lengths past their sequences": ("mp.split_indexer_prefill_chunks([0, 0, 0], [2**63 - 1, 2**63 - 1, 2], 10, 10)",
                                           "query_lens must be at most seq_lens"),
    "a BF16 prefill of no tokens": ("mp.plan_step([0], [0], 0, mp.StepConfig(16, kv_dtype='bf16', max_model_len=1000))",
                                    "prefill query lengths must be at least 1"),
    "no heads": ("mp.step_mode(0)", "between 1 and 128"),
    "a billion heads": ("mp.step_mode(10**9)", "between 1 and 128"),
    "an 8,192-token decode": ("mp.plan_step([8192, 1, 1], [0, 0, 0], 2, mp.StepConfig(16, max_model_len=70000))",
                              "decode query lengths"),
}

RUNNER = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import mla_planner as mp
try:
    result = {call}
except ValueError as e:
    print("ValueError:", e)
else:
    print("returned:", str(result)[:200])
"""


@pytest.mark.parametrize("call, needle", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_a_value_error_in_bounded_time_and_memory(call: str, needle: str) -> None:
    proc = subprocess.run([sys.executable, "-c", RUNNER.format(call=call)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ValueError:") and needle in proc.stdout, proc.stdout
