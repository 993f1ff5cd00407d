"""One ``vllm serve`` process: its command line and environment, start, /health, stop, and what its
log says; the GPU's memory as nvidia-smi sees it.

Each server and each bench client runs in its own process group, so one ``killpg`` ends it with
every process it started (the API server's engine-core process too). The group stays in the
driver's session: should the driver itself be killed, whoever ends that session's leftovers (the
device tool, a terminal) ends the servers too; the group leader also gets SIGTERM when the thread
that started it ends (Linux ``PR_SET_PDEATHSIG``). Live servers are stopped at exit, on
SIGTERM/SIGHUP and on Ctrl-C (``install_cleanup``).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from run_cases import ENV_DEFAULTS, PLANNER_VARS, REPLACE_VAR

HERE = Path(__file__).resolve().parent
ENGINES = {"stock": "FLASHMLA_SPARSE", "plugin": "CUSTOM"}
SERVED_NAME = "tiny-deepseek-v32"
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")  # what the `vllm` console script runs
HOST = "127.0.0.1"
# Lines of a server log that say the engine failed.
ERROR_PATTERNS = ("CUDA out of memory", "OutOfMemoryError", "CUDA error", "illegal memory access",
                  "EngineDeadError", "EngineCore encountered", "Traceback (most recent call last)")
EXCEPTION_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b: ")
SHUTDOWN_MARK = "[shutdown] "  # vLLM's first line once a stop began (SIGTERM to the API server or engine)
# vLLM's prefix of a line logged below ERROR: such a line may quote an error (the H200's ulimit
# WARNING quotes an OSError) without being one.
QUIET_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")
REFUSAL = re.compile(r"set MLA_PLANNER_SCRATCH_MB=(\d+(?:\.\d+)?) or more")  # the plugin's too-small budget
RESERVATION = re.compile(r"scratch reservation of ([\d,]+) MiB")
FELL_BACK = "falls back to the bounded path"  # the plugin's warning for a step that could not run its plan
KV_SIZED = "GPU KV cache size"  # vLLM 0.26's and 0.33's line once the KV cache is sized (kv_cache_utils.py)
# a start that failed because other servers' memory changed during its memory profiling
DISTURBED = ("Error in memory profiling", "No available memory for the cache blocks",
             "less than desired GPU memory utilization")


@dataclass(frozen=True)
class ServerSpec:
    engine: str  # stock | plugin
    util: float  # --gpu-memory-utilization
    port: int
    mnbt: int = 32768  # --max-num-batched-tokens
    max_model_len: int = 70000
    scratch_mb: int | None = None  # the plugin's budget (MLA_PLANNER_SCRATCH_MB); None: its default
    log_iterations: bool = False  # vLLM logs every engine step (tests/e2e/step_log.py compare)
    prefix_caching: bool = False  # --enable-prefix-caching (off: --no-enable-prefix-caching)
    extra_args: tuple[str, ...] = ()  # more of vLLM's flags, after the fixed ones (the matrix's axes)
    gpu: int | None = None  # CUDA_VISIBLE_DEVICES: this GPU of several (None: the environment's)


def server_args(spec: ServerSpec, model_dir: Path) -> list[str]:
    """The words after ``vllm serve``: vLLM's defaults (CUDA graphs, its engine process, no forced
    MQA) except what the comparison fixes. Every flag is in vLLM 0.26.0's and 0.33.0's parser
    (tests/e2e/test_serve.py parses them with the installed vLLM's)."""
    return [str(model_dir), "--served-model-name", SERVED_NAME, "--tokenizer", str(model_dir),
            "--load-format", "dummy", "--kv-cache-dtype", "fp8_ds_mla", "--block-size", "64",
            "--max-model-len", str(spec.max_model_len), "--max-num-batched-tokens", str(spec.mnbt),
            "--gpu-memory-utilization", str(spec.util),
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching", "--seed", "0",
            # no generation_config.json in the folder: vLLM's sampling defaults, no Hub lookup
            "--generation-config", "vllm",
            "--attention-backend", ENGINES[spec.engine], "--host", HOST, "--port", str(spec.port),
            "--disable-uvicorn-access-log",  # one log line per request (and per /health poll) otherwise
            *(["--enable-logging-iteration-details"] if spec.log_iterations else []), *spec.extra_args]


def server_command(spec: ServerSpec, model_dir: Path, python: str, fake: bool = False) -> list[str]:
    head = [python, str(HERE / "fakes.py"), "serve"] if fake else [python, *VLLM_CLI, "serve"]
    return head + server_args(spec, model_dir)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """run_cases' environment less ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a server keeps its engine in
    its own process, as operators run it. PYTHONPATH (the GPU machine's /tmp/site) passes through."""
    env = dict(os.environ if base is None else base)
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONUNBUFFERED"] = "1"
    for var in PLANNER_VARS:  # the plugin's settings come from the spec alone
        env.pop(var, None)
    if spec.engine == "plugin" and spec.scratch_mb is not None:
        env["MLA_PLANNER_SCRATCH_MB"] = str(spec.scratch_mb)
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
    assert REPLACE_VAR not in env  # with it, the plugin would stand in for stock's FLASHMLA_SPARSE
    return env


def client_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A bench client's environment: a stock server's (run_cases' defaults, no plugin settings)."""
    return server_env(ServerSpec("stock", 0.0, 0), base)


def _own_group() -> None:
    """In the child before exec: a process group of its own; SIGTERM when the driver dies."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the group kill still works
        pass


def spawn(cmd: list[str], log: IO[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_own_group)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a zombie leader still counts
        return True
    return True


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 20) -> dict[str, Any]:
    """SIGTERM to the group, SIGKILL after ``grace_s``; waits until no process of it is left."""
    pgid = proc.pid
    forced = False
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:  # the engine process may outlive the leader
        time.sleep(0.2)
    if group_alive(pgid):
        forced = True
        os.killpg(pgid, signal.SIGKILL)
    rc = proc.wait()
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"rc": rc, "forced": forced, "left_running": group_alive(pgid)}


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (Linux /proc): the API server and its engine process."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return sorted(pids)


def http_status(url: str, timeout_s: float = 5) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int | None, Any, str | None]:
    """(status, parsed body, error text) of a POST; status None when the connection failed."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), json.loads(response.read()), None
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:2000]
        return int(exc.code), None, f"HTTP {exc.code}: {text}"
    except (OSError, ValueError) as exc:
        return None, None, f"{type(exc).__name__}: {exc}"[:2000]


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of a stopped server in TIME_WAIT do not count:
    uvicorn binds with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    """One ``vllm serve`` process (group), its log file and its /health."""

    def __init__(self, spec: ServerSpec, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.spec, self.cmd, self.env, self.log_path = spec, cmd, env, log_path
        self.url = f"http://{HOST}:{spec.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.stopped: dict[str, Any] | None = None

    def start(self) -> None:
        # A port can be held for a moment by something short-lived (a process forked while a probe
        # socket was open, a client's ephemeral port): only one still taken after 2 s is a server.
        deadline = time.monotonic() + 2
        while not port_free(self.spec.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.spec.port} is taken: another server still running?")
            time.sleep(0.1)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:  # the child keeps its own descriptor
            self.proc = spawn(self.cmd, log, self.env)
        self.t0 = time.monotonic()
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout_s: float = 5) -> int | None:
        return http_status(self.url + "/health", timeout_s)

    def healthy(self) -> bool:
        return self.alive() and self.health() == 200

    def start_state(self, limit_s: float) -> dict[str, Any] | None:
        """How the start went once it is settled: ``ok`` (/health answers 200), ``exited`` or, past
        ``limit_s`` since the start, ``timeout``; None while it is still starting."""
        elapsed = time.monotonic() - self.t0
        if not self.alive():
            return {"status": "exited", "rc": self.proc.returncode if self.proc else None, "elapsed_s": elapsed,
                    "log_tail": self.log_tail()}
        if self.health(timeout_s=2) == 200:
            return {"status": "ok", "elapsed_s": elapsed}
        return {"status": "timeout", "elapsed_s": elapsed, "log_tail": self.log_tail()} if elapsed >= limit_s else None

    def stop(self, grace_s: float = 20) -> dict[str, Any]:
        if self.proc is None:
            return {"rc": None, "forced": False, "left_running": False}
        if self.stopped is None:
            was_alive = self.alive()
            self.stopped = {"alive_at_stop": was_alive, **kill_group(self.proc, grace_s)}
            _LIVE.discard(self)
        return self.stopped

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def log_tail(self) -> str:
        return tail(self.log_path, 30)


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log (4,000 characters at most); "" where there is none."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])[-4000:]


_LIVE: set[Server] = set()


def stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop(grace_s=10)
        except Exception as exc:  # keep stopping the others
            print(f"stopping {server.log_path.stem}: {exc}", file=sys.stderr)


_STOP: list[int] = []  # the signal that asked the driver to stop, once one has


def _stop_requested(signum: int, _frame: Any) -> None:
    _STOP.append(signum)
    check_stop()


def check_stop() -> None:
    """Raises (SystemExit, or KeyboardInterrupt for Ctrl-C) once a stop was asked for: unwinds the
    plan's finally blocks, which stop its servers, then atexit. The handler raises at once, and the
    driver's polling loops call this again, since an exception raised while Python runs a finalizer
    (a Popen's ``__del__``, say) is printed and dropped."""
    if _STOP:
        if _STOP[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + _STOP[0])


def install_cleanup() -> None:
    atexit.register(stop_all)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _stop_requested)


# --- what a log says ------------------------------------------------------------------------------


def log_facts(text: str) -> dict[str, Any]:
    """What a server log says about the engine: its KV cache, the plugin's lines (the reservation,
    steps that fell back), the errors before the stop."""
    def number(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1).replace(",", "")) if m else None

    lines = text.splitlines()
    engine = engine_lines(lines)
    planner = [line.strip()[:400] for line in lines if "mla-planner" in line]
    reserved = [int(m.group(1).replace(",", "")) for line in planner for m in [RESERVATION.search(line)] if m]
    counts = {p: n for p in ERROR_PATTERNS if (n := sum(p in line for line in engine))}
    return {
        "kv_cache_memory_gib": number(r"Available KV cache memory: ([\d.]+) GiB"),
        "kv_cache_tokens": number(r"GPU KV cache size: ([\d,]+) tokens"),
        "graph_capture": next((line.strip()[:200] for line in lines if "Graph capturing finished" in line), None),
        "planner_lines": planner[:40], "planner_line_count": len(planner),
        "reserved_mib": reserved[-1] if reserved else None,
        "fallback_lines": sum(FELL_BACK in line for line in lines),
        "fallback_examples": [line for line in planner if FELL_BACK in line][:5],
        "error_count": counts, "first_errors": first_errors(engine),
    }


def first_errors(engine: list[str], limit: int = 5) -> list[str]:
    """The first distinct error lines of ``engine_lines``: exception lines and ERROR_PATTERNS (but the
    bare "Traceback ..." line)."""
    found: list[str] = []
    for line in engine:
        if EXCEPTION_LINE.search(line) or any(p in line for p in ERROR_PATTERNS[:-1]):
            if line.strip()[:400] not in found:
                found.append(line.strip()[:400])
            if len(found) >= limit:
                break
    return found


def stop_index(lines: list[str]) -> int:
    """Where the stop of a server began in its log lines (their length if it did not). Stopping a
    server kills its engine mid-loop, and the API server then logs an EngineDeadError traceback of
    its own: what follows vLLM's first "[shutdown]" line (in 0.26 and 0.33) is the stop's."""
    return next((i for i, line in enumerate(lines) if SHUTDOWN_MARK in line), len(lines))


def engine_lines(lines: list[str]) -> list[str]:
    """The log lines in which an error is the engine's: before the stop, not logged below ERROR."""
    return [line for line in lines[:stop_index(lines)] if not QUIET_LEVEL.search(line)]


def refusal(text: str) -> tuple[str | None, int | None]:
    """The plugin's refusal of a budget below the engine's minimum, and that minimum (MiB, rounded up)."""
    for line in text.splitlines():
        m = REFUSAL.search(line)
        if m:
            return line.strip()[:500], math.ceil(float(m.group(1)))
    return None, None


def disturbed(text: str) -> str | None:
    """The line saying the start failed for other servers' memory, if it did."""
    return next((line.strip()[:400] for line in text.splitlines() if any(p in line for p in DISTURBED)), None)


# --- the GPU ----------------------------------------------------------------------------------------


def _nvidia_smi(query: str) -> list[list[str]] | None:
    """Rows of an nvidia-smi CSV query, or None where there is no nvidia-smi or it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[field.strip() for field in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def gpu_memory_used_mib() -> list[int] | None:
    """Used memory of each GPU, all processes on it together."""
    rows = _nvidia_smi("--query-gpu=memory.used")
    try:
        return None if rows is None else [int(float(row[0])) for row in rows]
    except (ValueError, IndexError):
        return None


def gpu_processes() -> list[list[int]] | None:
    """[pid, used MiB] of each process holding GPU memory: is the server alone on the GPU? (In a
    container nvidia-smi may name host pids, which differ from the ones the driver sees.)"""
    rows = _nvidia_smi("--query-compute-apps=pid,used_memory")
    try:
        return None if rows is None else [[int(row[0]), int(float(row[1]))] for row in rows]
    except (ValueError, IndexError):
        return None


def wait_gpu_idle(max_s: float = 30, below_mib: int = 4096) -> float:
    """After a server stops: until the GPU's memory is back under ``below_mib`` (the next server
    measures free memory at start-up). Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        used = gpu_memory_used_mib()
        if used is None or max(used, default=0) < below_mib:
            break
        time.sleep(1)
    return time.monotonic() - t0
