"""The reports of a results folder, from its saved files alone: ``serve.md`` over the served phases and
``matrix.md`` from ``matrix.json``; they say what is missing and compute only medians, ratios and differences.

    python3 tests/e2e/report.py DIR   # writes DIR's reports, and prints them
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, TypeGuard

from serve_proc import ERROR_PATTERNS
from step_log import plugin_over_stock

SERVE_MD, MATRIX_MD = "serve.md", "matrix.md"
PHASES = ("ab", "boundary", "failrate", "soak")
# (title, bench key, digits): the per-workload columns, medians over repeats.
METRICS = (("TTFT p50 ms", "p50_ttft_ms", 1), ("TTFT p99 ms", "p99_ttft_ms", 1), ("TPOT p50 ms", "p50_tpot_ms", 2),
           ("TPOT p99 ms", "p99_tpot_ms", 2), ("output tok/s", "output_throughput", 0),
           ("total tok/s", "total_token_throughput", 0))
ENGINES = ("stock", "plugin")
YES_NO = {True: "yes", False: "**no**", None: "–"}
STEP_MIB = 16  # a change between two soak samples at least this large is a step, not sampling noise


def write(folder: Path) -> str:
    """Each report whose results ``folder`` holds, written there; their text."""
    phases = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("schema") == 1 and data.get("phase") in PHASES:
            phases[path.stem] = data
    reports = [(SERVE_MD, render_serve(phases))] if phases else []
    if (folder / "matrix.json").is_file():
        reports.append((MATRIX_MD, render_matrix(json.loads((folder / "matrix.json").read_text()))))
    for name, text in reports:
        (folder / name).write_text(text)
    return "\n".join(text for _, text in reports) or f"no results in {folder}"


def table(*titles: str) -> list[str]:
    """A markdown table's header and separator rows."""
    return ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]


def row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def isnum(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float))


def cell(value: Any, limit: int = 100) -> str:
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def num(value: Any, digits: int = 0) -> str:
    return f"{value:,.{digits}f}" if isnum(value) else "–"


def median(values: list[Any]) -> float | None:
    nums = [v for v in values if isnum(v)]
    return statistics.median(nums) if nums else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if isnum(a) and isnum(b) and b else "–"


def up(record: dict[str, Any]) -> bool:
    return bool(record.get("startup", {}).get("status") == "ok")


def server_rows(records: list[dict[str, Any]]) -> list[str]:
    lines = table("server", "engine", "util", "mnbt", "start-up", "KV cache GiB", "KV tokens", "mla-planner log lines",
                  "alive at end", "errors in log")
    for r in records:
        s = r.get("startup", {})
        started = f"{s.get('status')}, {s['elapsed_s']:.0f} s" if "elapsed_s" in s else s.get("status", "–")
        if s.get("status") not in ("ok", None, "not run"):
            last = (s.get("log_tail") or "").rpartition("\n")[2]
            started += f": {cell(s.get('error') or last, 80)}"
        errors = ", ".join(f"{k} ×{v}" for k, v in (r.get("error_count") or {}).items()) or "none"
        lines.append(row(r.get("label"), r.get("engine"), r.get("util"), r.get("mnbt"), started,
                         num(r.get("kv_cache_memory_gib"), 2), num(r.get("kv_cache_tokens")),
                         r.get("planner_line_count", 0), YES_NO[r.get("alive_at_end")], cell(errors, 80)))
    return lines


def engine_checks(records: list[dict[str, Any]]) -> list[str]:
    """A plugin server must log the planner's lines, a stock server none."""
    return [f"**{r.get('label')}: {r.get('engine')} server logged {r.get('planner_line_count', 0)} mla-planner lines**"
            for r in records if "planner_lines" in r and up(r)
            and (r.get("engine") == "plugin") != bool(r.get("planner_line_count"))]


# --- serve.md -----------------------------------------------------------------------------------------


def client_rows(runs: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """The summaries of one client (or ``combined``) over the ok runs."""
    if label == "combined":
        return [r["combined"] for r in runs if r.get("status") == "ok" and r.get("combined")]
    return [r["clients"][label]["result"] for r in runs
            if r.get("status") == "ok" and (r["clients"].get(label) or {}).get("result")]


def paired_ratios(wruns: list[dict[str, Any]], label: str, key: str) -> list[float]:
    """Plugin/stock ``key`` of one client (or ``combined``) in each repeat both engines finished: the two
    runs of a repeat share a seed and ran back to back or at once, so the ratio leaves out what moves
    from one repeat to the next, which the ratio of the medians keeps."""
    got: dict[str, dict[Any, float]] = {"stock": {}, "plugin": {}}
    for r in wruns:
        value = next(iter(client_rows([r], label)), {}).get(key)
        if r.get("engine") in got and isnum(value):
            got[r["engine"]][(r.get("call"), r.get("seed"))] = value
    return plugin_over_stock(got)


def workload_lines(workload: str, title: str, every: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """One workload's table: per client (and all clients combined), each engine's medians over its
    finished repeats (warm-ups left out), then plugin/stock; then the per-repeat ratios."""
    wruns = [r for r in every if not r.get("warmup")]
    labels = list(dict.fromkeys(label for r in wruns for label in r.get("clients", {})))
    labels += ["combined"] if len(labels) > 1 else []
    by_engine = {e: [r for r in wruns if r["engine"] == e] for e in ENGINES}
    done = {e: sum(r.get("status") == "ok" for r in rs) for e, rs in by_engine.items()}
    lines = [f"### {workload}: {title}", "", f"Median over repeats ({done['stock']} stock, {done['plugin']} plugin "
             f"finished; seeds {sorted({r['seed'] for r in wruns})}, the same for both engines).", ""]
    summary = []
    if labels:
        lines += table("client", "engine", *(m[0] for m in METRICS), "failed requests")
        meds: dict[str, dict[str, float | None]] = {}
        for label in labels:
            for engine in ENGINES:
                rows = client_rows(by_engine[engine], label)
                meds[engine] = {key: median([r.get(key) for r in rows]) for _, key, _ in METRICS}
                failed = sum(int(r.get("failed") or 0) for r in rows)
                lines.append(row(label, engine, *(num(meds[engine][key], d) for _, key, d in METRICS),
                                 failed if rows else "–"))
            ratios = (ratio(meds["plugin"][k], meds["stock"][k]) for _, k, _ in METRICS)
            lines.append(row(label, "plugin/stock", *ratios) + " |")
        # the workload as a whole (the last label: its one client, or all combined)
        for name, key in (("total tokens/s", "total_token_throughput"), ("output tokens/s", "output_throughput")):
            summary.append(f"{workload}: plugin/stock {name} {ratio(meds['plugin'][key], meds['stock'][key])} "
                           f"(medians of {done['plugin']} and {done['stock']} repeats)")
        totals = {e: " ".join(num(r.get("total_token_throughput")) for r in client_rows(by_engine[e], labels[-1]))
                  or "–" for e in ENGINES}
        lines += ["", f"Total tokens/s per repeat ({labels[-1]}): stock {totals['stock']}; plugin {totals['plugin']}."]
        how = "at the same time" if any(r.get("at_once") for r in wruns) else "back to back"
        for name, key, label in (("total tokens/s", "total_token_throughput", labels[-1]),
                                 ("TPOT p50", "p50_tpot_ms", labels[0])):  # combined has no TPOT: the first client's
            paired = paired_ratios(wruns, label, key)
            if paired:
                mid, of = statistics.median(paired), "" if label == labels[-1] else f" ({label})"
                spread = f", {min(paired):.3f}–{max(paired):.3f}" if len(paired) > 1 else ""
                lines.append(f"Plugin/stock {name}{of} per repeat (same seed, {how}): "
                             f"{' '.join(f'{r:.3f}' for r in paired)}; median {mid:.3f}.")
                summary.append(f"{workload}: plugin/stock {name}{of} per repeat, median {mid:.3f} "
                               f"({len(paired)} pairs{spread}, {how})")
    lines += [f"- {r['tag']}: {r.get('status')}: {cell(r.get('error'), 160)}" for r in every if r.get("status") != "ok"]
    return [*lines, ""], summary


def ab_section(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    runs, calls = data.get("runs", []), data.get("calls", [])
    records = [rec for call in calls for rec in call.get("servers", {}).values()]
    lines = ["Servers (started one after the other, then both up together):", "", *server_rows(records), ""]
    summary = engine_checks(records)
    for call in calls:
        if call.get("error"):
            summary.append(f"**ab call {call.get('id')}: {call['error']}** (no bench run)")
        kv = {e: (call.get("servers", {}).get(e) or {}).get("kv_cache_memory_gib") for e in ENGINES}
        if kv["stock"] is not None and kv["plugin"] is not None:
            summary.append(f"ab servers at util {call.get('util')}: KV cache stock {kv['stock']:.2f} GiB, plugin "
                           f"{kv['plugin']:.2f} GiB (stock − plugin {1024 * (kv['stock'] - kv['plugin']):,.0f} MiB)")
    for workload in dict.fromkeys(r["workload"] for r in runs):
        more, said = workload_lines(workload, data.get("workload_titles", {}).get(workload, ""),
                                    [r for r in runs if r["workload"] == workload])
        lines += more
        summary += said
    failures = sum(int((r.get("combined") or {}).get("failed") or 0) for r in runs)
    summary.append(f"ab: {failures} failed requests over {sum(r.get('status') == 'ok' for r in runs)} finished "
                   f"bench runs ({len(runs)} planned)")
    return lines, summary


def boundary_section(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    servers, titles = data.get("servers", []), data.get("case_titles", {})
    lines = [*server_rows(servers), "", *table("server", "case", "result", "requests ok", "health after")]
    not_ok = []
    for s in servers:
        for case in s.get("case_order", []):
            r = s.get("cases", {}).get(case)
            if r is None:
                text, r = "not run: the server did not start" if not up(s) else "no result: the driver ended", {}
            elif r.get("status") == "started":
                text = "no result: the driver ended during this case"
            else:
                text = r.get("status", "–") + (f": {cell(r.get('error'), 90)}" if r.get("error") else "")
            if r.get("status") != "ok":
                not_ok.append(f"{case} ({s.get('mnbt')})")
            lines.append(row(s.get("label"), f"{case}: {titles.get(case, '')}", text, f"{r.get('requests_ok', '–')}/"
                             f"{len(r.get('requests', [])) or '–'}", r.get("health_after", "–")))
    run = data.get("run", {})
    return lines, [*engine_checks(servers), f"boundary ({run.get('engine')}, util {run.get('util')}): "
                   + ("every case finished" if not not_ok else f"not finished: case {', '.join(not_ok)}")]


def failrate_section(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    trials, engine = data.get("trials", []), data.get("run", {}).get("engine")
    lines = table("util", "trials run", "32K prompt finished", "failed at start-up", "failed on the 32K prompt",
                  "engine died", "CUDA OOM in log", "first error")
    summary = []
    for util in sorted({t["util"] for t in trials}):
        ts = [t for t in trials if t["util"] == util and t.get("status") not in ("not run", None)]
        ok = sum(t["status"] == "ok" for t in ts)
        at_start = sum(t["status"] == "startup failed" for t in ts)
        died = sum(bool(t.get("engine_died")) for t in ts)
        error = next((t.get("case", {}).get("error") or t.get("status") for t in ts if t["status"] != "ok"), "")
        lines.append(row(util, len(ts), ok, at_start, len(ts) - ok - at_start, died,
                         sum(bool(t.get("oom_in_log")) for t in ts), cell(error, 100)))
        summary.append(f"failrate ({engine}) at {util}: {len(ts) - ok} of {len(ts)} failed ({at_start} at start-up, "
                       f"{len(ts) - ok - at_start} on the 32K prompt), engine died in {died}")
    skipped = [t["label"] for t in trials if t.get("status") == "not run"]
    lines += ["", f"Not run (deadline): {', '.join(skipped)}."] if skipped else []
    servers = [t["server"] for t in trials if "server" in t]
    return ["Fresh server per trial; one 32,768-token prompt each.", "", *lines, "", *server_rows(servers)], summary


def memory_flatness(samples: list[dict[str, Any]], after_s: float) -> dict[str, Any]:
    """Used GPU memory (MiB, the first GPU) of the samples taken at ``after_s`` or later."""
    used = [s["used_mib"][0] for s in samples if s.get("used_mib") and s["t_s"] >= after_s]
    if not used:
        return {"samples": 0}
    return {"samples": len(used), "min_mib": min(used), "max_mib": max(used), "spread_mib": max(used) - min(used)}


def settled(samples: list[dict[str, Any]], warm: float) -> dict[str, Any] | None:
    """The steps of ``STEP_MIB`` or more in used memory from ``warm`` on (an allocator growing to a larger
    shape: a few that stop; a leak: steps that go on), and the flatness after the last; None without one."""
    used = [(s["t_s"], s["used_mib"][0]) for s in samples if s.get("used_mib") and s["t_s"] >= warm]
    steps = [(t, b - a) for (_, a), (t, b) in zip(used, used[1:]) if abs(b - a) >= STEP_MIB]
    if not steps:
        return None
    at, change = steps[-1]
    return {"steps": steps, "at_s": at, "change_mib": change, "span_s": samples[-1]["t_s"] - at,
            **memory_flatness(samples, at)}


def steps_row(after: dict[str, Any] | None) -> str:
    head = f"| steps of {STEP_MIB} MiB or more between samples after warm-up |"
    if after is None:
        return f"{head} none |"
    steps = after["steps"]
    listed = ", ".join(f"{d:+,} MiB at {t:.0f} s" for t, d in steps[:8]) + (f", … ({len(steps)} in all)"
                                                                            if len(steps) > 8 else "")
    return (f"{head} {listed}; from the last ({after['at_s']:.0f} s) to the end ({after['span_s']:.0f} s, "
            f"{after['samples']} samples): {num(after['min_mib'])}–{num(after['max_mib'])} MiB, "
            f"max − min {num(after['spread_mib'])} MiB |")


def soak_section(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    its, samples = data.get("iterations", []), data.get("samples", [])
    warm = its[0]["t_end_s"] if its else 0.0  # after the first iteration: kernels compiled, pools grown
    flat, after, every = memory_flatness(samples, warm), settled(samples, warm), memory_flatness(samples, 0.0)
    done, failed = (sum(int((i.get("combined") or {}).get(k) or 0) for i in its) for k in ("completed", "failed"))
    record = data.get("server", {})
    errors = {k: v for k, v in (record.get("error_count") or {}).items() if k in ERROR_PATTERNS[:5]}
    tps = [(i.get("combined") or {}).get("total_token_throughput") for i in its]
    lines = [*server_rows([record]), "", "| | |", "|---|---|",
             f"| soak | {num(data.get('soak_elapsed_s'))} s of {num(data.get('soak_s'))} s asked"
             + (f" (cut: {data['cut']})" if data.get("cut") else "") + " |",
             f"| mix iterations | {len(its)} ({sum(i.get('status') != 'ok' for i in its)} without a result) |",
             f"| requests | {done:,} completed, {failed:,} failed |",
             f"| total tokens/s per iteration | first {num(tps[0] if tps else None)}, median {num(median(tps))}, "
             f"last {num(tps[-1] if tps else None)} |",
             f"| GPU memory used (nvidia-smi), every sample | {every.get('samples')} samples, "
             f"{num(every.get('min_mib'))}–{num(every.get('max_mib'))} MiB |",
             f"| after warm-up (from {warm:.0f} s, the first iteration's end) | {flat.get('samples')} samples, "
             f"{num(flat.get('min_mib'))}–{num(flat.get('max_mib'))} MiB, **max − min {num(flat.get('spread_mib'))} MiB** |",
             steps_row(after),
             f"| /health not 200 | {sum(s.get('health') != 200 for s in samples)} of {len(samples)} samples |",
             f"| server processes | {data.get('pids_at_start')} at the start, {data.get('pids_at_end')} at the end: "
             f"{'the same' if data.get('same_processes') else '**not the same**'} |",
             f"| CUDA errors in the server log | {', '.join(f'{k} ×{v}' for k, v in errors.items()) or 'none'} |", ""]
    summary = [f"soak ({data.get('run', {}).get('engine')}, {num(data.get('soak_elapsed_s'))} s): {failed} failed "
               f"requests, memory spread after warm-up {num(flat.get('spread_mib'))} MiB"
               + (f" (last step {after['change_mib']:+,} MiB at {after['at_s']:.0f} s, then "
                  f"{num(after['spread_mib'])} MiB over {after['span_s']:.0f} s)" if after else "") + ", "
               f"{'same processes' if data.get('same_processes') else 'processes changed or died'}, "
               f"{sum(errors.values())} CUDA error lines"]
    return lines, summary


SECTIONS = {"ab": ("Throughput A/B (`vllm bench serve`)", ab_section),
            "boundary": ("Boundary requests", boundary_section),
            "failrate": ("Stock failure rate on a 32K prompt", failrate_section), "soak": ("Soak", soak_section)}


def render_serve(phases: dict[str, dict[str, Any]]) -> str:
    v, run = next(iter(phases.values())).get("versions", {}), next(iter(phases.values())).get("run", {})
    scaled = f", {run['layers']} hidden layers" if run.get("layers") is not None else ""
    out = ["# Serving (`vllm serve`): stock FLASHMLA_SPARSE vs the plugin", "",
           f"vLLM {v.get('vllm')}, torch {v.get('torch')}, mla-planner {v.get('mla-planner')}, transformers "
           f"{v.get('transformers')}. Model: tests/e2e/tiny-deepseek-v32 (dummy weights{scaled}) with a generated "
           "word-level tokenizer; `vllm serve` with vLLM's defaults (CUDA graphs, engine process) and "
           "`--kv-cache-dtype fp8_ds_mla --block-size 64 --max-model-len 70000 --no-enable-prefix-caching`.", ""]
    summary: list[str] = []
    body: list[str] = []
    for stem, data in sorted(phases.items(), key=lambda kv: (PHASES.index(kv[1]["phase"]), kv[0])):
        title, section = SECTIONS[data["phase"]]
        lines, said = section(data)
        summary += said
        unfinished = "" if data.get("finished") else " (the driver did not finish this phase)"
        body += [f"## {title}: `{stem}.json`{unfinished}", "", *lines, ""]
    return "\n".join([*out, "## Summary", "", *(f"- {s}" for s in summary or ["no results yet"]), "", *body])


# --- matrix.md ----------------------------------------------------------------------------------------

LOAD_COLUMNS = (("chat", "chat burst"), ("32k", "32K"), ("eight", "8 prompts"), ("64k", "64K"))
KV_NOTES = {
    "staggered": "Each server (and twin) started once the one before it had sized its KV cache: no two memory "
                 "profilings overlapped, though an earlier server's CUDA-graph capture may have.",
    "together": "**All servers started at once**: each KV cache was sized while the others allocated, so the KV "
                "figures carry each other's start-ups and are not a measure of the reservation.",
    "chained": "Each server (and twin) started once the one before it was up: every KV cache sized alone.",
}
MATRIX_COLUMNS = ("server", "model", "MTP", "max-num-seqs", "budget MiB", "CUDA graphs", "chunked prefill",
                  "prefix caching", "start-up", "KV GiB plugin", "KV GiB stock", "Δ GiB", "reserved GiB",
                  "min found MiB", *(title for _, title in LOAD_COLUMNS), "fallback lines", "alive at end")


def load_cell(result: dict[str, Any] | None) -> str:
    """``ok/asked``, failures in bold; why a step did not run."""
    result = result or {}
    status, n, ok = result.get("status"), result.get("n_requests"), result.get("requests_ok")
    if status in (None, "not run", "started"):
        return {None: "–", "not run": "not run", "started": "**cut** (driver ended)"}[status]
    if not isinstance(n, int) or not isinstance(ok, int):
        return cell(status)
    return f"{ok}/{n}" if ok == n else f"{ok}/{n}, **{n - ok} failed**"


def alive(plugin: dict[str, Any]) -> bool | None:
    """Process alive and /health 200 at the end; None where the server never came up."""
    if not up(plugin) or "alive_at_end" not in plugin:
        return None
    return bool(plugin.get("alive_at_end")) and plugin.get("health_at_end") == 200


def matrix_row(rec: dict[str, Any]) -> str:
    c, plugin, probe, phases = rec.get("config", {}), rec.get("plugin") or {}, rec.get("probe"), rec.get("phases") or {}
    s = plugin.get("startup") or {}
    started = f"{s['elapsed_s']:.0f} s" if up(plugin) and "elapsed_s" in s else cell(s.get("status", "–"))
    started += f" (retry {len(rec['attempts'])})" if rec.get("attempts") else ""
    kv, twin_kv, reserved = plugin.get("kv_cache_memory_gib"), (rec.get("twin") or {}).get("kv_cache_memory_gib"), \
        plugin.get("reserved_mib")
    if not probe:
        found = "–"
    elif probe.get("min_mb") is not None:
        found = f"{probe['min_mb']}" + (" (64 started)" if probe.get("outcome") == "started" else "")
    else:
        found = f"**none** ({cell(probe.get('outcome') or probe.get('error'), 40)})"
    # the first load step after which the server was not healthy
    died = next((title for key, title in LOAD_COLUMNS if phases.get(key, {}).get("health_after", 200) != 200), None)
    budget = c.get("budget")
    return row(rec.get("name"), c.get("model"), c.get("mtp") or "–", c.get("max_num_seqs"),
               f"min → {rec['scratch_mb']}" if budget == "min" and rec.get("scratch_mb") is not None else budget,
               "yes" if c.get("cuda_graphs") else "eager", "on" if c.get("chunked_prefill") else "**off**",
               "**on**" if c.get("prefix_caching") else "off", started, num(kv, 2), num(twin_kv, 2),
               f"{kv - twin_kv:+.2f}" if isnum(kv) and isnum(twin_kv) else "–",
               num(reserved / 1024 if isinstance(reserved, int) else None, 2), found,
               *(load_cell(phases.get(k)) for k, _ in LOAD_COLUMNS), plugin.get("fallback_lines", "–"),
               {True: "yes", None: "–"}.get(alive(plugin), "**no**" + (f" (after {died})" if died else "")))


def matrix_notes(rec: dict[str, Any]) -> list[str]:
    """What the table leaves out: refusal, the plugin's lines, retries, errors."""
    out = [f"- **{rec.get('name')}** ({cell(rec.get('title'), 200)}; util {rec.get('util')}, "
           f"--max-num-batched-tokens {rec.get('mnbt')})"]
    probe, plugin, twin = rec.get("probe") or {}, rec.get("plugin") or {}, rec.get("twin")
    if probe.get("refusal_line"):
        out.append(f"  - refusal at {probe.get('scratch_mb')} MiB: `{cell(probe['refusal_line'], 300)}`")
    elif probe:
        out.append(f"  - {probe.get('scratch_mb', 64)} MiB start: {probe.get('outcome')}"
                   + (f"; {cell(probe.get('first_errors') or probe.get('error'), 300)}"
                      if probe.get("outcome") != "started" else ""))
    for attempt in rec.get("probe_attempts") or []:
        out.append(f"  - an earlier {attempt.get('scratch_mb')} MiB start: {attempt.get('outcome')}"
                   + (f" (`{cell(attempt.get('disturbed_line'), 200)}`)" if attempt.get("disturbed_line") else ""))
    for attempt in rec.get("attempts") or []:
        line = next(iter(attempt.get("first_errors") or []), attempt.get("startup", {}).get("status"))
        out.append(f"  - first start failed, retried alone: `{cell(line, 240)}`")
    for attempt in rec.get("twin_attempts") or []:
        out.append(f"  - the stock twin's first start failed ({attempt.get('startup', {}).get('status')}), retried alone")
    s = plugin.get("startup") or {}
    if s.get("status") not in (None, "ok"):
        out.append(f"  - start-up {s.get('status')}: {cell(s.get('error') or '', 200)}")
    if twin and not up(twin):
        out.append(f"  - stock twin: {(twin.get('startup') or {}).get('status')}")
    lines, count = plugin.get("planner_lines") or [], plugin.get("planner_line_count", 0)
    shown = [line for line in lines if "budget" in line or "reservation" in line][:3]
    out += [f"  - `{cell(line[line.find('mla-planner'):], 300)}`" for line in shown]
    out += [f"  - fallback: `{cell(line[line.find('mla-planner'):], 300)}`" for line in plugin.get("fallback_examples") or []]
    out += [f"  - {count} mla-planner lines in all"] if count > len(shown) else []
    out += [f"  - error: `{cell(line, 300)}`" for line in plugin.get("first_errors") or []]
    for key, title in LOAD_COLUMNS:
        result = (rec.get("phases") or {}).get(key) or {}
        if result.get("status") not in (None, "ok"):
            out.append(f"  - {title}: {result.get('status')}: {cell(result.get('error'), 200)}")
    return out


def render_matrix(data: dict[str, Any]) -> str:
    if not data:
        return "# Flag matrix\n\nNo matrix.json here.\n"
    run, versions, gaps = data.get("run") or {}, data.get("versions") or {}, data.get("coverage_gaps") or []
    records = list((data.get("servers") or {}).values())
    failed = sum(1 for rec in records for result in (rec.get("phases") or {}).values()
                 if isinstance(result.get("n_requests"), int) and result["requests_ok"] != result["n_requests"])
    dead = [rec.get("name") for rec in records if alive(rec.get("plugin") or {}) is False]
    never = [rec.get("name") for rec in records if alive(rec.get("plugin") or {}) is None]
    lines = [
        "# Flag matrix: `vllm serve` with the plugin", "",
        f"vLLM {versions.get('vllm', '?')}, torch {versions.get('torch', '?')}, mla-planner "
        f"{versions.get('mla-planner', '?')}; started {data.get('started_at', '?')}, "
        + (f"finished in {data['elapsed_s']:.0f} s" if data.get("finished") and "elapsed_s" in data
           else "**not finished**")
        + f"; `--start {run.get('start', '?')}`, util {run.get('util')} (+ each numeric budget's share)"
        + (", stock twins" if run.get("stock_twins") else ", no stock twins") + ".", "",
        "Coverage: " + ("every value of every axis, and both required pairs with CUDA graphs."
                        if not gaps else "**missing " + ", ".join(gaps) + "**."), "",
        *table(*MATRIX_COLUMNS), *(matrix_row(rec) for rec in records), "",
        f"Phases with failed requests: {failed}; engines dead at the end: {', '.join(dead) or 'none'}; "
        f"servers not up: {', '.join(never) or 'none'}.", "",
        "Δ GiB is plugin − stock (negative: the plugin's KV cache is smaller); reserved GiB is the reservation the "
        "plugin's log names. " + KV_NOTES.get(str(run.get("start")), "") + " Fallback lines: the plugin's lines "
        "saying a step fell back to the bounded path.", "", "## Notes", ""]
    for rec in records:
        lines += matrix_notes(rec)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
