"""End-to-end tests of the `mla-planner` command line (one subprocess per run)."""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import mla_planner
from mla_planner import data

GIB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str, cwd: Path | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "mla_planner.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    if ok:
        assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r


def bad_input(*args: str, cwd: Path | None = None) -> str:
    """Runs a command that must refuse its input: exit 2, one-line message."""
    r = cli(*args, cwd=cwd, ok=False)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "error:" in r.stderr
    return r.stderr


def write_trace(path: Path, steps: list[list[tuple[int, int, bool]]]) -> Path:
    lines = [
        json.dumps({"requests": [{"query_len": q, "context_len": c, "decode": d} for q, c, d in step]})
        for step in steps
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- plan ---------------------------------------------------------------------


def test_plan_default_step() -> None:
    out = cli("plan").stdout
    assert "1 request, 32,768 query tokens" in out
    assert "16 query heads per rank (deepseek-v3.2 at TP 8)" in out
    assert "mixed batch" in out
    assert "planned (mla-planner): 14 launches" in out
    assert "peak     981.5 MiB, launch 0 = q_padded 176.3 + o_accum 627.0 + lse_accum 1.2 + out 156.8 + lse" in out
    assert "bound    budget" in out
    # Stock: one call of 32,768 tokens, 12.27 GiB (docs/kernels.md, "Sparse decode").
    assert "peak     12.27 GiB = q_padded 2.25 + o_accum 8.00 + lse_accum 0.02 + out 2.00 + lse 0.01 GiB" in out


def _check_shape(value: Any, shape: Any, where: str = "$") -> None:
    """`shape`: a type, a tuple of types, [element shape] or {key: shape} (exact keys)."""
    if isinstance(shape, dict):
        assert isinstance(value, dict), where
        assert set(value) == set(shape), (where, sorted(value), sorted(shape))
        for k, s in shape.items():
            _check_shape(value[k], s, f"{where}.{k}")
    elif isinstance(shape, list):
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            _check_shape(v, shape[0], f"{where}[{i}]")
    else:
        assert isinstance(value, shape) and not (isinstance(value, bool) and shape is int), (where, value)


PAIR = [int]
LAUNCH = {"kernel": str, "tokens": PAIR, "requests": PAIR, "batch": int, "s_q": int, "bytes": int, "buffers": dict}
ROUTE_TOKENS = {"dense_mha": int, "masked_mha": int, "sparse_mqa": int}
PLAN_SCHEMA = {
    "schema": str,
    "config": {
        "preset": (str, type(None)),
        "tp": (int, type(None)),
        "num_heads": int,
        "topk": int,
        "kv_dtype": str,
        "arch": str,
        "num_sms": int,
        "masked_mha": bool,
        "budget_bytes": int,
        "max_model_len": int,
        "gather_workspace_rows": int,
        "indexer_workspace_rows": int,
    },
    "step": {"query_lens": [int], "context_lens": [int], "num_decodes": int, "num_tokens": int},
    "mode": str,
    "vllm_path": str,
    "planned": {
        "launches": [LAUNCH],
        "peak_bytes": int,
        "bound": str,
        "failure": (str, type(None)),
        "prefill_groups": [{"requests": PAIR, "path": str, "mask_bytes": int}],
        "prefill_tokens_by_path": ROUTE_TOKENS,
        "gather_chunks": [[int]],
        "gather_workspace_bytes": int,
        "indexer_chunks": [[int]],
        "indexer_peak_bytes": int,
    },
    "stock": {"launches": [LAUNCH], "peak_bytes": int, "failure": (str, type(None)), "prefill_tokens_by_path": ROUTE_TOKENS},
}


# A BF16 step whose prefill runs on sparse MQA: the plan is stock's one call.
BF16_SPARSE_STEP = ["--heads", "128", "--kv-dtype", "bf16", "--query-lens", "1,40000", "--context-lens", "100,0",
                    "--num-decodes", "1"]


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--query-lens", "1,1,8192", "--context-lens", "100,50,0", "--num-decodes", "2", "--budget", "512MiB"],
        ["--preset", "deepseek-v3.2", "--tp", "2", "--query-lens", "1,70000", "--context-lens", "9,0", "--num-decodes", "1"],
        ["--heads", "128", "--kv-dtype", "bf16", "--arch", "sm100", "--masked-mha", "--query-lens", "30000,4000"],
        BF16_SPARSE_STEP,
    ],
)
def test_plan_json_schema_and_consistency(args: list[str]) -> None:
    plan = json.loads(cli("plan", "--json", *args).stdout)
    _check_shape(plan, PLAN_SCHEMA)
    assert plan["schema"] == "mla-planner.plan/2"
    assert plan["mode"] in ("mixed_batch", "separate_prefill_decode", "bf16")
    assert plan["planned"]["bound"] in ("none", "budget", "int32_stride", "grid")
    step, cfg = plan["step"], plan["config"]
    # The JSON is the planner's own plan: same launches and bytes as the API.
    config = mla_planner.StepConfig(
        cfg["num_heads"], scratch_budget_bytes=cfg["budget_bytes"], kv_dtype=cfg["kv_dtype"], arch=cfg["arch"],
        num_sms=cfg["num_sms"], topk=cfg["topk"], gather_workspace_rows=cfg["gather_workspace_rows"],
        indexer_workspace_rows=cfg["indexer_workspace_rows"], masked_mha=cfg["masked_mha"], execution="vllm",
    )  # fmt: skip
    api = mla_planner.plan_step(step["query_lens"], step["context_lens"], step["num_decodes"], config)
    launches = plan["planned"]["launches"]
    assert [x["tokens"] + x["requests"] for x in launches] == api.launches[:, :4].tolist()
    assert [x["bytes"] for x in launches] == api.launch_bytes.tolist()
    assert plan["planned"]["peak_bytes"] == api.peak_bytes == max((x["bytes"] for x in launches), default=0)
    for x in plan["stock"]["launches"] + launches:  # planned: shared buffers at the longest launch's size
        assert sum(x["buffers"].values()) == x["bytes"], x
    if plan["mode"] != "bf16":
        assert plan["planned"]["peak_bytes"] <= cfg["budget_bytes"]


def test_plan_text_of_a_bf16_sparse_step() -> None:
    # Its one launch counts the indices vLLM translates for the call; stock's row, the call's
    # buffers only (docs/cli.md). The peak line names the launch and adds up either way.
    text = " ".join(cli("plan", *BF16_SPARSE_STEP).stdout.split())  # lines unfolded
    planned, stock = text.split("stock vLLM:")
    assert "1 launch" in planned and "FAILS: int32_stride" in planned
    assert "peak 5.23 GiB = out 4.88" in planned and "workspace_indices 0.31 GiB" in planned
    assert "peak 4.92 GiB = out 4.88" in stock and "workspace_indices" not in stock


def test_plan_presets_state_the_vllm_path() -> None:
    glm = json.loads(cli("plan", "--json", "--preset", "glm-5", "--tp", "8").stdout)
    assert glm["config"]["num_heads"] == 8 and glm["mode"] == "mixed_batch"
    v32 = json.loads(cli("plan", "--json", "--preset", "deepseek-v3.2", "--tp", "4").stdout)
    assert v32["config"]["num_heads"] == 32 and v32["mode"] == "separate_prefill_decode"
    assert v32["vllm_path"].startswith("separate prefill/decode")
    listing = cli("presets").stdout
    assert "--tp 8:  16 heads per rank; FP8 KV takes vLLM's mixed batch path" in listing
    assert "--tp 1: 128 heads per rank; FP8 KV takes vLLM's separate prefill/decode path" in listing


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "llama"], "unknown preset 'llama'"),
        (["--preset", "glm-5", "--tp", "2"], "supports --tp 4, 8"),
        (["--budget", "1GB"], "is not a size"),
        (["--budget", "1KiB"], "give at least"),
        (["--query-lens", "1,2", "--context-lens", "5"], "give one per request"),
        (["--query-lens", "1,-2"], "--query-lens must be at least 1, got -2"),
        (["--tokens", "-5"], "--tokens must be at least 1, got -5"),
        (["--budget", "-1GiB"], "argument --budget: '-1GiB' is not a size"),
        (["--budget", "1KiB"], "--budget must be more than the allocator's 64 KiB reserve"),
        (["--tokens", "100", "--context-lens", "200000"], "--tokens 100 + --context-lens 200,000 is more than --max-model-len"),
        (["--query-lens", "1,x"], "not a comma-separated list"),
        (["--heads", "16", "--preset", "glm-5"], "not both"),
        (["--masked-mha"], "--masked-mha needs --arch sm100"),
        (["--heads", "200"], "must be between 1 and 128"),  # refused by the planner core
    ],
)
def test_plan_bad_input(args: list[str], message: str) -> None:
    assert message in bad_input("plan", *args)


# --- trace gen ----------------------------------------------------------------


def test_trace_gen_is_seeded_and_the_default_workload_is_its_output(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl.gz"
    cli("trace", "gen", "--steps", "3000", "--seed", "0", "-o", str(a))
    cli("trace", "gen", "--steps", "3000", "--seed", "0", "-o", str(b))
    cli("trace", "gen", "--steps", "3000", "--seed", "1", "-o", str(c))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    shipped = (resources.files(data) / data.DEFAULT_TRACE).read_bytes()
    assert shipped == a.read_bytes(), "regenerate the shipped trace (see mla_planner/data/__init__.py)"
    assert len(shipped) < 1 << 20


def test_trace_gen_follows_the_scheduler_model() -> None:
    out = cli("trace", "gen", "--steps", "800", "--seed", "3", "--max-num-batched-tokens", "8192,65536").stdout
    steps = [json.loads(line)["requests"] for line in out.splitlines()]
    assert len(steps) == 800
    big_steps = 0
    for i, reqs in enumerate(steps):
        budget = 8192 if i < 400 else 65536
        tokens = sum(r["query_len"] for r in reqs)
        assert tokens <= budget
        big_steps += tokens > 8192
        assert len(reqs) <= 32
        flags = [r["decode"] for r in reqs]
        assert flags == sorted(flags, reverse=True), "decodes first"
        assert all(r["query_len"] == 1 for r in reqs if r["decode"])
        assert all(r["query_len"] >= 1 and r["context_len"] >= 0 for r in reqs)
    assert big_steps > 0  # long documents arrive and take the bigger budget
    # Chunked prefill carries context: some prefill chunk starts mid-prompt.
    assert any(r["context_len"] >= 8192 and not r["decode"] for reqs in steps for r in reqs)


def test_trace_gen_bad_input(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert "--steps must be from 1 to 1,000,000" in bad_input("trace", "gen", "--steps", "0", "-o", str(out))
    assert "got 100,000,000,000" in bad_input("trace", "gen", "--steps", "100000000000", "-o", str(out))
    assert "not a comma-separated list" in bad_input("trace", "gen", "--max-num-batched-tokens", "8k", "-o", str(out))
    assert not out.exists()


# --- simulate -------------------------------------------------------------------

OUTPUTS = ("simulate.md", "simulate.png", "simulate_steps.csv", "simulate_summary.json")


def test_simulate_default_workload_outputs_agree(tmp_path: Path) -> None:
    r = cli("simulate", cwd=tmp_path)  # no --out: ./mla-planner-report
    assert r.stderr == ""  # no progress bar when stderr is not a terminal
    out = tmp_path / "mla-planner-report"
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)
    png = (out / "simulate.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    summary = json.loads((out / "simulate_summary.json").read_text())
    rows = list(csv.DictReader((out / "simulate_steps.csv").open()))
    assert summary["steps"] == len(rows) == 3000
    for policy in ("stock", "planned"):
        s = summary[policy]
        peaks = [int(row[f"{policy}_bytes"]) for row in rows]
        assert s["peak_bytes"]["max"] == max(peaks)
        assert s["over_headroom_steps"] == sum(p > summary["headroom_bytes"] for p in peaks)
        assert s["hard_failure_steps"]["int32_stride"] == sum(row[f"{policy}_failure"] == "int32_stride" for row in rows)
        assert s["launches_per_step"]["total"] == sum(int(row[f"{policy}_launches"]) for row in rows)
    # The default workload shows the problem and the fix.
    assert summary["stock"]["over_headroom_steps"] > 0 and summary["stock"]["hard_failure_steps"]["int32_stride"] > 0
    assert summary["planned"]["peak_bytes"]["max"] <= summary["budget_bytes"]
    assert summary["planned"]["failed_steps"] == 0
    # Terminal and Markdown show the same figures.
    report = (out / "simulate.md").read_text()
    stock_oom, planned_oom = summary["stock"]["over_headroom_steps"], summary["planned"]["over_headroom_steps"]
    assert f"| steps over the 4.00 GiB headroom (OOM) | {stock_oom:,} | {planned_oom:,} |" in report
    assert "![per-step scratch](simulate.png)" in report
    line = next(x for x in r.stdout.splitlines() if "headroom (OOM)" in x)
    assert line.split()[-2:] == [f"{stock_oom:,}", f"{planned_oom:,}"]


def test_simulate_golden_tiny_trace(tmp_path: Path) -> None:
    """Stock and planned peaks computed by hand from docs/kernels.md, "Sparse decode" (16 heads per
    rank padded to h = 64, sm90, 132 SMs, topk 2048, d_v 512, d_qk 576)."""
    trace = write_trace(
        tmp_path / "tiny.jsonl",
        [
            [(1, 5000, True)] * 4,  # 4 decodes
            [(32768, 0, False)],  # one 32K prompt
            [(1, 7000, True), (1, 8000, True), (60000, 0, False)],  # over the int32 stride limit
            [(1, 10, True)] * 3 + [(1000, 0, False)],  # a short prompt: dense MHA, only decodes sparse
        ],
    )
    h, dv, dqk, sms = 64, 512, 576, 132

    def decode(s_q: int, out: bool) -> int:  # b = 1
        parts = max((sms // s_q) // (h // 64), 1)
        o_accum = (1 + parts) * s_q * h * dv * 4
        lse_accum = (1 + parts) * s_q * h * 4
        q_padded = s_q * h * dqk * 2
        lse = s_q * h * 4
        return o_accum + lse_accum + q_padded + lse + (s_q * h * dv * 2 if out else 0)

    slots = 2048 * 4  # each launch translates its own tokens' top-k indices (int32)

    def planned(tokens: int) -> tuple[int, int]:
        # P = 1 from 67 tokens on, so bytes grow linearly. The backend's launches: the longest
        # whole number of 132-token waves under the 1 GiB budget less the allocator's 64 KiB,
        # then the rest (one launch more than the fewest at most).
        per_token = decode(1000, True) // 1000 + slots
        longest = (GIB - (64 << 10)) // per_token
        wave = longest - longest % sms
        fewest, aligned = math.ceil(tokens / longest), math.ceil(tokens / wave)
        assert aligned <= fewest + 1
        return wave * per_token, aligned

    stock_peaks = [decode(4, True), decode(32768, True), decode(60002, True), decode(3, True)]
    p32k, p60k = planned(32768), planned(60002)
    planned_peaks = [decode(4, True) + 4 * slots, p32k[0], p60k[0], decode(3, True) + 3 * slots]
    assert stock_peaks[1] == 13_178_503_168  # 12.27 GiB, docs/kernels.md "Sparse decode"
    assert p32k[1] == 14

    cli("simulate", str(trace), "--out", str(tmp_path / "out"), "--headroom-gib", "4")
    rows = list(csv.DictReader((tmp_path / "out" / "simulate_steps.csv").open()))
    assert [int(r["stock_bytes"]) for r in rows] == stock_peaks
    assert [int(r["planned_bytes"]) for r in rows] == planned_peaks
    assert [r["stock_failure"] for r in rows] == ["", "", "int32_stride", ""]  # 60,002 > 58,254 tokens
    assert [int(r["planned_launches"]) for r in rows] == [1, p32k[1], p60k[1], 1]
    assert [int(r["stock_launches"]) for r in rows] == [1, 1, 1, 1]
    s = json.loads((tmp_path / "out" / "simulate_summary.json").read_text())
    assert s["stock"]["peak_bytes"]["max"] == stock_peaks[2]
    assert s["stock"]["over_headroom_steps"] == 2 and s["stock"]["failed_steps"] == 2
    assert s["planned"]["peak_bytes"]["max"] == p60k[0] <= GIB
    assert s["planned"]["over_headroom_steps"] == 0
    prefill = 32768 + 60000 + 1000
    for policy in ("stock", "planned"):
        assert s[policy]["prefill_tokens_by_path"] == {"dense_mha": 1000, "masked_mha": 0, "sparse_mqa": 92768}
        assert s[policy]["prefill_share_by_path"]["dense_mha"] == pytest.approx(1000 / prefill)


def test_simulate_reads_gzip_and_orders_decodes_first(tmp_path: Path) -> None:
    plain = tmp_path / "t.jsonl"
    # A prefill listed before a decode; `decode` left out (query_len 1 = decode).
    plain.write_text('{"requests": [{"query_len": 4096, "context_len": 0}, {"query_len": 1, "context_len": 9}]}\n\n')
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    for trace, out in ((plain, "a"), (gz, "b")):
        cli("simulate", str(trace), "--out", str(tmp_path / out), "--no-plot")
    a = (tmp_path / "a" / "simulate_steps.csv").read_text()
    assert a == (tmp_path / "b" / "simulate_steps.csv").read_text()
    assert a.splitlines()[1].startswith("1,4097,4096,")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"requests": [{"query_len": 1, "context_len": 2}', "malformed JSON"),
        ('{"requests": [{"query_len": -3, "context_len": 0}]}', "request 0: query_len must be >= 1, got -3"),
        ('{"requests": [{"query_len": 1, "context_len": 0}, {"query_len": 8, "context_len": -5}]}',
         "request 1: context_len must be >= 0, got -5"),
        ('{"requests": [{"query_len": 1.5, "context_len": 0}]}', "request 0: query_len must be an integer, got 1.5"),
        ('{"requests": [{"query_len": 1, "context_len": 0, "decode": "yes"}]}', "request 0: decode must be true or false"),
        ('{"requests": [{"query_len": 1, "context": 0}]}', "request 0: unknown field 'context'"),
        ('{"steps": []}', 'a step needs a "requests" list'),
        ("[1, 2]", "a step must be a JSON object"),
    ],
)  # fmt: skip
def test_simulate_bad_trace_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"requests": [{"query_len": 1, "context_len": 3}]}'
    trace = tmp_path / "bad.jsonl"
    trace.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    err = bad_input("simulate", str(trace), "--out", str(tmp_path / "out"))
    assert f"{trace}:3: {message}" in err
    assert not (tmp_path / "out").exists()


def test_simulate_other_bad_input_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert "cannot read trace" in bad_input("simulate", str(tmp_path / "missing.jsonl"), "--out", str(out))
    trace = write_trace(tmp_path / "t.jsonl", [[(1, 3, True)], [(9000, 0, False)]])
    # A budget below one launch's minimum: the planner's message, with the step.
    assert f"{trace}:1: a budget of 1.0 MiB is below" in bad_input("simulate", str(trace), "--budget", "1MiB", "--out", str(out))
    assert "unknown preset" in bad_input("simulate", str(trace), "--preset", "nope", "--out", str(out))
    assert not out.exists()


def test_simulate_ctrl_c_stops_cleanly(tmp_path: Path) -> None:
    # A FIFO as the trace: opening it for writing returns once `simulate` has
    # opened it (past its imports), and the replay then waits for more steps.
    trace = tmp_path / "trace.fifo"
    os.mkfifo(trace)
    out = tmp_path / "out"
    # Ctrl-C's disposition as a terminal gives it: a test run started in the background inherits
    # SIGINT ignored, and Python then installs no handler in the child.
    p = subprocess.Popen(
        [sys.executable, "-m", "mla_planner.cli", "simulate", str(trace), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    with open(trace, "w") as f:
        f.write('{"requests":[{"query_len":8192,"context_len":0}]}\n' * 100)
        f.flush()
        time.sleep(0.5)
        assert p.poll() is None
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=30)
    assert p.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists()


def test_simulate_output_is_replaced_whole(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[(1, 3, True)]])
    out = tmp_path / "out"
    cli("simulate", str(trace), "--out", str(out), "--no-plot")
    cli("simulate", str(trace), "--out", str(out), "--no-plot")
    assert sorted(os.listdir(out)) == sorted(set(OUTPUTS) - {"simulate.png"})  # no temporary files left
    assert "simulate.png" not in (out / "simulate.md").read_text()  # no picture named that was not written


def test_help_and_version() -> None:
    assert "simulate" in cli("--help").stdout
    assert mla_planner.__version__ in cli("--version").stdout
    assert "--headroom-gib" in cli("simulate", "--help").stdout
