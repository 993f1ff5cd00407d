"""Issue 14: stock FLASHMLA_SPARSE vs the plugin through ``vllm serve``, driven by ``vllm bench serve``.

    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_serve.py --phase ab --out /tmp/serve
    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_serve.py --phase boundary --out /tmp/serve
    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_serve.py --phase failrate --out /tmp/serve
    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_serve.py --phase soak --detach --out /tmp/serve
    PYTHONPATH=$(bash tests/e2e/device_install.sh pythonpath) python3 tests/e2e/run_serve.py --phase soak --follow --out /tmp/serve   # next call
    ... --phase ab --detach ...; ... --phase ab --follow ...   # any phase that outlasts one call
    python3 tests/e2e/run_serve.py --report-only /tmp/serve

Each phase (serve_phases.py) ends by ``--deadline-s`` and writes ``DIR/<phase>[-<engine>].json``,
rewritten after every step, server logs under ``DIR/logs``, bench results under ``DIR/bench``, and
``DIR/serve.md`` (serve_report.py) over every phase file in DIR. The tiny model gets a generated
tokenizer in ``DIR/model`` (serve_tokenizer.py), checked before any server starts.

A soak of 600 s does not fit in one 10-minute device call with a server's start-up, nor does
``ab`` at its default counts with two servers' start-ups on a fresh machine: ``--detach`` runs the
phase in a process of its own session (which the device machine keeps while it stays warm) and
follows it until the deadline; ``--follow`` in the next call picks it up until it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import serve_bench
import serve_phases as sp
import serve_report
import step_log
from run_cases import CASE_TITLES, ENV_DEFAULTS, MODEL_DIR, PLANNER_VARS, model_variant, write_json
from serve_proc import client_env, install_cleanup
from serve_tokenizer import check_tokenizer, served_model_dir

# ab's two servers share the GPU. 0.40 each, not 0.45: stock's step of 32K FP8 tokens allocates
# ~14 GiB nobody reserved, beyond its share; at 0.45 each (14 GiB left over) the H200 measured stock's
# process at 76.4 GiB of its 62.9 GiB share, and the plugin's server, within its own, died of it.
PHASE_DEFAULTS = {  # engine, util
    "ab": (None, 0.40),
    "boundary": ("plugin", 0.95),
    "failrate": ("stock", None),
    "soak": ("plugin", 0.95),
}
DETACHED_MARGIN_S = 600  # a detached soak's own deadline: --soak-s plus this (start-up, last iteration)
DETACHED_DEADLINE_S = 1500  # any other detached phase's: within the 30 minutes a device machine is held
LOGGING_VAR = "VLLM_LOGGING_CONFIG_PATH"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=list(PHASE_DEFAULTS), help="what to run (one phase a call)")
    ap.add_argument("--out", type=Path, help="results folder (kept: later calls add to it)")
    ap.add_argument("--deadline-s", type=float, default=540, help="the phase ends by then (default 540)")
    ap.add_argument("--engine", choices=("stock", "plugin"),
                    help="boundary, soak: default plugin; failrate: default stock (ab runs both)")
    ap.add_argument("--util", type=float, help="--gpu-memory-utilization (ab: 0.40 each; boundary, soak: 0.95)")
    ap.add_argument("--workloads", default="long,chat,mix", help=f"ab: of {', '.join(serve_bench.WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=3, help="ab: interleaved repeats per engine and workload")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="ab: rounds of every workload on both servers before the repeats, left out of the medians "
                         "(default 1: a server's first run of a workload pays first-use costs)")
    ap.add_argument("--at-once", nargs="?", const="*", default="", metavar="WORKLOADS",
                    help="ab: these workloads (none given: all of the call's) run both engines' runs of a repeat at "
                         "the same time, so the machine's swings of seconds hit both alike (for chat's per-step "
                         "comparison); the others one after the other")
    ap.add_argument("--prompt-scale", type=float, default=1.0, help="ab, soak: scales every client's prompt count")
    ap.add_argument("--failrate-utils", default="0.90,0.95", help="failrate: utilizations, in turn")
    ap.add_argument("--failrate-n", type=int, default=2, help="failrate: servers per utilization")
    ap.add_argument("--soak-s", type=float, default=600, help="soak: how long to repeat the mix (default 600)")
    ap.add_argument("--sample-s", type=float, default=5, help="soak: seconds between memory samples")
    ap.add_argument("--detach", action="store_true",
                    help="run the phase in a session of its own (its own deadline), follow it until --deadline-s")
    ap.add_argument("--follow", action="store_true",
                    help="follow the phase detached in DIR until it ends or --deadline-s")
    ap.add_argument("--scratch-mb", type=int, help="the plugin's budget (MLA_PLANNER_SCRATCH_MB; default: its own)")
    ap.add_argument("--log-iterations", action="store_true",
                    help="every server logs each engine step (vLLM's --enable-logging-iteration-details), "
                         "for step_log.py compare")
    ap.add_argument("--port-base", type=int, default=8100, help="servers listen on this port and above (0: any free)")
    ap.add_argument("--start-timeout-s", type=float, default=240, help="a server's start-up limit (default 240)")
    ap.add_argument("--request-timeout-s", type=float, default=120, help="a boundary request's limit (default 120)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for vllm serve and vllm bench serve")
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--tp", type=int, default=1, help="every server's --tensor-parallel-size (one GPU per worker)")
    ap.add_argument("--heads", type=int, help="the model's attention heads (default: its config's; 16 x --tp keeps "
                                                "16 per rank, as DeepSeek-V3.2 at TP 8)")
    ap.add_argument("--layers", type=int, help="the model's hidden layers (default: its config's, 2; more put more "
                                                 "of each step in attention, as in the real model's 61)")
    ap.add_argument("--report-only", type=Path, metavar="DIR",
                    help="only write DIR/serve.md from DIR's JSON (the ab step figures from DIR's logs)")
    ap.add_argument("--fake-server", action="store_true", help=argparse.SUPPRESS)  # CPU tests: serve_fakes.py
    ap.add_argument("--fake-bench", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report_only:
        return args
    if not (args.phase and args.out):
        ap.error("give --phase and --out (or --report-only DIR)")
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
    args.util = args.util if args.util is not None else util
    for u in [args.util, *args.failrate_utils]:
        if u is not None and not 0 < u <= 1:
            ap.error(f"utilization {u} is not in (0, 1]")
    if args.repeats < 1 or args.failrate_n < 1 or args.prompt_scale <= 0 or args.sample_s <= 0:
        ap.error("--repeats and --failrate-n must be at least 1, --prompt-scale and --sample-s positive")
    if args.warmup_rounds < 0:
        ap.error("--warmup-rounds must be 0 or more")
    if args.tp < 1 or any(n is not None and n < 1 for n in (args.heads, args.layers)):
        ap.error("--tp, --heads and --layers must be at least 1")
    if args.detach and args.follow:
        ap.error("--detach follows the phase itself: give one of --detach and --follow")
    return args


def result_path(args: argparse.Namespace) -> Path:
    out: Path = args.out
    return out / ("ab.json" if args.phase == "ab" else f"{args.phase}-{args.engine}.json")


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in ("vllm", "torch", "mla-planner", "transformers", "tokenizers"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


# the arguments that change what a server runs: a phase file adds only runs that agree on them
MODEL_ARGS = ("tp", "heads", "layers")


def run_phase(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = result_path(args)
    # ab and failrate add to an earlier call's file (serve_phases.py says how); the others start afresh.
    data: dict[str, Any] = json.loads(path.read_text()) if args.phase in ("ab", "failrate") and path.is_file() else {}
    run = {k: v for k, v in vars(args).items() if k not in ("out", "model", "report_only") and not k.startswith("fake")}
    earlier = {k: data.get("run", {}).get(k) for k in MODEL_ARGS}
    if data and earlier != {k: run[k] for k in MODEL_ARGS}:  # one file, one report: of one model
        print(f"{path} holds runs of another model or parallelism "
              f"({' '.join(f'--{k} {v}' for k, v in earlier.items() if v is not None)}"
              f"); give another --out", file=sys.stderr)
        return 2
    data.update(schema=1, phase=args.phase, run=run, finished=False, versions=versions(),
                started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                env={k: os.environ.get(k) for k in ("PYTHONPATH", *ENV_DEFAULTS, *PLANNER_VARS)},
                workload_titles=serve_bench.WORKLOAD_TITLES, case_titles=CASE_TITLES)

    def save() -> None:
        write_json(path, data)

    if args.log_iterations and not os.environ.get(LOGGING_VAR):
        # vLLM's iteration lines are of use with milliseconds in their stamps (step_log.py)
        step_log.write_config(out / "logging.json", plugin_steps=False)  # imports vLLM: before the variable
        os.environ[LOGGING_VAR] = str(out / "logging.json")
        print(f"{args.phase}: --log-iterations: servers log with millisecond stamps ({LOGGING_VAR}="
              f"{os.environ[LOGGING_VAR]})", flush=True)
    clients = None
    if args.phase in ("ab", "soak"):
        # The clients' imports happen meanwhile, and the forkserver's spawn (a fork of this process)
        # is over before any port is probed: a child holding a probe socket would make it look taken.
        clients = serve_bench.Clients(args.python, args.fake_bench, client_env())
        clients.warm()
    model_dir = served_model_dir(out / "model", model_variant(args.model, out, heads=args.heads, layers=args.layers))
    try:
        data["tokenizer"] = check_tokenizer(model_dir)
    except Exception as exc:  # no server is started on a tokenizer that would fail them
        data.update(tokenizer={"error": f"{type(exc).__name__}: {exc}"}, finished=True)
        save()
        print(f"tokenizer check failed: {exc}", file=sys.stderr)
        return 2
    print(f"{args.phase}: tokenizer ok ({data['tokenizer']['class']}, {data['tokenizer']['len']} tokens); "
          f"results in {path}", flush=True)
    save()
    ctx = sp.Ctx(out=out, python=args.python, model_dir=model_dir, deadline=start + args.deadline_s,
                 port_base=args.port_base, scratch_mb=args.scratch_mb, tp=args.tp, log_iterations=args.log_iterations,
                 start_timeout_s=args.start_timeout_s, request_timeout_s=args.request_timeout_s,
                 fake_server=args.fake_server, clients=clients)
    if args.phase == "ab":
        sp.phase_ab(ctx, data, save, util=args.util, workloads=args.workloads, repeats=args.repeats,
                    scale=args.prompt_scale, warmup_rounds=args.warmup_rounds, at_once=tuple(args.at_once))
    elif args.phase == "boundary":
        sp.phase_boundary(ctx, data, save, engine=args.engine, util=args.util)
    elif args.phase == "failrate":
        sp.phase_failrate(ctx, data, save, engine=args.engine, utils=args.failrate_utils, n=args.failrate_n)
    else:
        sp.phase_soak(ctx, data, save, engine=args.engine, util=args.util, soak_s=args.soak_s,
                      sample_s=args.sample_s, scale=args.prompt_scale)
    data.update(finished=True, elapsed_s=time.monotonic() - start)
    save()
    return 0


def recount_steps(out: Path, ab: dict[str, Any] | None) -> None:
    """The step figures of each ab call that has them, counted again from its server logs in
    ``out`` by this step_log, so that a report of an older run reads as ``step_log.py compare``
    does now; a call whose logs are not all there, or do not parse, keeps what the run stored."""
    if ab is None:
        return
    for call in ab.get("calls", []):
        logs = [rec.get("log") for rec in call.get("servers", {}).values()]
        if "steps" in call and logs and all(log and (out / log).is_file() for log in logs):
            try:
                call.update(step_log.step_figures(out, ab, call))
            except Exception:  # the figures the run stored stand
                pass


def write_report(out: Path, recount: bool = False) -> str:
    """DIR/serve.md from DIR's phase files; with ``recount`` (``--report-only``) the ab step figures
    from DIR's logs. A phase has just counted its own, so its report does not parse the logs again."""
    phases = serve_report.load_dir(out)
    if recount:
        recount_steps(out, phases.get("ab"))
    text = serve_report.render(phases)
    (out / serve_report.REPORT_MD).write_text(text)
    return text


def driver_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """A detached phase's log and pid file in DIR."""
    out: Path = args.out
    return out / f"{args.phase}-driver.log", out / f"{args.phase}-driver.pid"


def detach(args: argparse.Namespace, argv: list[str], script: Path | None = None) -> None:
    """The same command without --detach, in a session of its own, with a deadline of its own
    (``script``: the driver to run, this one unless given; run_matrix.py detaches through here)."""
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = args.soak_s + DETACHED_MARGIN_S if args.phase == "soak" else DETACHED_DEADLINE_S
    cmd = [sys.executable, str(script or Path(__file__).resolve()), *[a for a in argv if a != "--detach"],
           "--deadline-s", str(deadline)]  # argparse takes the last --deadline-s
    log_path, pid_path = driver_files(args)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pid_path.write_text(f"{proc.pid}\n")
    print(f"{args.phase}: detached as pid {proc.pid} (log {log_path})", flush=True)


def follow(args: argparse.Namespace, again: str | None = None) -> int:
    """Prints the detached phase's log as it grows, until it ends or this call's deadline
    (``again``: the flags that follow it in a next call, ``--phase PHASE --follow`` unless given)."""
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
            print(f"  | {line}", flush=True)
        shown = len(lines)
        if not pid_alive(pid):
            print(f"{args.phase}: finished (pid {pid} ended)", flush=True)
            return 0
        if time.monotonic() - start > args.deadline_s:
            print(f"{args.phase}: still running (pid {pid}); call again with {again or f'--phase {args.phase} --follow'} "
                  "within the machine's warm time", flush=True)
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
        print(write_report(args.report_only, recount=True))
        return 0
    if args.detach:
        detach(args, argv)
    if args.detach or args.follow:
        rc = follow(args)
        print(write_report(args.out))
        return rc
    install_cleanup()
    try:
        rc = run_phase(args)
    finally:
        text = write_report(args.out)
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
