"""``e2e.md`` from the JSON that ``run_cases.py`` and ``run_e2e.py`` leave in a results folder.

Works from saved files alone: every run file there (``<run>.json``, any group) and ``driver.json``.
Reports what the files say, including what is missing (a run cut by the deadline, a case a crash or
timeout interrupted), and computes no number the files do not hold.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from serve_report import cell

DRIVER_JSON = "driver.json"
REPORT_MD = "e2e.md"
GIB = 1 << 30
MIB = 1 << 20
PROMPT_CASES = ("1", "2", "3", "4", "5")
THROUGHPUT_GOAL = 0.97


def load_driver(folder: Path) -> dict[str, Any]:
    """run_e2e.py's record of its runs (how each process ended)."""
    path = folder / DRIVER_JSON
    return dict(json.loads(path.read_text())) if path.is_file() else {"runs": {}}


def load_dir(folder: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Run results by run name (file stem), and the driver's record."""
    runs: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == DRIVER_JSON:
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("schema") == 1 and "run" in data:
            runs[path.stem] = data
    return runs, load_driver(folder)


def render_dir(folder: Path) -> str:
    runs, driver = load_dir(folder)
    return render(runs, driver)


def _gib(value: Any) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "–"


def _order(item: tuple[str, dict[str, Any]]) -> tuple[float, int, int, str]:
    run = item[1]["run"]
    return (-run["util"], 0 if run["backend"] == "stock" else 1, run["mnbt"], item[0])


def case_result(name: str, data: dict[str, Any], case: str, driver: dict[str, Any]) -> str:
    """One table cell: ok / OOM / error / why there is no result."""
    startup = data.get("startup", {})
    if startup.get("status") == "error":
        return cell(f"engine failed to start: {startup.get('error', '')}", 90)
    result = data.get("cases", {}).get(case)
    timed_out = driver.get("runs", {}).get(name, {}).get("timed_out")
    end = "timeout" if timed_out else "crash or kill"
    if startup.get("status") != "ok":
        return f"no result: process ended during start-up ({end})"
    if result is None:
        return f"no result: process ended before this case ({end})" if not data.get("finished") else "not run"
    status = result.get("status")
    after = f" (after failure in case {', '.join(result['after_failure_in'])})" if result.get("after_failure_in") else ""
    if status == "started":
        return f"no result: process ended during this case ({end}){after}"
    if status == "skipped":
        return cell(f"not run: {result.get('error', '')}", 90)
    if status == "error":
        error = str(result.get("error", ""))
        if result.get("oom"):
            size = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", error)
            return "**OOM**" + (f" (tried to allocate {size.group(1)})" if size else "") + after
        return cell(f"**error**: {error.splitlines()[0] if error else ''}", 90) + after
    return "ok" + after


def tokens_cell(result: dict[str, Any] | None) -> str:
    if not result or "outputs" not in result:
        return "–"
    outputs = result["outputs"]
    back = sum(len(o["token_ids"]) == result.get("max_tokens") for o in outputs)
    first = outputs[0]["token_ids"] if outputs else []
    ids = str(first) if len(first) <= 4 else str(first[:4])[:-1] + ", …]"
    return f"{'yes' if result.get('tokens_back') else 'no'} {back}/{len(outputs)}: {ids}"


def engines_table(runs: list[tuple[str, dict[str, Any]]], driver: dict[str, Any]) -> list[str]:
    lines = ["| run | backend | util | mnbt | start-up | KV blocks | KV tokens | KV cache GiB | KV granted GiB "
             "| allocated after start GiB | attention impl |", "|" + "---|" * 11]
    for name, data in runs:
        run, s = data["run"], data.get("startup", {})
        if s.get("status") == "ok":
            started = f"ok, {s.get('elapsed_s', 0):.0f} s"
        else:
            started = cell(s.get("error") or case_result(name, data, "-", driver), 60)
        blocks, size = s.get("num_gpu_blocks"), s.get("block_size")
        tokens = s.get("kv_cache_size_tokens") or (blocks * size if blocks and size else None)
        attn = impl_names(s)
        lines.append(f"| {name} | {run['backend']} | {run['util']} | {run['mnbt']} | {started} | {blocks or '–'} | "
                     f"{tokens or '–'} | {_gib(s.get('kv_cache_bytes'))} | {_gib(s.get('kv_available_bytes'))} | "
                     f"{_gib((s.get('memory') or {}).get('allocated'))} | {cell(attn, 120)} |")
    return lines


def case_table(case: str, runs: list[tuple[str, dict[str, Any]]], driver: dict[str, Any]) -> list[str]:
    lines = ["| run | backend | util | mnbt | result | peak GiB | peak over start GiB | free after GiB "
             "| prompt tok/s (wall) | tokens back | KV cache GiB |", "|" + "---|" * 11]
    for name, data in runs:
        if case not in data["run"]["cases"]:
            continue
        run, r = data["run"], data.get("cases", {}).get(case) or {}
        tok_s = f"{r['prompt_tok_s']:,.0f}" if isinstance(r.get("prompt_tok_s"), (int, float)) else "–"
        lines.append(f"| {name} | {run['backend']} | {run['util']} | {run['mnbt']} | "
                     f"{case_result(name, data, case, driver)} | {_gib(r.get('peak_allocated_bytes'))} | "
                     f"{_gib(r.get('peak_over_before_bytes'))} | {_gib((r.get('memory_after') or {}).get('free'))} | "
                     f"{tok_s} | {cell(tokens_cell(r), 60)} | {_gib(data.get('startup', {}).get('kv_cache_bytes'))} |")
    return lines if len(lines) > 2 else []


def _pairs(runs: list[tuple[str, dict[str, Any]]], case: str | None = None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(stock, planned) runs at the same util and mnbt; with ``case``, both must have it ``ok``."""
    def ok(d: dict[str, Any]) -> bool:
        if case is None:
            return bool(d.get("startup", {}).get("status") == "ok")
        return bool(d.get("cases", {}).get(case, {}).get("status") == "ok")

    pairs = []
    for _, stock in runs:
        for _, planned in runs:
            same = (stock["run"]["util"], stock["run"]["mnbt"]) == (planned["run"]["util"], planned["run"]["mnbt"])
            if same and stock["run"]["backend"] == "stock" and planned["run"]["backend"] == "planned":
                if ok(stock) and ok(planned):
                    pairs.append((stock, planned))
    return pairs


def throughput_section(runs: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    lines, goals = [], []
    for stock, planned in _pairs(runs, "throughput"):
        s, p = stock["cases"]["throughput"], planned["cases"]["throughput"]
        lines += [f"util {stock['run']['util']}, mnbt {stock['run']['mnbt']}; median of {s.get('repeats')} "
                  f"repeats after a warm-up, prompt tokens/s:", "",
                  "| workload | stock | planned | planned/stock | samples stock | samples planned |", "|---|---|---|---|---|---|"]
        for workload, s_med in s["median_tok_s"].items():
            p_med = p["median_tok_s"].get(workload)
            if p_med is None:
                continue
            ratio = p_med / s_med
            samples = [" ".join(f"{v:,.0f}" for v in d["tok_s"][workload]) for d in (s, p)]
            lines.append(f"| {workload} | {s_med:,.0f} | {p_med:,.0f} | {ratio:.3f} | {samples[0]} | {samples[1]} |")
            goals.append(f"{workload} at {stock['run']['util']}: planned/stock {ratio:.3f} "
                         f"({'meets' if ratio >= THROUGHPUT_GOAL else 'below'} {THROUGHPUT_GOAL})")
        lines += ["", *(f"- {w}: {t}" for w, t in s.get("workloads", {}).items()), ""]
    return lines, goals


def scratch_budget(planned: dict[str, Any]) -> str:
    """The budget the planned run's backend read (``planner_settings``)."""
    settings = planned.get("planner_settings") or {}
    if "scratch_mb" in settings:
        return f"{settings['scratch_mb']} ({settings.get('source')})"
    return f"not recorded{': ' + settings['error'] if 'error' in settings else ''}"


def impl_names(startup: dict[str, Any]) -> str:
    """Attention implementation classes, each with its top-level package (mla_planner for ours)."""
    names = [f"{path.rsplit('.', 1)[-1]} ({path.split('.', 1)[0]})" for path in startup.get("attention_impls") or []]
    return ", ".join(names) or "–"


def _mib_diff(stock: dict[str, Any], planned: dict[str, Any], key: str) -> str:
    a, b = stock.get(key), planned.get(key)
    return f"{(a - b) / MIB:,.0f}" if isinstance(a, int) and isinstance(b, int) else "–"


def kv_section(runs: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    lines = ["| util | mnbt | stock KV GiB | planned KV GiB | stock − planned MiB | granted: stock − planned MiB "
             "| scratch budget MiB |", "|---|---|---|---|---|---|---|"]
    goals = []
    for stock, planned in _pairs(runs):
        s, p = stock["startup"], planned["startup"]
        budget_text = scratch_budget(planned)
        diff, granted = _mib_diff(s, p, "kv_cache_bytes"), _mib_diff(s, p, "kv_available_bytes")
        lines.append(f"| {stock['run']['util']} | {stock['run']['mnbt']} | {_gib(s.get('kv_cache_bytes'))} | "
                     f"{_gib(p.get('kv_cache_bytes'))} | {diff} | {granted} | {budget_text} |")
        if diff != "–":
            goals.append(f"KV cache at {stock['run']['util']}/{stock['run']['mnbt']}: stock − planned = {diff} MiB "
                         f"(scratch budget: {budget_text})")
    return (lines if len(lines) > 2 else []), goals


def _margins(run: dict[str, Any]) -> str:
    out = []
    for pos in run.get("top_logprobs", []):
        out.append(f"{pos[0][1] - pos[1][1]:.3g}" if len(pos) >= 2 else "–")
    return ", ".join(out) or "–"


def same_function_section(runs: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    lines = ["| run | first tokens | same on a repeat | top-1 − top-2 logprob per position |", "|---|---|---|---|"]
    goals = []
    for name, data in runs:
        r = data.get("cases", {}).get("same_function")
        if r and r.get("status") == "ok":
            lines.append(f"| {name} | {r['token_ids']} | {'yes' if r.get('repeat_identical') else 'no'} | "
                         f"{_margins(r['runs'][0])} |")
    for stock, planned in _pairs(runs, "same_function"):
        s, p = stock["cases"]["same_function"]["token_ids"], planned["cases"]["same_function"]["token_ids"]
        where = next((i for i, (a, b) in enumerate(zip(s, p)) if a != b), None)
        goals.append(f"same function at {stock['run']['util']}: " + (
            "same first tokens" if s == p else f"first tokens differ from position {where}: stock {s}, planned {p}"))
    return (lines if len(lines) > 2 else []), goals


def runs_table(driver: dict[str, Any]) -> list[str]:
    lines = ["| run | status | rc | wall s | timed out | log |", "|---|---|---|---|---|---|"]
    for name, d in driver.get("runs", {}).items():
        wall = f"{d['wall_s']:.0f}" if "wall_s" in d else "–"
        status = f"{d.get('status')}: {d['reason']}" if d.get("reason") else d.get("status")
        lines.append(f"| {name} | {status} | {d.get('rc', '–')} | {wall} | "
                     f"{'yes' if d.get('timed_out') else 'no'} | {d.get('log', '–')} |")
    return lines if len(lines) > 2 else []


def render(runs_by_name: dict[str, dict[str, Any]], driver: dict[str, Any]) -> str:
    runs = sorted(runs_by_name.items(), key=_order)
    first_ok = next((d for _, d in runs if d.get("startup", {}).get("status") == "ok"), None)
    out = ["# End to end: stock FLASHMLA_SPARSE vs the planned backend (issue 6)", ""]
    if first_ok:
        v = first_ok.get("versions", {})
        out += [f"Device: {first_ok['startup'].get('device', '?')}; vLLM {v.get('vllm')}, torch {v.get('torch')}, "
                f"mla-planner {v.get('mla-planner')}. Model: tests/e2e/tiny-deepseek-v32 (dummy weights), FP8 KV "
                "(fp8_ds_mla), block size 64, prefix caching off, greedy, max_tokens 4 (case 5: 16).", ""]
    not_run = [n for n, d in driver.get("runs", {}).items() if d.get("status") == "not run" and n not in runs_by_name]
    planned_95 = [(n, d) for n, d in runs if d["run"]["backend"] == "planned" and d["run"]["util"] == 0.95]
    goals = []
    if planned_95:
        cases = {c: case_result(n, d, c, driver) for n, d in planned_95 for c in d["run"]["cases"] if c in PROMPT_CASES}
        failed = sorted(c for c, text in cases.items() if not text.startswith("ok"))
        seen = sorted(cases)
        goals.append(f"planned at 0.95: cases {', '.join(seen)} " + ("all finished" if not failed else
                                                                       f"not all finished (case {', '.join(failed)})"))
    for name, d in runs:
        impls = d.get("startup", {}).get("attention_impls")
        ours = impls is not None and any(i.startswith("mla_planner.") for i in impls)
        if impls is not None and ours != (d["run"]["backend"] == "planned"):
            goals.append(f"**{name} ran {'our' if ours else 'no planned'} attention implementation**: {impls}")
    thr_lines, thr_goals = throughput_section(runs)
    kv_lines, kv_goals = kv_section(runs)
    sf_lines, sf_goals = same_function_section(runs)
    goals += thr_goals + kv_goals + sf_goals
    out += ["## Summary", "", *(f"- {g}" for g in goals or ["no results yet"])]
    if not_run:
        out.append(f"- not run (deadline): {', '.join(not_run)}")
    out += ["", "## Engines", "", *engines_table(runs, driver), ""]
    for case in PROMPT_CASES:
        table = case_table(case, runs, driver)
        if table:
            title = next(d["case_titles"].get(case) for _, d in runs if case in d.get("case_titles", {}))
            out += [f"## Case {case}: {title}", "", *table, ""]
    for title, lines in (("Throughput", thr_lines), ("KV cache: stock − planned vs the scratch budget", kv_lines),
                         ("Same function: a fixed 16K prompt, greedy", sf_lines), ("Runs", runs_table(driver))):
        if lines:
            out += [f"## {title}", "", *lines, ""]
    out += ["Peak GiB: torch.cuda.max_memory_allocated over the case (KV cache and weights included); peak over "
            "start: the same less what was allocated when the case began. Prompt tok/s (wall): prompt tokens over "
            "the generate call's wall time, kernel compilation of a first-seen shape included.", ""]
    return "\n".join(out)
