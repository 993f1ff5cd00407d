"""The serve driver (docs/e2e.md): stock FLASHMLA_SPARSE against the plugin under ``vllm serve``, one
``--phase`` a call, until ``--deadline-s`` (what it leaves no time for is recorded as not run). Results in
``DIR/<phase>[-<engine>].json``, rewritten at every change; then report.py's reports.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TypeVar

import matrix_design as md
import report
import serve_proc as sp
import step_log
from report import ENGINES, up
from run_cases import (CASE_MAX_TOKENS, CASE_PROMPTS, CASE_TITLES, ENV_DEFAULTS, MAX_TOKENS, MODEL_DIR, PLANNER_VARS,
                       TOKEN_RANGE, case_prompts, error_text, model_variant, versions, write_json)
from serve_proc import Server, ServerSpec, check_stop

PHASES = ("ab", "boundary", "failrate", "soak", "matrix")
# ab's two servers share the GPU: at 0.45 each, stock's 32K FP8 step (~14 GiB beyond its share) killed
# the plugin's server on the H200.
PHASE_DEFAULTS = {  # engine, util (the matrix's: before each server's budget share)
    "ab": (None, 0.40), "boundary": ("plugin", 0.95), "failrate": ("stock", None), "soak": ("plugin", 0.95),
    "matrix": (None, 0.09)}
# start-up and request limits: the matrix's servers start side by side on cold compile caches
TIMEOUTS = {"matrix": (360.0, 180.0)}
DEFAULT_TIMEOUTS = (240.0, 120.0)
MAX_UTIL_SUM = 0.92  # the matrix's servers (and twins alive at once) on one GPU
DETACHED_MARGIN_S = 600  # a detached soak's own deadline: --soak-s plus this (start-up, last iteration)
DETACHED_DEADLINE_S = 1500  # any other detached phase's: within the 30 minutes a device machine is held
LOGGING_VAR = "VLLM_LOGGING_CONFIG_PATH"
MIN_SERVER_S = 120  # a server start (~65-95 s with CUDA graph capture) and one request
MIN_BENCH_S = 30  # a bench client takes some seconds to start (prompt sampling): start none with less left
MIN_STEP_S = 15  # a request step starts with at least this much left
SEED_BASE = 1000  # the recorded runs' seeds: SEED_BASE + 100 x repeat + 10 x the workload's place in WORKLOADS


def say(message: str) -> None:
    print(message, flush=True)


def not_run(why: str) -> dict[str, Any]:
    return {"status": "not run", "error": why}


def split(text: str) -> list[str]:
    return [w for w in text.split(",") if w]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog="docs/e2e.md says what each phase and option does.")
    add = ap.add_argument
    add("--phase", choices=PHASES, required=True, help="one a call")
    add("--out", type=Path, required=True, help="results folder (kept: later calls add to it)")
    add("--deadline-s", type=float, default=540, help="the call ends by then (default 540)")
    add("--detach", action="store_true", help="run the phase in a session of its own; follow it until --deadline-s")
    add("--follow", action="store_true", help="follow the phase detached in DIR until it ends or --deadline-s")
    add("--engine", choices=ENGINES, help="boundary, soak: default plugin; failrate: default stock")
    add("--util", type=float, help="--gpu-memory-utilization (ab: 0.40 each; boundary, soak: 0.95; matrix: 0.09, "
                                   "0.04 with --stock-twins --start together, plus each server's budget share)")
    add("--log-iterations", action="store_true", help="servers log each engine step, for step_log.py compare")
    add("--layers", type=int, help="the model's hidden layers (default: its config's, 2)")
    add("--workloads", default="long,chat,mix", help=f"ab: of {', '.join(sp.WORKLOADS)}")
    add("--repeats", type=int, default=3, help="ab: interleaved repeats per engine and workload")
    add("--warmup-rounds", type=int, default=1, help="ab: rounds of every workload left out of the medians")
    add("--at-once", nargs="?", const="*", default="", metavar="WORKLOADS",
        help="ab: these workloads (none given: all) run both engines' runs of a repeat at the same time")
    add("--prompt-scale", type=float, default=1.0, help="ab, soak: scales every client's prompt count")
    add("--failrate-utils", default="0.90,0.95", help="failrate: utilizations, in turn")
    add("--failrate-n", type=int, default=2, help="failrate: servers per utilization")
    add("--soak-s", type=float, default=600, help="soak: how long to repeat the mix (default 600)")
    add("--sample-s", type=float, default=5, help="soak: seconds between memory samples")
    add("--servers", help=f"matrix: of {','.join(c.name for c in md.DESIGN)} (default: all)")
    add("--stock-twins", nargs="?", const="all", default="", help="matrix: a stock twin beside each server (or NAMES)")
    add("--start", choices=("staggered", "together", "chained"), default="staggered",
        help="matrix: each start once the one before has sized its KV cache, all at once, or once it is up")
    add("--port-base", type=int, default=8100, help="servers listen on this port and above (0: any free)")
    add("--start-timeout-s", type=float, help="a server's start-up limit (default 240; matrix: 360)")
    add("--request-timeout-s", type=float, help="one request's limit (default 120; matrix: 180)")
    add("--fake-server", action="store_true", help=argparse.SUPPRESS)
    add("--fake-bench", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.detach and a.follow:
        ap.error("--detach follows the phase itself: give one of --detach and --follow")
    a.workloads = split(a.workloads)
    if bad := sorted(set(a.workloads) - set(sp.WORKLOADS)):
        ap.error(f"unknown workload(s) {bad}; known: {', '.join(sp.WORKLOADS)}")
    a.at_once = a.workloads if a.at_once == "*" else split(a.at_once)
    if bad := sorted(set(a.at_once) - set(a.workloads)):
        ap.error(f"--at-once {','.join(bad)}: not in --workloads {','.join(a.workloads)}")
    a.failrate_utils = [float(u) for u in split(a.failrate_utils)]
    engine, util = PHASE_DEFAULTS[a.phase]
    a.engine = a.engine or engine
    if a.phase == "matrix" and a.util is None and a.start == "together" and a.stock_twins:
        util = 0.04  # every twin alive beside every server
    a.util = util if a.util is None else a.util
    start_s, request_s = TIMEOUTS.get(a.phase, DEFAULT_TIMEOUTS)
    a.start_timeout_s, a.request_timeout_s = a.start_timeout_s or start_s, a.request_timeout_s or request_s
    if bad := [u for u in [a.util, *a.failrate_utils] if u is not None and not 0 < u <= 1]:
        ap.error(f"utilization {bad[0]} is not in (0, 1]")
    if a.phase != "matrix":
        return a
    # the matrix's servers and twins, their shares of the GPU within MAX_UTIL_SUM
    names = [c.name for c in md.DESIGN]
    a.servers = split(a.servers or ",".join(names))
    if bad := sorted(set(a.servers) - set(names)):
        ap.error(f"unknown server(s) {bad}; known: {', '.join(names)}")
    a.stock_twins = list(a.servers) if a.stock_twins == "all" else split(a.stock_twins)
    if bad := sorted(set(a.stock_twins) - set(a.servers)):
        ap.error(f"--stock-twins {','.join(bad)}: not among the servers run ({','.join(a.servers)})")
    utils = [md.util_for(c, a.util) for c in md.DESIGN if c.name in a.servers]
    twin_utils = [md.util_for(c, a.util) for c in md.DESIGN if c.name in a.stock_twins]
    # a stock twin lives until every server is up when together, else until the next start
    twins = sum(twin_utils) if a.start == "together" else max(twin_utils, default=0)
    if sum(utils) + twins > MAX_UTIL_SUM:
        ap.error(f"the servers' utilizations add up to {sum(utils) + twins:.2f} (at most {MAX_UTIL_SUM}): lower --util")
    return a


class Run:
    """One call: its arguments, deadline and results (``data``, rewritten to ``path`` at every change,
    under the lock: the matrix's threads change it)."""

    def __init__(self, args: argparse.Namespace, path: Path, data: dict[str, Any], t0: float) -> None:
        self.args, self.path, self.data, self.t0 = args, path, data, t0
        self.out: Path = args.out
        self.deadline: float = t0 + args.deadline_s
        self.lock = threading.RLock()
        self.clients: sp.Clients | None = None  # None: no step of this phase runs a bench client
        # the served model folders, the matrix's by server, the other phases' one as "" (the clients' tokenizer too)
        self.model_dirs: dict[str, Path] = {}
        self.closed = False  # no record after this: the reports are written from the file as it is then

    def update(self, target: dict[str, Any] | None = None, **values: Any) -> None:
        """``target.update(values)`` and the file rewritten (none once closed: a stop leaves the matrix's
        load threads running until the process exits, and what they would add would disagree with the
        reports)."""
        with self.lock:
            if not self.closed:
                (self.data if target is None else target).update(values)
                write_json(self.path, self.data)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def late(self, needed_s: float) -> dict[str, Any] | None:
        """A ``not run`` record where less than ``needed_s`` is left."""
        return not_run(f"deadline: {self.left():.0f} s left") if self.left() < needed_s else None

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def port(self, k: int) -> int:
        return sp.free_port() if self.args.port_base == 0 else int(self.args.port_base) + k

    def job(self, engine: str, util: float, k: int, label: str, mnbt: int = 32768) -> Job:
        """A server of the phases but the matrix, on their one model."""
        spec = ServerSpec(engine, util, self.port(k), mnbt, log_iterations=self.args.log_iterations)
        return Job(spec, label, self.model_dirs[""])


# --- starting servers ----------------------------------------------------------------------------------

Done = Callable[[Server | None, dict[str, Any]], None]


@dataclass
class Job:
    """A server to start, and what to do with it once up, failed, or not started (server None)."""

    spec: ServerSpec
    label: str  # its log: DIR/logs/LABEL.log
    model_dir: Path
    done: Done | None = None
    kv_only: bool = False  # a stock twin: its KV cache lines are all it is started for
    compared: bool = False  # its KV figure is set against another's (a twin, or a server that has one)


@dataclass
class Starting:
    job: Job
    server: Server
    record: dict[str, Any]
    limit_s: float  # its start-up limit
    state: dict[str, Any] | None = None  # Server.start_state, once settled


def spawn(run: Run, job: Job) -> Starting:
    """Starts a job's server; from the main thread only (``PR_SET_PDEATHSIG``: SIGTERM when it ends)."""
    spec = job.spec
    server = Server(spec, sp.server_command(spec, job.model_dir, sys.executable, run.args.fake_server),
                    sp.server_env(spec), run.out / "logs" / f"{job.label}.log")
    record: dict[str, Any] = {"label": job.label, "engine": spec.engine, "util": spec.util, "mnbt": spec.mnbt,
                              "port": spec.port, "scratch_mb": spec.scratch_mb, "cmd": server.cmd,
                              "log": f"logs/{job.label}.log", "window_s": [run.now(), None]}
    say(f"{job.label}: starting {spec.engine} server (util {spec.util}, mnbt {spec.mnbt}, port {spec.port}) ...")
    item = Starting(job, server, record, max(1.0, min(run.args.start_timeout_s, run.left() - 5)))
    try:
        server.start()
    except Exception as exc:
        item.state = {"status": "error", "error": error_text(exc), "elapsed_s": 0.0}
    record["pid"] = server.pid
    return item


def settle(job: Job, server: Server | None, record: dict[str, Any]) -> None:
    if server is not None:
        record.update(sp.log_facts(server.log_text()))
        s, kv = record["startup"], record.get("kv_cache_memory_gib")
        say(f"{job.label}: {s['status']} after {s['elapsed_s']:.0f} s" + (f", KV cache {kv} GiB" if kv is not None else "")
            + (f", {record['planner_line_count']} mla-planner log lines" if job.spec.engine == "plugin" else ""))
    if job.done is not None:
        job.done(server, record)


def gate(item: Starting, mode: str, following: Job | None) -> bool:
    """Whether the start after ``item``, ``following``, may go: ``chained``, once it is up (a twin:
    sized); ``staggered``, once it has sized its KV cache (its memory profiling is over), but a start
    whose KV figure is compared waits until it is up: vLLM 0.33 captures CUDA graphs after the KV
    line, which would count in the next one's profiling; ``together``, at once."""
    if mode == "together" or item.state is not None:
        return True
    sized = sp.KV_SIZED in item.server.log_text()
    if item.job.kv_only:
        return sized
    return sized and mode == "staggered" and not (following is not None and following.compared)


def start_jobs(run: Run, jobs: list[Job], mode: str = "chained",
               min_left_s: float = MIN_SERVER_S) -> list[tuple[Server | None, dict[str, Any]]]:
    """Starts ``jobs``' servers in order, each once the one before passes its ``gate``, none with less
    than ``min_left_s`` left, all on this thread. Returns each job's server (None: not started) and
    record, with its window (spawn to gate, or to settled) and ``startup``."""
    queue, started = list(jobs), list[tuple[Server | None, dict[str, Any]]]()
    current: Starting | None = None
    released: list[Starting] = []  # past their gate, awaiting /health
    while queue or current or released:
        check_stop()
        if current is None and queue:
            job = queue.pop(0)
            late = run.late(min_left_s)  # nothing started that could not be up and used in time
            if late is not None:
                record: dict[str, Any] = {"label": job.label, "engine": job.spec.engine, "util": job.spec.util,
                                          "startup": late}
                started.append((None, record))
                settle(job, None, record)
                continue
            current = spawn(run, job)
            started.append((current.server, current.record))
        if current is not None:
            current.state = current.state or current.server.start_state(current.limit_s)
            if gate(current, mode, queue[0] if queue else None):
                if mode != "together":
                    current.record["window_s"][1] = run.now()
                if current.job.kv_only and current.state is None:  # sized: all a twin is for
                    alive = current.server.alive()
                    current.state = {"status": "ok" if alive else "exited", "until": "KV cache sized",
                                     "elapsed_s": time.monotonic() - current.server.t0,
                                     **({} if alive else {"log_tail": current.server.log_tail()})}
                released.append(current)
                current = None
                if mode == "together" and queue:
                    continue  # every start at once
        time.sleep(0.5)
        for item in list(released):  # before the next start, so a twin sized is stopped by then
            item.state = item.state or item.server.start_state(item.limit_s)
            if item.state is not None:
                released.remove(item)
                item.record["startup"] = item.state
                if item.record["window_s"][1] is None:
                    item.record["window_s"][1] = run.now()
                settle(item.job, item.server, item.record)
    return started


def start_one(run: Run, job: Job, min_left_s: float = MIN_SERVER_S) -> tuple[Server | None, dict[str, Any]]:
    return start_jobs(run, [job], min_left_s=min_left_s)[0]


def finish(server: Server, record: dict[str, Any]) -> None:
    """Alive and /health, the plugin's metrics, the stop, then the whole log's facts."""
    record["alive_at_end"] = alive = server.alive()
    record["health_at_end"] = server.health() if alive else None
    if alive:  # the plugin's metrics, where vLLM serves a worker's (PROMETHEUS_MULTIPROC_DIR set)
        text = sp.http(server.url + "/metrics", timeout_s=10)[1] or ""
        record["plugin_metrics"] = [line for line in text.splitlines() if line.startswith("mla_planner_")]
    record["stop"] = server.stop()
    record.update(sp.log_facts(server.log_text()))
    if record["stop"].get("left_running"):
        say(f"{server.log_path.stem}: WARNING: processes of the server's group still running after SIGKILL")


# --- requests: run_cases' cases (token-id prompts) and the matrix's chat burst, over HTTP ---------------

STAGGER_S = 0.02  # a case's prompts, this far apart, reach the server as one submission (case 3's blocker first)
CHAT_N, CHAT_PREFIX, CHAT_LEN, CHAT_MAX_TOKENS, CHAT_SEED = 100, 256, (300, 1100), (16, 256), 2900


def chat_prompts(n: int, seed: int = CHAT_SEED) -> list[tuple[list[int], int]]:
    """``n`` (token ids, max_tokens): a shared 256-token prefix (prefix caching's hits), 300-1,100
    tokens in all, 16-256 out; the same for every server."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(CHAT_PREFIX)]
    return [(prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(*CHAT_LEN) - CHAT_PREFIX)],
             rng.randint(*CHAT_MAX_TOKENS)) for _ in range(n)]


def one_request(url: str, ids: list[int], max_tokens: int, delay_s: float, timeout_s: float) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens back (ignore_eos is vLLM's extension of the API)."""
    time.sleep(delay_s)
    t0 = time.perf_counter()
    body = {"model": sp.SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    status, answer, error = sp.http(url + "/v1/completions", body, timeout_s)
    usage = (answer or {}).get("usage") or {}
    tokens = usage.get("completion_tokens")
    ok = status == 200 and tokens == max_tokens
    if status == 200 and not ok:
        error = f"{tokens} tokens back, {max_tokens} asked"
    return {"prompt_len": len(ids), "status": status, "ok": ok, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": tokens, "elapsed_s": time.perf_counter() - t0, "error": error}


def send_step(url: str, case: str | None, timeout_s: float) -> dict[str, Any]:
    """A case of run_cases' (its prompts ``STAGGER_S`` apart), or (None) the chat burst, whose requests
    are not kept: every prompt at once, each answer awaited; counts, and the first errors."""
    max_tokens = CASE_MAX_TOKENS.get(case or "", MAX_TOKENS)
    prompts = chat_prompts(CHAT_N) if case is None else [(ids, max_tokens) for ids in case_prompts(case)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(one_request, url, ids, m, 0.0 if case is None else i * STAGGER_S, timeout_s)
                   for i, (ids, m) in enumerate(prompts)]
        requests = [f.result() for f in futures]
    errors = list(dict.fromkeys(str(r["error"]) for r in requests if not r["ok"]))[:5]
    ok = sum(r["ok"] for r in requests)
    result = {"status": "ok" if ok == len(requests) else "error", "error": errors[0] if errors else None,
              "errors": errors, "n_requests": len(requests), "requests_ok": ok, "elapsed_s": time.perf_counter() - t0,
              "prompt_tokens": sum(len(ids) for ids, _ in prompts), "max_tokens": sum(m for _, m in prompts)}
    return result if case is None else {**result, "requests": requests, "prompt_lens": CASE_PROMPTS[case],
                                        "max_tokens": max_tokens}


def probe(run: Run, name: str, server: Server, steps: list[tuple[str, str | None]], results: dict[str, Any]) -> None:
    """Each step (a case, or None: the chat burst) on ``server`` in turn, into ``results[key]``, /health
    after each; not run past the deadline or on a server dead or not healthy."""
    for key, case in steps:
        check_stop()
        result = run.late(MIN_STEP_S) or (not_run("server process exited") if not server.alive() else
                                          not_run("server not healthy") if server.health() != 200 else None)
        if result is None:
            run.update(results, **{key: {"status": "started", "at_s": run.now()}})
            result = send_step(server.url, case, max(5.0, min(run.args.request_timeout_s, run.left() - 5)))
            if result["status"] != "ok":
                time.sleep(2)  # a dying engine takes a moment to take the server down
            result.update(alive_after=server.alive(), health_after=server.health() if server.alive() else None)
        run.update(results, **{key: result})
        say(f"{name} {key}: {result['status']}" + (f", {result['requests_ok']}/{result['n_requests']} requests ok"
                                                   if "n_requests" in result else "")
            + (f" ({str(result.get('error'))[:160]})" if result.get("error") else "")
            + (f"; health after: {result['health_after']}" if "health_after" in result else ""))


# --- bench clients ----------------------------------------------------------------------------------


def bench(run: Run, servers: dict[str, Server], workload: str, seed: int, tags: dict[str, str], scale: float,
          timeout_s: float, tick: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    """A workload's clients against every server of ``servers`` at once: per engine, each client's
    summary and the workload combined."""
    assert run.clients is not None, "a phase that runs bench clients gets a Clients"
    clients = sp.WORKLOADS[workload]
    runs = []
    for engine, server in servers.items():
        for c in clients:
            result = run.out / "bench" / f"{tags[engine]}-{c.label}.json"
            runs.append((sp.bench_args(c, base_url=server.url, tokenizer=run.model_dirs[""], seed=seed, scale=scale,
                                       result=result, metadata={"engine": engine, "workload": workload,
                                                                "tag": tags[engine]}), result))
    outcomes = sp.run_clients(run.clients, runs, timeout_s, tick)
    records = {}
    for k, engine in enumerate(servers):
        mine = outcomes[k * len(clients):(k + 1) * len(clients)]
        summaries = [o["result"] for o in mine if o["result"] is not None]
        ok = len(summaries) == len(mine)
        whole = summaries[0] if len(mine) == 1 and ok else sp.combined(summaries) if ok else {}
        records[engine] = {"status": "ok" if ok else "error", "seed": seed, "combined": whole,
                           "clients": {c.label: o for c, o in zip(clients, mine)},
                           "error": next((o["error"] for o in mine if o["error"]), None)}
    return records


def run_line(tag: str, run: dict[str, Any]) -> str:
    c = run.get("combined") or {}
    if run["status"] != "ok":
        return f"{tag}: {run['status']}: {run.get('error')}"
    first = next(iter(run["clients"].values()))["result"]
    return (f"{tag}: {c.get('completed')} done, {c.get('failed')} failed, out {c.get('output_throughput', 0):,.0f} "
            f"tok/s, total {c.get('total_token_throughput', 0):,.0f} tok/s, TTFT p50 {first.get('p50_ttft_ms') or 0:.0f} "
            f"ms, TPOT p50 {first.get('p50_tpot_ms') or 0:.1f} ms ({c.get('duration', 0):.0f} s)")


# --- the phases (docs/e2e.md, "Phases"): each stops its servers on the way out ------------------------


def ab(run: Run) -> None:
    a, data = run.args, run.data
    records: dict[str, dict[str, Any]] = {}
    call = {"id": len(data.setdefault("calls", [])), "workloads": a.workloads, "repeats": a.repeats,
            "scale": a.prompt_scale, "warmup_rounds": a.warmup_rounds, "util": a.util, "at_once": a.at_once,
            "servers": records}
    data["calls"].append(call)
    # An earlier call's runs of these workloads are replaced; its other workloads stay.
    data["runs"] = [r for r in data.get("runs", []) if r["workload"] not in a.workloads]
    servers: dict[str, Server] = {}
    try:
        # one after the other: vLLM's start-up measures the GPU's free memory, which a second server
        # starting beside it would disturb
        for k, engine in enumerate(ENGINES):
            server, records[engine] = start_one(run, run.job(engine, a.util, 100 * k, f"ab{call['id']}-{engine}"),
                                                min_left_s=0)
            if server is not None:
                servers[engine] = server
            run.update()
            if not up(records[engine]):
                call["error"] = f"{engine} server did not start: {records[engine]['startup'].get('status')}"
                return
        # Warm-up rounds, left out of the medians: a first run pays first-use costs (chat's TTFT p99
        # 1.5-1.9 s, then 0.24-0.30 s on the H200), and the first engine JIT-compiles what the second loads.
        for r in range(-a.warmup_rounds, a.repeats):
            name = f"w{-r}" if r < 0 else f"r{r + 1}"
            # the first engine alternates by repeat: a drift over the call (stock rose 150K -> 210K
            # tokens/s over one on the H200) favours neither side of the per-repeat ratio
            order = ENGINES[::-1] if r > 0 and r % 2 else ENGINES
            for w in a.workloads:
                seed = SEED_BASE + 100 * r + 10 * list(sp.WORKLOADS).index(w)  # warm-ups: below SEED_BASE
                runs = {e: {"workload": w, "engine": e, "repeat": r + 1 if r >= 0 else None, "seed": seed,
                            "call": call["id"], "tag": f"ab{call['id']}-{name}-{w}-{e}", "warmup": r < 0}
                        for e in order}
                # at once, the machine's swings hit both runs alike
                for together in [runs] if w in a.at_once else [{e: runs[e]} for e in order]:
                    bench_runs(run, servers, together, w, seed)
                    for one in together.values():
                        data["runs"].append(one)
                        run.update()
                        say(run_line(one["tag"], one))
                        check_stop()
    finally:
        for engine, server in servers.items():
            finish(server, records[engine])
        run.update()


def bench_runs(run: Run, servers: dict[str, Server], runs: dict[str, dict[str, Any]], workload: str,
               seed: int) -> None:
    """The workload against each engine's server in ``runs`` at once, each run filled in with its
    result and window (for step_log.py compare --ab); none runs if one cannot."""
    why = {e: run.late(MIN_BENCH_S) or (None if servers[e].healthy() else
                                        {**not_run("server not healthy"), "alive": servers[e].alive()}) for e in runs}
    if any(why.values()):
        for e, one in runs.items():
            one.update(why[e] or not_run("the other engine's run could not start"))
        return
    began = step_log.stamp()
    done = bench(run, {e: servers[e] for e in runs}, workload, seed, {e: one["tag"] for e, one in runs.items()},
                 run.args.prompt_scale, run.left() - 10)
    ended = step_log.stamp()
    for e, one in runs.items():
        one.update(done[e], window=[began, ended], healthy_after=servers[e].healthy(), at_once=len(runs) > 1)


BOUNDARY = ((32768, ("1", "2", "5")), (65536, ("4", "5")))  # (max_num_batched_tokens, cases)


def boundary(run: Run) -> None:
    a = run.args
    run.data["servers"] = []
    for k, (mnbt, cases) in enumerate(BOUNDARY):
        label = f"boundary-{a.engine}-{mnbt // 1024}k"
        server, record = start_one(run, run.job(a.engine, a.util, k, label, mnbt))
        record.update(mnbt=mnbt, cases={}, case_order=list(cases))
        run.data["servers"].append(record)
        run.update()
        if server is None:
            continue
        try:
            if up(record):
                probe(run, label, server, [(case, case) for case in cases], record["cases"])
        finally:
            finish(server, record)
            run.update()
        sp.wait_gpu_idle()


def failrate(run: Run) -> None:
    """Trials add to an earlier call's (but its ``not run`` ones): a rate wants more than one call's."""
    a, data = run.args, run.data
    data["trials"] = [t for t in data.get("trials", []) if t.get("status") != "not run"]
    call = 1 + max((t.get("call", 0) for t in data["trials"]), default=0)
    for i in range(a.failrate_n):
        for util in a.failrate_utils:  # interleaved, so drift over the call hits each utilization alike
            label = f"failrate-{a.engine}-{util:.2f}-c{call}-{i + 1}"
            trial: dict[str, Any] = {"label": label, "util": util, "call": call, "index": i + 1}
            data["trials"].append(trial)
            server, record = start_one(run, run.job(a.engine, util, len(data["trials"]), label))
            if server is None:
                run.update(trial, **record["startup"])
                continue
            trial["server"] = record
            try:
                if up(record):
                    probe(run, label, server, [("case", "1")], trial)
                    case = trial["case"]
                    trial.update(status=case["status"],
                                 engine_died=case["health_after"] != 200 if "health_after" in case else None)
                else:
                    trial.update(status="startup failed", engine_died=None)
            finally:
                finish(server, record)
                trial["oom_in_log"] = any("out of memory" in k.lower() or "OutOfMemory" in k
                                          for k in record["error_count"])
                run.update()
            say(f"{label}: {trial['status']}, engine died: {trial.get('engine_died')}, OOM in log: {trial['oom_in_log']}")
            sp.wait_gpu_idle()


def soak(run: Run) -> None:
    a, data = run.args, run.data
    data.update(samples=[], iterations=[], soak_s=a.soak_s, sample_s=a.sample_s)
    server, data["server"] = start_one(run, run.job(a.engine, a.util, 0, f"soak-{a.engine}"), min_left_s=0)
    assert server is not None  # started whatever the deadline
    t0 = time.monotonic()
    due = [t0]

    def sample(force: bool = False) -> None:
        """Every ``--sample-s``: the GPU's used memory (the server is alone on it), alive, /health."""
        now = time.monotonic()
        if now >= due[0] or force:
            due[0] = now + a.sample_s
            data["samples"].append({"t_s": round(now - t0, 1), "used_mib": sp.gpu_memory_used_mib(),
                                    "alive": server.alive(), "health": server.health(timeout_s=3)})

    try:  # from here on a stop (a signal) still stops the server and records it
        run.update()
        if not up(data["server"]):
            return
        data["pids_at_start"] = sp.group_pids(server.pid or 0)  # the API server and its engine process
        sample()
        i = 0
        while time.monotonic() - t0 < a.soak_s:
            spent = f"after {time.monotonic() - t0:.0f} s"
            if run.left() < MIN_BENCH_S or not server.alive():
                data["cut"] = (f"deadline {spent} of {a.soak_s:.0f}" if server.alive() else
                               f"server process exited {spent}")
                break
            one = bench(run, {a.engine: server}, "mix", SEED_BASE + 10 * i, {a.engine: f"soak-i{i + 1}"},
                        a.prompt_scale, run.left() - 10, sample)[a.engine]
            one.update(iteration=i + 1, t_end_s=round(time.monotonic() - t0, 1))
            data["iterations"].append(one)
            run.update()
            say(run_line(f"soak iteration {i + 1} ({one['t_end_s']:.0f} s)", one))
            check_stop()
            i += 1
        sample(force=True)
    finally:
        if "pids_at_start" in data:
            data["soak_elapsed_s"] = time.monotonic() - t0
            # vLLM restarts nothing itself: a dead engine takes its server down. Same processes at the
            # end as at the start (and /health 200 in every sample) means none died and none replaced it.
            data["pids_at_end"] = sp.group_pids(server.pid or 0) if server.alive() else []
            data["same_processes"] = data["pids_at_end"] == data["pids_at_start"]
        finish(server, data["server"])
        run.update()


# --- the flag matrix (docs/e2e.md, "The flag matrix") ------------------------------------------------

LOAD = (("chat", None), ("32k", "1"), ("eight", "2"), ("64k", "4"))  # (key, case; None: the chat burst)
RETRIES = 1  # a start other servers' memory disturbed is retried alone this many times
# offsets from --port-base, plus the server's index in the design
PORTS = {"plugin": 0, "stock": 20, "probe": 40, "retry": 60, "stock-retry": 80}
T = TypeVar("T")


def each(items: list[T], work: Callable[[T], None]) -> None:
    """``work`` for every item at once on threads, none of which starts a server (``PR_SET_PDEATHSIG``)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(items)))
    try:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
    except BaseException:  # a stop asked for (or a failure): on to stopping the servers, not waiting for the rest
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


class Matrix:
    """The matrix's records by server (``data["servers"]``) and its servers and twins once up. In order:
    the minimum budgets (the ``min`` servers started at PROBE_MB), the servers and twins (``gate``; a
    start other servers disturbed is retried alone), the load on all at once, and the end."""

    def __init__(self, run: Run) -> None:
        self.run, self.args = run, run.args
        self.configs = {c.name: c for c in md.DESIGN if c.name in run.args.servers}
        self.index = {c.name: i for i, c in enumerate(md.DESIGN)}
        self.records: dict[str, dict[str, Any]] = run.data["servers"]
        self.servers: dict[str, Server] = {}
        self.twins: dict[str, Server] = {}

    def job(self, name: str, role: str, label: str, scratch_mb: int | None, done: Done, kv_only: bool = False,
            compared: bool = False) -> Job:
        config = self.configs[name]
        spec = md.spec(config, "stock" if role.startswith("stock") else "plugin", md.util_for(config, self.args.util),
                       self.run.port(PORTS[role] + self.index[name]), scratch_mb)
        return Job(spec, label, self.run.model_dirs[name], done, kv_only, compared)

    def retry_label(self, name: str, label: str, key: str, retry: bool) -> str:
        return f"{label}-retry{len(self.records[name].get(key, []))}" if retry else label

    # 1. the minimum budget

    def probe_job(self, name: str) -> Job:
        """A start at 64 MiB: refused (the minimum is in the line) or up (64 is the minimum)."""
        return self.job(name, "probe", f"{name}-min{md.PROBE_MB}", md.PROBE_MB,
                        lambda server, start: self.probed(name, server, start))

    def probed(self, name: str, server: Server | None, start: dict[str, Any]) -> None:
        rec = self.records[name]
        result: dict[str, Any] = {"scratch_mb": md.PROBE_MB, "startup": start["startup"], "min_mb": None}
        if server is None:
            result.update(outcome="not run", error=start["startup"]["error"])
        elif up(start):
            result.update(outcome="started", min_mb=md.PROBE_MB, log=start["log"], window_s=start["window_s"])
            self.servers[name] = server
            self.run.update(rec, plugin=start, scratch_mb=md.PROBE_MB)
        else:
            finish(server, start)
            text = server.log_text()
            line, minimum = sp.refusal(text)
            result.update(log=start["log"], window_s=start["window_s"], refusal_line=line, rc=start["stop"]["rc"],
                          first_errors=start["first_errors"], outcome="refused" if minimum is not None else
                          "disturbed" if sp.disturbed(text) else "failed", min_mb=minimum)
            if result["outcome"] == "disturbed":
                result["disturbed_line"] = sp.disturbed(text)
        earlier = [*rec.get("probe_attempts", []), *([rec["probe"]] if rec.get("probe") else [])]
        self.run.update(rec, probe=result, probe_attempts=earlier)
        say(f"{name}: {md.PROBE_MB} MiB start {result['outcome']}"
            + (f": minimum {result['min_mb']} MiB" if result["min_mb"] is not None else "")
            + (f" ({result['refusal_line']})" if result.get("refusal_line") else ""))

    def find_minimums(self) -> None:
        names = [n for n, c in self.configs.items() if c.budget == "min"]
        if names:
            say(f"minimum budget: {len(names)} start(s) at {md.PROBE_MB} MiB ({', '.join(names)})")
        # together unless chained: a refused start ends before vLLM profiles memory; one disturbed is retried
        mode = "chained" if self.args.start == "chained" else "together"
        start_jobs(self.run, [self.probe_job(n) for n in names], mode)
        for _ in range(RETRIES):
            again = [n for n in names if self.records[n]["probe"].get("outcome") == "disturbed"]
            if not again or self.run.left() < MIN_SERVER_S:
                break
            say(f"retrying alone: {', '.join(again)} (a start disturbed by the others)")
            start_jobs(self.run, [self.probe_job(n) for n in again])

    def budget(self, name: str) -> int | None:
        """The server's MLA_PLANNER_SCRATCH_MB: its own, the minimum found, or None."""
        budget = self.configs[name].budget
        found = (self.records[name].get("probe") or {}).get("min_mb")
        return budget if isinstance(budget, int) else None if found is None else int(found)

    # 2. the servers and their stock twins

    def plugin_job(self, name: str, retry: bool = False) -> Job:
        rec, scratch = self.records[name], self.budget(name)

        def done(server: Server | None, start: dict[str, Any]) -> None:
            if server is not None:
                self.servers[name] = server
            self.run.update(rec, plugin=start, scratch_mb=scratch)

        return self.job(name, "retry" if retry else "plugin", self.retry_label(name, name, "attempts", retry), scratch,
                        done, compared=name in self.args.stock_twins)

    def twin_job(self, name: str, retry: bool = False) -> Job:
        """The same flags, FLASHMLA_SPARSE, no budget; stopped once its KV lines are in."""
        def done(server: Server | None, start: dict[str, Any]) -> None:
            self.run.update(self.records[name], twin=start)
            if server is not None:
                self.twins[name] = server
                if retry or self.args.start != "together":  # stopped before the next start: none is profiling
                    self.stop_twin(name)

        label = self.retry_label(name, f"{name}-stock", "twin_attempts", retry)
        return self.job(name, "stock-retry" if retry else "stock", label, None, done, kv_only=True, compared=True)

    def stop_twin(self, name: str) -> None:
        server = self.twins.pop(name, None)
        if server is not None:
            finish(server, self.records[name]["twin"])
            self.run.update()

    def start_servers(self) -> None:
        names = []
        for name, rec in self.records.items():
            if name in self.servers:  # up at 64 MiB: that was the minimum
                continue
            if self.budget(name) is None:
                probe_rec = rec.get("probe") or {}
                why = probe_rec.get("error") or (f"no minimum: the {md.PROBE_MB} MiB start {probe_rec.get('outcome')} "
                                                 "without the plugin's refusal line")
                self.run.update(rec, plugin={"startup": not_run(why)})
                continue
            names.append(name)
        twins = [n for n in self.records if n in self.args.stock_twins and (n in names or n in self.servers)]
        if names:
            say(f"starting {len(names)} server(s){f' and {len(twins)} stock twin(s)' if twins else ''} "
                f"({self.args.start}): {', '.join(names)}")
        # each server, then its twin (the order staggered and chained starts take)
        start_jobs(self.run, [job for n in self.records for job in ([self.plugin_job(n)] if n in names else [])
                              + ([self.twin_job(n)] if n in twins else [])], self.args.start)
        # Together, the twins' KV lines are in once every start is over; stopped now, before any retry and the load.
        for n in list(self.twins):
            self.stop_twin(n)
        for _ in range(RETRIES):
            again = [(n, "plugin") for n in names if self.disturbed_start(n, "plugin")]
            again += [(n, "twin") for n in twins if self.disturbed_start(n, "twin")]
            if not again or self.run.left() < MIN_SERVER_S:
                break
            say(f"retrying alone: {', '.join(f'{n} ({role})' for n, role in again)} (a start disturbed by the others)")
            for n, role in again:
                rec = self.records[n]
                if role == "plugin":
                    finish(self.servers.pop(n), rec["plugin"])
                    self.run.update(rec, attempts=[*rec.get("attempts", []), rec["plugin"]])
                    start_jobs(self.run, [self.plugin_job(n, retry=True)])
                else:
                    self.run.update(rec, twin_attempts=[*rec.get("twin_attempts", []), rec["twin"]])
                    start_jobs(self.run, [self.twin_job(n, retry=True)])

    def disturbed_start(self, name: str, key: str) -> bool:
        """The start failed, and its log says other servers' memory is why."""
        rec = self.records[name].get(key) or {}
        if rec.get("startup", {}).get("status") in ("ok", "not run", None):
            return False
        log = self.run.out / rec["log"]
        return log.is_file() and sp.disturbed(log.read_text(errors="replace")) is not None

    # 3. the load, and 4. the end

    def load(self) -> None:
        names = [n for n in self.records if n in self.servers and self.servers[n].alive()]
        for n, rec in self.records.items():
            self.run.update(rec, phases={} if n in names else {k: not_run("server not up") for k, _ in LOAD})
        if names:
            say(f"load on {len(names)} server(s) at once: chat burst of {CHAT_N}, then cases 1, 2, 4")
            each(names, lambda n: probe(self.run, n, self.servers[n], list(LOAD), self.records[n]["phases"]))

    def finish_all(self) -> None:
        for name in list(self.twins):
            self.stop_twin(name)
        each(list(self.servers), lambda n: finish(self.servers[n], self.records[n]["plugin"]))
        self.run.update()


def matrix(run: Run) -> None:
    m = Matrix(run)
    try:
        m.find_minimums()
        m.start_servers()
        m.load()
    finally:
        m.finish_all()


PLANS: dict[str, Callable[[Run], None]] = {"ab": ab, "boundary": boundary, "failrate": failrate, "soak": soak,
                                           "matrix": matrix}


# --- a phase's call ----------------------------------------------------------------------------------


def prepare_models(run: Run) -> bool:
    """Each served model folder (the matrix's: with an MTP layer where it speculates; ``""``: the one
    model of the other phases) with its tokenizer, checked; False (the error in the results) where it
    would fail the servers."""
    a, out = run.args, run.out
    if a.phase == "matrix":
        sources = {c.name: md.model_source(c, out / "variants") for c in md.DESIGN if c.name in a.servers}
    else:
        sources = {"": model_variant(MODEL_DIR, out / "variants", layers=a.layers)}
    run.model_dirs = {name: sp.served_model_dir(out / "model", source) for name, source in sources.items()}
    tokenizers: dict[str, Any] = run.data.setdefault("tokenizers", {})
    for folder in sorted(set(run.model_dirs.values())):
        try:
            tokenizers[folder.name] = facts = sp.check_tokenizer(folder)
        except Exception as exc:  # no server is started on a tokenizer that would fail them
            run.update(tokenizers, **{folder.name: {"error": error_text(exc)}})
            print(f"tokenizer check failed: {exc}", file=sys.stderr)
            return False
        say(f"{a.phase}: tokenizer ok ({facts['class']}, {facts['len']} tokens): {folder.name}")
    return True


def matrix_header(args: argparse.Namespace) -> dict[str, Any]:
    configs = [c for c in md.DESIGN if c.name in args.servers]
    gaps = md.coverage_gaps(configs)
    say(f"matrix: {len(configs)} server(s); coverage " + ("complete" if not gaps else f"gaps: {', '.join(gaps)}"))
    for c in configs:
        say(f"  {c.name}: {md.describe(c)}")
    return {"design": [asdict(c) for c in configs], "coverage_gaps": gaps,
            "axes": {k: list(v) for k, v in md.AXES.items()}, "required_pairs": list(md.REQUIRED_PAIRS),
            "servers": {c.name: {"name": c.name, "config": c.values(), "title": md.describe(c),
                                 "util": md.util_for(c, args.util), "mnbt": md.mnbt(c)} for c in configs}}


def run_phase(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"{args.phase}.json" if args.phase in ("ab", "matrix") else f"{args.phase}-{args.engine}.json")
    # ab and failrate add to an earlier call's file; the others start afresh
    data: dict[str, Any] = json.loads(path.read_text()) if args.phase in ("ab", "failrate") and path.is_file() else {}
    run_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "out" and not k.startswith("fake")}
    earlier = data.get("run", {}).get("layers")
    if data and earlier != args.layers:  # one file, one report: of one model
        print(f"{path} holds runs of another model (--layers {earlier}); give another --out", file=sys.stderr)
        return 2
    data.update(schema=1, phase=args.phase, run=run_args, finished=False, versions=versions(),
                started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                env={k: os.environ.get(k) for k in ("PYTHONPATH", *ENV_DEFAULTS, *PLANNER_VARS)},
                workload_titles=sp.WORKLOAD_TITLES, case_titles=CASE_TITLES,
                **(matrix_header(args) if args.phase == "matrix" else {}))
    run = Run(args, path, data, start)
    run.update()
    if args.log_iterations and not os.environ.get(LOGGING_VAR):
        # vLLM's iteration lines are of use with milliseconds in their stamps (step_log.py)
        step_log.write_config(out / "logging.json", plugin_steps=False)  # imports vLLM: before the variable
        os.environ[LOGGING_VAR] = str(out / "logging.json")
        say(f"{args.phase}: --log-iterations: servers log with millisecond stamps ({LOGGING_VAR}="
            f"{os.environ[LOGGING_VAR]})")
    if args.phase in ("ab", "soak"):
        # The clients' imports happen meanwhile, and the forkserver's spawn (a fork of this process)
        # is over before any port is probed: a child holding a probe socket would make it look taken.
        # A client's environment is a stock server's (run_cases' defaults, no plugin settings).
        run.clients = sp.Clients(args.fake_bench, sp.server_env(ServerSpec("stock", 0.0, 0)))
        run.clients.warm()
    if not prepare_models(run):
        run.update(finished=True)
        return 2
    say(f"{args.phase}: results in {path}")
    try:
        PLANS[args.phase](run)
        run.update(finished=True, elapsed_s=time.monotonic() - start)
    finally:
        run.closed = True
    return 0


def detached_deadline(args: argparse.Namespace) -> float:
    return float(args.soak_s + DETACHED_MARGIN_S if args.phase == "soak" else DETACHED_DEADLINE_S)


def follow(args: argparse.Namespace, argv: list[str]) -> int:
    """With --detach, this command without it, in a session and with a deadline of its own; then its
    log as it grows, until it ends or the deadline."""
    start = time.monotonic()
    log, pid_file = (args.out / f"{args.phase}-driver.{ext}" for ext in ("log", "pid"))
    if args.detach:
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), *[a for a in argv if a != "--detach"],
               "--deadline-s", str(detached_deadline(args))]  # argparse takes the last --deadline-s
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        pid_file.write_text(f"{proc.pid}\n")
        say(f"{args.phase}: detached as pid {proc.pid} (log {log})")
    if not pid_file.is_file():
        print(f"no detached {args.phase} in {args.out}", file=sys.stderr)
        return 2
    pid, shown = int(pid_file.read_text()), 0
    while True:
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        for line in lines[shown:]:
            say(f"  | {line}")
        shown = len(lines)
        # a zombie (its parent, a previous call's driver, is gone, so init reaps it soon) has ended
        if sp.proc_stat(pid)[:1] in ([], ["Z"]):
            say(f"{args.phase}: finished (pid {pid} ended)")
            return 0
        if time.monotonic() - start > args.deadline_s:
            say(f"{args.phase}: still running (pid {pid}); call again with --phase {args.phase} --follow within the "
                "machine's warm time")
            return 0
        time.sleep(5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.detach or args.follow:
        rc = follow(args, argv)
        print(report.write(args.out))
        return rc
    sp.install_cleanup()
    try:
        rc = run_phase(args)
    finally:
        text = report.write(args.out)
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
