"""Where a server's time goes, step by step, from its log.

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

Stock's engine logs no such lines. Started with ``--enable-logging-iteration-details``
(``run_serve.py --log-iterations``), every server, stock's too, logs vLLM's own line per engine
step ("Iteration(N): C context requests, T context tokens, G generation requests, D generation
tokens, iteration elapsed time: E ms"), from its API server as each step's output arrives; a step
with no context tokens is decode-only. ``compare`` measures both engines of an ``ab`` with those
lines alike: the decode-only steps' mean gap (the per-step cost the chat workload sees; any
difference is work the plugin adds) and the other steps' time per token (their context and
generation tokens: how much faster the steps that prefill are). E is the engine's wait for a step's output: with async
scheduling the next step's host work runs before that wait, so E is what the GPU had left, and the
gaps, not E, are the steps' durations.

    python3 tests/e2e/step_log.py config /tmp/step-logging.json   # then VLLM_LOGGING_CONFIG_PATH=/tmp/step-logging.json
    python3 tests/e2e/step_log.py report /tmp/serve/logs/ab0-plugin.log
    python3 tests/e2e/step_log.py compare /tmp/serve/logs/ab0-stock.log /tmp/serve/logs/ab0-plugin.log
    python3 tests/e2e/step_log.py compare --ab /tmp/serve   # each workload's timed runs apart

``config`` writes vLLM's own logging configuration (so it needs vLLM) with milliseconds in the
timestamps and the plugin's logger at debug level (``--no-plugin-steps``: at INFO, as stock's engine
logs nothing per step); every other vLLM logger stays at INFO.
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
from typing import Any, Iterator

PLUGIN_LOGGER = "vllm.mla_planner"
STEP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*mla-planner step: (\d+) tokens, (\d+) decode tokens, "
                  r"(\d+) prefills, (stock's code|\w+)")
ITERATION = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*Iteration\((\d+)\): (\d+) context requests, "
                       r"(\d+) context tokens, (\d+) generation requests, (\d+) generation tokens, "
                       r"iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")
DECODE_ONLY = "decode-only, stock's code"
KINDS = (DECODE_ONLY, "decodes + dense prefills, stock's code", "planned: mixed_batch", "planned: separate_prefill_decode")
ITERATION_KINDS = ("decode-only", "with context tokens")
DEFAULT_GAP_S = 0.5
STAMP = "%m-%d %H:%M:%S.%f"  # vLLM's log time under `config` (local time), to the microsecond; lines show ms


@dataclass(frozen=True)
class Step:
    at_s: float  # seconds since the first step line
    tokens: int
    decode_tokens: int
    prefills: int  # requests with prompt tokens in the step
    kind: str
    elapsed_ms: float | None = None  # vLLM's iteration lines: the engine's wait for the step's output

    @property
    def decode_only(self) -> bool:
        """No prompt tokens, and (the plugin's lines) not planned: the steps both engines run alike."""
        return self.kind in (DECODE_ONLY, ITERATION_KINDS[0])


@dataclass(frozen=True)
class Split:
    """A log's busy time, and the part of it the decode-only steps take."""

    steps: int
    busy_s: float
    decode_only: int  # steps
    inner_gaps: list[float]  # the gaps inside runs of decode-only steps, s
    other_tokens: int  # the tokens of the steps that are not decode-only (prompt and decode)

    @property
    def decode_gap_s(self) -> float | None:
        return statistics.mean(self.inner_gaps) if self.inner_gaps else None

    @property
    def decode_s(self) -> float | None:
        """The decode-only steps' time: their mean gap inside runs of them times their count."""
        gap = self.decode_gap_s
        return None if gap is None else gap * self.decode_only


def logging_config(plugin_steps: bool = True) -> dict[str, object]:
    """vLLM's default logging configuration with millisecond timestamps and, with ``plugin_steps``,
    the plugin at DEBUG. Its step lines are written by the engine process between steps, a cost
    stock's engine does not pay: a per-step comparison of the two engines leaves them out."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["format"] = formatter["format"].replace("%(asctime)s", "%(asctime)s.%(msecs)03d")
    config["handlers"]["vllm"]["level"] = "DEBUG"
    config["loggers"]["vllm"]["level"] = "INFO"
    if plugin_steps:
        config["loggers"][PLUGIN_LOGGER] = {"level": "DEBUG"}  # propagates to the "vllm" handler
    return config


def kind_of(detail: str, prefills: int) -> str:
    if detail == "stock's code":
        return DECODE_ONLY if prefills == 0 else KINDS[1]
    return f"planned: {detail}"


def stamp() -> str:
    """Now, as vLLM stamps its log lines under `config`: the driver marks each bench run's window."""
    return datetime.now().strftime(STAMP)[:-3]


Window = tuple[str, str]  # stamps, first and last


def _matches(text: str, pattern: re.Pattern[str],
             windows: list[Window] | None = None) -> Iterator[tuple[float, re.Match[str]]]:
    """The lines ``pattern`` matches (its first group a timestamp; inside one of ``windows``, if
    given), with their time in seconds since the first of them."""
    start: datetime | None = None
    for line in text.splitlines():
        m = pattern.search(line)
        if m is None or windows is not None and not any(a <= m[1] <= b for a, b in windows):
            continue  # the stamps have one fixed width: as strings they order as times (within a year)
        at = datetime.strptime(m[1], STAMP)
        start = start or at
        yield (at - start).total_seconds(), m


def parse(text: str) -> list[Step]:
    """The plugin's step lines."""
    return [Step(at, int(m[2]), int(m[3]), int(m[4]), kind_of(m[5], int(m[4]))) for at, m in _matches(text, STEP)]


def parse_iterations(text: str, windows: list[Window] | None = None) -> list[Step]:
    """vLLM's iteration lines (``--enable-logging-iteration-details``), any engine's, inside
    ``windows`` if given: tokens are the context (prompt) tokens and the generation (decode)
    tokens together."""
    return [Step(at, int(m[4]) + int(m[6]), int(m[6]), int(m[3]), ITERATION_KINDS[int(m[3]) > 0], float(m[7]))
            for at, m in _matches(text, ITERATION, windows)]


def split(steps: list[Step], gap_s: float = DEFAULT_GAP_S) -> Split:
    """Gaps of ``gap_s`` or more are idle time (between bench runs, start-up), not a step's."""
    gaps = [b.at_s - a.at_s for a, b in zip(steps, steps[1:])]
    inner = [gaps[i] for i in range(1, len(gaps))
             if gaps[i] < gap_s and all(steps[j].decode_only for j in (i - 1, i, i + 1))]
    return Split(len(steps), sum(g for g in gaps if g < gap_s), sum(s.decode_only for s in steps), inner,
                 sum(s.tokens for s in steps if not s.decode_only))


def breakdown(steps: list[Step], gap_s: float = DEFAULT_GAP_S) -> list[str]:
    """The report's lines, by the kind of step."""
    if len(steps) < 2:
        return [f"{len(steps)} step line(s): nothing to measure (was the plugin's logger at DEBUG, or the server "
                "started with --enable-logging-iteration-details?)"]
    gaps = [b.at_s - a.at_s for a, b in zip(steps, steps[1:])]
    whole = split(steps, gap_s)
    busy = whole.busy_s
    lines = [f"{len(steps):,} steps logged, {busy:.2f} s busy (gaps under {gap_s} s); by the kind of step:",
             "",
             "| kind | steps | tokens | decode tokens | gaps after them, s |",
             "|---|---:|---:|---:|---:|"]
    order = KINDS + ITERATION_KINDS
    for kind in sorted({s.kind for s in steps}, key=lambda k: (order.index(k) if k in order else len(order), k)):
        mine = [i for i, s in enumerate(steps) if s.kind == kind]
        after = sum(gaps[i] for i in mine if i < len(gaps) and gaps[i] < gap_s)
        lines.append(f"| {kind} | {len(mine):,} | {sum(steps[i].tokens for i in mine):,} | "
                     f"{sum(steps[i].decode_tokens for i in mine):,} | {after:.2f} |")
    lines.append("")
    if whole.decode_s is not None and whole.decode_gap_s is not None:
        lines.append(f"decode-only steps: mean {whole.decode_gap_s * 1e3:.2f} ms inside runs of them "
                     f"({len(whole.inner_gaps):,} gaps; median {statistics.median(whole.inner_gaps) * 1e3:.2f} ms), "
                     f"so {whole.decode_only:,} take about {whole.decode_s:.2f} s, {whole.decode_s / busy:.1%} of the "
                     f"busy time; the other steps about {busy - whole.decode_s:.2f} s")
    else:
        lines.append("no runs of decode-only steps: their time is not estimated")
    return lines


Summary = dict[str, Any]  # one engine's steps, split as ``compare`` shows them (JSON-ready)


def summarize(steps: list[Step], gap_s: float = DEFAULT_GAP_S) -> Summary:
    """The figures ``compare`` puts side by side, for one engine's steps."""
    sp = split(steps, gap_s)
    waits = [s.elapsed_ms for s in steps if s.decode_only and s.elapsed_ms is not None]
    other_s = None if sp.decode_s is None else sp.busy_s - sp.decode_s
    return {"steps": sp.steps, "busy_s": sp.busy_s, "decode_only": sp.decode_only, "inner_gaps": len(sp.inner_gaps),
            "decode_gap_ms": None if sp.decode_gap_s is None else sp.decode_gap_s * 1e3,
            "decode_wait_ms": statistics.mean(waits) if waits else None, "decode_s": sp.decode_s,
            "other_tokens": sp.other_tokens,
            "other_ms_per_1k": other_s / sp.other_tokens * 1e6 if other_s is not None and sp.other_tokens else None}


def compare(a: Summary, b: Summary, gap_s: float = DEFAULT_GAP_S) -> list[str]:
    """Stock's steps (``a``) beside the plugin's (``b``), from vLLM's iteration lines of the same
    work (the same bench runs), split into decode-only steps and the rest."""
    if a["steps"] < 2 or b["steps"] < 2:
        return [f"iteration lines: stock {a['steps']}, plugin {b['steps']}: nothing to compare (were the servers "
                "started with --enable-logging-iteration-details, and VLLM_LOGGING_CONFIG_PATH from `config`?)"]

    def row(label: str, key: str, fmt: str, ratio: bool = True) -> str:
        x, y = a[key], b[key]
        cells = [format(v, fmt) if v is not None else "-" for v in (x, y)]
        r = f"{y / x:.3f}" if ratio and x and y is not None else ""
        return f"| {label} | {cells[0]} | {cells[1]} | {r} |"

    lines = [f"vLLM's iteration lines, gaps under {gap_s} s:", "",
             "| | stock | plugin | plugin/stock |", "|---|---:|---:|---:|",
             row("steps", "steps", ",", ratio=False),
             row("busy s", "busy_s", ".2f"),
             row("decode-only steps", "decode_only", ",", ratio=False),
             row("decode-only: mean gap inside runs of them, ms", "decode_gap_ms", ".3f"),
             row("decode-only: mean iteration elapsed time, ms", "decode_wait_ms", ".3f"),
             row("decode-only: their time (mean gap x count), s", "decode_s", ".2f"),
             f"| other steps | {a['steps'] - a['decode_only']:,} | {b['steps'] - b['decode_only']:,} |  |",
             row("other steps: tokens", "other_tokens", ",", ratio=False),
             row("other steps: time per 1K tokens, ms", "other_ms_per_1k", ".3f"), ""]
    return lines + verdict(a, b)


def verdict(a: Summary, b: Summary) -> list[str]:
    """The two figures to quote: the plugin's decode-only steps against stock's, and r."""
    lines = []
    if a["decode_gap_ms"] and b["decode_gap_ms"]:
        lines.append(f"decode-only steps: the plugin's {b['decode_gap_ms'] / a['decode_gap_ms'] - 1:+.1%} against "
                     f"stock's ({a['inner_gaps']:,} and {b['inner_gaps']:,} gaps)")
    if a["other_ms_per_1k"] and b["other_ms_per_1k"]:
        lines.append(f"other steps: stock's time per token {a['other_ms_per_1k'] / b['other_ms_per_1k']:.3f}x "
                     "the plugin's (r)")
    return lines


def ab_steps(out: Path, data: dict[str, Any], call: dict[str, Any],
             gap_s: float = DEFAULT_GAP_S) -> dict[str, dict[str, Summary]]:
    """Per workload of one ab call, per engine: the summary of the iteration lines inside that
    workload's timed runs (warm-up rounds left out) in the engine's server log."""
    servers = call.get("servers", {})
    found: dict[str, dict[str, Summary]] = {}
    texts = {e: (out / rec["log"]).read_text(errors="replace") if (out / rec["log"]).is_file() else ""
             for e, rec in servers.items() if rec.get("log")}
    for workload in call["workloads"]:
        runs = [r for r in data.get("runs", []) if r["call"] == call["id"] and r["workload"] == workload
                and not r["warmup"] and r.get("window")]
        found[workload] = {e: summarize(parse_iterations(text, [(r["window"][0], r["window"][1]) for r in runs
                                                                 if r["engine"] == e]), gap_s)
                           for e, text in texts.items()}
    return found


def compare_ab(out: Path, gap_s: float = DEFAULT_GAP_S) -> list[str]:
    """``compare`` for each call and workload of ``out/ab.json``."""
    data = json.loads((out / "ab.json").read_text())
    lines: list[str] = []
    for call in data.get("calls", []):
        if set(call.get("servers", {})) != {"stock", "plugin"}:
            continue
        for workload, engines in ab_steps(out, data, call, gap_s).items():
            timed = sum(r["call"] == call["id"] and r["workload"] == workload and not r["warmup"]
                        for r in data["runs"])
            lines += [f"### call {call['id']}, {workload} ({timed} timed runs)", ""]
            lines += compare(engines["stock"], engines["plugin"], gap_s) + [""]
    return lines or [f"{out / 'ab.json'}: no call with both servers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write the logging configuration (VLLM_LOGGING_CONFIG_PATH)")
    cfg.add_argument("path", type=Path)
    cfg.add_argument("--no-plugin-steps", action="store_true",
                     help="milliseconds only: the plugin's step lines stay off (for compare: both engines log alike)")
    rep = sub.add_parser("report", help="the step breakdown of a server log")
    rep.add_argument("log", type=Path)
    rep.add_argument("--iterations", action="store_true", help="from vLLM's iteration lines, not the plugin's")
    cmp = sub.add_parser("compare", help="stock's and the plugin's steps in an ab, from vLLM's iteration lines: "
                                          "two server logs, or --ab DIR for each workload's timed runs")
    cmp.add_argument("logs", type=Path, nargs="*", metavar="LOG", help="stock's server log, then the plugin's")
    cmp.add_argument("--ab", type=Path, metavar="DIR", help="run_serve.py's folder of an ab phase")
    for p in (rep, cmp):
        p.add_argument("--gap-s", type=float, default=DEFAULT_GAP_S, help="gaps this long are idle time (default 0.5)")
    args = ap.parse_args(argv)
    if args.command == "config":
        args.path.write_text(json.dumps(logging_config(plugin_steps=not args.no_plugin_steps), indent=1) + "\n")
        print(f"VLLM_LOGGING_CONFIG_PATH={args.path}")
        return 0
    if args.command == "compare":
        if len(args.logs) != (2 if args.ab is None else 0):
            cmp.error("give two logs (stock's, then the plugin's) or --ab DIR")
        if args.ab is not None:
            print("\n".join(compare_ab(args.ab, args.gap_s)))
            return 0
        stock, plugin = (summarize(parse_iterations(p.read_text(errors="replace")), args.gap_s) for p in args.logs)
        print("\n".join(compare(stock, plugin, args.gap_s)))
        return 0
    text = args.log.read_text(errors="replace")
    print("\n".join(breakdown(parse_iterations(text) if args.iterations else parse(text), args.gap_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
