"""What `simulate` writes: a Markdown report, the PNG, a per-step CSV and a
JSON summary (the last two so tools and tests can check the first two)."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from pathlib import Path
from typing import Any

from . import vllm_releases
from .atomic import AtomicFiles
from .config import PlannerConfig
from .records import PERCENTILES, POLICIES, Records
from .units import format_bytes

FILES = {"report": "simulate.md", "plot": "simulate.png", "steps": "simulate_steps.csv", "summary": "simulate_summary.json"}
LINE_WIDTH = 100
PATH_NAMES = {"dense_mha": "dense MHA", "masked_mha": "masked MHA", "sparse_mqa": "sparse MQA"}


def _rows(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, stock, planned) rows shared by the terminal and the report."""

    def both(fmt: Any) -> tuple[str, str]:
        return fmt(s["stock"]), fmt(s["planned"])

    rows = [("peak scratch, worst step", *both(lambda p: format_bytes(p["peak_bytes"]["max"])))]
    for q in PERCENTILES:
        rows.append((f"peak scratch, p{q:g}", *both(lambda p, q=q: format_bytes(p["peak_bytes"][f"p{q:g}"]))))
    rows += [
        ("peak scratch, mean", *both(lambda p: format_bytes(int(p["peak_bytes"]["mean"])))),
        (f"steps over the {format_bytes(s['budget_bytes'])} budget", *both(lambda p: f"{p['over_budget_steps']:,}")),
        (f"steps over the {format_bytes(s['headroom_bytes'])} headroom (OOM)", *both(lambda p: f"{p['over_headroom_steps']:,}")),
        ("steps over the int32 stride limit", *both(lambda p: f"{p['hard_failure_steps']['int32_stride']:,}")),
        ("steps over the CUDA grid limit", *both(lambda p: f"{p['hard_failure_steps']['grid']:,}")),
        ("steps failing vLLM's workspace assert", *both(lambda p: f"{p['hard_failure_steps']['workspace_assert']:,}")),
        ("steps that fail (OOM or a hard limit)", *both(lambda p: f"{p['failed_steps']:,}")),
        ("kernel launches per step, mean", *both(lambda p: f"{p['launches_per_step']['mean']:.2f}")),
        ("kernel launches per step, max", *both(lambda p: f"{p['launches_per_step']['max']:,}")),
    ]
    for path, name in PATH_NAMES.items():
        rows.append((f"prefill tokens via {name}", *both(lambda p, r=path: f"{p['prefill_share_by_path'][r]:.1%}")))
    return rows


def _steps(n: int) -> str:
    return f"{n:,} step" + ("" if n == 1 else "s")


def _header(s: dict[str, Any]) -> list[str]:
    c = s["config"]
    return [
        f"trace: {s['trace']}, {_steps(s['steps'])}",
        f"model: {c['num_heads']} heads per rank ({c['heads_from']}), {c['kv_dtype']} KV, {c['arch']} with {c['num_sms']} SMs",
        f"path:  {c['vllm_path']}",
    ]


def terminal_summary(s: dict[str, Any]) -> str:
    rows = [("", "stock vLLM", "mla-planner"), *_rows(s)]
    w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
    header = [wrapped for h in _header(s) for wrapped in textwrap.wrap(h, LINE_WIDTH, subsequent_indent=" " * 7)]
    lines = header + [""] + [f"  {a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in rows]
    return "\n".join(lines)


def verdict(s: dict[str, Any]) -> str:
    """The outcome in one line, for the end of the terminal output."""
    stock, planned = s["stock"], s["planned"]
    return (
        f"stock fails {stock['failed_steps']:,} of {_steps(s['steps'])}, worst {format_bytes(stock['peak_bytes']['max'])}; "
        f"planned {planned['failed_steps']:,}, worst {format_bytes(planned['peak_bytes']['max'])}"
    )


def where_written(paths: list[Path]) -> str:
    """Where the report went, as an absolute path: the terminal may be far
    from the folder (`--out ../x`, a script's cwd)."""
    report_path = next(p for p in paths if p.name == FILES["report"])
    others = ", ".join(p.name for p in paths if p != report_path)
    return f"report: {report_path.absolute()} (beside it: {others})"


def markdown(s: dict[str, Any], cfg: PlannerConfig, *, plot: bool = True) -> str:
    """The report; ``plot``: beside a picture of the steps (``--no-plot`` writes none, so the report
    names none)."""
    lines = ["# mla-planner simulate", "", *(f"- {h}" for h in _header(s)), ""]
    lines += [
        "Scratch = the bytes of the step's largest sparse-attention kernel launch (split-KV accumulators,",
        "padded q, outputs the kernel allocates). Stock = vLLM as shipped: "
        f"{vllm_releases.SIMULATED.minor}'s FLASHMLA_SPARSE backend,",
        f"and {vllm_releases.names(vllm_releases.with_masked_mha())}'s all-or-nothing masked-MHA fallback where masked"
        " MHA is on. Planned = mla-planner under",
        f"a {format_bytes(cfg.step.scratch_budget_bytes)} budget per launch. A step over the headroom is an OOM in production;",
        "a step over a hard limit raises in the kernel whatever the memory. Details: docs/cli.md.",
        "",
        "| | stock vLLM | mla-planner |",
        "|---|---:|---:|",
        *(f"| {a} | {b} | {c} |" for a, b, c in _rows(s)),
        "",
        *([f"![per-step scratch]({FILES['plot']})", ""] if plot else []),
        f"Per-step figures: [{FILES['steps']}]({FILES['steps']}); summary: [{FILES['summary']}]({FILES['summary']}).",
        "",
    ]
    return "\n".join(lines)


def steps_csv(rec: Records) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "tokens", "prefill_tokens"] + [f"{p}_{c}" for p in POLICIES for c in ("bytes", "launches", "failure")])
    st, pl = rec.policies["stock"], rec.policies["planned"]
    for i in range(len(rec)):
        w.writerow([i + 1, rec.tokens[i], rec.prefill_tokens[i], st.peak_bytes[i], st.launches[i], st.failures[i],
                    pl.peak_bytes[i], pl.launches[i], pl.failures[i]])
    return buf.getvalue()


def write_all(
    files: AtomicFiles, out: Path, rec: Records, s: dict[str, Any], cfg: PlannerConfig, *, plot: bool, trace_name: str
) -> list[Path]:
    """Every file, the Markdown report last. `trace_name`: the trace as the
    plot's title names it."""
    paths = {k: out / v for k, v in FILES.items()}
    files.write_bytes(paths["summary"], (json.dumps(s, indent=2) + "\n").encode())
    files.write_bytes(paths["steps"], steps_csv(rec).encode())
    if plot:
        from .plot import render_png  # matplotlib takes a while to import; only here

        c = s["config"]
        title = f"{trace_name}, {_steps(s['steps'])}: {c['num_heads']} heads per rank ({c['heads_from']}), {c['kv_dtype']} KV"
        files.write_bytes(paths["plot"], render_png(rec, budget_bytes=cfg.step.scratch_budget_bytes, headroom_bytes=s["headroom_bytes"], title=title))
    else:
        del paths["plot"]
    files.write_bytes(paths["report"], markdown(s, cfg, plot=plot).encode())
    return list(paths.values())
