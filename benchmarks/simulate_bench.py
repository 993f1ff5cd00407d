"""How fast `mla-planner simulate` replays a trace.

Target: 100,000 steps in under 10 s on the 2-core dev machine.
Generates the trace (not timed in the target), then times the whole command
end to end as a user runs it (process start, parsing, both policies, the
report, CSV and PNG) and, in process, parsing and replay on their own.

    .venv/bin/python benchmarks/simulate_bench.py [--steps 100000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mla_planner.cli import build_parser, config, simulate, tracegen
from mla_planner.cli.steps import read_trace

TARGET_S = 10.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "bench.jsonl"
        t = time.perf_counter()
        with open(trace, "w") as f:
            f.writelines(s.to_json() + "\n" for s in tracegen.generate(args.steps, args.seed, tracegen.DEFAULT_BATCHED_TOKENS))
        gen_s = time.perf_counter() - t
        print(f"trace: {args.steps:,} steps, {trace.stat().st_size / 2**20:.0f} MiB, generated in {gen_s:.1f} s")

        cmd = [sys.executable, "-m", "mla_planner.cli", "simulate", str(trace), "--out", str(Path(tmp) / "out"), "--quiet"]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cli_s = time.perf_counter() - t

        cfg = config.PlannerConfig.from_args(build_parser().parse_args(["simulate"]))
        t = time.perf_counter()
        steps = list(read_trace(trace))
        parse_s = time.perf_counter() - t
        t = time.perf_counter()
        simulate.replay(steps, cfg, str(trace))
        replay_s = time.perf_counter() - t

    n = args.steps
    print(f"parse only:          {parse_s:6.2f} s  {n / parse_s:10,.0f} steps/s")
    print(f"replay, both policies:{replay_s:5.2f} s  {n / replay_s:10,.0f} steps/s")
    verdict = "ok" if cli_s < TARGET_S * n / 100_000 else "TOO SLOW"
    print(f"mla-planner simulate, end to end: {cli_s:.2f} s  {n / cli_s:,.0f} steps/s  "
          f"(target: 100,000 steps < {TARGET_S:.0f} s) {verdict}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
