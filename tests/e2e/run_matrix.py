"""Issue 29's flag matrix: ``vllm serve`` with the plugin under a covering set of configurations
(matrix_design.py), several servers sharing one H200 at small ``--gpu-memory-utilization``.

    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_matrix.py --out /tmp/matrix --detach --deadline-s 560
    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_matrix.py --out /tmp/matrix --follow --deadline-s 560   # next call, if still running
    python3 tests/e2e/run_matrix.py --report-only /tmp/matrix      # the table (DIR/matrix.md)

What runs, in order (``--deadline-s`` ends it; what it cut is recorded as not run):

1. **The minimum budget**, for each server whose budget is ``min``: a start at
   ``MLA_PLANNER_SCRATCH_MB=64``. The plugin refuses a budget below what one step of the engine can
   need, with a line ``set MLA_PLANNER_SCRATCH_MB=N or more``, and the server exits non-zero: N is
   the minimum, and that server starts again with N. A server that starts at 64 is kept: 64 is the
   minimum. These starts come first, before any other (together unless ``--start chained``): the
   KV figure of one kept beside others' carries their start-ups.
2. **The servers**, each with its own port, model copy and flags; with ``--stock-twins``, after each
   its stock twin (``FLASHMLA_SPARSE``, the same flags, no budget), read only for its KV cache lines
   and stopped before the next start. vLLM sizes a KV cache from the whole GPU's free memory, from
   the engine's first snapshot to the end of its memory profiling: another server allocating or
   freeing meanwhile is counted as this one's (its KV cache shrinks, or goes below zero: "No
   available memory for the cache blocks"), or fails the start ("Error in memory profiling").
   ``--start staggered`` (the default) therefore starts each server once the one before it has
   logged its KV cache size, so that no two profilings overlap, while the earlier servers' CUDA-graph
   capture and API start go on; but a start whose KV figure is compared (a twin, or a server that
   has one) waits until the one before it is up (vLLM 0.33 captures CUDA graphs after the KV line,
   and what that allocates counts as the next one's); ``together`` starts them all at once
   (quicker, their KV figures carry each other's start-ups); ``chained`` each once the one before
   it is up. A start that failed
   of another's memory is retried alone (``--retries``), the first attempt kept in the record.
3. **The load**, on every server that is up, all servers at the same time: a chat burst of
   ``--chat-n`` concurrent ``/v1/completions`` (token-id prompts of 300-1,100 tokens behind a shared
   256-token prefix, 16-256 tokens out, ``ignore_eos``), then run_cases' 32K case (1), eight
   prompts (2) and 64K case (4); ``/health`` after each.
4. **The end**: per server, alive (process and ``/health`` 200), then stopped; its log read for the
   KV cache, the plugin's ``mla-planner`` lines (reservation, and lines that say a step fell back
   to the bounded path) and the first error lines.

``DIR/matrix.json`` is rewritten after every step; server logs are in ``DIR/logs``, model copies and
their generated tokenizers in ``DIR/variants`` and ``DIR/model``; ``DIR/matrix.md`` (matrix_report.py)
is the table. ``--detach``/``--follow`` as run_serve.py's: a run longer than one device call goes on
in a session of its own.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TypeVar

import matrix_design as md
import matrix_report
import run_serve
import serve_phases as sp
from run_cases import CASE_TITLES, ENV_DEFAULTS, PLANNER_VARS, TOKEN_RANGE, write_json
from serve_proc import (ERROR_PATTERNS, Server, ServerSpec, check_stop, engine_lines, free_port, install_cleanup,
                        log_facts)
from serve_requests import one_request, run_case
from serve_tokenizer import check_tokenizer, served_model_dir

PHASE = "matrix"  # run_serve's detach/follow files: DIR/matrix-driver.log, DIR/matrix-driver.pid
REFUSAL = re.compile(r"set MLA_PLANNER_SCRATCH_MB=(\d+(?:\.\d+)?) or more")
RESERVATION = re.compile(r"scratch reservation of ([\d,]+) MiB")
FELL_BACK = "falls back to the bounded path"  # the plugin's warning for a step that could not run its plan
KV_SIZED = "GPU KV cache size"  # vLLM 0.26's and 0.33's line once the KV cache is sized (kv_cache_utils.py)
# a start that failed because other servers' memory changed during its profiling: retried alone
DISTURBED = ("Error in memory profiling", "No available memory for the cache blocks",
             "less than desired GPU memory utilization")
EXCEPTION_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b: ")
LOAD_PHASES = (("chat", None), ("32k", "1"), ("eight", "2"), ("64k", "4"))
CHAT_PREFIX, CHAT_LEN, CHAT_MAX_TOKENS, CHAT_SEED = 256, (300, 1100), (16, 256), 2900
MIN_PHASE_S = 15  # a load phase starts with at least this much left
# offsets from --port-base, plus the server's index in the design
PORTS = {"plugin": 0, "stock": 20, "probe": 40, "retry": 60, "stock-retry": 80}
MAX_UTIL_SUM = 0.92


def say(message: str) -> None:
    sp.say(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="results folder")
    ap.add_argument("--deadline-s", type=float, default=540, help="the run ends by then (default 540)")
    ap.add_argument("--servers", help=f"of {','.join(c.name for c in md.DESIGN)} (default: all; a subset's "
                                      "coverage gaps are reported)")
    ap.add_argument("--util", type=float, help="every server's --gpu-memory-utilization before its budget's share "
                                               "(default 0.09; 0.04 with --stock-twins --start together)")
    ap.add_argument("--stock-twins", nargs="?", const="all", default="",
                    help="beside each server (or each of the comma-separated NAMES given) its stock twin "
                         "(FLASHMLA_SPARSE, same flags), for its KV cache lines")
    ap.add_argument("--start", choices=("staggered", "together", "chained"), default="staggered",
                    help="staggered (default): each once the one before has sized its KV cache, so that no two "
                         "servers' memory profiling overlaps; together: every server at once (their KV figures "
                         "carry each other's start-ups, and a start may fail of it); chained: each once the one "
                         "before it is up")
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs to spread the servers over (CUDA_VISIBLE_DEVICES; a server and its twin share one); "
                         "each GPU's starts are staggered or chained on their own, side by side (default 1)")
    ap.add_argument("--retries", type=int, default=1, help="retries, alone, of a start other servers disturbed")
    ap.add_argument("--min-fallback-mb", type=int,
                    help="budget for a 'min' server whose 64 MiB start gave no minimum (default: not started)")
    ap.add_argument("--chat-n", type=int, default=100, help="requests in the chat burst (default 100)")
    ap.add_argument("--port-base", type=int, default=8300, help="ports from here (0: any free)")
    ap.add_argument("--start-timeout-s", type=float, default=360, help="a server's start-up limit (default 360)")
    ap.add_argument("--request-timeout-s", type=float, default=180, help="one request's limit (default 180)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for vllm serve")
    ap.add_argument("--detach", action="store_true", help="run in a session of its own, follow it until --deadline-s")
    ap.add_argument("--follow", action="store_true", help="follow a detached run in DIR until it ends or --deadline-s")
    ap.add_argument("--report-only", type=Path, metavar="DIR", help="only print (and write DIR/matrix.md) the table")
    ap.add_argument("--fake-server", action="store_true", help=argparse.SUPPRESS)  # CPU tests: serve_fakes.py
    args = ap.parse_args(argv)
    args.phase = PHASE
    if args.report_only:
        return args
    if not args.out:
        ap.error("give --out (or --report-only DIR)")
    if args.detach and args.follow:
        ap.error("--detach follows the run itself: give one of --detach and --follow")
    names = [c.name for c in md.DESIGN]
    args.servers = [s for s in (args.servers or ",".join(names)).split(",") if s]
    unknown = [s for s in args.servers if s not in names]
    if unknown:
        ap.error(f"unknown server(s) {unknown}; known: {', '.join(names)}")
    args.stock_twins = [] if not args.stock_twins else (
        list(args.servers) if args.stock_twins == "all" else [s for s in args.stock_twins.split(",") if s])
    strays = [s for s in args.stock_twins if s not in args.servers]
    if strays:
        ap.error(f"--stock-twins {','.join(strays)}: not among the servers run ({','.join(args.servers)})")
    if args.util is None:
        args.util = 0.04 if args.stock_twins and args.start == "together" else 0.09
    if not 0 < args.util <= 1 or args.retries < 0 or args.chat_n < 1:
        ap.error("--util must be in (0, 1], --retries 0 or more, --chat-n at least 1")
    if args.gpus < 1:
        ap.error("--gpus must be at least 1")
    for g in range(args.gpus):
        on_gpu = [c for c in selected(args) if gpu_of(args, c.name) in (g, None)]
        utils = [md.util_for(c, args.util) for c in on_gpu]
        twin_utils = [md.util_for(c, args.util) for c in on_gpu if c.name in args.stock_twins]
        # a stock twin lives until every server is up when together, else until the next start
        twins = 0 if not twin_utils else sum(twin_utils) if args.start == "together" else max(twin_utils)
        if sum(utils) + twins > MAX_UTIL_SUM:
            ap.error(f"the servers' utilizations on GPU {g} add up to {sum(utils) + twins:.2f} (at most "
                     f"{MAX_UTIL_SUM}): lower --util")
    return args


def selected(args: argparse.Namespace) -> list[md.Config]:
    return [c for c in md.DESIGN if c.name in args.servers]


def gpu_of(args: argparse.Namespace, name: str) -> int | None:
    """With ``--gpus N`` (N > 1), the i-th selected server's GPU is i mod N; else the environment's."""
    if args.gpus <= 1:
        return None
    return [c.name for c in selected(args)].index(name) % int(args.gpus)


class Store:
    """The run's JSON, rewritten after every change; threads change it under the lock."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data, self.lock = path, data, threading.RLock()

    def save(self) -> None:
        with self.lock:
            write_json(self.path, self.data)

    def update(self, target: dict[str, Any], **values: Any) -> None:
        with self.lock:
            target.update(values)
            write_json(self.path, self.data)


class Run:
    """What every step needs: arguments, deadline, model folders, the results."""

    def __init__(self, args: argparse.Namespace, store: Store, model_dirs: dict[str, Path], t0: float) -> None:
        self.args, self.store, self.model_dirs, self.t0 = args, store, model_dirs, t0
        self.deadline: float = t0 + args.deadline_s
        self.configs = {c.name: c for c in selected(args)}
        self.index = {c.name: i for i, c in enumerate(md.DESIGN)}
        self.records: dict[str, dict[str, Any]] = store.data["servers"]
        self.servers: dict[str, Server] = {}  # the plugin server of each config, once started
        self.twins: dict[str, Server] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def port(self, role: str, name: str) -> int:
        base: int = self.args.port_base
        return free_port() if base == 0 else base + PORTS[role] + self.index[name]

    def ctx(self, name: str) -> sp.Ctx:
        a = self.args
        return sp.Ctx(out=a.out, python=a.python, model_dir=self.model_dirs[name], deadline=self.deadline,
                      port_base=a.port_base, start_timeout_s=a.start_timeout_s, request_timeout_s=a.request_timeout_s,
                      fake_server=a.fake_server)

    def util(self, name: str) -> float:
        return md.util_for(self.configs[name], self.args.util)

    def gpu(self, name: str) -> int | None:
        """The GPU a server and its twin (and its 64 MiB start) run on: round robin over ``--gpus``."""
        return gpu_of(self.args, name)



T = TypeVar("T")


def each(items: list[T], work: Callable[[T], None], together: bool) -> None:
    """``work`` for every item: all at once on threads, or one after the other. Nothing that starts
    a server runs on these threads: its process gets SIGTERM when the thread that started it ends
    (serve_proc's ``PR_SET_PDEATHSIG``)."""
    if not together or len(items) < 2:
        for item in items:
            work(item)
        return
    pool = ThreadPoolExecutor(max_workers=len(items))
    try:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
    except BaseException:  # a stop asked for (or a failure): on to stopping the servers, not waiting for the rest
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


@dataclass
class Job:
    """A server to start, and what to do with it once it is up or failed."""

    name: str  # the design's server it belongs to
    spec: ServerSpec
    label: str  # its log: DIR/logs/LABEL.log
    done: Callable[[Server, dict[str, Any]], None]
    key: str  # where its record goes in its server's: "probe", "plugin" or "twin"
    kv_only: bool = False  # a stock twin: its KV cache lines are all it is started for
    compared: bool = False  # its KV figure is set against another's (a twin, or a server that has one)


@dataclass
class Starting:
    """A spawned server not yet done with: its job, process and serve_phases record."""

    job: Job
    server: Server
    record: dict[str, Any]
    gated: bool = False  # the next start of its chain is released


def settled(run: Run, server: Server) -> bool:
    """Exited, answering /health, or past the start-up limit: serve_phases' wait returns at once."""
    limit = max(1.0, min(run.args.start_timeout_s, run.left() - 5))
    return not server.alive() or server.health(timeout_s=2) == 200 or time.monotonic() - server.t0 >= limit


def gate(run: Run, item: Starting, mode: str, following: Job | None) -> bool:
    """Whether the next start of ``item``'s chain, ``following``, may go: ``chained``, once a server is
    up (a twin: once its KV cache is sized); ``staggered``, once either has sized its KV cache (vLLM's
    memory profiling is over, the cache is allocated right after), except that a start whose KV
    figure is compared (a twin, or a server that has one) waits until the server before it is up: on
    vLLM 0.33 that server captures its CUDA graphs after its KV line, and whatever it allocates
    during the next one's profiling counts as the next one's; ``together``, each start is a chain
    of its own."""
    if mode == "together" or settled(run, item.server):
        return True
    sized = KV_SIZED in item.server.log_text()
    if item.job.kv_only:
        return sized
    return sized and mode == "staggered" and not (following is not None and following.compared)


def twin_sized(run: Run, item: Starting) -> None:
    """A stock twin done at its KV line: the record serve_phases' wait would give, less the wait."""
    record, server = item.record, item.server
    up = server.alive()
    record["startup"] = {"status": "ok" if up else "exited", "elapsed_s": time.monotonic() - server.t0,
                         "until": "KV cache sized", **({} if up else {"log_tail": server.log_tail()})}
    record.update(log_facts(server.log_text()))
    say(f"{item.job.label}: KV cache sized after {record['startup']['elapsed_s']:.0f} s: "
        f"{record.get('kv_cache_memory_gib')} GiB")


def start_jobs(run: Run, jobs: list[Job], mode: str) -> None:
    """Starts ``jobs``' servers: one chain per GPU (``--gpus``), each start of a chain once the one
    before it passes its ``gate``, the chains side by side (``together``: every job a chain of its own).
    Every server is spawned on this (the main) thread and polled here; each job's ``done`` gets
    serve_phases' record of its start, with its window in the run's seconds (spawn to gate)."""
    if mode == "together":
        chains = [[job] for job in jobs]
    else:
        gpus = sorted({job.spec.gpu for job in jobs}, key=lambda g: -1 if g is None else g)
        chains = [[job for job in jobs if job.spec.gpu == g] for g in gpus]
    current: list[Starting | None] = [None] * len(chains)
    released: list[Starting] = []  # gated, awaiting /health
    while True:
        check_stop()
        for k, chain in enumerate(chains):
            if current[k] is None and chain:
                job = chain.pop(0)
                if run.left() < sp.MIN_SERVER_S:  # nothing started that could not be up and used in time
                    not_run = {"status": "not run", "error": f"deadline: {run.left():.0f} s left"}
                    run.store.update(run.records[job.name], **{job.key: {"outcome": "not run", **not_run}
                                                               if job.key == "probe" else {"startup": not_run}})
                    continue
                server, record = sp.spawn_server(run.ctx(job.name), job.spec, job.label)
                record["window_s"] = [run.now(), None]
                current[k] = Starting(job, server, record)
            item = current[k]
            if item is not None and ("startup" in item.record or gate(run, item, mode, chain[0] if chain else None)):
                current[k] = None
                if mode != "together":
                    item.record["window_s"][1] = run.now()
                    if item.job.kv_only and "startup" not in item.record and not settled(run, item.server):
                        twin_sized(run, item)  # sized: all a twin is for
                released.append(item)
        for item in list(released):
            if "startup" in item.record or settled(run, item.server):
                if "startup" not in item.record:
                    sp.await_server(run.ctx(item.job.name), item.server, item.record)  # returns at once
                if item.record["window_s"][1] is None:
                    item.record["window_s"][1] = run.now()
                released.remove(item)
                item.job.done(item.server, item.record)
        if not released and not any(current) and not any(chains):
            return
        time.sleep(0.5)


# --- what a log says --------------------------------------------------------------------------------


def refusal(text: str) -> tuple[str | None, int | None]:
    """The plugin's refusal line and the minimum it names (MiB, rounded up)."""
    for line in text.splitlines():
        m = REFUSAL.search(line)
        if m:
            return line.strip()[:500], math.ceil(float(m.group(1)))
    return None, None


def disturbed(text: str) -> str | None:
    """The line saying the start failed for other servers' memory, if it did."""
    return next((line.strip()[:400] for line in text.splitlines() if any(p in line for p in DISTURBED)), None)


def plugin_facts(text: str) -> dict[str, Any]:
    """The plugin's lines (all of them, up to 40), those saying a step fell back, and the
    reservation the log names."""
    lines = [line.strip()[:400] for line in text.splitlines() if "mla-planner" in line]
    reserved = [int(m.group(1).replace(",", "")) for line in lines for m in [RESERVATION.search(line)] if m]
    return {"mla_planner_lines": lines[:40], "mla_planner_line_count": len(lines),
            "fallback_lines": sum(FELL_BACK in line for line in text.splitlines()),
            "fallback_examples": [line for line in lines if FELL_BACK in line][:5],
            "reserved_mib": reserved[-1] if reserved else None}


def first_errors(text: str, limit: int = 5) -> list[str]:
    """The first distinct error lines before the stop began: exception lines and serve_proc's patterns,
    in lines not logged at a level below ERROR."""
    found: list[str] = []
    for line in engine_lines(text.splitlines()):
        if EXCEPTION_LINE.search(line) or any(p in line for p in ERROR_PATTERNS[:-1]):  # not "Traceback ..."
            short = line.strip()[:400]
            if short not in found:
                found.append(short)
            if len(found) >= limit:
                break
    return found


def end_facts(server: Server) -> dict[str, Any]:
    """serve_phases' end of a server (alive, /health, stop, log facts) and what this driver reads."""
    end: dict[str, Any] = {"label": server.log_path.stem}  # finish_server names it in a warning
    sp.finish_server(server, end)
    del end["label"]
    text = server.log_text()
    end.update(plugin_facts(text), first_errors=first_errors(text))
    return end


# --- 1. the minimum budget --------------------------------------------------------------------------


def probe_job(run: Run, name: str) -> Job:
    """A start at 64 MiB: refused (the minimum is in the line) or up (64 is the minimum)."""
    spec = md.spec(run.configs[name], "plugin", run.util(name), run.port("probe", name), md.PROBE_MB, run.gpu(name))
    return Job(name, spec, f"{name}-min{md.PROBE_MB}", lambda server, start: probed(run, name, server, start), "probe")


def probed(run: Run, name: str, server: Server, start: dict[str, Any]) -> None:
    rec = run.records[name]
    text = server.log_text()
    line, minimum = refusal(text)
    result: dict[str, Any] = {"scratch_mb": md.PROBE_MB, "log": start["log"], "startup": start["startup"],
                              "window_s": start["window_s"], "refusal_line": line, "min_mb": None}
    if start["startup"]["status"] == "ok":
        result.update(outcome="started", min_mb=md.PROBE_MB)
        run.servers[name] = server
        run.store.update(rec, plugin=start, scratch_mb=md.PROBE_MB)
    else:
        end = end_facts(server)
        result.update(rc=end["stop"]["rc"], first_errors=end["first_errors"])
        if minimum is not None:
            result.update(outcome="refused", min_mb=minimum)
        elif disturbed(text):
            result.update(outcome="disturbed", disturbed_line=disturbed(text))
        else:
            result.update(outcome="failed")
    earlier = [*rec.get("probe_attempts", []), *([rec["probe"]] if rec.get("probe") else [])]
    run.store.update(rec, probe=result, probe_attempts=earlier)
    say(f"{name}: {md.PROBE_MB} MiB start {result['outcome']}"
        + (f": minimum {result['min_mb']} MiB" if result["min_mb"] is not None else "") + (f" ({line})" if line else ""))


def find_minimums(run: Run) -> None:
    names = [n for n, c in run.configs.items() if c.budget == "min"]
    if not names:
        return
    if run.left() < sp.MIN_SERVER_S:
        for n in names:
            run.store.update(run.records[n], probe={"outcome": "not run", "error": f"deadline: {run.left():.0f} s left"})
        return
    say(f"minimum budget: {len(names)} start(s) at {md.PROBE_MB} MiB ({', '.join(names)})")
    # together unless chained: a refused start ends before vLLM profiles memory; one disturbed is retried
    start_jobs(run, [probe_job(run, n) for n in names], "chained" if run.args.start == "chained" else "together")
    for _ in range(run.args.retries):
        again = [n for n in names if run.records[n]["probe"].get("outcome") == "disturbed"]
        if not again or run.left() < sp.MIN_SERVER_S:
            break
        say(f"retrying alone: {', '.join(again)} (a start disturbed by the others)")
        start_jobs(run, [probe_job(run, n) for n in again], "chained")


def budget_of(run: Run, name: str) -> int | None:
    """The server's MLA_PLANNER_SCRATCH_MB: its own, the minimum found, the fallback, or None."""
    config = run.configs[name]
    if isinstance(config.budget, int):
        return config.budget
    found = (run.records[name].get("probe") or {}).get("min_mb")
    fallback: int | None = run.args.min_fallback_mb
    return int(found) if found is not None else fallback


# --- 2. the servers (and their stock twins) --------------------------------------------------------


def plugin_job(run: Run, name: str, retry: bool = False) -> Job:
    rec = run.records[name]
    scratch = budget_of(run, name)
    spec = md.spec(run.configs[name], "plugin", run.util(name), run.port("retry" if retry else "plugin", name), scratch,
                   run.gpu(name))

    def done(server: Server, start: dict[str, Any]) -> None:
        run.servers[name] = server
        run.store.update(rec, plugin=start, scratch_mb=scratch)

    return Job(name, spec, f"{name}-retry{len(rec.get('attempts', []))}" if retry else name, done, "plugin",
               compared=name in run.args.stock_twins)


def twin_job(run: Run, name: str, retry: bool = False) -> Job:
    """The stock twin: the same flags, FLASHMLA_SPARSE, no budget; stopped once its KV lines are in."""
    rec = run.records[name]
    spec = md.spec(run.configs[name], "stock", run.util(name), run.port("stock-retry" if retry else "stock", name),
                   None, run.gpu(name))

    def done(server: Server, start: dict[str, Any]) -> None:
        run.twins[name] = server
        run.store.update(rec, twin=start)
        if retry or run.args.start != "together":  # stopped before the next start: no other start is profiling
            stop_twin(run, name)

    label = f"{name}-stock" + (f"-retry{len(rec.get('twin_attempts', []))}" if retry else "")
    return Job(name, spec, label, done, "twin", kv_only=True, compared=True)


def stop_twin(run: Run, name: str) -> None:
    server = run.twins.pop(name, None)
    if server is not None:
        end = end_facts(server)
        run.store.update(run.records[name]["twin"], **end)


def start_servers(run: Run) -> None:
    names, skipped = [], []
    for name in run.configs:
        rec = run.records[name]
        if name in run.servers:  # up at 64 MiB: that was the minimum
            continue
        if budget_of(run, name) is None:
            probe_rec = rec.get("probe") or {}
            why = probe_rec.get("error") or (f"no minimum: the {md.PROBE_MB} MiB start {probe_rec.get('outcome')} "
                                             "without the plugin's refusal line")
            run.store.update(rec, plugin={"startup": {"status": "not run", "error": why}})
            skipped.append(name)
            continue
        names.append(name)
    twins = [n for n in run.configs if n not in skipped and n in run.args.stock_twins]
    # each server, then its twin (the order staggered and chained starts take)
    jobs = [job for n in run.configs for job in ([plugin_job(run, n)] if n in names else [])
            + ([twin_job(run, n)] if n in twins else [])]
    if not jobs:
        return
    if run.left() < sp.MIN_SERVER_S:
        for job in jobs:
            key = "plugin" if job.spec.engine == "plugin" else "twin"
            run.store.update(run.records[job.name], **{key: {"startup": {
                "status": "not run", "error": f"deadline: {run.left():.0f} s left"}}})
        return
    say(f"starting {len(names)} server(s){f' and {len(twins)} stock twin(s)' if twins else ''} "
        f"({run.args.start}): {', '.join(names)}")
    start_jobs(run, jobs, run.args.start)
    # Together, the twins' KV lines are in once every start is over; stopped now, before any retry and the load.
    for n in list(run.twins):
        stop_twin(run, n)
    for _ in range(run.args.retries):
        again = [(n, "plugin") for n in names if disturbed_start(run, n, "plugin")]
        again += [(n, "twin") for n in twins if disturbed_start(run, n, "twin")]
        if not again or run.left() < sp.MIN_SERVER_S:
            break
        say(f"retrying alone: {', '.join(f'{n} ({role})' for n, role in again)} (a start disturbed by the others)")
        for n, role in again:
            rec = run.records[n]
            if role == "plugin":
                end = end_facts(run.servers.pop(n))
                run.store.update(rec, attempts=[*rec.get("attempts", []), {**rec["plugin"], **end}])
                start_jobs(run, [plugin_job(run, n, retry=True)], "chained")
            else:
                run.store.update(rec, twin_attempts=[*rec.get("twin_attempts", []), rec["twin"]])
                start_jobs(run, [twin_job(run, n, retry=True)], "chained")


def disturbed_start(run: Run, name: str, key: str) -> bool:
    """The start failed, and its log says other servers' memory is why."""
    rec = run.records[name].get(key) or {}
    if rec.get("startup", {}).get("status") in ("ok", "not run", None):
        return False
    log = run.args.out / rec["log"]
    return log.is_file() and disturbed(log.read_text(errors="replace")) is not None


# --- 3. the load ------------------------------------------------------------------------------------


def chat_prompts(n: int, seed: int = CHAT_SEED) -> list[tuple[list[int], int]]:
    """``n`` (token ids, max_tokens): a shared 256-token prefix (a system prompt: prefix caching's
    hits), then each its own tokens to 300-1,100 in all; 16-256 tokens out. The same for every server."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(CHAT_PREFIX)]
    prompts = []
    for _ in range(n):
        length = rng.randint(*CHAT_LEN)
        ids = prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(length - CHAT_PREFIX)]
        prompts.append((ids, rng.randint(*CHAT_MAX_TOKENS)))
    return prompts


def chat_burst(url: str, n: int, timeout_s: float) -> dict[str, Any]:
    """``n`` completions at once; counts, and the first few errors."""
    prompts = chat_prompts(n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(one_request, url, ids, max_tokens, 0.0, timeout_s) for ids, max_tokens in prompts]
        results = [f.result() for f in futures]
    failed = [r for r in results if not r["ok"]]
    errors: list[str] = []
    for r in failed:
        if r["error"] not in errors and len(errors) < 5:
            errors.append(str(r["error"]))
    return {"status": "error" if failed else "ok", "error": errors[0] if errors else None, "errors": errors,
            "n_requests": n, "requests_ok": n - len(failed), "elapsed_s": time.perf_counter() - t0,
            "prompt_tokens": sum(len(ids) for ids, _ in prompts), "max_tokens": sum(m for _, m in prompts)}


def load(run: Run, name: str) -> None:
    """The chat burst, then cases 1, 2 and 4, on one server; /health after each."""
    server = run.servers[name]
    rec = run.records[name]
    run.store.update(rec, phases={})
    phases: dict[str, Any] = rec["phases"]
    for key, case in LOAD_PHASES:
        check_stop()
        if run.left() < MIN_PHASE_S:
            result: dict[str, Any] = {"status": "not run", "error": f"deadline: {run.left():.0f} s left"}
        elif not server.alive():
            result = {"status": "not run", "error": "server process exited"}
        elif server.health() != 200:
            result = {"status": "not run", "error": "server not healthy"}
        else:
            run.store.update(phases, **{key: {"status": "started", "at_s": run.now()}})
            timeout = max(5.0, min(run.args.request_timeout_s, run.left() - 5))
            if case is None:
                result = chat_burst(server.url, run.args.chat_n, timeout)
            else:
                result = run_case(server.url, case, timeout)
                result["n_requests"] = len(result["requests"])
            if result["status"] != "ok":
                time.sleep(2)  # a dying engine takes a moment to take the server down
            result.update(alive_after=server.alive(), health_after=server.health() if server.alive() else None)
        run.store.update(phases, **{key: result})
        done = f"{result.get('requests_ok')}/{result.get('n_requests')} ok" if "n_requests" in result else ""
        say(f"{name} {key}: {result['status']} {done}" + (f" ({str(result.get('error'))[:160]})"
            if result.get("error") else "") + (f"; health after: {result.get('health_after')}"
                                               if "health_after" in result else ""))


def run_loads(run: Run) -> None:
    names = [n for n in run.configs if n in run.servers and run.servers[n].alive()]
    for n in run.configs:
        if n not in names:
            run.store.update(run.records[n], phases={k: {"status": "not run", "error": "server not up"}
                                                     for k, _ in LOAD_PHASES})
    if names:
        say(f"load on {len(names)} server(s) at once: chat burst of {run.args.chat_n}, then cases 1, 2, 4")
        each(names, lambda n: load(run, n), together=True)


# --- the run ----------------------------------------------------------------------------------------


def prepare_models(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Path] | None:
    """Each server's model folder (its copy with an MTP layer where it speculates), with a generated
    tokenizer, checked; None (and the error in ``data``) where a tokenizer would fail the servers."""
    out: Path = args.out
    dirs: dict[str, Path] = {}
    for config in selected(args):
        dirs[config.name] = served_model_dir(out / "model", md.model_source(config, out / "variants"))
    data["tokenizers"] = {}
    for folder in sorted(set(dirs.values())):
        try:
            data["tokenizers"][folder.name] = check_tokenizer(folder)
        except Exception as exc:
            data["tokenizers"][folder.name] = {"error": f"{type(exc).__name__}: {exc}"}
            return None
    return dirs


def run_matrix(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    configs = selected(args)
    run_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("report_only", "detach", "follow", "fake_server")}
    data: dict[str, Any] = {
        "schema": 1, "phase": PHASE, "finished": False, "run": run_args, "versions": run_serve.versions(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", *ENV_DEFAULTS, *PLANNER_VARS)},
        "design": [asdict(c) for c in configs], "coverage_gaps": md.coverage_gaps(configs),
        "axes": {k: list(v) for k, v in md.AXES.items()}, "required_pairs": list(md.REQUIRED_PAIRS),
        "case_titles": {k: CASE_TITLES[c] for k, c in LOAD_PHASES if c}, "servers": {},
    }
    for c in configs:
        data["servers"][c.name] = {"name": c.name, "config": c.values(), "title": md.describe(c),
                                   "util": md.util_for(c, args.util), "mnbt": md.mnbt(c)}
    store = Store(out / matrix_report.RESULT, data)
    store.save()
    say(f"matrix: {len(configs)} server(s); coverage " +
        ("complete" if not data["coverage_gaps"] else f"gaps: {', '.join(data['coverage_gaps'])}"))
    for c in configs:
        say(f"  {c.name}: {md.describe(c)}")
    dirs = prepare_models(args, data)
    if dirs is None:
        store.update(data, finished=True)
        print(f"tokenizer check failed: {data['tokenizers']}", file=sys.stderr)
        return 2
    store.save()
    run = Run(args, store, dirs, t0)
    completed = False
    try:
        find_minimums(run)
        start_servers(run)
        run_loads(run)
        completed = True
    finally:
        for name in list(run.twins):
            stop_twin(run, name)
        names = list(run.servers)
        ends: dict[str, dict[str, Any]] = {}

        def finish(name: str) -> None:
            ends[name] = end_facts(run.servers[name])

        each(names, finish, together=True)
        for name in names:
            store.update(run.records[name]["plugin"], **ends[name])
        store.update(data, finished=completed, elapsed_s=time.monotonic() - t0)  # not finished: stopped midway
    return 0


def write_report(out: Path) -> str:
    text = matrix_report.render(matrix_report.load(out))
    (out / matrix_report.REPORT_MD).write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report_only:
        print(write_report(args.report_only))
        return 0
    if args.detach:
        run_serve.detach(args, argv, script=Path(__file__).resolve())
    if args.detach or args.follow:
        rc = run_serve.follow(args, again="--follow")
        if (args.out / matrix_report.RESULT).is_file():
            print(write_report(args.out))
        return rc
    install_cleanup()
    try:
        rc = run_matrix(args)
    finally:
        if (args.out / matrix_report.RESULT).is_file():
            print(write_report(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
