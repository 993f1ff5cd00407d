"""The serving driver (docs/e2e.md, "The serve driver" and "The flag matrix"): stock FLASHMLA_SPARSE
against the plugin through ``vllm serve``, and the plugin under the flag matrix's configurations.

    export PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath)
    python3 tests/e2e/run_serve.py --phase ab --out /tmp/serve          # or boundary, failrate, soak, matrix
    python3 tests/e2e/run_serve.py --phase soak --detach --out /tmp/serve
    python3 tests/e2e/run_serve.py --phase soak --follow --out /tmp/serve   # the next call
    python3 tests/e2e/run_serve.py --report-only /tmp/serve

A phase (serve_phases.py) ends by ``--deadline-s`` and writes ``DIR/<phase>[-<engine>].json``,
rewritten after every step, server logs under ``DIR/logs``, bench results under ``DIR/bench``, and
its report (report.py): ``DIR/serve.md``, or ``DIR/matrix.md`` for the matrix. A phase longer
than a device call runs ``--detach``ed in a session of its own, which the machine keeps while it
stays warm; ``--follow`` in the next call picks it up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import matrix_design as md
import report
import serve_bench
import serve_phases
import step_log
from run_cases import CASE_TITLES, ENV_DEFAULTS, MODEL_DIR, PLANNER_VARS, model_variant, versions
from serve_proc import client_env, install_cleanup
from serve_run import Run, say
from serve_tokenizer import check_tokenizer, served_model_dir

PHASES: dict[str, Callable[[Run], None]] = {"ab": serve_phases.ab, "boundary": serve_phases.boundary,
                                            "failrate": serve_phases.failrate, "soak": serve_phases.soak,
                                            "matrix": serve_phases.matrix}
# ab's two servers share the GPU. 0.40 each, not 0.45: stock's step of 32K FP8 tokens allocates
# ~14 GiB nobody reserved, beyond its share; at 0.45 each (14 GiB left over) the H200 measured stock's
# process at 76.4 GiB of its 62.9 GiB share, and the plugin's server, within its own, died of it.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--phase", choices=list(PHASES), help="what to run (one phase a call)")
    add("--out", type=Path, help="results folder (kept: later calls add to it)")
    add("--deadline-s", type=float, default=540, help="the phase ends by then (default 540)")
    add("--detach", action="store_true", help="run the phase in a session of its own (its own deadline), "
                                              "follow it until --deadline-s")
    add("--follow", action="store_true", help="follow the phase detached in DIR until it ends or --deadline-s")
    add("--report-only", type=Path, metavar="DIR", help="only write DIR's reports from its JSON (the ab step "
                                                        "figures as the run stored them: step_log.py compare "
                                                        "--ab DIR counts them again)")
    add("--engine", choices=("stock", "plugin"), help="boundary, soak: default plugin; failrate: default stock")
    add("--util", type=float, help="--gpu-memory-utilization (ab: 0.40 each; boundary, soak: 0.95; matrix: 0.09, "
                                   "0.04 with --stock-twins --start together, plus each server's budget share)")
    add("--log-iterations", action="store_true", help="every server logs each engine step (vLLM's "
                                                      "--enable-logging-iteration-details), for step_log.py compare")
    add("--layers", type=int, help="the model's hidden layers (default: its config's, 2; more put more of each step "
                                   "in attention, as in the real model's 61)")
    add("--workloads", default="long,chat,mix", help=f"ab: of {', '.join(serve_bench.WORKLOADS)}")
    add("--repeats", type=int, default=3, help="ab: interleaved repeats per engine and workload")
    add("--warmup-rounds", type=int, default=1, help="ab: rounds of every workload on both servers before the "
        "repeats, left out of the medians (default 1: a server's first run of a workload pays first-use costs)")
    add("--at-once", nargs="?", const="*", default="", metavar="WORKLOADS",
        help="ab: these workloads (none given: all of the call's) run both engines' runs of a repeat at the same "
             "time, so the machine's swings of seconds hit both alike (for chat's per-step comparison); the others "
             "one after the other")
    add("--prompt-scale", type=float, default=1.0, help="ab, soak: scales every client's prompt count")
    add("--failrate-utils", default="0.90,0.95", help="failrate: utilizations, in turn")
    add("--failrate-n", type=int, default=2, help="failrate: servers per utilization")
    add("--soak-s", type=float, default=600, help="soak: how long to repeat the mix (default 600)")
    add("--sample-s", type=float, default=5, help="soak: seconds between memory samples")
    add("--servers", help=f"matrix: of {','.join(c.name for c in md.DESIGN)} (default: all; a subset's coverage "
                          "gaps are reported)")
    add("--stock-twins", nargs="?", const="all", default="", help="matrix: beside each server (or each of the "
        "comma-separated NAMES given) its stock twin (FLASHMLA_SPARSE, same flags), for its KV cache lines")
    add("--start", choices=("staggered", "together", "chained"), default="staggered",
        help="matrix: staggered (default): each once the one before has sized its KV cache, so that no two servers' "
             "memory profiling overlaps; together: every server at once (their KV figures carry each other's "
             "start-ups, and a start may fail of it); chained: each once the one before it is up")
    add("--gpus", type=int, default=1, help="matrix: GPUs to spread the servers over (CUDA_VISIBLE_DEVICES; a server "
        "and its twin share one); each GPU's starts are staggered or chained on their own, side by side (default 1)")
    add("--retries", type=int, default=1, help="matrix: retries, alone, of a start other servers disturbed")
    add("--min-fallback-mb", type=int, help="matrix: budget for a 'min' server whose 64 MiB start gave no minimum "
                                            "(default: not started)")
    add("--chat-n", type=int, default=100, help="matrix: requests in the chat burst (default 100)")
    add("--port-base", type=int, default=8100, help="servers listen on this port and above (0: any free)")
    add("--start-timeout-s", type=float, help="a server's start-up limit (default 240; matrix: 360)")
    add("--request-timeout-s", type=float, help="one request's limit (default 120; matrix: 180)")
    add("--fake-server", action="store_true", help=argparse.SUPPRESS)  # CPU tests: fakes.py
    add("--fake-bench", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report_only:
        return args
    if not (args.phase and args.out):
        ap.error("give --phase and --out (or --report-only DIR)")
    if args.detach and args.follow:
        ap.error("--detach follows the phase itself: give one of --detach and --follow")
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in serve_bench.WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; known: {', '.join(serve_bench.WORKLOADS)}")
    args.at_once = args.workloads if args.at_once == "*" else [w for w in args.at_once.split(",") if w]
    if set(args.at_once) - set(args.workloads):
        ap.error(f"--at-once {','.join(args.at_once)}: not all of them are in --workloads {','.join(args.workloads)}")
    args.failrate_utils = [float(u) for u in args.failrate_utils.split(",") if u]
    engine, util = PHASE_DEFAULTS[args.phase]
    args.engine = args.engine or engine
    if args.phase == "matrix" and args.util is None and args.start == "together" and args.stock_twins:
        util = 0.04  # every twin alive beside every server
    args.util = args.util if args.util is not None else util
    start_s, request_s = TIMEOUTS.get(args.phase, DEFAULT_TIMEOUTS)
    args.start_timeout_s = args.start_timeout_s or start_s
    args.request_timeout_s = args.request_timeout_s or request_s
    for u in [args.util, *args.failrate_utils]:
        if u is not None and not 0 < u <= 1:
            ap.error(f"utilization {u} is not in (0, 1]")
    if args.repeats < 1 or args.failrate_n < 1 or args.prompt_scale <= 0 or args.sample_s <= 0:
        ap.error("--repeats and --failrate-n must be at least 1, --prompt-scale and --sample-s positive")
    if args.warmup_rounds < 0 or args.retries < 0 or args.chat_n < 1 or args.gpus < 1:
        ap.error("--warmup-rounds and --retries must be 0 or more, --chat-n and --gpus at least 1")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be at least 1")
    if args.phase == "matrix":
        matrix_args(ap, args)
    return args


def matrix_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The matrix's servers, twins and GPUs (``args.gpu_of``), each GPU's shares within MAX_UTIL_SUM."""
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
    selected = [c for c in md.DESIGN if c.name in args.servers]
    args.gpu_of = md.gpus_of([c.name for c in selected], args.gpus)
    for g in sorted({gpu for gpu in args.gpu_of.values()}, key=lambda g: -1 if g is None else g):
        on_gpu = [c for c in selected if args.gpu_of[c.name] == g]
        utils = [md.util_for(c, args.util) for c in on_gpu]
        twin_utils = [md.util_for(c, args.util) for c in on_gpu if c.name in args.stock_twins]
        # a stock twin lives until every server is up when together, else until the next start
        twins = 0 if not twin_utils else sum(twin_utils) if args.start == "together" else max(twin_utils)
        if sum(utils) + twins > MAX_UTIL_SUM:
            ap.error(f"the servers' utilizations on GPU {g or 0} add up to {sum(utils) + twins:.2f} (at most "
                     f"{MAX_UTIL_SUM}): lower --util")


def result_path(args: argparse.Namespace) -> Path:
    out: Path = args.out
    return out / (f"{args.phase}.json" if args.phase in ("ab", "matrix") else f"{args.phase}-{args.engine}.json")


def prepare_models(run: Run) -> bool:
    """Each served model folder (the matrix: one a server, its copy with an MTP layer where it
    speculates), with a generated tokenizer, checked; False (the error in the results) where a
    tokenizer would fail the servers."""
    a, out = run.args, run.out
    if a.phase == "matrix":
        run.model_dirs = {c.name: served_model_dir(out / "model", md.model_source(c, out / "variants"))
                          for c in md.DESIGN if c.name in a.servers}
        folders = sorted(set(run.model_dirs.values()))
    else:
        run.model_dir = served_model_dir(out / "model", model_variant(MODEL_DIR, out / "variants", layers=a.layers))
        folders = [run.model_dir]
    run.data["tokenizers"] = {}
    for folder in folders:
        try:
            run.data["tokenizers"][folder.name] = facts = check_tokenizer(folder)
        except Exception as exc:  # no server is started on a tokenizer that would fail them
            run.update(run.data["tokenizers"], **{folder.name: {"error": f"{type(exc).__name__}: {exc}"}})
            print(f"tokenizer check failed: {exc}", file=sys.stderr)
            return False
        say(f"{a.phase}: tokenizer ok ({facts['class']}, {facts['len']} tokens): {folder.name}")
    return True


def matrix_header(args: argparse.Namespace) -> dict[str, Any]:
    """The matrix's design and coverage, and a record for each of its servers."""
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
    path = result_path(args)
    # ab and failrate add to an earlier call's file (serve_phases.py says how); the others start afresh.
    data: dict[str, Any] = json.loads(path.read_text()) if args.phase in ("ab", "failrate") and path.is_file() else {}
    run_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("out", "report_only", "gpu_of") and not k.startswith("fake")}
    earlier = data.get("run", {}).get("layers")
    if data and earlier != args.layers:  # one file, one report: of one model
        print(f"{path} holds runs of another model (--layers {earlier}); give another --out", file=sys.stderr)
        return 2
    data.update(schema=1, phase=args.phase, run=run_args, finished=False, versions=versions(),
                started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                env={k: os.environ.get(k) for k in ("PYTHONPATH", *ENV_DEFAULTS, *PLANNER_VARS)},
                workload_titles=serve_bench.WORKLOAD_TITLES, case_titles=CASE_TITLES,
                **(matrix_header(args) if args.phase == "matrix" else {}))
    run = Run(args, path, data, start)
    run.save()
    if args.log_iterations and not os.environ.get(LOGGING_VAR):
        # vLLM's iteration lines are of use with milliseconds in their stamps (step_log.py)
        step_log.write_config(out / "logging.json", plugin_steps=False)  # imports vLLM: before the variable
        os.environ[LOGGING_VAR] = str(out / "logging.json")
        say(f"{args.phase}: --log-iterations: servers log with millisecond stamps ({LOGGING_VAR}="
            f"{os.environ[LOGGING_VAR]})")
    if args.phase in ("ab", "soak"):
        # The clients' imports happen meanwhile, and the forkserver's spawn (a fork of this process)
        # is over before any port is probed: a child holding a probe socket would make it look taken.
        run.clients = serve_bench.Clients(args.fake_bench, client_env())
        run.clients.warm()
    if not prepare_models(run):
        run.update(data, finished=True)
        return 2
    say(f"{args.phase}: results in {path}")
    PHASES[args.phase](run)
    run.update(data, finished=True, elapsed_s=time.monotonic() - start)
    return 0


def driver_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """A detached phase's log and pid file in DIR."""
    out: Path = args.out
    return out / f"{args.phase}-driver.log", out / f"{args.phase}-driver.pid"


def detached_deadline(args: argparse.Namespace) -> float:
    return float(args.soak_s + DETACHED_MARGIN_S if args.phase == "soak" else DETACHED_DEADLINE_S)


def detach(args: argparse.Namespace, argv: list[str]) -> None:
    """The same command without --detach, in a session of its own, with a deadline of its own."""
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *[a for a in argv if a != "--detach"],
           "--deadline-s", str(detached_deadline(args))]  # argparse takes the last --deadline-s
    log_path, pid_path = driver_files(args)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pid_path.write_text(f"{proc.pid}\n")
    say(f"{args.phase}: detached as pid {proc.pid} (log {log_path})")


def follow(args: argparse.Namespace) -> int:
    """Prints the detached phase's log as it grows, until it ends or this call's deadline."""
    start = time.monotonic()
    log, pid_file = driver_files(args)
    if not pid_file.is_file():
        print(f"no detached {args.phase} in {args.out}", file=sys.stderr)
        return 2
    pid = int(pid_file.read_text())
    shown = 0
    while True:
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        for line in lines[shown:]:
            say(f"  | {line}")
        shown = len(lines)
        if not pid_alive(pid):
            say(f"{args.phase}: finished (pid {pid} ended)")
            return 0
        if time.monotonic() - start > args.deadline_s:
            say(f"{args.phase}: still running (pid {pid}); call again with --phase {args.phase} --follow within the "
                "machine's warm time")
            return 0
        time.sleep(5)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its parent, a previous call's driver, is gone, so init reaps it soon) is ended
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.report_only:
        print(report.write(args.report_only))
        return 0
    if args.detach:
        detach(args, argv)
    if args.detach or args.follow:
        rc = follow(args)
        print(report.write(args.out))
        return rc
    install_cleanup()
    try:
        rc = run_phase(args)
    finally:
        text = report.write(args.out)
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
