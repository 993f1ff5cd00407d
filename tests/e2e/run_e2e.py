"""End to end in-process (docs/e2e.md, "The in-process runner"): stock FLASHMLA_SPARSE vs the planned
backend, one ``run_cases.py`` process per engine.

    python3 tests/e2e/run_e2e.py --group A --out /tmp/e2e      # 0.95: cases 1-5
    python3 tests/e2e/run_e2e.py --report-only /tmp/e2e        # e2e.md from the saved JSON

Each run (``--list``) writes ``DIR/<run>.json`` and ``DIR/<run>.log``. Runs share one deadline
(``--deadline-s``), so a group ends inside a device call; what it cuts is reported as not run.
``DIR/e2e.md`` covers every run in DIR, earlier groups' too.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import report
import serve_proc
import serve_run
from run_cases import ENV_DEFAULTS
from serve_run import say

HERE = Path(__file__).resolve().parent
MIN_RUN_S = 75  # an engine start-up alone takes about a minute: start no run with less left


@dataclass(frozen=True)
class Run:
    name: str
    backend: str
    util: float
    mnbt: int
    cases: tuple[str, ...]
    group: str
    timeout_s: int = 300
    tp: int = 1
    heads: int | None = None  # the model's attention heads (TP runs keep 16 per rank)
    debug_log: bool = False  # VLLM_LOGGING_LEVEL=DEBUG: every rank logs each step's plan


RUNS = (  # planned first in group A: finishing every case at 0.95 is the goal
    Run("planned-0.95-32k", "planned", 0.95, 32768, ("1", "2", "3", "5"), "A"),
    Run("planned-0.95-64k", "planned", 0.95, 65536, ("4", "5"), "A"),
    Run("stock-0.95-32k", "stock", 0.95, 32768, ("1", "2", "3", "5"), "A"),
    Run("stock-0.95-64k", "stock", 0.95, 65536, ("4", "5"), "A"),
    Run("stock-0.90-32k", "stock", 0.90, 32768, ("1", "same_function", "throughput"), "B"),
    Run("planned-0.90-32k", "planned", 0.90, 32768, ("1", "same_function", "throughput"), "B"),
    # Tensor parallel 2 (two GPUs), the model scaled to 32 heads: 16 per rank, as DeepSeek-V3.2 at TP 8.
    Run("planned-tp2-0.95-32k", "planned", 0.95, 32768, ("1", "2", "3", "5"), "T", tp=2, heads=32, debug_log=True),
    Run("planned-tp2-0.95-64k", "planned", 0.95, 65536, ("4", "5"), "T", tp=2, heads=32, debug_log=True),
    Run("stock-tp2-0.95-32k", "stock", 0.95, 32768, ("1", "2", "3", "5"), "T", tp=2, heads=32),
    Run("stock-tp2-0.95-64k", "stock", 0.95, 65536, ("4", "5"), "T", tp=2, heads=32),
)
RUNS_BY_NAME = {r.name: r for r in RUNS}


def select_runs(group: str | None, names: str | None) -> list[Run]:
    if names:
        wanted = [n for n in names.split(",") if n]
        unknown = [n for n in wanted if n not in RUNS_BY_NAME]
        if unknown:
            raise SystemExit(f"unknown run(s) {unknown}; known: {', '.join(RUNS_BY_NAME)}")
        return [RUNS_BY_NAME[n] for n in wanted]
    return [r for r in RUNS if r.group == group]


def command(run: Run, out: Path, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, str(HERE / "run_cases.py"), "--backend", run.backend, "--util", str(run.util),
           "--mnbt", str(run.mnbt), "--cases", *run.cases, "--out", str(out / f"{run.name}.json"),
           "--repeats", str(args.repeats)]
    if run.tp != 1:
        cmd += ["--tp", str(run.tp)]
    if run.heads is not None:
        cmd += ["--heads", str(run.heads)]
    if args.fake_engine:
        cmd.append("--fake-engine")
    return cmd


def run_one(cmd: list[str], log: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``cmd`` in its own process group (``serve_proc.spawn``: SIGTERM to it if this driver
    dies, so no engine outlives it on the GPU), output to ``log``; kills the group at the timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = serve_proc.spawn(cmd, f, env)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = serve_proc.kill_group(proc, grace_s=15)["rc"]
    return {"rc": rc, "timed_out": timed_out, "timeout_s": round(timeout_s), "wall_s": time.monotonic() - t0,
            "log": log.name}


def progress_lines(log: Path) -> list[str]:
    """run_cases.py's own one-line reports, out of the vLLM log around them."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [line for line in text.splitlines() if re.match(r"(engine up|engine start-up failed|case \S+: )", line)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=("A", "B", "T"),
                    help="A: 0.95, cases 1-5; B: 0.90, throughput + same function; T: A at tensor parallel 2")
    ap.add_argument("--runs", help="comma-separated run names instead of a group (see --list)")
    ap.add_argument("--out", type=Path, help="results folder (kept: later groups add to it)")
    ap.add_argument("--deadline-s", type=float, default=570, help="all runs of this call end by then (default 570)")
    ap.add_argument("--repeats", type=int, default=5, help="throughput repeats per workload (default 5)")
    ap.add_argument("--report-only", type=Path, metavar="DIR", help="only write DIR/e2e.md from DIR's JSON")
    ap.add_argument("--list", action="store_true", help="print the runs and exit")
    ap.add_argument("--fake-engine", action="store_true", help=argparse.SUPPRESS)  # CPU tests of the pipeline
    args = ap.parse_args(argv)
    if not (args.list or args.report_only) and not ((args.group or args.runs) and args.out):
        ap.error("give --group or --runs, and --out (or --report-only DIR, or --list)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for r in RUNS:
            tp = f"  tp {r.tp}, {r.heads} heads" if r.tp != 1 else ""
            print(f"{r.group}  {r.name:20} {r.backend:8} util {r.util}  mnbt {r.mnbt:5}  cases {' '.join(r.cases)}{tp}")
        return 0
    if args.report_only:
        print(report.write(args.report_only))
        return 0

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # the served phases' bookkeeping: the deadline, and driver.json saved as it changes
    run = serve_run.Run(args, out / report.DRIVER_JSON, report.load_driver(out), time.monotonic())
    for r in select_runs(args.group, args.runs):
        if run.left() < MIN_RUN_S:
            why = {"status": "not run", "reason": f"deadline: {run.left():.0f} s left"}
            run.update(run.data["runs"], **{r.name: why})
            say(f"{r.name}: not run ({run.left():.0f} s left of the deadline)")
            continue
        timeout = min(r.timeout_s, run.left() - 5)
        say(f"{r.name}: running (timeout {timeout:.0f} s) ...")
        extra_env = {"VLLM_LOGGING_LEVEL": "DEBUG"} if r.debug_log else None
        result = run_one(command(r, out, args), out / f"{r.name}.log", timeout, extra_env)
        run.update(run.data["runs"], **{r.name: {"status": "ran", **result}})
        state = "TIMED OUT" if result["timed_out"] else f"rc {result['rc']}"
        say(f"{r.name}: {state} after {result['wall_s']:.0f} s")
        for line in progress_lines(out / f"{r.name}.log"):
            say(f"    {line}")
        time.sleep(3 if result["timed_out"] else 1)  # the next engine measures free memory at start-up
    run.save()
    print(report.write(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
