"""Stand-ins for the CPU tests; no number they produce means anything. ``modules()``: what ``run_cases.Bench``
takes for (torch, ``vllm.LLM``, ``SamplingParams``). ``fakes.py serve MODEL ...`` answers ``/health`` and
``/v1/completions`` (streamed or not) on the word-level tokenizer's words and logs the lines the driver
reads; ``fakes.py bench ...`` writes a result shaped like ``vllm bench serve``'s.

The served stand-in's environment steers it: FAKE_SERVE_START_S (seconds before it listens),
FAKE_SERVE_EXIT_AT_START=1 (an OOM at start-up), FAKE_SERVE_MIN_MB (the plugin's minimum budget, else
64 + ``--max-num-seqs`` / 8), FAKE_SERVE_DIE_OVER=N and FAKE_SERVE_HANG_OVER=N (a prompt over N tokens
kills the engine, or never answers), FAKE_SERVE_DISTURB_ONCE=PATH (the first start fails as vLLM's memory
profiling does when another process frees memory). Stock at 0.95 dies with more than 16,384 prompt tokens
in flight, as on 32K; the plugin reserves its budget from the KV cache and, speculating, logs a fallback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

from step_log import stamp

OOM_TOKENS = 16384


class FakeEngine:
    """Every request gets one token a step."""

    def __init__(self) -> None:
        self.output_processor = SimpleNamespace(request_states={})
        self.ids = itertools.count()

    def add(self, prompt: dict[str, list[int]], params: Any) -> str:
        request_id = f"{next(self.ids)}-abcd1234"  # vLLM 0.26's suffix on the id it hands back
        self.output_processor.request_states[request_id] = (prompt["prompt_token_ids"], params, [])
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for request_id in request_ids:
            self.output_processor.request_states.pop(request_id, None)

    def step(self) -> list[Any]:
        time.sleep(0.001)
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.output_processor.request_states.items()):
            tokens.append(100 + len(tokens))
            if len(tokens) >= params.max_tokens:
                del self.output_processor.request_states[request_id]
                completion = SimpleNamespace(token_ids=tokens, finish_reason="length", logprobs=None)
                outputs.append(SimpleNamespace(request_id=request_id.split("-")[0], finished=True,
                                               prompt_token_ids=prompt, outputs=[completion]))
        return outputs


class FakeLLM:
    def __init__(self, **kwargs: Any) -> None:
        self.llm_engine = FakeEngine()

    def enqueue(self, prompts: list[dict[str, list[int]]], params: Any, use_tqdm: bool = True) -> list[str]:
        return [self.llm_engine.add(p, params) for p in prompts]


def modules() -> tuple[Any, Any, Any]:
    """What ``run_cases.Bench`` takes in place of (torch, vllm.LLM, vllm.SamplingParams)."""
    def zero() -> int:
        return 0

    cuda = SimpleNamespace(synchronize=zero, reset_peak_memory_stats=zero, memory_allocated=zero,
                           memory_reserved=zero, max_memory_allocated=zero, max_memory_reserved=zero,
                           mem_get_info=lambda: (0, 0), get_device_name=lambda: "CPU stand-in")
    return SimpleNamespace(cuda=cuda), FakeLLM, SimpleNamespace


# --- vllm serve and vllm bench serve ---------------------------------------------------------------


def log(line: str) -> None:
    print(line, flush=True)


class FakeServer:
    def __init__(self, args: argparse.Namespace) -> None:
        stock = args.attention_backend == "FLASHMLA_SPARSE"
        self.oom_over = OOM_TOKENS if stock and args.gpu_memory_utilization >= 0.95 else None
        # any engine: a longer prompt kills it, or never answers
        self.die_over, self.hang_over = (int(v) if (v := os.environ.get(f"FAKE_SERVE_{k}_OVER")) else None
                                         for k in ("DIE", "HANG"))
        # the line a step that fell back logs (plugin with speculative decoding), once
        self.fallback_line: str | None = (
            "mla-planner: a step falls back to the bounded path: uniform decodes of 1 + k tokens (said once per reason)"
            if not stock and args.speculative_config else None)
        self.in_flight = self.iteration = 0
        self.lock = threading.Lock()
        self.log_iterations = args.enable_logging_iteration_details

    def step(self, context_tokens: int, decode_tokens: int) -> None:
        """vLLM's line per engine step under --enable-logging-iteration-details (a request here is two
        steps: its prompt, then its decodes as one)."""
        if self.log_iterations:
            with self.lock:
                self.iteration += 1
                log(f"(APIServer pid={os.getpid()}) INFO {stamp()} [loggers.py:181] Engine 000: Iteration("
                    f"{self.iteration}): {int(context_tokens > 0)} context requests, {context_tokens} context tokens, "
                    f"1 generation requests, {decode_tokens} generation tokens, iteration elapsed time: 1.00 ms, "
                    "GPU KV cache usage: 0.1%")

    def completion(self, n_prompt: int) -> bool:
        """A request of ``n_prompt`` tokens, in flight for a moment; False when that killed the engine."""
        log(f"INFO fake: completion request of {n_prompt} prompt tokens")
        with self.lock:
            fell_back, self.fallback_line = self.fallback_line, None
            self.in_flight += n_prompt
            over = self.oom_over is not None and self.in_flight > self.oom_over
        if fell_back:
            log(f"INFO [backend.py:1] {fell_back}")
        if self.hang_over is not None and n_prompt > self.hang_over:
            time.sleep(3600)
        if over or (self.die_over is not None and n_prompt > self.die_over):
            log("ERROR [core.py] EngineCore encountered a fatal error.")
            log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.")
            log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
            threading.Timer(0.3, lambda: os._exit(1)).start()
            return False
        time.sleep(0.3)
        with self.lock:
            self.in_flight -= n_prompt
        return True


def handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet, as --disable-uvicorn-access-log
            pass

        def send_json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.send_json(200 if self.path == "/health" else 404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else prompt.split()  # token ids, or the tokenizer's words
            if self.path == "/tokenize":  # bench's check that the server counts its prompts' tokens alike
                self.send_json(200, {"tokens": [0] * len(ids)})
                return
            if self.path != "/v1/completions" or not server.completion(len(ids)):
                self.send_json(500, {"error": "EngineCore encountered an issue. See stack trace above."})
                return
            n = int(body.get("max_tokens") or 16)
            server.step(len(ids), 1)
            server.step(0, n - 1)
            usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            if not body.get("stream"):
                self.send_json(200, {"choices": [{"index": 0, "text": " w7" * n, "finish_reason": "length"}],
                                     "usage": usage})
                return
            self.send_response(200)  # HTTP/1.0: the body ends when the connection closes
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n):
                self.wfile.write(b'data: {"choices": [{"index": 0, "text": " w7"}]}\n\n')
                self.wfile.flush()
                time.sleep(0.001)
            if (body.get("stream_options") or {}).get("include_usage"):
                self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class Httpd(ThreadingHTTPServer):
    request_queue_size = 1024  # uvicorn's backlog is 2048: a burst of 100 connections is not turned away


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fake vllm serve")
    ap.add_argument("model")
    ap.add_argument("--attention-backend")
    ap.add_argument("--speculative-config")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--enable-logging-iteration-details", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args, _ = ap.parse_known_args(argv)  # the other flags are vLLM's business
    server = FakeServer(args)
    log(f"INFO fake vllm serve {args.model} on port {args.port}, backend {args.attention_backend}")
    if os.environ.get("FAKE_SERVE_EXIT_AT_START") == "1":
        # as stock vLLM 0.33 at 0.95 on the H200: its warm-up step runs out of memory
        log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.")
        log("RuntimeError: fake start-up failure")
        return 3
    plugin = args.attention_backend == "CUSTOM"
    budget = os.environ.get("MLA_PLANNER_SCRATCH_MB")
    budget_mb = int(budget or 1024)
    minimum = int(os.environ.get("FAKE_SERVE_MIN_MB") or 64 + args.max_num_seqs // 8)
    if plugin and budget_mb < minimum:  # as the plugin's start-up check: before any memory is profiled
        log("ERROR [core.py:1] EngineCore failed to start.")
        log("Traceback (most recent call last):")
        log(f"mla_planner.engine_model.settings.SettingsError: MLA_PLANNER_SCRATCH_MB={budget_mb} is below the "
            f"{minimum} MiB one step of this engine can need; set MLA_PLANNER_SCRATCH_MB={minimum} or more")
        log("RuntimeError: Engine core initialization failed. See root cause above.")
        return 1
    disturb = os.environ.get("FAKE_SERVE_DISTURB_ONCE")
    try:
        if disturb:  # the first start alone, of those started together
            os.close(os.open(disturb, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        disturb = None
    if disturb:
        log("Traceback (most recent call last):")
        log("AssertionError: Error in memory profiling. Initial free memory 10.00 GiB, current free memory 12.00 GiB. "
            "This happens when other processes sharing the same container release GPU memory while vLLM is "
            "profiling during initialization.")
        return 1
    kv_gib = 60.0 - (budget_mb / 1024 if plugin else 0.0)
    log(f"INFO [gpu_worker.py:561] Available KV cache memory: {kv_gib:.2f} GiB")
    log(f"INFO [kv_cache_utils.py:2177] GPU KV cache size: {int(kv_gib * 10000):,} tokens")
    if plugin:
        log(f"INFO [backend.py:198] mla-planner: sparse MLA scratch budget {budget_mb} MiB "
            f"({'MLA_PLANNER_SCRATCH_MB' if budget else 'default'}), reserved from the KV cache; 16 heads per rank")
    time.sleep(float(os.environ.get("FAKE_SERVE_START_S", "0.2")))
    if plugin:
        log(f"INFO [backend.py:1] mla-planner: scratch reservation of {budget_mb} MiB handed to the kernels")
    httpd = Httpd((args.host, args.port), handler(server))
    log("INFO:     Application startup complete.")
    httpd.serve_forever()
    return 0


def bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fake vllm bench serve")
    for flag in ("--base-url", "--result-dir", "--result-filename", "--label"):
        ap.add_argument(flag, required=True)
    for flag in ("--num-prompts", "--random-input-len", "--random-output-len", "--seed", "--max-concurrency"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--metadata", nargs="*", default=[])
    args, _ = ap.parse_known_args(argv)
    try:
        with urllib.request.urlopen(args.base_url + "/health", timeout=5) as response:
            up = response.status == 200
    except OSError:
        up = False
    started = time.time()
    time.sleep(float(os.environ.get("FAKE_BENCH_HOLD_S", "0")))  # a run that lasts: are two at once?
    n, tokens = args.num_prompts, args.random_input_len + args.random_output_len
    done = n if up else 0
    duration = (1.0 if "engine=plugin" in args.metadata else 1.25) + args.seed % 7 / 100  # the plugin "faster"
    result = {"backend": "vllm", "label": args.label, "num_prompts": n, "max_concurrency": args.max_concurrency,
              "duration": duration, "completed": done, "failed": n - done,
              "total_input_tokens": done * args.random_input_len, "total_output_tokens": done * args.random_output_len,
              "request_throughput": done / duration, "output_throughput": done * args.random_output_len / duration,
              "total_token_throughput": done * tokens / duration,
              "max_concurrent_requests": min(n, args.max_concurrency),
              "fake_span": [started, time.time()]}
    for metric, base in (("ttft", 40.0), ("tpot", 5.0), ("itl", 5.0), ("e2el", 900.0)):
        result.update({f"median_{metric}_ms": base + args.seed % 5, f"p99_{metric}_ms": 2 * base,
                       f"mean_{metric}_ms": base})
    os.makedirs(args.result_dir, exist_ok=True)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
    print(f"fake bench: {done}/{n} completed", flush=True)
    return 0


def main() -> int:
    return serve(sys.argv[2:]) if sys.argv[1] == "serve" else bench(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
