"""Stand-ins for ``vllm serve`` and ``vllm bench serve``, for CPU tests of the serving driver.

    python3 serve_fakes.py serve MODEL_DIR --port P --attention-backend B ...   # the server's flags
    python3 serve_fakes.py bench --base-url URL --num-prompts N ...             # bench's flags

``serve`` answers what the driver and vLLM's bench client use: ``/health``, ``/v1/models``,
``/tokenize`` and ``/v1/completions`` (token-id or text prompts, streamed as server-sent events or
not), on the word-level tokenizer's words (``w<id>``). It logs the lines the driver reads (KV cache,
the plugin's budget) and, under ``--enable-logging-iteration-details``, vLLM's line per engine step
(two a request). Like e2e_fakes, stock (FLASHMLA_SPARSE) at gpu_memory_utilization >= 0.95
"runs out of memory" when more than 16,384 prompt tokens are in flight at once: it logs a CUDA OOM,
answers 500 and exits, as a server whose engine died. The environment steers start-up:
FAKE_SERVE_START_S (seconds before it listens, default 0.2), FAKE_SERVE_EXIT_AT_START=1 (logs a CUDA
OOM and exits with an error instead). For the matrix: the plugin (CUSTOM) refuses to start below
its minimum budget with the line the plugin logs (``set MLA_PLANNER_SCRATCH_MB=N or more``; N is
FAKE_SERVE_MIN_MB, or 64 + ``--max-num-seqs`` / 8), reserves MLA_PLANNER_SCRATCH_MB (1024 unless
set) from its KV cache, and with ``--speculative-config`` logs one line of a step that fell back to
the bounded path; FAKE_SERVE_DIE_OVER=N makes any server's engine die on a prompt of more than N
tokens (FAKE_SERVE_HANG_OVER=N: never answer it), and FAKE_SERVE_DISTURB_ONCE=PATH makes the first
server to start (the one that creates PATH) fail as vLLM's memory profiling does when another
process frees GPU memory meanwhile. ``bench`` writes a result JSON shaped like bench's: every
prompt completed if the server's /health answers 200, none otherwise. No number either produces
means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from step_log import stamp

OOM_TOKENS = 16384
SPECIALS = {"<s>": 0, "</s>": 1, "<unk>": 2}


def encode(text: str) -> list[int]:
    return [SPECIALS.get(w, int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 2) for w in text.split()]


class FakeServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.served_model_name or args.model
        self.model = args.model
        stock = args.attention_backend == "FLASHMLA_SPARSE"
        self.oom_over = OOM_TOKENS if stock and args.gpu_memory_utilization >= 0.95 else None
        die_over = os.environ.get("FAKE_SERVE_DIE_OVER")
        self.die_over = int(die_over) if die_over else None  # any engine: a longer prompt kills it
        hang_over = os.environ.get("FAKE_SERVE_HANG_OVER")
        self.hang_over = int(hang_over) if hang_over else None  # any engine: a longer prompt never answers
        # the line a step that fell back logs (plugin with speculative decoding), once
        self.fallback_line: str | None = (
            "mla-planner: a step falls back to the bounded path: uniform decodes of 1 + k tokens (said once per reason)"
            if args.attention_backend == "CUSTOM" and args.speculative_config else None)
        self.in_flight = 0
        self.lock = threading.Lock()
        self.log_iterations = args.enable_logging_iteration_details
        self.iteration = 0

    def log(self, line: str) -> None:
        print(line, flush=True)

    def step(self, context_tokens: int, decode_tokens: int) -> None:
        """vLLM's line per engine step under --enable-logging-iteration-details (a request here is two
        steps: its prompt, then its decodes as one)."""
        if not self.log_iterations:
            return
        with self.lock:
            self.iteration += 1
            self.log(f"(APIServer pid={os.getpid()}) INFO {stamp()} [loggers.py:181] Engine 000: "
                     f"Iteration({self.iteration}): {int(context_tokens > 0)} context requests, {context_tokens} "
                     f"context tokens, 1 generation requests, {decode_tokens} generation tokens, iteration elapsed "
                     "time: 1.00 ms, GPU KV cache usage: 0.1%")

    def die(self) -> None:
        self.log("ERROR [core.py] EngineCore encountered a fatal error.")
        self.log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.")
        self.log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
        threading.Timer(0.3, lambda: os._exit(1)).start()

    def prefill(self, n: int) -> bool:
        """Holds ``n`` tokens in flight for a moment; False when that "ran out of memory"."""
        with self.lock:
            self.in_flight += n
            over = self.oom_over is not None and self.in_flight > self.oom_over
        if over:
            self.die()
            return False
        time.sleep(0.3)
        with self.lock:
            self.in_flight -= n
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
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self.send_json(200, {"data": [{"id": server.name, "root": server.model}]})
            else:
                self.send_json(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/tokenize":
                self.send_json(200, {"tokens": encode(body["prompt"])})
                return
            if self.path != "/v1/completions":
                self.send_json(404, {"error": "not found"})
                return
            prompt = body["prompt"]
            ids = list(prompt) if isinstance(prompt, list) else encode(prompt)
            server.log(f"INFO fake: completion request of {len(ids)} prompt tokens")
            with server.lock:
                fell_back, server.fallback_line = server.fallback_line, None
            if fell_back:
                server.log(f"INFO [backend.py:1] {fell_back}")
            if server.hang_over is not None and len(ids) > server.hang_over:
                time.sleep(3600)
            if server.die_over is not None and len(ids) > server.die_over:
                server.die()
                self.send_json(500, {"error": "EngineCore encountered an issue. See stack trace above."})
                return
            if not server.prefill(len(ids)):
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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--attention-backend")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--served-model-name")
    ap.add_argument("--enable-logging-iteration-details", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--speculative-config")
    args, _ = ap.parse_known_args(argv)  # the other flags are vLLM's business
    server = FakeServer(args)
    server.log(f"INFO fake vllm serve {args.model} on port {args.port}, backend {args.attention_backend}, "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    if os.environ.get("FAKE_SERVE_EXIT_AT_START") == "1":
        # as stock vLLM 0.33 at 0.95 on the H200: its warm-up step runs out of memory
        server.log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.")
        server.log("RuntimeError: fake start-up failure")
        return 3
    plugin = args.attention_backend == "CUSTOM"
    budget = os.environ.get("MLA_PLANNER_SCRATCH_MB")
    budget_mb = int(budget) if budget else 1024
    if plugin:
        minimum = int(os.environ.get("FAKE_SERVE_MIN_MB") or 64 + args.max_num_seqs // 8)
        if budget_mb < minimum:  # as the plugin's start-up check: before any memory is profiled
            server.log("ERROR [core.py:1] EngineCore failed to start.")
            server.log("Traceback (most recent call last):")
            server.log(f"mla_planner.engine_model.settings.SettingsError: MLA_PLANNER_SCRATCH_MB={budget_mb} is below "
                       f"the {minimum} MiB one step of this engine can need; set MLA_PLANNER_SCRATCH_MB={minimum} or more")
            server.log("RuntimeError: Engine core initialization failed. See root cause above.")
            return 1
    disturb = os.environ.get("FAKE_SERVE_DISTURB_ONCE")
    if disturb:
        try:
            os.close(os.open(disturb, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            server.log("Traceback (most recent call last):")
            server.log("AssertionError: Error in memory profiling. Initial free memory 10.00 GiB, current free memory "
                       "12.00 GiB. This happens when other processes sharing the same container release GPU memory "
                       "while vLLM is profiling during initialization.")
            return 1
    kv_gib = 60.0 - (budget_mb / 1024 if plugin else 0.0)
    server.log(f"INFO [gpu_worker.py:561] Available KV cache memory: {kv_gib:.2f} GiB")
    server.log(f"INFO [kv_cache_utils.py:2177] GPU KV cache size: {int(kv_gib * 10000):,} tokens")
    if plugin:
        source = "MLA_PLANNER_SCRATCH_MB" if budget else "default"
        server.log(f"INFO [backend.py:198] mla-planner: sparse MLA scratch budget {budget_mb} MiB ({source}), reserved "
                   "from the KV cache; 16 heads per rank")
    time.sleep(float(os.environ.get("FAKE_SERVE_START_S", "0.2")))
    if plugin:
        server.log(f"INFO [backend.py:1] mla-planner: scratch reservation of {budget_mb} MiB handed to the kernels")
    httpd = Httpd((args.host, args.port), handler(server))
    server.log("INFO:     Application startup complete.")
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
    plugin = "engine=plugin" in args.metadata
    try:
        with urllib.request.urlopen(args.base_url + "/health", timeout=5) as response:
            up = response.status == 200
    except OSError:
        up = False
    started = time.time()
    time.sleep(float(os.environ.get("FAKE_BENCH_HOLD_S", "0")))  # a run that lasts: are two at once?
    n = args.num_prompts
    done = n if up else 0
    duration = (1.0 if plugin else 1.25) + args.seed % 7 / 100  # the plugin "faster", to test the ratios
    result = {"backend": "vllm", "label": args.label, "num_prompts": n, "max_concurrency": args.max_concurrency,
              "duration": duration, "completed": done, "failed": n - done,
              "total_input_tokens": done * args.random_input_len, "total_output_tokens": done * args.random_output_len,
              "request_throughput": done / duration, "output_throughput": done * args.random_output_len / duration,
              "total_token_throughput": done * (args.random_input_len + args.random_output_len) / duration,
              "max_concurrent_requests": min(n, args.max_concurrency), "fake_span": [started, time.time()]}
    for metric, base in (("ttft", 40.0), ("tpot", 5.0), ("itl", 5.0), ("e2el", 900.0)):
        result[f"median_{metric}_ms"] = result[f"p50_{metric}_ms"] = base + args.seed % 5
        result[f"p99_{metric}_ms"] = 2 * base
        result[f"mean_{metric}_ms"] = base
    os.makedirs(args.result_dir, exist_ok=True)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
    print(f"fake bench: {done}/{n} completed", flush=True)
    return 0


def main() -> int:
    mode, rest = sys.argv[1], sys.argv[2:]
    return serve(rest) if mode == "serve" else bench(rest)


if __name__ == "__main__":
    sys.exit(main())
