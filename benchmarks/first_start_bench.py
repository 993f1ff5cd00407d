"""The profile an engine measures at its first start, against `mla-planner calibrate`'s full one:
how long the reduced grid takes, and whether it routes steps as the full profile does.

For each engine shape (16 heads per rank; ``--max-step-tokens`` values; ``--max-model-len``) the
reduced grid (``mla_planner.calibration.grid.first_start_grid``) is measured on this GPU with
vLLM's kernels, as the backend measures it from inside vLLM's start-up, and timed. Then both
profiles choose the route of each step of a fixed set (prefills of 512 to 32K tokens, alone and
beside 8 or 64 one-token decodes over 4K of context), and the table gives the routes each picks
and each one's predicted time for the step under the full profile:

    python benchmarks/first_start_bench.py --full sm90-full.json --out first_start.md

The full profile comes from ``mla-planner calibrate -o sm90-full.json`` on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import mla_planner
from mla_planner.calibration.grid import first_start_grid
from mla_planner.calibration.measure import json_text, measure

HEADS = 16
PREFILLS = (512, 2048, 8192, 32768)
DECODES = (0, 8, 64)
DECODE_CONTEXT = 4096


def steps(max_step_tokens: int) -> list[tuple[list[int], list[int], int]]:
    out = []
    for prefill in PREFILLS:
        for decodes in DECODES:
            if prefill + decodes <= max_step_tokens:
                out.append(([1] * decodes + [prefill], [DECODE_CONTEXT] * decodes + [0], decodes))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", type=Path, required=True, help="the full profile (mla-planner calibrate) of this machine")
    ap.add_argument("--max-step-tokens", default="8192,32768", help="engine shapes: max_num_batched_tokens values")
    ap.add_argument("--max-model-len", type=int, default=70000)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_start_bench.py needs a CUDA GPU")
    full = mla_planner.CostModel.from_json(args.full.read_text())
    native = "16" in __import__("json").loads(args.full.read_text())["sparse_prefill"]
    lines = [f"First-start profile vs the full one on {torch.cuda.get_device_name()} ({full.environment['kernels']}), "
             f"{HEADS} heads per rank, budget {args.budget_mib} MiB, max_model_len {args.max_model_len:,}.", ""]
    for mnbt in (int(x) for x in args.max_step_tokens.split(",")):
        config = mla_planner.StepConfig(HEADS, arch=full.arch, num_sms=full.num_sms, topk=full.topk, kv_dtype="fp8",
                                        scratch_budget_bytes=args.budget_mib << 20, max_model_len=args.max_model_len,
                                        force_mqa=True, execution="vllm")
        grid = first_start_grid(config, mnbt, args.max_model_len, native)
        started = time.monotonic()
        profile = measure(grid, command="first_start_bench.py", progress=lambda m: None)
        seconds = time.monotonic() - started
        reduced = mla_planner.CostModel.from_json(json_text(profile))
        lines += [f"## max_num_batched_tokens {mnbt:,}: measured in {seconds:.1f} s "
                  f"({sum(map(len, grid.tokens.values())) + sum(map(len, grid.native_tokens.values()))} token sizes, "
                  f"{len(grid.rows)} row sizes, {grid.warmup} + {grid.runs} rounds)", "",
                  "| step | full: route (us) | first start: route | its route under the full profile (us) |",
                  "|---|---|---|---|"]
        agree = 0
        all_steps = steps(mnbt)
        for query_lens, context_lens, decodes in all_steps:
            a = full.choose_route(query_lens, context_lens, decodes, config)
            b = reduced.choose_route(query_lens, context_lens, decodes, config)
            priced = full.predict(query_lens, context_lens, decodes, b.config)
            b_under_full = priced.mixed if b.mode == "mixed_batch" else priced.separate
            a_time = (a.prediction.mixed if a.mode == "mixed_batch" else a.prediction.separate)
            agree += a.mode == b.mode and a.plan.prefill_heads == b.plan.prefill_heads
            label = f"{query_lens[-1]:,} prefill + {decodes} decodes"
            lines.append(f"| {label} | {a.mode} @{a.plan.prefill_heads} ({a_time.total_us if a_time else float('nan'):,.0f}) "
                         f"| {b.mode} @{b.plan.prefill_heads} | {b_under_full.total_us if b_under_full else float('nan'):,.0f} |")
        lines += ["", f"same route and prefill heads in {agree} of {len(all_steps)} steps", ""]
        print("\n".join(lines[-len(all_steps) - 7:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
