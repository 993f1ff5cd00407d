"""What run_serve.py runs beside itself: ``vllm serve`` processes, each in a process group of its own
(one ``killpg`` ends it with its engine; stopped at exit, on SIGTERM/SIGHUP/Ctrl-C, and by the kernel if
the driver dies), what their logs say, the GPU's memory, the generated tokenizer, and bench clients.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

from run_cases import ENV_DEFAULTS, MODEL_DIR, PLANNER_VARS, REPLACE_VAR

HERE = Path(__file__).resolve().parent
ENGINES = {"stock": "FLASHMLA_SPARSE", "plugin": "CUSTOM"}
SERVED_NAME = "tiny-deepseek-v32"
VLLM_CLI = "vllm.entrypoints.cli.main"  # what the `vllm` console script runs
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


def server_args(spec: ServerSpec, model_dir: Path) -> list[str]:
    """The words after ``vllm serve``: vLLM's defaults (CUDA graphs, its engine process, no forced
    MQA) but for what the comparison fixes."""
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
    head = [python, str(HERE / "fakes.py"), "serve"] if fake else [python, "-m", VLLM_CLI, "serve"]
    return head + server_args(spec, model_dir)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """run_cases' environment less ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (a server keeps its engine in
    its own process, as operators run it); the plugin's settings come from the spec alone."""
    env = {**ENV_DEFAULTS, **(os.environ if base is None else base), "PYTHONUNBUFFERED": "1"}
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", *PLANNER_VARS):
        env.pop(var, None)
    if spec.engine == "plugin" and spec.scratch_mb is not None:
        env["MLA_PLANNER_SCRATCH_MB"] = str(spec.scratch_mb)
    assert REPLACE_VAR not in env  # with it, the plugin would stand in for stock's FLASHMLA_SPARSE
    return env


def _own_group() -> None:
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the group kill still works
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a zombie leader still counts
        return True
    return True


def wait_while(alive: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 20) -> dict[str, Any]:
    """SIGTERM to the group, SIGKILL after ``grace_s``; waits until no process of it is left (the
    engine process may outlive the leader)."""
    pgid, forced = proc.pid, False
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    wait_while(lambda: group_alive(pgid), grace_s)
    if group_alive(pgid):
        forced = True
        os.killpg(pgid, signal.SIGKILL)
    rc = proc.wait()
    wait_while(lambda: group_alive(pgid), 10)
    return {"rc": rc, "forced": forced, "left_running": group_alive(pgid)}


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command (0: the state, "Z" a zombie; 2: the process
    group); none where the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (Linux /proc): the API server and its engine process."""
    return sorted(int(p.name) for p in Path("/proc").glob("[0-9]*")
                  if (fields := proc_stat(p.name)) and int(fields[2]) == pgid and fields[0] != "Z")


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 5) -> tuple[int | None, Any, str | None]:
    """(status, answer, error) of a GET (answer: the text) or a JSON POST (answer: parsed); status None
    when the connection failed."""
    request = urllib.request.Request(url) if body is None else urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode(errors="replace")
            return int(response.status), text if body is None else json.loads(text), None
    except urllib.error.HTTPError as exc:
        return int(exc.code), None, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}"
    except (OSError, ValueError) as exc:
        return None, None, f"{type(exc).__name__}: {exc}"[:2000]


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (TIME_WAIT does not count: uvicorn binds with SO_REUSEADDR too)."""
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


def tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])[-4000:]


class Server:

    def __init__(self, spec: ServerSpec, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.spec, self.cmd, self.env, self.log_path = spec, cmd, env, log_path
        self.url = f"http://{HOST}:{spec.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.stopped: dict[str, Any] | None = None

    def start(self) -> None:
        # a port can be held for a moment by something short-lived: only one still taken after 2 s is a server
        wait_while(lambda: not port_free(self.spec.port), 2)
        if not port_free(self.spec.port):
            raise RuntimeError(f"port {self.spec.port} is taken: another server still running?")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:  # the child keeps its own descriptor
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=_own_group)
        self.t0 = time.monotonic()
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout_s: float = 5) -> int | None:
        return http(self.url + "/health", timeout_s=timeout_s)[0]

    def healthy(self) -> bool:
        return self.alive() and self.health() == 200

    def start_state(self, limit_s: float) -> dict[str, Any] | None:
        """``ok`` (/health 200), ``exited``, ``timeout`` past ``limit_s``; None while still starting."""
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
            self.stopped = {"alive_at_stop": self.alive(), **kill_group(self.proc, grace_s)}
            _LIVE.discard(self)
        return self.stopped

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def log_tail(self) -> str:
        return tail(self.log_path, 30)


_LIVE: set[Server] = set()
_STOP: list[int] = []  # the signal that asked the driver to stop, once one has


def stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop(grace_s=10)
        except Exception as exc:  # keep stopping the others
            print(f"stopping {server.log_path.stem}: {exc}", file=sys.stderr)


def _stop_requested(signum: int, _frame: Any) -> None:
    _STOP.append(signum)
    check_stop()


def check_stop() -> None:
    """Raises (SystemExit, or KeyboardInterrupt for Ctrl-C) once a stop was asked for, unwinding the
    phase's finally blocks, which stop its servers. The polling loops call this again: an exception
    the handler raised inside a finalizer (a Popen's ``__del__``) is printed and dropped."""
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
    """A server log's KV cache, the plugin's lines (reservation, fallbacks), the errors before the stop."""
    def number(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1).replace(",", "")) if m else None

    lines = text.splitlines()
    # the engine's lines: not logged below ERROR, and before vLLM's first "[shutdown]" line (the API
    # server logs an EngineDeadError of the stop's own after it)
    stop = next((i for i, line in enumerate(lines) if SHUTDOWN_MARK in line), len(lines))
    engine = [line for line in lines[:stop] if not QUIET_LEVEL.search(line)]
    # the first distinct exception and ERROR_PATTERNS lines (but the bare "Traceback ...")
    errors = [line.strip()[:400] for line in engine
              if EXCEPTION_LINE.search(line) or any(p in line for p in ERROR_PATTERNS[:-1])]
    planner = [line.strip()[:400] for line in lines if "mla-planner" in line]
    reserved = [int(m.group(1).replace(",", "")) for line in planner for m in [RESERVATION.search(line)] if m]
    return {
        "kv_cache_memory_gib": number(r"Available KV cache memory: ([\d.]+) GiB"),
        "kv_cache_tokens": number(r"GPU KV cache size: ([\d,]+) tokens"),
        "planner_lines": planner[:40], "planner_line_count": len(planner),
        "reserved_mib": reserved[-1] if reserved else None,
        "fallback_lines": sum(FELL_BACK in line for line in lines),
        "fallback_examples": [line for line in planner if FELL_BACK in line][:5],
        "error_count": {p: n for p in ERROR_PATTERNS if (n := sum(p in line for line in engine))},
        "first_errors": list(dict.fromkeys(errors))[:5],
    }


def refusal(text: str) -> tuple[str | None, int | None]:
    """The plugin's refusal of a budget below the engine's minimum, and that minimum (MiB, rounded up)."""
    for line in text.splitlines():
        if m := REFUSAL.search(line):
            return line.strip()[:500], math.ceil(float(m.group(1)))
    return None, None


def disturbed(text: str) -> str | None:
    """The line saying the start failed for other servers' memory, if it did."""
    return next((line.strip()[:400] for line in text.splitlines() if any(p in line for p in DISTURBED)), None)


def gpu_memory_used_mib() -> list[int] | None:
    """Each GPU's used memory (nvidia-smi); None where it fails."""
    try:
        out = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
        used = [int(float(line.split(",")[0])) for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return used if out.returncode == 0 else None


def wait_gpu_idle(max_s: float = 30, below_mib: int = 4096) -> None:
    """Until the GPU's memory is back under ``below_mib``: the next server measures free memory."""
    wait_while(lambda: max(gpu_memory_used_mib() or [0]) >= below_mib, max_s)


# --- the tokenizer ------------------------------------------------------------------------------------
# The tiny models have none. A word-level one of exactly ``vocab_size`` words does: id ``i`` is ``w<i>``
# (``<s>`` 0 and ``</s>`` 1 the config's bos/eos, ``<unk>`` 2). Every id decodes to one word and
# re-encodes to itself, so vLLM's random dataset gets exactly the prompt lengths it asks for.

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json (WordLevel) and what AutoTokenizer reads beside it. The special tokens are named in
    tokenizer_config.json only: registered (the random dataset leaves them out) and vocabulary words, so
    ``len(tokenizer)`` stays ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False,  # "w5 ." style clean-ups would change the text
              "model_max_length": 1 << 20}  # no truncation warnings at 64K-token prompts
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def served_model_dir(where: Path, model: Path = MODEL_DIR) -> Path:
    """``model``'s config.json and the tokenizer under ``where``: what the servers and bench clients load."""
    folder = where / model.name
    config = json.loads((model / "config.json").read_text())
    if folder.is_dir():  # an earlier call's: reused if whole and of this config
        if all((folder / f).is_file() for f in TOKENIZER_FILES) and \
                json.loads((folder / "config.json").read_text()) == config:
            return folder
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy(model / "config.json", folder / "config.json")
    write_tokenizer(folder, int(config["vocab_size"]))
    return folder


def check_tokenizer(folder: Path, sample_len: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Loads ``folder`` with AutoTokenizer, as vLLM does; asserts its size and a round trip of random ids."""
    from transformers import AutoTokenizer

    vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(seed)
    ids = [rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(sample_len)]
    text = tokenizer.decode(ids)
    back = tokenizer.encode(text, add_special_tokens=False)
    with_specials = tokenizer.encode(text)  # what a server's completions endpoint does
    facts = {"class": type(tokenizer).__name__, "len": len(tokenizer), "vocab_size": tokenizer.vocab_size,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
             "all_special_ids": sorted(tokenizer.all_special_ids), "round_trip": back == ids,
             "adds_special_tokens": len(with_specials) - len(back)}
    assert facts["len"] == vocab_size and facts["vocab_size"] == vocab_size, facts
    assert facts["round_trip"] and max(back) < vocab_size, facts
    assert facts["adds_special_tokens"] == 0, facts
    assert (facts["bos_token_id"], facts["eos_token_id"]) == (0, 1), facts
    return facts


# --- bench clients (``vllm bench serve``): a workload is one or more started together ---------------


@dataclass(frozen=True)
class Client:
    label: str
    input_len: int  # --random-input-len
    output_len: int  # --random-output-len
    num_prompts: int  # at --prompt-scale 1
    concurrency: int  # --max-concurrency
    range_ratio: str | None = None  # --random-range-ratio: a float, or JSON {"input": r, "output": r}
    warmups: int = 1  # --num-warmups: requests before the timed run (kernel JIT, graphs)
    seed_offset: int = 0  # the clients of one workload draw different prompts


WORKLOADS: dict[str, tuple[Client, ...]] = {  # the order sets the seeds (run_serve.SEED_BASE)
    # Runs of a quarter of these prompts lasted 1-3 s on the H200 and moved by up to 25%. long: a
    # request is in flight for ~17 steps, so at 16 concurrent nearly every step prefills.
    "long": (Client("long", 32768, 16, num_prompts=32, concurrency=16),),
    "chat": (Client("chat", 1024, 256, num_prompts=512, concurrency=64, warmups=8),),
    # The simulator's default workload (tracegen.Mix) as the random dataset can draw it (uniform in
    # len * (1 ± range_ratio)): chat turns (mean 6.5K in, 320 out) and documents (tracegen's 8K-128K cut
    # at 65,536). Its 8:3 arrivals, at most 32 running, become closed loops of 24 and 8 with prompt
    # counts 8:3, so both clients finish at about the same time.
    "mix": (Client("mix-chat", 6528, 320, num_prompts=64, concurrency=24, warmups=4,
                   range_ratio='{"input": 0.95, "output": 0.9}'),
            Client("mix-doc", 36864, 288, num_prompts=24, concurrency=8, seed_offset=1,
                   range_ratio='{"input": 0.77, "output": 0.77}')),
    # 8k: prefill-heavy prompts a quarter of long's (one step holds four at the default 32K).
    "8k": (Client("8k", 8192, 16, num_prompts=64, concurrency=16),),
}
WORKLOAD_TITLES = {
    "long": "32,768 in, 16 out, 16 concurrent",
    "chat": "1,024 in, 256 out, 64 concurrent",
    "8k": "8,192 in, 16 out, 16 concurrent",
    "mix": "the simulator's default mix: chat turns 326-12,730 in / 32-608 out, 24 concurrent, with "
           "documents 8,478-65,250 in / 66-510 out, 8 concurrent (two bench clients at once)",
}
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
KEPT = ("completed", "failed", "num_prompts", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
        "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
        "p50_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "mean_tpot_ms")
# What the `vllm` console script imports before it parses (0.26.0's and 0.33.0's), and bench's modules.
CLI_PRELOAD = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.benchmark.main", "vllm.entrypoints.cli.collect_env",
               "vllm.entrypoints.cli.download_kernels", "vllm.entrypoints.cli.launch", "vllm.entrypoints.cli.openai",
               "vllm.entrypoints.cli.preload", "vllm.entrypoints.cli.run_batch", "vllm.entrypoints.cli.serve",
               "vllm.entrypoints.cli.snapshot", "vllm.benchmarks.serve", "vllm.benchmarks.datasets")


def bench_args(client: Client, *, base_url: str, tokenizer: Path, seed: int, result: Path, scale: float = 1.0,
               metadata: dict[str, str] | None = None) -> list[str]:
    """The flags of ``vllm bench serve`` for one client (as in vLLM 0.26.0 and 0.33.0)."""
    prompts = max(1, round(client.num_prompts * scale))
    return ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(client.input_len),
            "--random-output-len", str(client.output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(client.concurrency), "--seed", str(seed + client.seed_offset),
            "--ignore-eos", "--temperature", "0", "--num-warmups", str(min(client.warmups, prompts)),
            "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", "50,99", "--disable-tqdm",
            "--label", client.label, "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name,
            *(["--random-range-ratio", client.range_ratio] if client.range_ratio is not None else []),
            *(["--metadata", *(f"{k}={v}" for k, v in metadata.items())] if metadata else [])]


class Clients:
    """Starts bench clients. Importing vLLM's CLI takes ~25 s on the GPU machine, longer than most runs,
    so each client is forked from a forkserver that imported it once (``warm``, while the servers
    start), and runs the ``vllm`` console script's entry point (or fakes.py's) on ``bench_args``."""

    def __init__(self, fake: bool, env: dict[str, str]) -> None:
        self.fake = fake
        # the forkserver starts with this process's environment, which the clients' imports read once
        os.environ.update(env)
        self.mp = multiprocessing.get_context("forkserver")
        self.mp.set_forkserver_preload(["fakes"] if fake else list(CLI_PRELOAD))

    def warm(self) -> None:
        threading.Thread(target=lambda: self.run(os.getpid).join(), daemon=True).start()

    def run(self, target: Callable[..., Any], *args: Any) -> BaseProcess:
        p = self.mp.Process(target=target, args=args, daemon=True)
        p.start()
        return p

    def start(self, args: list[str], log: Path) -> BaseProcess:
        """``vllm bench serve`` on ``args`` in a forked process, its output to ``log``."""
        module, argv = ("fakes", ["fakes.py", "bench"]) if self.fake else (VLLM_CLI, ["vllm", "bench", "serve"])
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("$ " + " ".join(argv + args) + "\n")
        return self.run(run_entry_point, module, argv + args, str(log))


def run_entry_point(module: str, argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = argv
    try:
        code = importlib.import_module(module).main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code or 0)


def read_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The numbers of a bench result the report uses (p50: bench's median where no p50 key)."""
    try:
        result = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        return None, f"no readable result {path.name}: {exc}"
    out = {k: result.get(k) for k in KEPT}
    for metric in PERCENTILE_METRICS.split(","):
        if out[f"p50_{metric}_ms"] is None:
            out[f"p50_{metric}_ms"] = result.get(f"median_{metric}_ms")
    return out, None


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several clients as one: the tokens of all over the longest duration."""
    durations = [r["duration"] for r in results if isinstance(r.get("duration"), (int, float))]
    if len(durations) != len(results) or not durations or max(durations) <= 0:
        return {}
    wall = max(durations)
    tokens_in, tokens_out = (sum(int(r.get(k) or 0) for r in results) for k in ("total_input_tokens",
                                                                                "total_output_tokens"))
    return {"duration": wall, "completed": sum(int(r.get("completed") or 0) for r in results),
            "failed": sum(int(r.get("failed") or 0) for r in results),
            "output_throughput": tokens_out / wall, "total_token_throughput": (tokens_in + tokens_out) / wall}


def run_clients(clients: Clients, runs: list[tuple[list[str], Path]], timeout_s: float,
                tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every client (its flags, its result file) at once, awaited (``tick`` every 0.2 s meanwhile),
    killed at ``timeout_s``; per client its rc, wall time, and result or why none."""
    t0 = time.monotonic()
    procs: list[BaseProcess] = []
    for _, result in runs:
        result.unlink(missing_ok=True)  # a result left by an earlier call must not count for this one
    timed_out = False
    try:
        procs.extend(clients.start(args, result.with_suffix(".log")) for args, result in runs)
        while any(p.is_alive() for p in procs):
            check_stop()
            if timed_out := time.monotonic() - t0 > timeout_s:
                break
            if tick is not None:
                tick()
            time.sleep(0.2)
    finally:
        for p in procs:  # on the timeout, or an exception in tick: no client is left running
            if p.is_alive():
                p.kill()
            p.join(5)
    wall, out = time.monotonic() - t0, []
    for p, (_, result) in zip(procs, runs):
        summary, why = read_result(result)
        log = result.with_suffix(".log")
        out.append({"rc": p.exitcode, "timed_out": timed_out, "wall_s": wall, "result": summary,
                    "error": None if summary and p.exitcode == 0 else (why or f"rc {p.exitcode}"),
                    "log": log.name, "log_tail": None if summary else tail(log, 15)})
    return out
