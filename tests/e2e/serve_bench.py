"""The serving driver's workloads, run by vLLM's own benchmark client (``vllm bench serve``).

A workload is one or more bench clients started together against one server; each writes its result
JSON (``--save-result``), from which ``summarize`` keeps the numbers the report uses. Prompts come
from bench's ``random`` dataset on the generated word-level tokenizer (serve_tokenizer.py): ids
sampled, decoded to words, re-encoded, so each prompt has exactly the sampled length.

``mix`` approximates the simulator's default workload (``mla_planner/cli/tracegen.py`` ``Mix``, the
trace in ``mla_planner/data/default_trace.jsonl.gz``) with two clients at once, since the random
dataset draws lengths uniformly from ``len * (1 ± range_ratio)``:

- ``mix-chat``: chat turns. With prefix caching off a turn's cached conversation is prefilled again,
  so the whole prompt counts: in tracegen that is median 5.0K, mean 6.5K tokens (5th-95th
  percentile 0.3K-16K), output median 200, mean 320. Here uniform 326-12,730 (mean 6,528) in,
  32-608 (mean 320) out.
- ``mix-doc``: long documents, log-uniform 8K-128K in tracegen, cut at 65,536 here (the servers'
  max_model_len is 70,000): mean 36.8K. Here uniform 8,478-65,250 (mean 36,864) in, 66-510 out
  (tracegen: uniform 64-512).
- Arrivals: tracegen's 0.08 chat and 0.03 documents per step (8:3), at most 32 running. Here closed
  loops of 24 and 8 concurrent requests, prompt counts 8:3, so both clients finish at about the same
  time; tracegen's Poisson arrivals and its queue are not modelled.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

from serve_proc import HERE, SERVED_NAME, VLLM_CLI, check_stop, tail


@dataclass(frozen=True)
class Client:
    label: str
    input_len: int  # --random-input-len
    output_len: int  # --random-output-len
    num_prompts: int  # at --prompt-scale 1
    concurrency: int  # --max-concurrency
    range_ratio: str | None = None  # --random-range-ratio: a float, or JSON {"input": r, "output": r}
    warmups: int = 1  # --num-warmups: requests of the first prompt before the timed run (kernel JIT, graphs)
    seed_offset: int = 0  # the clients of one workload draw different prompts


WORKLOADS: dict[str, tuple[Client, ...]] = {
    # long and chat runs of 8 and 128 prompts lasted 1 s and 2-3 s on the H200, and one run's
    # throughput moved by up to 25%; four times as many make each run last several seconds.
    # long, prefill-heavy: a request is in flight for about 17 steps (its prompt, the rest of it
    # beside the others' decodes, 15 decode tokens), so at 16 concurrent nearly every step
    # prefills; at 2 concurrent most steps were decode-only.
    "long": (Client("long", 32768, 16, num_prompts=32, concurrency=16),),
    "chat": (Client("chat", 1024, 256, num_prompts=512, concurrency=64, warmups=8),),
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
# Per-request latency percentiles bench reports (p50 and p99 of each), and the numbers kept.
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
KEPT = ("completed", "failed", "num_prompts", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
        "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
        "p50_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "mean_tpot_ms")


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def bench_command(client: Client, *, python: str, base_url: str, tokenizer: Path, seed: int, result: Path,
                  scale: float = 1.0, metadata: dict[str, str] | None = None, fake: bool = False) -> list[str]:
    """``vllm bench serve`` for one client (flags as in vLLM 0.26.0 and 0.33.0)."""
    prompts = scaled(client.num_prompts, scale)
    head = [python, str(HERE / "fakes.py"), "bench"] if fake else [python, *VLLM_CLI, "bench", "serve"]
    cmd = [*head, "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", SERVED_NAME, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(client.input_len),
           "--random-output-len", str(client.output_len), "--num-prompts", str(prompts),
           "--max-concurrency", str(client.concurrency), "--seed", str(seed + client.seed_offset),
           "--ignore-eos", "--temperature", "0", "--num-warmups", str(min(client.warmups, prompts)),
           "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", "50,99", "--disable-tqdm",
           "--label", client.label, "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    if client.range_ratio is not None:
        cmd += ["--random-range-ratio", client.range_ratio]
    if metadata:
        cmd += ["--metadata", *(f"{k}={v}" for k, v in metadata.items())]
    return cmd


# What the `vllm` console script's ``main`` imports before it parses (0.26.0's and 0.33.0's lists;
# a module one release lacks is skipped), and bench's own modules.
CLI_PRELOAD = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.benchmark.main", "vllm.entrypoints.cli.collect_env",
               "vllm.entrypoints.cli.download_kernels", "vllm.entrypoints.cli.launch", "vllm.entrypoints.cli.openai",
               "vllm.entrypoints.cli.preload", "vllm.entrypoints.cli.run_batch", "vllm.entrypoints.cli.serve",
               "vllm.entrypoints.cli.snapshot", "vllm.benchmarks.serve", "vllm.benchmarks.datasets")


class Clients:
    """Starts bench clients. Importing vLLM's CLI takes ~25 s on the GPU machine (a bench log's first
    line comes ~25 s after its process starts), longer than most runs last, and would leave the
    server idle between runs. So each client is a fresh process that runs the ``vllm`` console
    script's own entry point with the command line ``bench_command`` wrote, forked from one process
    that imported the CLI once (multiprocessing's forkserver, preloaded), started by ``warm`` while
    the servers start. The stand-in client (``fakes.py bench``) runs the same way."""

    def __init__(self, fake: bool, env: dict[str, str]) -> None:
        self.fake = fake
        # The forkserver starts with this process's environment, and the clients' imports read some
        # of it once (huggingface_hub's HF_HUB_OFFLINE, say): this process takes the clients' own.
        os.environ.update(env)
        self.mp = multiprocessing.get_context("forkserver")
        self.mp.set_forkserver_preload(["fakes"] if fake else list(CLI_PRELOAD))
        self._warming: threading.Thread | None = None

    def warm(self) -> None:
        """Starts the forkserver (and its imports) in the background; the first client waits for it."""
        if self._warming is None:
            self._warming = threading.Thread(target=self._noop_client, daemon=True)
            self._warming.start()

    def _noop_client(self) -> None:
        p = self.mp.Process(target=os.getpid)
        p.start()
        p.join()

    def start(self, cmd: list[str], log: Path) -> BaseProcess:
        """``cmd`` as ``bench_command`` wrote it, run in a forked process; its output goes to ``log``."""
        module, argv = entry_point(cmd)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("$ " + " ".join(cmd) + "\n")
        p = self.mp.Process(target=run_entry_point, args=(module, argv, str(log)), daemon=True)
        p.start()
        return p


def entry_point(cmd: list[str]) -> tuple[str, list[str]]:
    """The module whose ``main()`` runs ``cmd``, and the ``sys.argv`` it sees."""
    if cmd[1:3] == list(VLLM_CLI):
        return VLLM_CLI[1], ["vllm", *cmd[3:]]
    if Path(cmd[1]).name == "fakes.py":
        return "fakes", [cmd[1], *cmd[2:]]
    raise ValueError(f"not a bench command line: {cmd[:3]}")


def run_entry_point(module: str, argv: list[str], log: str) -> None:
    """In the client's process: output to ``log``, then the module's ``main()`` with ``argv``."""
    import importlib

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


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a bench result JSON the report uses (p50 is bench's median where no p50 key)."""
    out = {k: result.get(k) for k in KEPT}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        if out[f"p50_{metric}_ms"] is None:
            out[f"p50_{metric}_ms"] = result.get(f"median_{metric}_ms")
    return out


def read_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.is_file():
        return None, f"no result file {path.name}"
    try:
        return summarize(json.loads(path.read_text())), None
    except (ValueError, OSError) as exc:
        return None, f"unreadable {path.name}: {exc}"


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A workload of several clients as one: tokens of all over the longest client's duration."""
    durations = [r["duration"] for r in results if isinstance(r.get("duration"), (int, float))]
    if len(durations) != len(results) or not durations or max(durations) <= 0:
        return {}
    wall = max(durations)
    tokens_in = sum(int(r.get("total_input_tokens") or 0) for r in results)
    tokens_out = sum(int(r.get("total_output_tokens") or 0) for r in results)
    return {"duration": wall, "completed": sum(int(r.get("completed") or 0) for r in results),
            "failed": sum(int(r.get("failed") or 0) for r in results),
            "output_throughput": tokens_out / wall, "total_token_throughput": (tokens_in + tokens_out) / wall}


def run_clients(clients: Clients, cmds: list[list[str]], results: list[Path], logs: list[Path], timeout_s: float,
                tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Starts every client at once, waits for all (calling ``tick`` meanwhile, every 0.2 s), kills them
    all at ``timeout_s``; per client: rc, timed out, wall time, and its summarized result or why none."""
    t0 = time.monotonic()
    procs: list[BaseProcess] = []
    for result in results:
        result.unlink(missing_ok=True)  # a result left by an earlier call must not count for this one
    timed_out = False
    try:
        procs.extend(clients.start(cmd, log) for cmd, log in zip(cmds, logs))
        while any(p.is_alive() for p in procs):
            check_stop()
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                break
            if tick is not None:
                tick()
            time.sleep(0.2)
    finally:
        for p in procs:  # on the timeout, or an exception in tick: no client is left running
            if p.is_alive():
                p.kill()
            p.join(5)
    wall = time.monotonic() - t0
    out = []
    for p, result, log in zip(procs, results, logs):
        summary, why = read_result(result)
        rc = p.exitcode
        out.append({"rc": rc, "timed_out": timed_out, "wall_s": wall, "result": summary,
                    "error": None if summary and rc == 0 else (why or f"rc {rc}"),
                    "log": log.name, "log_tail": None if summary else tail(log, 15)})
    return out
