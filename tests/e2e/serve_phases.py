"""The served phases (docs/e2e.md, "Phases" and "The flag matrix"), each a plan over serve_run's
servers, requests and bench clients: ``ab``, ``boundary``, ``failrate``, ``soak`` and ``matrix``.
Each stops its servers on the way out, its record saying how far it came.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import matrix_design as md
import serve_bench as sb
from serve_proc import Server, check_stop, disturbed, gpu_memory_used_mib, gpu_processes, group_pids, refusal, wait_gpu_idle
from report import up
from serve_run import MIN_BENCH_S, MIN_SERVER_S, Job, Run, bench, finish, probe, run_line, say, start_jobs, start_one
from step_log import stamp, step_figures

ENGINES = ("stock", "plugin")
SEED_BASE = 1000  # the recorded runs' seeds: SEED_BASE + 100 x repeat + 10 x the workload's place in serve_bench


def ab(run: Run) -> None:
    a, data = run.args, run.data
    records: dict[str, dict[str, Any]] = {}
    call = {"id": len(data.setdefault("calls", [])), "workloads": a.workloads, "repeats": a.repeats,
            "scale": a.prompt_scale, "warmup_rounds": a.warmup_rounds, "util": a.util, "at_once": a.at_once,
            "servers": records}
    data["calls"].append(call)
    # An earlier call's runs of these workloads are replaced (their step figures with them); its
    # other workloads stay.
    data["runs"] = [r for r in data.get("runs", []) if r["workload"] not in a.workloads]
    for earlier in data["calls"][:-1]:
        for w in a.workloads:
            for figures in ("steps", "step_pairs"):
                (earlier.get(figures) or {}).pop(w, None)
    servers: dict[str, Server] = {}
    try:
        # one after the other: vLLM's start-up measures the GPU's free memory, which a second server
        # starting beside it would disturb
        for k, engine in enumerate(ENGINES):
            server, records[engine] = start_one(run, Job(run.spec(engine, a.util, 100 * k), f"ab{call['id']}-{engine}",
                                                         run.model_dir), min_left_s=0)
            if server is not None:
                servers[engine] = server
            run.save()
            if not up(records[engine]):
                call["error"] = f"{engine} server did not start: {records[engine]['startup'].get('status')}"
                return
        # Warm-up rounds first, left out of the medians: a server's first run of a workload pays
        # first-use costs (on the H200, chat's TTFT p99 was 1.5-1.9 s in the first repeat and
        # 0.24-0.30 s after, in both engines), and kernels JIT-compiled to disk are compiled by the
        # first engine and loaded by the second.
        for r in range(-a.warmup_rounds, a.repeats):
            name = f"w{-r}" if r < 0 else f"r{r + 1}"
            # Which engine goes first alternates by repeat, so that a drift over the call (the
            # machine warming, stock's runs rose 150K -> 210K tokens/s over one on the H200)
            # favours neither engine's side of the per-repeat ratio. Warm-ups: stock first.
            order = ENGINES[::-1] if r > 0 and r % 2 else ENGINES
            for w in a.workloads:
                seed = SEED_BASE + 100 * r + 10 * list(sb.WORKLOADS).index(w)  # warm-ups: below SEED_BASE
                runs = {e: {"workload": w, "engine": e, "repeat": r + 1 if r >= 0 else None, "seed": seed,
                            "call": call["id"], "tag": f"ab{call['id']}-{name}-{w}-{e}", "warmup": r < 0}
                        for e in order}
                # at once, the machine's swings hit both runs alike
                for together in [runs] if w in a.at_once else [{e: runs[e]} for e in order]:
                    bench_runs(run, servers, together, w, seed)
                    for one in together.values():
                        data["runs"].append(one)
                        run.save()
                        say(run_line(one["tag"], one))
                        check_stop()
    finally:
        for engine, server in servers.items():
            finish(server, records[engine])
        run.save()
        if a.log_iterations:  # the logs are whole once the servers have stopped
            try:
                call.update(step_figures(run.out, data, call))
            except Exception as exc:  # a figure short, never the phase's own outcome hidden
                call["steps_error"] = f"{type(exc).__name__}: {exc}"
            run.save()


def bench_runs(run: Run, servers: dict[str, Server], runs: dict[str, dict[str, Any]], workload: str,
               seed: int) -> None:
    """The workload against the server of each engine in ``runs``, all at the same time (one run:
    alone), the runs filled in with their results and their window in the server logs (for
    step_log.py compare --ab); none runs if one cannot (a run alone is not a pair)."""
    def why_not(server: Server) -> dict[str, Any] | None:
        if run.left() < MIN_BENCH_S:
            return {"status": "not run", "error": f"deadline: {run.left():.0f} s left"}
        return None if server.healthy() else {"status": "not run", "error": "server not healthy", "alive": server.alive()}

    why = {e: why_not(servers[e]) for e in runs}
    if any(why.values()):
        for e, one in runs.items():
            one.update(why[e] or {"status": "not run", "error": "the other engine's run could not start"})
        return
    began = stamp()
    done = bench(run, {e: servers[e] for e in runs}, workload, seed, {e: one["tag"] for e, one in runs.items()},
                 run.args.prompt_scale, run.left() - 10)
    ended = stamp()
    for e, one in runs.items():
        one.update(done[e], window=[began, ended], healthy_after=servers[e].healthy(), at_once=len(runs) > 1)


BOUNDARY = ((32768, ("1", "2", "5")), (65536, ("4", "5")))  # (max_num_batched_tokens, cases)


def boundary(run: Run) -> None:
    a = run.args
    run.data["servers"] = []
    for k, (mnbt, cases) in enumerate(BOUNDARY):
        label = f"boundary-{a.engine}-{mnbt // 1024}k"
        server, record = start_one(run, Job(run.spec(a.engine, a.util, k, mnbt), label, run.model_dir))
        record.update(mnbt=mnbt, cases={}, case_order=list(cases))
        run.data["servers"].append(record)
        run.save()
        if server is None:
            continue
        try:
            if up(record):
                probe(run, label, server, [(case, case) for case in cases], record["cases"])
        finally:
            finish(server, record)
            run.save()
        wait_gpu_idle()


def failrate(run: Run) -> None:
    """Trials add to an earlier call's (its ``not run`` ones dropped): a rate wants more servers than
    one call starts."""
    a, data = run.args, run.data
    data["trials"] = [t for t in data.get("trials", []) if t.get("status") != "not run"]
    call = 1 + max((t.get("call", 0) for t in data["trials"]), default=0)
    for i in range(a.failrate_n):
        for util in a.failrate_utils:  # interleaved, so drift over the call hits each utilization alike
            label = f"failrate-{a.engine}-{util:.2f}-c{call}-{i + 1}"
            trial: dict[str, Any] = {"label": label, "util": util, "call": call, "index": i + 1}
            data["trials"].append(trial)
            server, record = start_one(run, Job(run.spec(a.engine, util, len(data["trials"])), label, run.model_dir))
            if server is None:
                run.update(trial, status="not run", error=record["startup"]["error"])
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
                trial["oom_in_log"] = any("out of memory" in k.lower() or "OutOfMemory" in k for k in record["error_count"])
                run.save()
            say(f"{label}: {trial['status']}, engine died: {trial.get('engine_died')}, OOM in log: {trial['oom_in_log']}")
            wait_gpu_idle()


def soak(run: Run) -> None:
    a, data = run.args, run.data
    data.update(samples=[], iterations=[], soak_s=a.soak_s, sample_s=a.sample_s)
    server, record = start_one(run, Job(run.spec(a.engine, a.util, 0), f"soak-{a.engine}", run.model_dir),
                               min_left_s=0)
    data["server"] = record
    assert server is not None  # started whatever the deadline
    t0 = time.monotonic()
    due = [t0]

    def sample(force: bool = False) -> None:
        """Every ``--sample-s``: the GPU's used memory (the server is alone on the GPU: its API and
        engine processes'), the server process, /health."""
        now = time.monotonic()
        if now < due[0] and not force:
            return
        due[0] = now + a.sample_s
        data["samples"].append({"t_s": round(now - t0, 1), "used_mib": gpu_memory_used_mib(),
                                "processes": gpu_processes(), "alive": server.alive(),
                                "health": server.health(timeout_s=3)})

    # From here on a stop (a signal, raised wherever the driver is) still stops the server and
    # records it: the results file names the server as soon as it is saved.
    try:
        run.save()
        if not up(record):
            return
        data["pids_at_start"] = group_pids(server.pid or 0)  # the API server and its engine process
        sample()
        i = 0
        while time.monotonic() - t0 < a.soak_s:
            if run.left() < MIN_BENCH_S:
                data["cut"] = f"deadline after {time.monotonic() - t0:.0f} s of {a.soak_s:.0f}"
                break
            if not server.alive():
                data["cut"] = f"server process exited after {time.monotonic() - t0:.0f} s"
                break
            tag = f"soak-i{i + 1}"
            one = bench(run, {a.engine: server}, "mix", SEED_BASE + 10 * i, {a.engine: tag}, a.prompt_scale,
                        run.left() - 10, sample)[a.engine]
            one.update(iteration=i + 1, t_end_s=round(time.monotonic() - t0, 1))
            data["iterations"].append(one)
            run.save()
            say(run_line(f"soak iteration {i + 1} ({one['t_end_s']:.0f} s)", one))
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
        finish(server, record)
        run.save()


# --- the flag matrix ---------------------------------------------------------------------------------

LOAD = (("chat", None), ("32k", "1"), ("eight", "2"), ("64k", "4"))  # (key, case; None: the chat burst)
# offsets from --port-base, plus the server's index in the design
PORTS = {"plugin": 0, "stock": 20, "probe": 40, "retry": 60, "stock-retry": 80}
T = TypeVar("T")


def each(items: list[T], work: Callable[[T], None]) -> None:
    """``work`` for every item, all at once on threads. Nothing that starts a server runs on these
    threads: its process gets SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(items)))
    try:
        for future in [pool.submit(work, item) for item in items]:
            future.result()
    except BaseException:  # a stop asked for (or a failure): on to stopping the servers, not waiting for the rest
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


class Matrix:
    """The matrix's servers, by name: their records (``data["servers"]``), and the plugin server and
    stock twin of each once started. In order: the minimum budgets (``min`` servers started at
    PROBE_MB: refused with the minimum in the line, or up, and 64 is it), the servers and their
    twins (``--start``: serve_run's ``gate``; a start other servers' memory disturbed is retried
    alone), the load on all at once, and the end (alive, then stopped, the log read).
    """

    def __init__(self, run: Run) -> None:
        self.run, self.args = run, run.args
        self.configs = {c.name: c for c in md.DESIGN if c.name in run.args.servers}
        self.index = {c.name: i for i, c in enumerate(md.DESIGN)}
        self.records: dict[str, dict[str, Any]] = run.data["servers"]
        self.servers: dict[str, Server] = {}
        self.twins: dict[str, Server] = {}

    def job(self, name: str, role: str, label: str, scratch_mb: int | None,
            done: Callable[[Server | None, dict[str, Any]], None], kv_only: bool = False, compared: bool = False) -> Job:
        config = self.configs[name]
        engine = "stock" if role.startswith("stock") else "plugin"
        spec = md.spec(config, engine, md.util_for(config, self.args.util), self.run.port(PORTS[role] + self.index[name]),
                       scratch_mb, self.args.gpu_of[name])
        return Job(spec, label, self.run.model_dirs[name], done, kv_only, compared)

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
            line, minimum = refusal(text)
            result.update(log=start["log"], window_s=start["window_s"], refusal_line=line, rc=start["stop"]["rc"],
                          first_errors=start["first_errors"])
            if minimum is not None:
                result.update(outcome="refused", min_mb=minimum)
            elif disturbed(text):
                result.update(outcome="disturbed", disturbed_line=disturbed(text))
            else:
                result.update(outcome="failed")
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
        start_jobs(self.run, [self.probe_job(n) for n in names], "chained" if self.args.start == "chained" else "together")
        for _ in range(self.args.retries):
            again = [n for n in names if self.records[n]["probe"].get("outcome") == "disturbed"]
            if not again or self.run.left() < MIN_SERVER_S:
                break
            say(f"retrying alone: {', '.join(again)} (a start disturbed by the others)")
            start_jobs(self.run, [self.probe_job(n) for n in again])

    def budget(self, name: str) -> int | None:
        """The server's MLA_PLANNER_SCRATCH_MB: its own, the minimum found, the fallback, or None."""
        budget = self.configs[name].budget
        if isinstance(budget, int):
            return budget
        found = (self.records[name].get("probe") or {}).get("min_mb")
        fallback: int | None = self.args.min_fallback_mb
        return int(found) if found is not None else fallback

    # 2. the servers and their stock twins

    def plugin_job(self, name: str, retry: bool = False) -> Job:
        rec, scratch = self.records[name], self.budget(name)

        def done(server: Server | None, start: dict[str, Any]) -> None:
            if server is not None:
                self.servers[name] = server
            self.run.update(rec, plugin=start, scratch_mb=scratch)

        label = f"{name}-retry{len(rec.get('attempts', []))}" if retry else name
        return self.job(name, "retry" if retry else "plugin", label, scratch, done,
                        compared=name in self.args.stock_twins)

    def twin_job(self, name: str, retry: bool = False) -> Job:
        """The stock twin: the same flags, FLASHMLA_SPARSE, no budget; stopped once its KV lines are in."""
        rec = self.records[name]

        def done(server: Server | None, start: dict[str, Any]) -> None:
            self.run.update(rec, twin=start)
            if server is not None:
                self.twins[name] = server
                if retry or self.args.start != "together":  # stopped before the next start: none is profiling
                    self.stop_twin(name)

        label = f"{name}-stock" + (f"-retry{len(rec.get('twin_attempts', []))}" if retry else "")
        return self.job(name, "stock-retry" if retry else "stock", label, None, done, kv_only=True, compared=True)

    def stop_twin(self, name: str) -> None:
        server = self.twins.pop(name, None)
        if server is not None:
            finish(server, self.records[name]["twin"])
            self.run.save()

    def start_servers(self) -> None:
        names = []
        for name, rec in self.records.items():
            if name in self.servers:  # up at 64 MiB: that was the minimum
                continue
            if self.budget(name) is None:
                probe_rec = rec.get("probe") or {}
                why = probe_rec.get("error") or (f"no minimum: the {md.PROBE_MB} MiB start {probe_rec.get('outcome')} "
                                                 "without the plugin's refusal line")
                self.run.update(rec, plugin={"startup": {"status": "not run", "error": why}})
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
        for _ in range(self.args.retries):
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
        return log.is_file() and disturbed(log.read_text(errors="replace")) is not None

    # 3. the load, and 4. the end

    def load(self) -> None:
        names = [n for n in self.records if n in self.servers and self.servers[n].alive()]
        for n, rec in self.records.items():
            phases = {k: {"status": "not run", "error": "server not up"} for k, _ in LOAD} if n not in names else {}
            self.run.update(rec, phases=phases)
        if names:
            say(f"load on {len(names)} server(s) at once: chat burst of {self.args.chat_n}, then cases 1, 2, 4")
            each(names, lambda n: probe(self.run, n, self.servers[n], list(LOAD), self.records[n]["phases"]))

    def finish_all(self) -> None:
        for name in list(self.twins):
            self.stop_twin(name)
        each(list(self.servers), lambda n: finish(self.servers[n], self.records[n]["plugin"]))
        self.run.save()


def matrix(run: Run) -> None:
    m = Matrix(run)
    try:
        m.find_minimums()
        m.start_servers()
        m.load()
    finally:
        m.finish_all()
