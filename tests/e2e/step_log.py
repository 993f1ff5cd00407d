"""Where a plugin server's time goes, step by step, from its log.

The backend logs every FP8 step its metadata builder sees at debug level (``mla-planner step:
...``): the steps it plans, with their route, and the steps it leaves to stock's code (decode-only
steps, decodes beside prefills vLLM runs dense). With the timestamps in milliseconds the gaps
between those lines are the steps' durations, to within the engine's one-step lead of the GPU
(async scheduling builds step N+1 while step N runs), which shifts a gap onto the next step.
Hence the decode-only time is estimated from steps inside runs of decode-only steps, where the
shift does not matter: their mean gap times the number of decode-only steps. The mean, not the
median: the timestamps are whole milliseconds, so the gaps of ~3 ms steps are 2, 3, 4 or 5 ms and
their median a whole number, off by up to half a millisecond (on the H200: a median of 3 ms where
the mean was 3.32), while the truncation errors cancel in the mean.

    python3 tests/e2e/step_log.py config /tmp/step-logging.json   # then VLLM_LOGGING_CONFIG_PATH=/tmp/step-logging.json
    python3 tests/e2e/step_log.py report /tmp/serve/logs/plugin-0.40-32k-p8001.log

``config`` writes vLLM's own logging configuration (so it needs vLLM) with milliseconds in the
timestamps and the plugin's logger at debug level; every other vLLM logger stays at INFO.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

PLUGIN_LOGGER = "vllm.mla_planner"
STEP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*mla-planner step: (\d+) tokens, (\d+) decode tokens, "
                  r"(\d+) prefills, (stock's code|\w+)")
DECODE_ONLY = "decode-only, stock's code"
KINDS = (DECODE_ONLY, "decodes + dense prefills, stock's code", "planned: mixed_batch", "planned: separate_prefill_decode")
DEFAULT_GAP_S = 0.5


@dataclass(frozen=True)
class Step:
    at_s: float  # seconds since the first step line
    tokens: int
    decode_tokens: int
    prefills: int
    kind: str


def logging_config() -> dict[str, object]:
    """vLLM's default logging configuration with millisecond timestamps and the plugin at DEBUG."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["format"] = formatter["format"].replace("%(asctime)s", "%(asctime)s.%(msecs)03d")
    config["handlers"]["vllm"]["level"] = "DEBUG"
    config["loggers"]["vllm"]["level"] = "INFO"
    config["loggers"][PLUGIN_LOGGER] = {"level": "DEBUG"}  # propagates to the "vllm" handler
    return config


def kind_of(detail: str, prefills: int) -> str:
    if detail == "stock's code":
        return DECODE_ONLY if prefills == 0 else KINDS[1]
    return f"planned: {detail}"


def parse(text: str) -> list[Step]:
    steps: list[Step] = []
    start: datetime | None = None
    for line in text.splitlines():
        m = STEP.search(line)
        if m is None:
            continue
        at = datetime.strptime(m.group(1), "%m-%d %H:%M:%S.%f")
        start = start or at
        tokens, decode_tokens, prefills = int(m.group(2)), int(m.group(3)), int(m.group(4))
        steps.append(Step((at - start).total_seconds(), tokens, decode_tokens, prefills, kind_of(m.group(5), prefills)))
    return steps


def breakdown(steps: list[Step], gap_s: float = DEFAULT_GAP_S) -> list[str]:
    """The report's lines. Gaps of ``gap_s`` or more are idle time (between bench runs, start-up)."""
    if len(steps) < 2:
        return [f"{len(steps)} step line(s): nothing to measure (was the plugin's logger at DEBUG?)"]
    gaps = [b.at_s - a.at_s for a, b in zip(steps, steps[1:])]
    busy = sum(g for g in gaps if g < gap_s)
    lines = [f"{len(steps):,} steps logged, {busy:.2f} s busy (gaps under {gap_s} s); by the kind of step:",
             "",
             "| kind | steps | tokens | decode tokens | gaps after them, s |",
             "|---|---:|---:|---:|---:|"]
    for kind in sorted({s.kind for s in steps}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)):
        mine = [i for i, s in enumerate(steps) if s.kind == kind]
        after = sum(gaps[i] for i in mine if i < len(gaps) and gaps[i] < gap_s)
        lines.append(f"| {kind} | {len(mine):,} | {sum(steps[i].tokens for i in mine):,} | "
                     f"{sum(steps[i].decode_tokens for i in mine):,} | {after:.2f} |")
    inner = [gaps[i] for i in range(1, len(gaps))
             if gaps[i] < gap_s and all(steps[j].kind == DECODE_ONLY for j in (i - 1, i, i + 1))]
    decode_only = sum(s.kind == DECODE_ONLY for s in steps)
    lines.append("")
    if inner:
        mean = statistics.mean(inner)
        estimate = decode_only * mean
        lines.append(f"decode-only steps: mean {mean * 1e3:.2f} ms inside runs of them ({len(inner):,} gaps; "
                     f"median {statistics.median(inner) * 1e3:.2f} ms), "
                     f"so {decode_only:,} take about {estimate:.2f} s, {estimate / busy:.1%} of the busy time; "
                     f"the other steps about {busy - estimate:.2f} s")
    else:
        lines.append("no runs of decode-only steps: their time is not estimated")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write the logging configuration (VLLM_LOGGING_CONFIG_PATH)")
    cfg.add_argument("path", type=Path)
    rep = sub.add_parser("report", help="the step breakdown of a server log")
    rep.add_argument("log", type=Path)
    rep.add_argument("--gap-s", type=float, default=DEFAULT_GAP_S, help="gaps this long are idle time (default 0.5)")
    args = ap.parse_args(argv)
    if args.command == "config":
        args.path.write_text(json.dumps(logging_config(), indent=1) + "\n")
        print(f"VLLM_LOGGING_CONFIG_PATH={args.path}")
        return 0
    print("\n".join(breakdown(parse(args.log.read_text(errors="replace")), args.gap_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
