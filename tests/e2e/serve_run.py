"""What every served phase is made of: a run (its deadline, its results file, its ports), servers
started (one after the other, staggered, or all at once) and finished, requests sent to a server
with /health after each, and bench clients run against one server or several at once.

Every record is saved as it changes (``Run.update``), so a crash or the device's time limit keeps
what came before; a step that its deadline leaves no time for is recorded as not run.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import serve_bench as sb
from run_cases import CASE_MAX_TOKENS, CASE_PROMPTS, MAX_TOKENS, TOKEN_RANGE, case_prompts, write_json
from serve_proc import (KV_SIZED, SERVED_NAME, Server, ServerSpec, check_stop, free_port, log_facts, post_json,
                        server_command, server_env)
from report import up

MIN_SERVER_S = 120  # a server start (~65-95 s with CUDA graph capture) and one request
MIN_BENCH_S = 30  # a bench client takes some seconds to start (prompt sampling): start none with less left
MIN_STEP_S = 15  # a request step starts with at least this much left


def say(message: str) -> None:
    print(message, flush=True)


class Run:
    """One call of the driver: its arguments, deadline and results (``data``, in ``path``, rewritten
    after every change; the matrix's threads change it under the lock)."""

    def __init__(self, args: argparse.Namespace, path: Path, data: dict[str, Any], t0: float) -> None:
        self.args, self.path, self.data, self.t0 = args, path, data, t0
        self.out: Path = args.out
        self.deadline: float = t0 + args.deadline_s
        self.lock = threading.RLock()
        self.clients: sb.Clients | None = None  # None: no step of this phase runs a bench client
        self.model_dir = Path()  # the served model folder (the bench clients' tokenizer too)
        self.model_dirs: dict[str, Path] = {}  # the matrix's, by server

    def save(self) -> None:
        with self.lock:
            write_json(self.path, self.data)

    def update(self, target: dict[str, Any], **values: Any) -> None:
        with self.lock:
            target.update(values)
            write_json(self.path, self.data)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def port(self, k: int) -> int:
        base: int = self.args.port_base
        return free_port() if base == 0 else base + k

    def spec(self, engine: str, util: float, k: int, mnbt: int = 32768) -> ServerSpec:
        """A phase's server, with vLLM's iteration lines where the run asks for them."""
        return ServerSpec(engine, util, self.port(k), mnbt, log_iterations=self.args.log_iterations)


# --- starting servers -------------------------------------------------------------------------------

Done = Callable[[Server | None, dict[str, Any]], None]


@dataclass
class Job:
    """A server to start, and what to do with it once it is up, failed, or not started (server None)."""

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
    """Starts a job's server process. Call it from the main thread: the server's process gets SIGTERM
    when the thread that started it ends (``PR_SET_PDEATHSIG``)."""
    spec = job.spec
    server = Server(spec, server_command(spec, job.model_dir, sys.executable, run.args.fake_server),
                    server_env(spec), run.out / "logs" / f"{job.label}.log")
    record: dict[str, Any] = {"label": job.label, "engine": spec.engine, "util": spec.util, "mnbt": spec.mnbt,
                              "port": spec.port, "scratch_mb": spec.scratch_mb, "cmd": server.cmd,
                              "log": f"logs/{job.label}.log", "window_s": [run.now(), None]}
    say(f"{job.label}: starting {spec.engine} server (util {spec.util}, mnbt {spec.mnbt}, port {spec.port}) ...")
    # the start-up limit: --start-timeout-s, or 5 s before the deadline
    item = Starting(job, server, record, max(1.0, min(run.args.start_timeout_s, run.left() - 5)))
    try:
        server.start()
    except Exception as exc:
        item.state = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "elapsed_s": 0.0}
    record["pid"] = server.pid
    return item


def settle(run: Run, job: Job, server: Server | None, record: dict[str, Any]) -> None:
    """The start is over: its record gets the log's facts, and the job's ``done`` the server."""
    if server is not None:
        record.update(log_facts(server.log_text()))
        s, kv = record["startup"], record.get("kv_cache_memory_gib")
        say(f"{job.label}: {s['status']} after {s['elapsed_s']:.0f} s" + (f", KV cache {kv} GiB" if kv is not None else "")
            + (f", {record['planner_line_count']} mla-planner log lines" if job.spec.engine == "plugin" else ""))
    if job.done is not None:
        job.done(server, record)


def gate(item: Starting, mode: str, following: Job | None) -> bool:
    """Whether the next start of ``item``'s chain, ``following``, may go: ``chained``, once a server is
    up (a twin: once its KV cache is sized); ``staggered``, once either has sized its KV cache (vLLM's
    memory profiling is over, the cache is allocated right after), except that a start whose KV
    figure is compared (a twin, or a server that has one) waits until the server before it is up: on
    vLLM 0.33 that server captures its CUDA graphs after its KV line, and whatever it allocates
    during the next one's profiling counts as the next one's; ``together``, each start is a chain
    of its own."""
    if mode == "together" or item.state is not None:
        return True
    sized = KV_SIZED in item.server.log_text()
    if item.job.kv_only:
        return sized
    return sized and mode == "staggered" and not (following is not None and following.compared)


def start_jobs(run: Run, jobs: list[Job], mode: str = "chained", min_left_s: float = MIN_SERVER_S) -> list[dict[str, Any]]:
    """Starts ``jobs``' servers: one chain per GPU (a spec's ``gpu``), each start of a chain once the
    one before it passes its ``gate``, the chains side by side (``together``: every job a chain of
    its own); no start with less than ``min_left_s`` left. Every server is spawned and polled on this
    (the main) thread. Returns the jobs' start records, in order: each with its window in the run's
    seconds (spawn to gate, or to settled) and its ``startup``, also handed to the job's ``done``."""
    if mode == "together":
        chains = [[job] for job in jobs]
    else:
        gpus = sorted({job.spec.gpu for job in jobs}, key=lambda g: -1 if g is None else g)
        chains = [[job for job in jobs if job.spec.gpu == g] for g in gpus]
    records: dict[int, dict[str, Any]] = {}
    current: list[Starting | None] = [None] * len(chains)
    released: list[Starting] = []  # past their gate, awaiting /health
    while True:
        check_stop()
        for ready in list(released):  # first, so a twin sized is stopped before its chain's next start
            ready.state = ready.state or ready.server.start_state(ready.limit_s)
            if ready.state is not None:
                released.remove(ready)
                ready.record["startup"] = ready.state
                if ready.record["window_s"][1] is None:
                    ready.record["window_s"][1] = run.now()
                settle(run, ready.job, ready.server, ready.record)
        for k, chain in enumerate(chains):
            if current[k] is None and chain:
                job = chain.pop(0)
                if run.left() < min_left_s:  # nothing started that could not be up and used in time
                    records[id(job)] = {"label": job.label, "engine": job.spec.engine, "util": job.spec.util,
                                        "startup": {"status": "not run", "error": f"deadline: {run.left():.0f} s left"}}
                    settle(run, job, None, records[id(job)])
                    continue
                current[k] = spawn(run, job)
            item = current[k]
            if item is None:
                continue
            records[id(item.job)] = item.record
            item.state = item.state or item.server.start_state(item.limit_s)
            if gate(item, mode, chain[0] if chain else None):
                current[k] = None
                if mode != "together":
                    item.record["window_s"][1] = run.now()
                if item.job.kv_only and item.state is None:  # sized: all a twin is for
                    alive = item.server.alive()
                    item.state = {"status": "ok" if alive else "exited", "until": "KV cache sized",
                                  "elapsed_s": time.monotonic() - item.server.t0,
                                  **({} if alive else {"log_tail": item.server.log_tail()})}
                released.append(item)
        if not released and not any(current) and not any(chains):
            return [records[id(job)] for job in jobs if id(job) in records]
        time.sleep(0.5)


def start_one(run: Run, job: Job, min_left_s: float = MIN_SERVER_S) -> tuple[Server | None, dict[str, Any]]:
    """One server, started and awaited; None if it was not started."""
    got: list[Server | None] = [None]

    def keep(server: Server | None, record: dict[str, Any]) -> None:
        got[0] = server
        if job.done is not None:
            job.done(server, record)

    (record,) = start_jobs(run, [Job(job.spec, job.label, job.model_dir, keep)], min_left_s=min_left_s)
    return got[0], record


def finish(server: Server, record: dict[str, Any]) -> None:
    """A server's end: alive and /health, the plugin's metrics, the stop, then its whole log's facts."""
    record["alive_at_end"] = server.alive()
    record["health_at_end"] = server.health() if server.alive() else None
    if server.alive():  # the plugin's metrics, where vLLM serves a worker's (PROMETHEUS_MULTIPROC_DIR set)
        record["plugin_metrics"] = plugin_metrics(server.url)
    record["stop"] = server.stop()
    record.update(log_facts(server.log_text()))
    if record["stop"].get("left_running"):
        say(f"{server.log_path.stem}: WARNING: processes of the server's group still running after SIGKILL")


def plugin_metrics(url: str) -> list[str]:
    """The ``mla_planner_*`` samples of the server's ``/metrics``; none where it serves none."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return []
    return [line for line in text.splitlines() if line.startswith("mla_planner_")]


# --- requests ---------------------------------------------------------------------------------------
# Plain HTTP POSTs: run_cases' cases (token-id prompts, as the in-process runs draw them) and the
# matrix's chat burst. A case's prompts go at once, each on its own thread, a few milliseconds apart
# in the case's order, so the server receives them as one submission (case 3's 32K blocker first).
# Throughput is not measured here: that is ``vllm bench serve``'s job (serve_bench.py).

STAGGER_S = 0.02
CHAT_PREFIX, CHAT_LEN, CHAT_MAX_TOKENS, CHAT_SEED = 256, (300, 1100), (16, 256), 2900



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


def completion_body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens back (ignore_eos is vLLM's extension of the API)."""
    return {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def one_request(url: str, ids: list[int], max_tokens: int, delay_s: float, timeout_s: float) -> dict[str, Any]:
    time.sleep(delay_s)
    t0 = time.perf_counter()
    status, body, error = post_json(url + "/v1/completions", completion_body(ids, max_tokens), timeout_s)
    usage = (body or {}).get("usage") or {}
    tokens = usage.get("completion_tokens")
    ok = status == 200 and tokens == max_tokens
    if status == 200 and not ok:
        error = f"{tokens} tokens back, {max_tokens} asked"
    return {"prompt_len": len(ids), "status": status, "ok": ok, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": tokens, "elapsed_s": time.perf_counter() - t0, "error": error}


def send_all(url: str, prompts: list[tuple[list[int], int]], stagger_s: float, timeout_s: float) -> dict[str, Any]:
    """Every prompt at once, each on its own thread (``stagger_s`` apart), every answer awaited (or
    its error recorded): counts, and the first few errors."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(one_request, url, ids, max_tokens, i * stagger_s, timeout_s)
                   for i, (ids, max_tokens) in enumerate(prompts)]
        requests = [f.result() for f in futures]
    errors: list[str] = []
    for r in requests:
        if not r["ok"] and str(r["error"]) not in errors and len(errors) < 5:
            errors.append(str(r["error"]))
    ok = sum(r["ok"] for r in requests)
    return {"status": "ok" if ok == len(requests) else "error", "error": errors[0] if errors else None,
            "errors": errors, "n_requests": len(requests), "requests_ok": ok, "elapsed_s": time.perf_counter() - t0,
            "prompt_tokens": sum(len(ids) for ids, _ in prompts), "max_tokens": sum(m for _, m in prompts),
            "requests": requests}


def run_case(url: str, case: str, timeout_s: float) -> dict[str, Any]:
    """One of run_cases' cases: its prompts as one submission."""
    max_tokens = CASE_MAX_TOKENS.get(case, MAX_TOKENS)
    result = send_all(url, [(ids, max_tokens) for ids in case_prompts(case)], STAGGER_S, timeout_s)
    return {**result, "prompt_lens": CASE_PROMPTS[case], "max_tokens": max_tokens}


def chat_burst(url: str, n: int, timeout_s: float) -> dict[str, Any]:
    """``n`` chat completions at once (``chat_prompts``); the requests themselves are not kept."""
    result = send_all(url, chat_prompts(n), 0.0, timeout_s)
    del result["requests"]
    return result



def probe(run: Run, name: str, server: Server, steps: list[tuple[str, str | None]], results: dict[str, Any]) -> None:
    """Each step of ``steps`` on ``server`` in turn, into ``results[key]``: a case of run_cases' sent
    over HTTP, or (case None) the chat burst; /health after each. A step the deadline, a dead
    server or one not healthy leaves no chance is not run."""
    for key, case in steps:
        check_stop()
        if run.left() < MIN_STEP_S:
            result: dict[str, Any] = {"status": "not run", "error": f"deadline: {run.left():.0f} s left"}
        elif not server.alive():
            result = {"status": "not run", "error": "server process exited"}
        elif server.health() != 200:
            result = {"status": "not run", "error": "server not healthy"}
        else:
            run.update(results, **{key: {"status": "started", "at_s": run.now()}})
            timeout = max(5.0, min(run.args.request_timeout_s, run.left() - 5))
            result = chat_burst(server.url, run.args.chat_n, timeout) if case is None else \
                run_case(server.url, case, timeout)
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
    """One workload's clients against every server of ``servers`` (by engine) at the same time: per
    engine, per client its summary, and the workload combined."""
    assert run.clients is not None, "a phase that runs bench clients gets a Clients"
    clients = sb.WORKLOADS[workload]
    cmds, results = [], []
    for engine, server in servers.items():
        meta = {"engine": engine, "workload": workload, "tag": tags[engine]}
        for c in clients:
            results.append(run.out / "bench" / f"{tags[engine]}-{c.label}.json")
            cmds.append(sb.bench_command(c, python=sys.executable, base_url=server.url, tokenizer=run.model_dir,
                                         seed=seed, result=results[-1], scale=scale, metadata=meta,
                                         fake=run.clients.fake))
    outcomes = sb.run_clients(run.clients, cmds, results, [r.with_suffix(".log") for r in results], timeout_s, tick)
    records = {}
    for k, engine in enumerate(servers):
        mine = outcomes[k * len(clients):(k + 1) * len(clients)]
        summaries = [o["result"] for o in mine if o["result"] is not None]
        ok = len(summaries) == len(mine)
        whole = summaries[0] if len(mine) == 1 and ok else sb.combined(summaries) if ok else {}
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
