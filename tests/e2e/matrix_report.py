"""``matrix.md`` from the ``matrix.json`` run_matrix.py leaves in a results folder: one row per server.

    python3 tests/e2e/run_matrix.py --report-only DIR

Works from the saved file alone and reports what it says, what did not run included; it computes
only the KV cache differences (plugin − stock) of the figures the server logs gave.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT = "matrix.json"
REPORT_MD = "matrix.md"
PHASE_COLUMNS = (("chat", "chat burst"), ("32k", "32K"), ("eight", "8 prompts"), ("64k", "64K"))


def load(folder: Path) -> dict[str, Any]:
    path = folder / RESULT
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _cell(value: Any, limit: int = 100) -> str:
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _gib(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "–"


def phase_cell(result: dict[str, Any] | None) -> str:
    """``ok/asked``, failures in bold; why a phase did not run."""
    if not result:
        return "–"
    status = result.get("status")
    if status == "not run":
        return "not run"
    if status == "started":
        return "**cut** (driver ended)"
    n, ok = result.get("n_requests"), result.get("requests_ok")
    if not isinstance(n, int) or not isinstance(ok, int):
        return _cell(status)
    return f"{ok}/{n}" if ok == n else f"{ok}/{n}, **{n - ok} failed**"


def alive(plugin: dict[str, Any]) -> bool | None:
    """Process alive and /health 200 at the end; None where the server never came up."""
    if plugin.get("startup", {}).get("status") != "ok":
        return None
    if "alive_at_end" not in plugin:
        return None
    return bool(plugin.get("alive_at_end")) and plugin.get("health_at_end") == 200


def died_in(rec: dict[str, Any]) -> str | None:
    """The first load phase after which the server was not healthy."""
    for key, title in PHASE_COLUMNS:
        result = (rec.get("phases") or {}).get(key) or {}
        if "health_after" in result and result["health_after"] != 200:
            return title
    return None


def startup_cell(rec: dict[str, Any]) -> str:
    s = (rec.get("plugin") or {}).get("startup") or {}
    status = s.get("status", "–")
    text = f"{s['elapsed_s']:.0f} s" if status == "ok" and "elapsed_s" in s else _cell(status)
    if rec.get("attempts"):
        text += f" (retry {len(rec['attempts'])})"
    return text


def kv_cells(rec: dict[str, Any]) -> tuple[str, str, str]:
    plugin = (rec.get("plugin") or {}).get("kv_cache_memory_gib")
    stock = (rec.get("twin") or {}).get("kv_cache_memory_gib")
    diff = plugin - stock if isinstance(plugin, (int, float)) and isinstance(stock, (int, float)) else None
    return _gib(plugin), _gib(stock), (f"{diff:+.2f}" if diff is not None else "–")


def min_cell(rec: dict[str, Any]) -> str:
    probe = rec.get("probe")
    if not probe:
        return "–"
    if probe.get("min_mb") is not None:
        return f"{probe['min_mb']}" + (" (64 started)" if probe.get("outcome") == "started" else "")
    return f"**none** ({_cell(probe.get('outcome') or probe.get('error'), 40)})"


def row(rec: dict[str, Any]) -> str:
    c = rec.get("config", {})
    budget = c.get("budget")
    scratch = rec.get("scratch_mb")
    budget_text = f"min → {scratch}" if budget == "min" and scratch is not None else str(budget)
    kv_plugin, kv_stock, kv_diff = kv_cells(rec)
    plugin = rec.get("plugin") or {}
    a = alive(plugin)
    where = died_in(rec)
    alive_text = {True: "yes", None: "–"}.get(a, "**no**" + (f" (after {where})" if where else ""))
    phases = rec.get("phases") or {}
    cells = [rec.get("name"), c.get("model"), c.get("mtp") or "–", c.get("max_num_seqs"), budget_text,
             "yes" if c.get("cuda_graphs") else "eager", "on" if c.get("chunked_prefill") else "**off**",
             "**on**" if c.get("prefix_caching") else "off", startup_cell(rec), kv_plugin, kv_stock, kv_diff,
             _reserved(plugin), min_cell(rec), *(phase_cell(phases.get(k)) for k, _ in PHASE_COLUMNS),
             plugin.get("fallback_lines", "–"), alive_text]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def _reserved(plugin: dict[str, Any]) -> str:
    mib = plugin.get("reserved_mib")
    return f"{mib / 1024:.2f}" if isinstance(mib, (int, float)) else "–"


KV_NOTES = {
    "staggered": "Each server (and twin) started once the one before it had sized its KV cache: no two memory "
                 "profilings overlapped, though an earlier server's CUDA-graph capture may have.",
    "together": "**All servers started at once**: each KV cache was sized while the others allocated, so the KV "
                "figures carry each other's start-ups and are not a measure of the reservation.",
    "chained": "Each server (and twin) started once the one before it was up: every KV cache sized alone.",
}
HEADER = ("| server | model | MTP | max-num-seqs | budget MiB | CUDA graphs | chunked prefill | prefix caching "
          "| start-up | KV GiB plugin | KV GiB stock | Δ GiB | reserved GiB | min found MiB | chat burst | 32K "
          "| 8 prompts | 64K | fallback lines | alive at end |")


def notes(rec: dict[str, Any]) -> list[str]:
    """What the table leaves out: refusal, the plugin's lines, retries, errors, KV tokens."""
    name = rec.get("name")
    out = [f"- **{name}** ({_cell(rec.get('title'), 200)}; util {rec.get('util')}, "
           f"--max-num-batched-tokens {rec.get('mnbt')})"]
    probe = rec.get("probe") or {}
    if probe.get("refusal_line"):
        out.append(f"  - refusal at {probe.get('scratch_mb')} MiB: `{_cell(probe['refusal_line'], 300)}`")
    elif probe:
        out.append(f"  - {probe.get('scratch_mb', 64)} MiB start: {probe.get('outcome')}"
                   + (f"; {_cell(probe.get('first_errors') or probe.get('error'), 300)}"
                      if probe.get("outcome") != "started" else ""))
    for attempt in rec.get("probe_attempts") or []:
        out.append(f"  - an earlier {attempt.get('scratch_mb')} MiB start: {attempt.get('outcome')}"
                   + (f" (`{_cell(attempt.get('disturbed_line'), 200)}`)" if attempt.get("disturbed_line") else ""))
    plugin = rec.get("plugin") or {}
    for attempt in rec.get("attempts") or []:
        line = next(iter(attempt.get("first_errors") or []), attempt.get("startup", {}).get("status"))
        out.append(f"  - first start failed, retried alone: `{_cell(line, 240)}`")
    for attempt in rec.get("twin_attempts") or []:
        out.append(f"  - the stock twin's first start failed ({attempt.get('startup', {}).get('status')}), retried alone")
    s = plugin.get("startup") or {}
    if s.get("status") not in (None, "ok"):
        out.append(f"  - start-up {s.get('status')}: {_cell(s.get('error') or '', 200)}")
    twin = rec.get("twin")
    tokens = {"plugin": plugin.get("kv_cache_tokens"), "stock": (twin or {}).get("kv_cache_tokens")}
    if any(isinstance(t, (int, float)) for t in tokens.values()):
        out.append("  - KV cache tokens: " + ", ".join(f"{k} {t:,.0f}" if isinstance(t, (int, float)) else f"{k} –"
                                                        for k, t in tokens.items() if k == "plugin" or twin))
    if twin and (twin.get("startup") or {}).get("status") != "ok":
        out.append(f"  - stock twin: {(twin.get('startup') or {}).get('status')}")
    lines = plugin.get("mla_planner_lines") or []
    shown = [line for line in lines if "budget" in line or "reservation" in line][:3]
    for line in shown:
        out.append(f"  - `{_cell(line[line.find('mla-planner'):], 300)}`")
    for line in plugin.get("fallback_examples") or []:
        out.append(f"  - fallback: `{_cell(line[line.find('mla-planner'):], 300)}`")
    if plugin.get("mla_planner_line_count", 0) > len(shown):
        out.append(f"  - {plugin['mla_planner_line_count']} mla-planner lines in all")
    for line in plugin.get("first_errors") or []:
        out.append(f"  - error: `{_cell(line, 300)}`")
    for key, title in PHASE_COLUMNS:
        result = (rec.get("phases") or {}).get(key) or {}
        if result.get("status") not in (None, "ok"):
            out.append(f"  - {title}: {result.get('status')}: {_cell(result.get('error'), 200)}")
    return out


def render(data: dict[str, Any]) -> str:
    if not data:
        return f"# Flag matrix\n\nNo {RESULT} here.\n"
    run = data.get("run") or {}
    versions = data.get("versions") or {}
    gaps = data.get("coverage_gaps") or []
    lines = [
        "# Flag matrix: `vllm serve` with the plugin",
        "",
        f"vLLM {versions.get('vllm', '?')}, torch {versions.get('torch', '?')}, mla-planner "
        f"{versions.get('mla-planner', '?')}; started {data.get('started_at', '?')}, "
        + (f"finished in {data['elapsed_s']:.0f} s" if data.get("finished") and "elapsed_s" in data
           else "**not finished**")
        + f"; `--start {run.get('start', '?')}`, util {run.get('util')} (+ each numeric budget's share)"
        + (", stock twins" if run.get("stock_twins") else ", no stock twins") + ".",
        "",
        "Coverage: " + ("every value of every axis, and both required pairs with CUDA graphs."
                        if not gaps else "**missing " + ", ".join(gaps) + "**."),
        "",
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
    ]
    records = list((data.get("servers") or {}).values())
    lines += [row(rec) for rec in records]
    failed = sum(1 for rec in records for k, _ in PHASE_COLUMNS
                 if isinstance(((rec.get("phases") or {}).get(k) or {}).get("n_requests"), int)
                 and rec["phases"][k]["requests_ok"] != rec["phases"][k]["n_requests"])
    dead = [rec.get("name") for rec in records if alive(rec.get("plugin") or {}) is False]
    never = [rec.get("name") for rec in records if alive(rec.get("plugin") or {}) is None]
    lines += ["", f"Phases with failed requests: {failed}; engines dead at the end: {', '.join(dead) or 'none'}; "
                  f"servers not up: {', '.join(never) or 'none'}.", "",
              "Δ GiB is plugin − stock (negative: the plugin's KV cache is smaller); reserved GiB is the "
              "reservation the plugin's log names. " + KV_NOTES.get(str(run.get("start")), "") + " Fallback lines: the "
              "plugin's lines saying a step fell back to the bounded path.", "", "## Notes", ""]
    for rec in records:
        lines += notes(rec)
    return "\n".join(lines) + "\n"
