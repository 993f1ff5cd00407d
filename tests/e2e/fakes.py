"""Stand-ins for vLLM, torch.cuda, ``vllm serve`` and ``vllm bench serve``, for the CPU tests. No number
they produce means anything.

``modules()``: what ``run_cases.Bench`` takes for (torch, ``vllm.LLM``, ``SamplingParams``), the shape of
what run_cases touches in vLLM with a toy scheduler (prompts prefilled under the token budget in order,
then one token a step). ``python3 fakes.py serve MODEL --port P ...`` answers what the driver and vLLM's
bench client use (``/health``, ``/v1/models``, ``/tokenize``, ``/v1/completions``, streamed or not) on the
word-level tokenizer's words, and logs the lines the driver reads; ``python3 fakes.py bench ...`` writes a
result shaped like bench's. Stock at utilization 0.95 runs out of memory past 16,384 prompt tokens in a
step (in-process: raises) or in flight (served: a CUDA OOM logged, HTTP 500, exit), as it does on 32K.

The served stand-in's environment steers it: FAKE_SERVE_START_S (seconds before it listens),
FAKE_SERVE_EXIT_AT_START=1 (an OOM at start-up), FAKE_SERVE_MIN_MB (the plugin's minimum budget, else
64 + ``--max-num-seqs`` / 8, refused as the plugin does), FAKE_SERVE_DIE_OVER=N and FAKE_SERVE_HANG_OVER=N
(a prompt over N tokens kills the engine, or never answers), FAKE_SERVE_DISTURB_ONCE=PATH (the first start
fails as vLLM's memory profiling does when another process frees memory). The plugin reserves
MLA_PLANNER_SCRATCH_MB (1024) from its KV cache and, speculating, logs one step that fell back.
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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

from step_log import stamp

GIB = 1 << 30
OOM_TOKENS = 16384
TOTAL = 140 * GIB


class FakeOOM(RuntimeError):
    pass


@dataclass
class FakeParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    detokenize: bool = True
    logprobs: int | None = None


@dataclass
class _Request:
    internal_id: str
    external_id: str
    prompt: list[int]
    params: FakeParams
    computed: int = 0
    generated: list[int] = field(default_factory=list)


class FakeCuda:
    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    def synchronize(self) -> None:
        pass

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_allocated(self) -> int:
        return self.allocated

    max_memory_reserved, memory_reserved = max_memory_allocated, memory_allocated

    def mem_get_info(self) -> tuple[int, int]:
        return TOTAL - self.allocated, TOTAL

    def get_device_name(self) -> str:
        return "Fake H200 (CPU stand-in)"


CUDA = FakeCuda()


def _impl(planned: bool) -> Any:
    """An object whose class has the module and name of the real implementation."""
    if planned:
        return type("PlannedFlashMLASparseImpl", (), {"__module__": "mla_planner.vllm_backend.backend"})()
    return type("FlashMLASparseImpl", (), {"__module__": "vllm.v1.attention.backends.mla.flashmla_sparse"})()


class FakeEngine:
    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.budget = int(kwargs["max_num_batched_tokens"])
        util = float(kwargs["gpu_memory_utilization"])
        planned = kwargs["attention_backend"] == "CUSTOM"
        self.oom = not planned and util >= 0.95
        kv_bytes = int(util * TOTAL) - 8 * GIB - (GIB if planned else 0)  # planned reserves a 1 GiB scratch
        block_bytes = 64 * 1200
        blocks = kv_bytes // block_bytes
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=64, kv_cache_size_tokens=blocks * 64,
                                         kv_cache_max_concurrency=blocks * 64 / kwargs["max_model_len"]),
            compilation_config=SimpleNamespace(static_forward_context={
                f"model.layers.{i}.attn": SimpleNamespace(
                    attn_backend=SimpleNamespace(get_name=lambda: "FLASHMLA_SPARSE"),  # ours keeps stock's name
                    impl=_impl(planned))
                for i in range(2)}),
        )
        kv_config = SimpleNamespace(
            kv_cache_tensors=[SimpleNamespace(size=blocks * 64 * 656, block_stride=0),
                              SimpleNamespace(size=blocks * block_bytes - blocks * 64 * 656, block_stride=0)],
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace())])
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(
            available_gpu_memory_for_kv_cache=kv_bytes, scheduler=SimpleNamespace(kv_cache_config=kv_config)))
        self.output_processor = SimpleNamespace(request_states={})
        self._ids = itertools.count()
        CUDA.allocated = CUDA.peak = 2 * GIB + blocks * block_bytes

    @property
    def _requests(self) -> dict[str, _Request]:
        states: dict[str, _Request] = self.output_processor.request_states
        return states

    def add(self, prompt: dict[str, list[int]], params: FakeParams) -> str:
        ext = str(next(self._ids))
        req = _Request(f"{ext}-abcd1234", ext, list(prompt["prompt_token_ids"]), params)
        self._requests[req.internal_id] = req
        return req.internal_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def step(self) -> list[Any]:
        time.sleep(0.001)
        left, prefill = self.budget, 0
        for req in self._requests.values():
            if req.computed < len(req.prompt):
                take = min(left, len(req.prompt) - req.computed)
                req.computed += take
                left -= take
                prefill += take
                if req.computed == len(req.prompt):
                    req.generated.append(100 + sum(req.prompt) % 1000)
            elif left > 0:
                left -= 1
                req.generated.append(100 + (sum(req.prompt) + len(req.generated)) % 1000)
        CUDA.transient(prefill * 4096)
        if self.oom and prefill > OOM_TOKENS:
            raise FakeOOM("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 139.8 GiB")
        outputs = []
        for req in list(self._requests.values()):
            if len(req.generated) >= req.params.max_tokens:
                del self._requests[req.internal_id]
                logprobs = None
                if req.params.logprobs:
                    logprobs = [{t: SimpleNamespace(logprob=-1.0), t + 1: SimpleNamespace(logprob=-1.25)}
                                for t in req.generated]
                completion = SimpleNamespace(token_ids=list(req.generated), finish_reason="length", logprobs=logprobs)
                outputs.append(SimpleNamespace(request_id=req.external_id, finished=True,
                                               prompt_token_ids=req.prompt, outputs=[completion]))
        return outputs


class FakeLLM:
    def __init__(self, **kwargs: Any) -> None:
        self.llm_engine = FakeEngine(kwargs)

    def enqueue(self, prompts: list[dict[str, list[int]]], params: FakeParams, use_tqdm: bool = True) -> list[str]:
        return [self.llm_engine.add(p, params) for p in prompts]


def modules() -> tuple[Any, Any, Any]:
    """What ``run_cases.Bench`` takes in place of (torch, vllm.LLM, vllm.SamplingParams)."""
    return SimpleNamespace(cuda=CUDA), FakeLLM, FakeParams


# --- vllm serve and vllm bench serve ---------------------------------------------------------------

SPECIALS = {"<s>": 0, "</s>": 1, "<unk>": 2}


def encode(text: str) -> list[int]:
    return [SPECIALS.get(w, int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 2) for w in text.split()]


class FakeServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.served_model_name or args.model
        self.model = args.model
        stock = args.attention_backend == "FLASHMLA_SPARSE"
        self.oom_over = OOM_TOKENS if stock and args.gpu_memory_utilization >= 0.95 else None
        # any engine: a longer prompt kills it, or never answers
        self.die_over, self.hang_over = (int(v) if (v := os.environ.get(f"FAKE_SERVE_{k}_OVER")) else None
                                        for k in ("DIE", "HANG"))
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
    for flag in ("--attention-backend", "--served-model-name", "--speculative-config"):
        ap.add_argument(flag)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--enable-logging-iteration-details", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args, _ = ap.parse_known_args(argv)  # the other flags are vLLM's business
    server = FakeServer(args)
    server.log(f"INFO fake vllm serve {args.model} on port {args.port}, backend {args.attention_backend}")
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
