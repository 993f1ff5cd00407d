"""The serving driver's four phases. Each fills its phase's JSON (``data``) and calls ``save`` after
every step, so a crash or the device's time limit keeps what came before; each stops starting work
when its deadline comes (what it cut is recorded as not run) and stops its servers on the way out.

- ``ab``: stock and plugin servers up at once (started one after the other: vLLM's start-up
  measures the GPU's free memory, which a second server starting beside it would disturb), then the
  workloads in interleaved repeats after warm-up rounds (``--warmup-rounds``, left out of the
  medians): for each repeat, each workload, both engines with the same seed, stock first in odd
  repeats, the plugin first in even ones; the workloads of ``--at-once`` both at the same time.
- ``boundary``: one server at 0.95 (plugin unless ``--engine stock``) through run_cases' cases 1, 2
  and 5, then one at max_num_batched_tokens 65536 through cases 4 and 5: ok or error per case, and
  /health after each.
- ``failrate``: fresh servers (stock unless ``--engine plugin``) at each utilization in turn: start,
  one 32K prompt, did it finish, did the engine die, stop. Trials add up over calls.
- ``soak``: one server (plugin unless ``--engine stock``) at 0.95, the mix workload over and over for
  ``--soak-s``, sampling the GPU's used memory (nvidia-smi; the server is the only process on the
  GPU, so this is its API and engine processes' memory), /health and its process meanwhile.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import serve_bench as sb
from serve_proc import (Server, ServerSpec, check_stop, free_port, gpu_memory_used_mib, gpu_processes, group_pids,
                        log_facts, server_command, server_env, wait_gpu_idle)
from serve_requests import run_case
from step_log import stamp, step_figures

Save = Callable[[], None]
MIN_BENCH_S = 30  # a bench client takes some seconds to start (prompt sampling): start none with less left
MIN_SERVER_S = 120  # a server start (~65-95 s with CUDA graph capture) and one request
SEED_BASE = 1000


def say(message: str) -> None:
    print(message, flush=True)


@dataclass
class Ctx:
    out: Path
    python: str
    model_dir: Path
    deadline: float  # time.monotonic() by which the phase ends
    port_base: int = 8100  # 0: any free ports
    scratch_mb: int | None = None
    tp: int = 1  # every server's --tensor-parallel-size
    log_iterations: bool = False  # every server's --enable-logging-iteration-details
    start_timeout_s: float = 240
    request_timeout_s: float = 120
    fake_server: bool = False
    clients: sb.Clients | None = None  # None: none of this phase's steps runs a bench client

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def port(self, k: int) -> int:
        return free_port() if self.port_base == 0 else self.port_base + k

    def spec(self, engine: str, util: float, k: int, mnbt: int = 32768) -> ServerSpec:
        return ServerSpec(engine, util, self.port(k), mnbt, scratch_mb=self.scratch_mb if engine == "plugin" else None,
                          tp=self.tp, log_iterations=self.log_iterations)


def start_server(ctx: Ctx, spec: ServerSpec, label: str) -> tuple[Server, dict[str, Any]]:
    """Starts a server and waits for /health; the record says how that went."""
    server, record = spawn_server(ctx, spec, label)
    if "startup" not in record:
        await_server(ctx, server, record)
    return server, record


def spawn_server(ctx: Ctx, spec: ServerSpec, label: str) -> tuple[Server, dict[str, Any]]:
    """Starts a server's process; the record has a ``startup`` only if it could not. Call it from the
    main thread: the server's process gets SIGTERM when the thread that started it ends
    (``PR_SET_PDEATHSIG``), so several servers are spawned here and awaited on threads."""
    server = Server(spec, server_command(spec, ctx.model_dir, ctx.python, ctx.fake_server), server_env(spec),
                    ctx.out / "logs" / f"{label}.log")
    record: dict[str, Any] = {"label": label, "engine": spec.engine, "util": spec.util, "mnbt": spec.mnbt,
                              "port": spec.port, "scratch_mb": spec.scratch_mb, "cmd": server.cmd,
                              "log": f"logs/{label}.log"}
    say(f"{label}: starting {spec.engine} server (util {spec.util}, mnbt {spec.mnbt}, port {spec.port}) ...")
    try:
        server.start()
    except Exception as exc:
        record["startup"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        say(f"{label}: could not start: {exc}")
        return server, record
    record["pid"] = server.pid
    return server, record


def await_server(ctx: Ctx, server: Server, record: dict[str, Any]) -> None:
    """Until the spawned server answers /health (or exits, or times out); its log's facts."""
    spec, label = server.spec, record["label"]
    record["startup"] = server.wait_healthy(max(1.0, min(ctx.start_timeout_s, ctx.left() - 5)))
    record.update(log_facts(server.log_text()))
    s = record["startup"]
    kv = record.get("kv_cache_memory_gib")
    say(f"{label}: {s['status']} after {s['elapsed_s']:.0f} s" + (f", KV cache {kv} GiB" if kv is not None else "")
        + (f", {len(record['planner_lines'])} mla-planner log lines" if spec.engine == "plugin" else ""))


def finish_server(server: Server, record: dict[str, Any]) -> None:
    """Health at the end, then stop; errors the whole log shows."""
    record["alive_at_end"] = server.alive()
    record["health_at_end"] = server.health() if server.alive() else None
    if server.alive():  # the plugin's metrics, where vLLM serves a worker's (PROMETHEUS_MULTIPROC_DIR set)
        record["plugin_metrics"] = plugin_metrics(server.url)
    record["stop"] = server.stop()
    record.update(log_facts(server.log_text()))
    if record["stop"].get("left_running"):
        say(f"{record['label']}: WARNING: processes of the server's group still running after SIGKILL")


def plugin_metrics(url: str) -> list[str]:
    """The ``mla_planner_*`` samples of the server's ``/metrics``; none where it serves none."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return []
    return [line for line in text.splitlines() if line.startswith("mla_planner_")]


def server_up(record: dict[str, Any]) -> bool:
    return bool(record.get("startup", {}).get("status") == "ok")


# --- ab ------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """One workload's bench clients against one server, ready to start."""

    clients: tuple[sb.Client, ...]
    cmds: list[list[str]]
    results: list[Path]
    logs: list[Path]


def bench_for(ctx: Ctx, server: Server, workload: str, seed: int, tag: str, scale: float) -> Bench:
    clients = sb.WORKLOADS[workload]
    results = [ctx.out / "bench" / f"{tag}-{c.label}.json" for c in clients]
    meta = {"engine": server.spec.engine, "workload": workload, "tag": tag}
    assert ctx.clients is not None, "a phase that runs bench clients gets a Clients"
    cmds = [sb.bench_command(c, python=ctx.python, base_url=server.url, tokenizer=ctx.model_dir, seed=seed,
                             result=r, scale=scale, metadata=meta, fake=ctx.clients.fake)
            for c, r in zip(clients, results)]
    return Bench(clients, cmds, results, [ctx.out / "bench" / f"{tag}-{c.label}.log" for c in clients])


def bench_record(bench: Bench, seed: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client its summary, and the workload combined."""
    by_label = {c.label: run for c, run in zip(bench.clients, runs)}
    ok = all(run["result"] is not None for run in runs)
    summaries = [run["result"] for run in runs if run["result"] is not None]
    whole = summaries[0] if len(bench.clients) == 1 and summaries else sb.combined(summaries) if ok else {}
    return {"status": "ok" if ok else "error", "seed": seed, "clients": by_label, "combined": whole,
            "error": next((run["error"] for run in runs if run["error"]), None)}


def bench_workload(ctx: Ctx, server: Server, workload: str, seed: int, tag: str, scale: float,
                   timeout_s: float, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """One workload's clients against ``server``."""
    engine = server.spec.engine
    return bench_at_once(ctx, {engine: server}, workload, seed, {engine: tag}, scale, timeout_s, tick)[engine]


def bench_at_once(ctx: Ctx, servers: dict[str, Server], workload: str, seed: int, tags: dict[str, str],
                  scale: float, timeout_s: float, tick: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    """One workload's clients against every server of ``servers`` at the same time: per engine, per
    client its summary, and the workload combined."""
    benches = {e: bench_for(ctx, server, workload, seed, tags[e], scale) for e, server in servers.items()}
    assert ctx.clients is not None
    runs = sb.run_clients(ctx.clients, [c for b in benches.values() for c in b.cmds],
                          [r for b in benches.values() for r in b.results],
                          [log for b in benches.values() for log in b.logs], timeout_s, tick)
    records, k = {}, 0
    for engine, bench in benches.items():
        records[engine] = bench_record(bench, seed, runs[k:k + len(bench.cmds)])
        k += len(bench.cmds)
    return records


def run_line(tag: str, run: dict[str, Any]) -> str:
    c = run.get("combined") or {}
    if run["status"] != "ok":
        return f"{tag}: {run['status']}: {run.get('error')}"
    first = next(iter(run["clients"].values()))["result"]
    return (f"{tag}: {c.get('completed')} done, {c.get('failed')} failed, out {c.get('output_throughput', 0):,.0f} "
            f"tok/s, total {c.get('total_token_throughput', 0):,.0f} tok/s, TTFT p50 {first.get('p50_ttft_ms') or 0:.0f} "
            f"ms, TPOT p50 {first.get('p50_tpot_ms') or 0:.1f} ms ({c.get('duration', 0):.0f} s)")


ENGINES = ("stock", "plugin")


def not_run(ctx: Ctx, server: Server) -> dict[str, Any] | None:
    """Why a bench run against ``server`` is not started now, as the run's fields; None if it may be."""
    if ctx.left() < MIN_BENCH_S:
        return {"status": "not run", "error": f"deadline: {ctx.left():.0f} s left"}
    if not server.healthy():
        return {"status": "not run", "error": "server not healthy", "alive": server.alive()}
    return None


def bench_runs(ctx: Ctx, servers: dict[str, Server], runs: dict[str, dict[str, Any]], workload: str, seed: int,
               scale: float) -> None:
    """The workload against the server of each engine in ``runs``, all at the same time (one run:
    alone), the runs filled in with their results and their window in the server logs (for
    step_log.py compare --ab); none runs if one cannot (a run alone is not a pair)."""
    why = {e: not_run(ctx, servers[e]) for e in runs}
    if any(why.values()):
        for e, run in runs.items():
            run.update(why[e] or {"status": "not run", "error": "the other engine's run could not start"})
        return
    began = stamp()
    done = bench_at_once(ctx, {e: servers[e] for e in runs}, workload, seed, {e: run["tag"] for e, run in runs.items()},
                         scale, ctx.left() - 10)
    ended = stamp()
    for e, run in runs.items():
        run.update(done[e], window=[began, ended], healthy_after=servers[e].healthy(), at_once=len(runs) > 1)


def phase_ab(ctx: Ctx, data: dict[str, Any], save: Save, *, util: float, workloads: list[str], repeats: int,
             scale: float, warmup_rounds: int, at_once: tuple[str, ...] = ()) -> None:
    records: dict[str, dict[str, Any]] = {}
    call = {"id": len(data.setdefault("calls", [])), "workloads": workloads, "repeats": repeats, "scale": scale,
            "warmup_rounds": warmup_rounds, "util": util, "at_once": list(at_once), "servers": records}
    data["calls"].append(call)
    # An earlier call's runs of these workloads are replaced (their step figures with them); its
    # other workloads stay.
    data["runs"] = [r for r in data.get("runs", []) if r["workload"] not in workloads]
    for earlier in data["calls"][:-1]:
        for w in workloads:
            for figures in ("steps", "step_pairs"):
                (earlier.get(figures) or {}).pop(w, None)
    servers: dict[str, Server] = {}
    try:
        for k, engine in enumerate(ENGINES):
            server, record = start_server(ctx, ctx.spec(engine, util, 100 * k), f"ab{call['id']}-{engine}")
            servers[engine] = server
            records[engine] = record
            save()
            if not server_up(record):
                call["error"] = f"{engine} server did not start: {record['startup'].get('status')}"
                return
        # Warm-up rounds first, left out of the medians: a server's first run of a workload pays
        # first-use costs (on the H200, chat's TTFT p99 was 1.5-1.9 s in the first repeat and
        # 0.24-0.30 s after, in both engines), and kernels JIT-compiled to disk are compiled by the
        # first engine and loaded by the second.
        for r in range(-warmup_rounds, repeats):
            name = f"w{-r}" if r < 0 else f"r{r + 1}"
            # Which engine goes first alternates by repeat, so that a drift over the call (the
            # machine warming, stock's runs rose 150K -> 210K tokens/s over one on the H200)
            # favours neither engine's side of the per-repeat ratio. Warm-ups: stock first.
            order = ENGINES[::-1] if r > 0 and r % 2 else ENGINES
            for w in workloads:
                together = w in at_once
                seed = SEED_BASE + 100 * r + 10 * list(sb.WORKLOADS).index(w)  # warm-ups: below SEED_BASE
                runs: dict[str, dict[str, Any]] = {
                    e: {"workload": w, "engine": e, "repeat": r + 1 if r >= 0 else None, "seed": seed,
                        "call": call["id"], "tag": f"ab{call['id']}-{name}-{w}-{e}", "warmup": r < 0}
                    for e in order}
                if together:  # both at the same time: the machine's swings hit both runs alike
                    bench_runs(ctx, servers, runs, w, seed, scale)
                for engine in order:
                    run = runs[engine]
                    if not together:
                        bench_runs(ctx, servers, {engine: run}, w, seed, scale)
                    data["runs"].append(run)
                    save()
                    say(run_line(run["tag"], run))
                    check_stop()
    finally:
        for engine, server in servers.items():
            finish_server(server, records[engine])
        save()
        if ctx.log_iterations:  # the logs are whole once the servers have stopped
            try:
                call.update(step_figures(ctx.out, data, call))
            except Exception as exc:  # a figure short, never the phase's own outcome hidden
                call["steps_error"] = f"{type(exc).__name__}: {exc}"
            save()


# --- boundary and failrate -----------------------------------------------------------------------


def probe_case(ctx: Ctx, server: Server, case: str) -> dict[str, Any]:
    result = run_case(server.url, case, ctx.request_timeout_s)
    check_stop()
    if result["status"] != "ok":
        time.sleep(2)  # a dying engine takes a moment to take the server down
    result["alive_after"] = server.alive()
    result["health_after"] = server.health() if server.alive() else None
    return result


def phase_boundary(ctx: Ctx, data: dict[str, Any], save: Save, *, engine: str, util: float) -> None:
    stages = ((32768, ("1", "2", "5")), (65536, ("4", "5")))
    data["servers"] = []
    for k, (mnbt, cases) in enumerate(stages):
        label = f"boundary-{engine}-{mnbt // 1024}k"
        if ctx.left() < MIN_SERVER_S:
            data["servers"].append({"label": label, "engine": engine, "util": util, "mnbt": mnbt,
                                    "startup": {"status": "not run", "error": f"deadline: {ctx.left():.0f} s left"},
                                    "cases": {}, "case_order": list(cases)})
            save()
            continue
        server, record = start_server(ctx, ctx.spec(engine, util, k, mnbt), label)
        record.update(cases={}, case_order=list(cases))
        data["servers"].append(record)
        save()
        try:
            for case in cases:
                if not server_up(record):
                    break
                if ctx.left() < 10:
                    record["cases"][case] = {"status": "not run", "error": "deadline"}
                elif not server.alive():
                    record["cases"][case] = {"status": "not run", "error": "server process exited"}
                else:
                    record["cases"][case] = {"status": "started"}
                    save()
                    record["cases"][case] = probe_case(ctx, server, case)
                result = record["cases"][case]
                save()
                say(f"{label} case {case}: {result['status']}" + (f" ({str(result.get('error'))[:160]})"
                    if result.get("error") else "") + f"; health after: {result.get('health_after')}")
        finally:
            finish_server(server, record)
            save()
        wait_gpu_idle()


def phase_failrate(ctx: Ctx, data: dict[str, Any], save: Save, *, engine: str, utils: list[float], n: int) -> None:
    """Trials add to an earlier call's (its ``not run`` ones dropped): a rate wants more servers than
    one call starts."""
    data["trials"] = [t for t in data.get("trials", []) if t.get("status") != "not run"]
    call = 1 + max((t.get("call", 0) for t in data["trials"]), default=0)
    for i in range(n):
        for util in utils:  # interleaved, so drift over the call hits each utilization alike
            label = f"failrate-{engine}-{util:.2f}-c{call}-{i + 1}"
            trial: dict[str, Any] = {"label": label, "util": util, "call": call, "index": i + 1}
            data["trials"].append(trial)
            if ctx.left() < MIN_SERVER_S:
                trial.update(status="not run", error=f"deadline: {ctx.left():.0f} s left")
                save()
                continue
            server, record = start_server(ctx, ctx.spec(engine, util, len(data["trials"])), label)
            trial["server"] = record
            try:
                if server_up(record):
                    trial["case"] = probe_case(ctx, server, "1")
                    trial["status"] = trial["case"]["status"]
                    trial["engine_died"] = trial["case"]["health_after"] != 200
                else:
                    trial.update(status="startup failed", engine_died=None)
            finally:
                finish_server(server, record)
                trial["oom_in_log"] = any("out of memory" in k.lower() or "OutOfMemory" in k for k in record["errors"])
                save()
            say(f"{label}: {trial['status']}, engine died: {trial.get('engine_died')}, OOM in log: {trial['oom_in_log']}")
            wait_gpu_idle()


# --- soak ----------------------------------------------------------------------------------------


def phase_soak(ctx: Ctx, data: dict[str, Any], save: Save, *, engine: str, util: float, soak_s: float,
               sample_s: float, scale: float) -> None:
    server, record = start_server(ctx, ctx.spec(engine, util, 0), f"soak-{engine}")
    data.update(server=record, samples=[], iterations=[], soak_s=soak_s, sample_s=sample_s)
    t0 = time.monotonic()
    due = [t0]

    def sample(force: bool = False) -> None:
        """Every ``sample_s``: the GPU's used memory, the server process, /health."""
        now = time.monotonic()
        if now < due[0] and not force:
            return
        due[0] = now + sample_s
        data["samples"].append({"t_s": round(now - t0, 1), "used_mib": gpu_memory_used_mib(),
                                "processes": gpu_processes(), "alive": server.alive(),
                                "health": server.health(timeout_s=3)})

    # From here on a stop (a signal, raised wherever the driver is) still stops the server and
    # records it: the results file names the server as soon as it is saved.
    try:
        save()
        if not server_up(record):
            return
        data["pids_at_start"] = group_pids(server.pid or 0)  # the API server and its engine process
        sample()
        i = 0
        while time.monotonic() - t0 < soak_s:
            if ctx.left() < MIN_BENCH_S:
                data["cut"] = f"deadline after {time.monotonic() - t0:.0f} s of {soak_s:.0f}"
                break
            if not server.alive():
                data["cut"] = f"server process exited after {time.monotonic() - t0:.0f} s"
                break
            seed = SEED_BASE + 10 * i
            run = bench_workload(ctx, server, "mix", seed, f"soak-i{i + 1}", scale, ctx.left() - 10, sample)
            run.update(iteration=i + 1, t_end_s=round(time.monotonic() - t0, 1))
            data["iterations"].append(run)
            save()
            say(run_line(f"soak iteration {i + 1} ({run['t_end_s']:.0f} s)", run))
            check_stop()
            i += 1
        sample(force=True)
    finally:
        if "pids_at_start" in data:
            data["soak_elapsed_s"] = time.monotonic() - t0
            # vLLM restarts nothing itself: a dead engine takes its server down. Same processes at the
            # end as at the start (and /health 200 in every sample) means none died and none replaced it.
            data["pids_at_end"] = group_pids(server.pid or 0) if server.alive() else []
            data["same_processes"] = data["pids_at_end"] == data["pids_at_start"]
        finish_server(server, record)
        save()
