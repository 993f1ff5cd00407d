"""Where a server's time goes, step by step, from its log (docs/e2e.md, "Step logs"): the plugin's step
lines (``mla-planner step: ...``, debug, written as a step is built) and vLLM's own (``Iteration(N): ...``,
written as its output arrives). With millisecond stamps (``config``) the gaps between lines are the steps'
durations, give or take the engine's one-step lead of the GPU.

    python3 tests/e2e/step_log.py config /tmp/step-logging.json   # then VLLM_LOGGING_CONFIG_PATH=/tmp/step-logging.json
    python3 tests/e2e/step_log.py report /tmp/serve/logs/ab0-plugin.log
    python3 tests/e2e/step_log.py compare --ab /tmp/serve   # each workload's timed runs apart, and per repeat
    python3 tests/e2e/step_log.py ranks /tmp/e2e/planned-tp2-0.95-32k.log   # a tensor-parallel run's workers
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

PLUGIN_LOGGER = "vllm.mla_planner"
STEP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*mla-planner step: (\d+) tokens, (\d+) decode tokens, "
                  r"(\d+) prefills, (stock's code|bounded path|\w+)")
LAYER = re.compile(r"mla-planner layer: bounded path \((.*)\)")  # a layer call that could not run its plan
ITERATION = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*Iteration\((\d+)\): (\d+) context requests, "
                       r"(\d+) context tokens, (\d+) generation requests, (\d+) generation tokens, "
                       r"iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")
SUMMARY = re.compile(r"since start-up ([\d,]+) steps planned \(([\d,]+) split, ([\d,]+) launches\), ([\d,]+) on "
                     r"vLLM's call; .*; ([\d,]+) fallbacks")
LAUNCHES = re.compile(r", (\d+) launches, ")
DECODE_ONLY = "decode-only, stock's code"
FALLBACK = "bounded path (could not be planned)"  # the plugin's fallback: counted, each reason logged once
KINDS = (DECODE_ONLY, "decodes + dense prefills, stock's code", "planned: mixed_batch", "planned: separate_prefill_decode",
         FALLBACK)
DECODE_STEP, CONTEXT_STEP = ITERATION_KINDS = ("decode-only", "with context tokens")  # vLLM's iteration lines
GAP_S = 0.5  # gaps this long are idle time (between bench runs, start-up), not a step's
STAMP = "%m-%d %H:%M:%S.%f"  # vLLM's log time under `config` (local time), to the microsecond; lines show ms
Window = tuple[str, str]  # a bench run's first and last stamp
Summary = dict[str, Any]  # one engine's steps, split as ``compare`` shows them (JSON-ready)


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
        return self.kind in (DECODE_ONLY, DECODE_STEP)


@dataclass(frozen=True)
class Split:
    """A log's busy time, and the part of it the decode-only steps take: as the stamps are whole
    milliseconds, their mean gap inside runs of them times their count (a median of ~3 ms would be off
    by up to half of one)."""

    steps: int
    busy_s: float
    decode_steps: int
    decode_gaps: list[float]  # the gaps inside runs of decode-only steps, s
    other_tokens: int  # prompt and decode tokens of the other steps whose own gap is busy time

    @property
    def decode_gap_s(self) -> float | None:
        return statistics.mean(self.decode_gaps) if self.decode_gaps else None

    @property
    def decode_s(self) -> float | None:
        return None if self.decode_gap_s is None else self.decode_gap_s * self.decode_steps


def write_config(path: Path, plugin_steps: bool = True) -> None:
    """vLLM's default logging configuration with millisecond stamps and, with ``plugin_steps``, the
    plugin at DEBUG (a cost between steps stock does not pay: a per-step comparison leaves it out)."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["format"] = formatter["format"].replace("%(asctime)s", "%(asctime)s.%(msecs)03d")
    # vLLM's colour formatter (on a terminal) would split the time from the milliseconds
    config["handlers"]["vllm"].update(formatter="vllm", level="DEBUG")
    config["loggers"]["vllm"]["level"] = "INFO"
    if plugin_steps:
        config["loggers"][PLUGIN_LOGGER] = {"level": "DEBUG"}  # propagates to the "vllm" handler
    path.write_text(json.dumps(config, indent=1) + "\n")


def stamp() -> str:
    """Now, as vLLM stamps its lines under `config`: the driver marks each bench run's window."""
    return datetime.now().strftime(STAMP)[:-3]


def _matches(text: str, pattern: re.Pattern[str],
             windows: list[Window] | None = None) -> Iterator[tuple[float, re.Match[str]]]:
    """The lines ``pattern`` matches (group 1: the stamp) inside ``windows`` if given, with their time
    in seconds since the first."""
    start: datetime | None = None
    for line in text.splitlines():
        m = pattern.search(line)
        if m is None or windows is not None and not any(a <= m[1] <= b for a, b in windows):
            continue  # the stamps have one fixed width: as strings they order as times (within a year)
        at = datetime.strptime(f"2000-{m[1]}", f"%Y-{STAMP}")  # a leap year: the stamps have none, 02-29 exists
        start = start or at
        yield (at - start).total_seconds(), m


def parse(text: str) -> list[Step]:
    """The plugin's step lines."""
    kinds = {"stock's code": KINDS[1], "bounded path": FALLBACK}
    return [Step(at, int(m[2]), int(m[3]), int(m[4]), DECODE_ONLY if m[5] == "stock's code" and m[4] == "0"
                 else kinds.get(m[5], f"planned: {m[5]}")) for at, m in _matches(text, STEP)]


def parse_iterations(text: str, windows: list[Window] | None = None) -> list[Step]:
    """vLLM's iteration lines inside ``windows`` if given; tokens: context and generation together."""
    return [Step(at, int(m[4]) + int(m[6]), int(m[6]), int(m[3]), CONTEXT_STEP if int(m[4]) else DECODE_STEP,
                 float(m[7])) for at, m in _matches(text, ITERATION, windows)]


def layer_fallbacks(text: str) -> list[str]:
    """The steps a layer call of which could not run its plan, by reason (the plugin's debug lines)."""
    reasons = collections.Counter(m[1] for m in LAYER.finditer(text))
    if not reasons:
        return ["no layer call fell back to the bounded path"]
    return [f"steps a layer call of which fell back to the bounded path: {sum(reasons.values()):,}"] + [
        f"- {reason}: {n:,}" for reason, n in reasons.most_common()]


def summaries(text: str) -> list[str]:
    """Whether each of the plugin's summary lines holds the counts of the step lines before it:
    planned, split, launches, on vLLM's call, fell back (a planned step whose layer call fell back
    counts as both)."""
    counts = [0, 0, 0, 0, 0]
    said, wrong = 0, []
    for line in text.splitlines():
        if (m := STEP.search(line)) is not None:
            if m[5] in ("stock's code", "bounded path"):
                counts[3 if m[5] == "stock's code" else 4] += 1
            else:
                n = int(launches[1]) if (launches := LAUNCHES.search(line)) else 1
                counts[:3] = [counts[0] + 1, counts[1] + (n > 1), counts[2] + n]
        elif LAYER.search(line) is not None:
            counts[4] += 1
        elif (s := SUMMARY.search(line)) is not None:
            said += 1
            if [int(g.replace(",", "")) for g in s.groups()] != counts:
                wrong.append(f"- {line[s.start():][:160]}: the step lines before it count {counts}")
    if not said:
        return ["no summary line"]
    return [f"summary lines: {said:,}, {said - len(wrong):,} of them holding the counts of the step lines before them",
            *wrong]


def line_gaps(steps: list[Step]) -> list[float]:
    """The gap between each line and the next, s."""
    return [b.at_s - a.at_s for a, b in zip(steps, steps[1:])]


def own_gaps(steps: list[Step], before: bool) -> list[float | None]:
    """Each step's gap: after its line (the plugin's, written as the step starts) or before it
    (``before``: vLLM's, written as its output arrives); None at the log's ends."""
    gaps: list[float | None] = list(line_gaps(steps))
    return [None, *gaps] if before else [*gaps, None]


def split(steps: list[Step], before: bool = False) -> Split:
    """The gap after line ``i`` is a decode-only step's where every step whose work it may hold is
    decode-only: ``i - 1`` to ``i + 1`` for the plugin's lines (written after a step's planning), to
    ``i + 2`` for vLLM's (``before``: written after the next step's host work). A step whose own gap
    is idle brings no time, nor are its tokens counted."""
    gaps = line_gaps(steps)
    last = 2 if before else 1  # the furthest step whose work the gap after line i holds
    inner = [gaps[i] for i in range(1, len(gaps))
             if gaps[i] < GAP_S and i + last < len(steps)
             and all(steps[j].decode_only for j in range(i - 1, i + last + 1))]
    busy_tokens = sum(s.tokens for s, g in zip(steps, own_gaps(steps, before))
                      if not s.decode_only and g is not None and g < GAP_S)
    return Split(len(steps), sum(g for g in gaps if g < GAP_S), sum(s.decode_only for s in steps), inner, busy_tokens)


def breakdown(steps: list[Step]) -> list[str]:
    """The report's lines on the plugin's step lines, by the kind of step."""
    if len(steps) < 2:
        return [f"{len(steps)} step line(s): nothing to measure (was the plugin's logger at DEBUG, or the server "
                "started with --enable-logging-iteration-details?)"]
    gaps, whole = own_gaps(steps, before=False), split(steps)
    busy = whole.busy_s
    lines = [f"{len(steps):,} steps logged, {busy:.2f} s busy (gaps under {GAP_S} s); by the kind of step:", "",
             "| kind | steps | tokens | decode tokens | gaps after them, s |", "|---|---:|---:|---:|---:|"]
    order = KINDS + ITERATION_KINDS
    for kind in sorted({s.kind for s in steps}, key=lambda k: (order.index(k) if k in order else len(order), k)):
        mine = [i for i, s in enumerate(steps) if s.kind == kind]
        own = sum(g for i in mine if (g := gaps[i]) is not None and g < GAP_S)
        lines.append(f"| {kind} | {len(mine):,} | {sum(steps[i].tokens for i in mine):,} | "
                     f"{sum(steps[i].decode_tokens for i in mine):,} | {own:.2f} |")
    if whole.decode_s is None or whole.decode_gap_s is None or busy <= 0:
        return [*lines, "", "no runs of decode-only steps: their time is not estimated"]
    return [*lines, "", f"decode-only steps: mean {whole.decode_gap_s * 1e3:.2f} ms inside runs of them "
            f"({len(whole.decode_gaps):,} gaps; median {statistics.median(whole.decode_gaps) * 1e3:.2f} ms), "
            f"so {whole.decode_steps:,} take about {whole.decode_s:.2f} s, {whole.decode_s / busy:.1%} of the "
            f"busy time; the other steps about {busy - whole.decode_s:.2f} s"]


def summarize(steps: list[Step]) -> Summary:
    """The figures ``compare`` puts side by side, for one engine's iteration lines. The gap closing a run
    of decode-only steps before a step with context tokens holds that step's host work (scheduling,
    metadata, planning, launches): shown apart."""
    sp, gaps = split(steps, before=True), line_gaps(steps)
    other_s = None if sp.decode_s is None or sp.busy_s <= sp.decode_s else sp.busy_s - sp.decode_s
    waits = [s.elapsed_ms for s in steps if s.decode_only and s.elapsed_ms is not None]
    host = [gaps[i] for i in range(len(gaps) - 1)
            if gaps[i] < GAP_S and steps[i].decode_only and steps[i + 1].decode_only and not steps[i + 2].decode_only]
    return {"steps": sp.steps, "busy_s": sp.busy_s, "decode_steps": sp.decode_steps,
            "other_steps": sp.steps - sp.decode_steps, "decode_gaps": len(sp.decode_gaps),
            "decode_gap_ms": None if sp.decode_gap_s is None else sp.decode_gap_s * 1e3,
            "decode_wait_ms": statistics.mean(waits) if waits else None, "decode_s": sp.decode_s,
            "other_tokens": sp.other_tokens,
            "other_ms_per_1k": other_s / sp.other_tokens * 1e6 if other_s and sp.other_tokens else None,
            "host_gaps": len(host), "host_gap_ms": statistics.mean(host) * 1e3 if host else None}


COMPARED = (("steps", "steps", ",", False), ("busy s", "busy_s", ".2f", True),
            ("decode-only steps", "decode_steps", ",", False),
            ("decode-only: mean gap inside runs of them, ms", "decode_gap_ms", ".3f", True),
            ("decode-only: mean iteration elapsed time, ms", "decode_wait_ms", ".3f", True),
            ("decode-only: their time (mean gap x count), s", "decode_s", ".2f", True),
            ("other steps", "other_steps", ",", False),
            ("other steps: tokens (those with busy time)", "other_tokens", ",", False),
            ("other steps: time per 1K tokens, ms", "other_ms_per_1k", ".3f", True),
            ("other steps after decode-only ones: the gap before, with their host work, ms", "host_gap_ms", ".3f",
             True), ("those gaps", "host_gaps", ",", False))


def compare(a: Summary, b: Summary) -> list[str]:
    """Stock's steps (``a``) beside the plugin's (``b``) over the same bench runs; then the two figures
    to quote: the plugin's decode-only steps against stock's, and r."""
    if a["steps"] < 2 or b["steps"] < 2:
        return [f"iteration lines: stock {a['steps']}, plugin {b['steps']}: nothing to compare (were the servers "
                "started with --enable-logging-iteration-details, and VLLM_LOGGING_CONFIG_PATH from `config`?)"]
    lines = [f"vLLM's iteration lines, gaps under {GAP_S} s:", "", "| | stock | plugin | plugin/stock |",
             "|---|---:|---:|---:|"]
    for label, key, fmt, ratio in COMPARED:
        x, y = a[key], b[key]
        cells = [format(v, fmt) if v is not None else "-" for v in (x, y)]
        quotient = f"{y / x:.3f}" if ratio and x and y is not None else ""
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {quotient} |")
    lines.append("")
    if a["decode_gap_ms"] and b["decode_gap_ms"]:
        lines.append(f"decode-only steps: the plugin's {b['decode_gap_ms'] / a['decode_gap_ms'] - 1:+.1%} against "
                     f"stock's ({a['decode_gaps']:,} and {b['decode_gaps']:,} gaps)")
    if a["other_ms_per_1k"] and b["other_ms_per_1k"]:
        lines.append(f"other steps: stock's time per token {a['other_ms_per_1k'] / b['other_ms_per_1k']:.3f}x "
                     "the plugin's (r)")
    return lines


def plugin_over_stock(values: dict[str, dict[Any, float]]) -> list[float]:
    """Plugin/stock of each key both engines have a value for, in stock's order."""
    stock, plugin = values.get("stock", {}), values.get("plugin", {})
    return [plugin[k] / stock[k] for k in stock if k in plugin and stock[k]]


def step_figures(out: Path, data: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    """An ab call's timed runs (warm-ups left out) per workload, from its server logs in ``out``: ``runs``,
    ``steps``, each engine's summary of them, and ``step_pairs``, plugin/stock mean decode-only gap per
    repeat (one seed), whose spread says whether the pooled figure stands out of the machine's own swings."""
    texts = {e: (out / rec["log"]).read_text(errors="replace") if (out / rec["log"]).is_file() else ""
             for e, rec in call.get("servers", {}).items() if rec.get("log")}
    figures: dict[str, Any] = {"runs": {}, "steps": {}, "step_pairs": {}}
    for w in call.get("workloads", []):
        runs = [r for r in data.get("runs", []) if r.get("call") == call.get("id") and r.get("workload") == w
                and not r.get("warmup") and r.get("window")]
        figures["runs"][w] = runs
        windows = {e: [(r["window"][0], r["window"][1]) for r in runs if r["engine"] == e] for e in texts}
        figures["steps"][w] = {e: summarize(parse_iterations(text, windows[e])) for e, text in texts.items()}
        gap: dict[str, dict[Any, float]] = {"stock": {}, "plugin": {}}
        for r in runs:
            if r["engine"] in gap and r["engine"] in texts:
                window = (r["window"][0], r["window"][1])
                mean = summarize(parse_iterations(texts[r["engine"]], [window]))["decode_gap_ms"]
                if mean:
                    gap[r["engine"]][r.get("seed")] = mean
        figures["step_pairs"][w] = plugin_over_stock(gap)
    return figures


def pairs_line(ratios: list[float]) -> str:
    """Per-repeat ratios, their median and range."""
    if not ratios:
        return "decode-only steps per repeat: no repeat with both engines' decode-only steps"
    spread = f", {min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else ""
    return (f"decode-only steps per repeat, plugin/stock: {' '.join(f'{r:.3f}' for r in ratios)}; median "
            f"{statistics.median(ratios):.3f} ({len(ratios)} pairs{spread})")


def compare_ab(out: Path) -> list[str]:
    """``compare`` for each call and workload of ``out/ab.json``, with the per-repeat pairs."""
    data = json.loads((out / "ab.json").read_text())
    lines: list[str] = []
    for call in data.get("calls", []):
        if set(call.get("servers", {})) == {"stock", "plugin"}:
            figures = step_figures(out, data, call)
            for workload, engines in figures["steps"].items():
                lines += [f"### call {call['id']}, {workload} ({len(figures['runs'][workload])} timed runs)", "",
                          *compare(engines["stock"], engines["plugin"]), pairs_line(figures["step_pairs"][workload]),
                          ""]
    return lines or [f"{out / 'ab.json'}: no call with both servers"]


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK = re.compile(r"\(Worker(?:_[A-Z]+\d+)*_TP(\d+) pid=\d+\)")
# vLLM 0.26 logs "Available KV cache memory" on rank 0 only; every rank logs the KV cache it holds.
RANK_KV = re.compile(r"(?:Current kv cache memory in use is|Available KV cache memory:) ([0-9.]+) ?GiB")
# The plugin's line: "... 1024 MiB (default); 676 MiB reserved ..."; earlier builds': "..., reserved ..."
# (the budget) or "..., 648 MiB of it reserved ...".
RESERVED = re.compile(r"mla-planner: sparse MLA scratch budget (\d+) MiB \([^)]*\)(?:; (\d+) MiB |, (?:(\d+) MiB of it )?)"
                      r"reserved")
RANK_STEP = re.compile(r"mla-planner step: (.*)$")


@dataclass
class Rank:
    kv_gib: float | None = None
    reserved_mib: int | None = None
    steps: list[str] = field(default_factory=list)


def rank_report(path: Path) -> tuple[list[str], list[str]]:
    """A tensor-parallel run's ranks, and what is wrong: a rank without its KV line; planned, a rank that
    reserved nothing or planned other steps than rank 0."""
    ranks: dict[int, Rank] = {}
    for line in (ANSI.sub("", raw) for raw in path.read_text(errors="replace").splitlines()):
        if (m := RANK.search(line)) is None:
            continue
        rank = ranks.setdefault(int(m.group(1)), Rank())
        if (hit := RANK_KV.search(line)) is not None:
            rank.kv_gib = float(hit.group(1))
        elif (res := RESERVED.search(line)) is not None:
            rank.reserved_mib = int(res.group(2) or res.group(3) or res.group(1))
        elif (step := RANK_STEP.search(line)) is not None:
            rank.steps.append(step.group(1).strip())
    planned = any(rank.reserved_mib is not None or rank.steps for rank in ranks.values())
    lines = [f"{path.name}: {len(ranks)} rank(s), {'planned' if planned else 'stock'}"]
    for r, rank in sorted(ranks.items()):
        kv = "–" if rank.kv_gib is None else f"{rank.kv_gib:.2f} GiB"
        reserved = "" if rank.reserved_mib is None else f", reserved {rank.reserved_mib} MiB"
        lines.append(f"  rank {r}: KV cache {kv}{reserved}, {len(rank.steps)} step plans logged")
    if not ranks:
        return lines, ["no worker lines (Worker_TP<rank>) in the log"]
    found = [f"rank {r}: no KV cache line" for r, rank in sorted(ranks.items()) if rank.kv_gib is None]
    if planned:
        found += [f"rank {r}: no scratch reservation" for r, rank in sorted(ranks.items()) if rank.reserved_mib is None]
        first = ranks[min(ranks)].steps
        found += [f"rank {r}: {len(rank.steps)} step plans differ from rank {min(ranks)}'s {len(first)}"
                  for r, rank in sorted(ranks.items()) if rank.steps != first]
        if not found:
            lines.append(f"  every rank logged the same {len(first)} step plans")
    return lines, found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("config", help="write the logging configuration (VLLM_LOGGING_CONFIG_PATH)").add_argument(
        "path", type=Path)
    sub.add_parser("report", help="the step breakdown of a server log, from the plugin's step lines").add_argument(
        "log", type=Path)
    sub.add_parser("compare", help="stock's and the plugin's steps in each workload's timed runs of an ab, from "
                   "vLLM's iteration lines").add_argument("--ab", type=Path, metavar="DIR", required=True,
                                                          help="run_serve.py's folder of an ab phase")
    sub.add_parser("ranks", help="each worker's KV cache, reservation and step plans in tensor-parallel run "
                   "logs").add_argument("logs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.command == "ranks":
        failed = False
        for path in args.logs:
            lines, found = rank_report(path)
            print("\n".join(lines + [f"  PROBLEM: {p}" for p in found]))
            failed |= bool(found)
        return 1 if failed else 0
    if args.command == "config":
        write_config(args.path)
        print(f"VLLM_LOGGING_CONFIG_PATH={args.path}")
    elif args.command == "compare":
        print("\n".join(compare_ab(args.ab)))
    else:
        text = args.log.read_text(errors="replace")
        print("\n".join([*breakdown(parse(text)), "", *layer_fallbacks(text), *summaries(text)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
