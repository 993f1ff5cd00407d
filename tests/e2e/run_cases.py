"""The in-process runner (docs/e2e.md): one vLLM engine in this process, stock FLASHMLA_SPARSE or the
planned backend, the cases in order. The JSON is rewritten after every case, so a crash keeps what came
before; a case that raises (stock's CUDA OOM) is a result, and the next case runs in the same engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import faults

MODEL_DIR = Path(__file__).resolve().parent / "tiny-deepseek-v32"
BACKENDS = {"stock": "FLASHMLA_SPARSE", "planned": "CUSTOM"}
ENV_DEFAULTS = {  # what vLLM needed on the H200, set unless already set
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: torch.cuda peak stats see it
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "CUDA_HOME": "/usr/local/cuda",  # DeepGEMM compiles the indexer's kernels at first use with nvcc
    "VLLM_NO_USAGE_STATS": "1",  # the GPU machine has no network
}
REPLACE_VAR = "MLA_PLANNER_REPLACE_FLASHMLA_SPARSE"
PLANNER_VARS = ("MLA_PLANNER_SCRATCH_MB", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB", REPLACE_VAR)
TOKEN_RANGE = (100, 30000)
MAX_TOKENS = 4

# Case 3: the 32K blocker fills one step of 32,768 tokens; the five queued prompts (32,767 tokens)
# then share the next step with the blocker's first decode token.
CASE_PROMPTS: dict[str, list[int]] = {
    "1": [32768],
    "2": [12288, 8192, 4096, 3072, 2048, 1536, 1024, 508],  # 32,764
    "3": [32768, 16384, 4096, 4096, 4096, 4095],
    "4": [65536],
    "5": [512],
}
CASE_MAX_TOKENS = {"5": 16}
CASE_TITLES = {
    "1": "one 32,768-token prompt",
    "2": "eight heterogeneous prompts, 32,764 tokens",
    "3": "16,384 + 3 x 4,096 + 4,095 tokens queued behind a 32K blocker",
    "4": "one 65,536-token prompt",
    "5": "a short normal request after the others (engine still healthy)",
    "throughput": "prefill tokens/s, median of repeats (prefix caching off, fresh prompts)",
    "same_function": "first generated tokens of a fixed 16K prompt",
}
CASES = tuple(CASE_TITLES)
SAME_FUNCTION_SEED, TOP_LOGPROBS = 16384, 5
MIXED_DECODERS, MIXED_DECODER_LEN, MIXED_DECODE_TOKENS, MIXED_PREFILLS = 8, 1024, 48, (16384, 16384)
THROUGHPUT_TITLES = {
    "prefill_8k": "one 8,192-token prompt, max_tokens 1",
    "prefill_32k": "one 32,768-token prompt, max_tokens 1",
    "mixed": f"{len(MIXED_PREFILLS)} x {MIXED_PREFILLS[0]:,}-token prompts (max_tokens 1) arriving while "
             f"{MIXED_DECODERS} requests of {MIXED_DECODER_LEN:,} tokens decode; timed until both finish",
}
# what model_variant may change, and the suffix each gives the copy's folder
VARIANT_KEYS = {"num_attention_heads": "h", "num_hidden_layers": "l", "num_nextn_predict_layers": "mtp"}


def token_prompt(length: int, rng: random.Random) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(*TOKEN_RANGE) for _ in range(length)]}


def case_prompts(case: str) -> list[list[int]]:
    """A case's prompts: the same for both backends, in-process and served; distinct per case."""
    rng = random.Random(1000 + CASES.index(case))
    return [token_prompt(n, rng)["prompt_token_ids"] for n in CASE_PROMPTS[case]]


def engine_kwargs(backend: str, util: float, mnbt: int, *, model: Path = MODEL_DIR, max_model_len: int = 70000,
                  max_num_seqs: int = 16, seed: int = 0, tp: int = 1, block_size: int = 64) -> dict[str, Any]:
    return {"model": str(model), "tensor_parallel_size": tp, "load_format": "dummy", "skip_tokenizer_init": True,
            "kv_cache_dtype": "fp8_ds_mla", "block_size": block_size, "max_model_len": max_model_len,
            "max_num_batched_tokens": mnbt, "max_num_seqs": max_num_seqs, "gpu_memory_utilization": util,
            "enforce_eager": True, "generation_config": "vllm", "attention_backend": BACKENDS[backend],
            "attention_config": {"sparse_mla_force_mqa": True}, "enable_prefix_caching": False, "seed": seed}


def model_variant(model: Path, where: Path, heads: int | None = None, layers: int | None = None,
                  mtp_layers: int | None = None) -> Path:
    """``model``, or a copy of its config under ``where`` with ``heads`` attention heads (16 per rank
    at tensor parallel), ``layers`` hidden layers, ``mtp_layers`` MTP layers (speculative decoding)."""
    config = json.loads((model / "config.json").read_text())
    asked = {"num_attention_heads": heads, "num_hidden_layers": layers, "num_nextn_predict_layers": mtp_layers}
    changes = {k: v for k, v in asked.items() if v is not None and v != config.get(k)}
    if not changes:
        return model
    scaled = where / (model.name + "".join(f"-{v}{VARIANT_KEYS[k]}" for k, v in changes.items()))
    scaled.mkdir(parents=True, exist_ok=True)
    (scaled / "config.json").write_text(json.dumps({**config, **changes}, indent=2) + "\n")
    return scaled


def check_engine_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """Names vLLM would reject or silently drop (LLM drops unknown attention_config keys)."""
    try:
        from vllm import SamplingParams
        from vllm.config import AttentionConfig
        from vllm.engine.arg_utils import EngineArgs

        SamplingParams(**sampling_kwargs(logprobs=TOP_LOGPROBS))
    except Exception as exc:
        return [f"vllm refuses the sampling parameters or cannot be imported: {exc}"]
    fields, attn_fields = ({f.name for f in dataclasses.fields(c)} for c in (EngineArgs, AttentionConfig))
    return [f"EngineArgs has no field {k!r}" for k in kwargs if k not in fields] + [
        f"AttentionConfig has no field {k!r}" for k in kwargs["attention_config"] if k not in attn_fields]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, epilog="docs/e2e.md says what each case and option does.")
    add = ap.add_argument
    add("--backend", choices=sorted(BACKENDS), required=True)
    add("--util", type=float, required=True, help="gpu_memory_utilization")
    add("--mnbt", type=int, default=32768, help="max_num_batched_tokens")
    add("--cases", nargs="+", required=True, help=f"in order; of {', '.join(CASES)} (commas also split)")
    add("--out", type=Path, required=True, help="JSON results, rewritten after every case")
    add("--repeats", type=int, default=5, help="throughput repeats per workload")
    add("--tp", type=int, default=1, help="tensor_parallel_size (workers in their own processes)")
    add("--heads", type=int, help="the model's attention heads (default: its config's)")
    add("--block-size", type=int, default=64, help="KV cache block size, a multiple of 64 (default 64)")
    add("--case-timeout-s", type=float, default=90, help="limit on one generate call (default 90 s)")
    add("--faults", help="fault modes, comma-separated (faults.MODES): the cases run once per mode")
    add("--dry-run", action="store_true", help="print the plan, check engine arguments, run nothing")
    add("--fake-engine", action="store_true", help=argparse.SUPPRESS)  # CPU tests: fakes
    args = ap.parse_args(argv)
    args.cases = [c for item in args.cases for c in item.split(",") if c]
    if set(args.cases) - set(CASES):
        ap.error(f"unknown case(s) {sorted(set(args.cases) - set(CASES))}; known: {', '.join(CASES)}")
    if not 0 < args.util <= 1:
        ap.error("--util must be in (0, 1]")
    if min(args.repeats, args.tp, args.heads or 1) < 1 or args.block_size < 64 or args.block_size % 64:
        ap.error("--repeats, --tp and --heads must be at least 1, --block-size a multiple of 64")
    args.faults = args.faults.split(",") if args.faults else None
    if args.faults is not None and (set(args.faults) - set(faults.MODES) or args.backend != "planned" or args.tp != 1):
        ap.error(f"--faults takes {', '.join(faults.MODES)}, with --backend planned and --tp 1")
    if "4" in args.cases and args.mnbt < max(CASE_PROMPTS["4"]):
        print(f"note: case 4 with --mnbt {args.mnbt} < 65536 is prefilled in chunks", file=sys.stderr)
    return args


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4000]


def failure(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()[-3000:],
            "oom": "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"}


def external_id(request_id: str) -> str:
    """The id outputs carry: vLLM 0.26 suffixes ``-<8 random chars>`` to the one it hands back."""
    return request_id.rsplit("-", 1)[0]


def sampling_kwargs(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> dict[str, Any]:
    """Greedy, so both backends' first tokens can be compared; token ids only (no tokenizer)."""
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "detokenize": False,
            "logprobs": logprobs}


class Bench:
    """The engine and what the cases need of it; the CPU tests pass stand-ins (``fakes``) for the modules."""

    def __init__(self, kwargs: dict[str, Any], modules: tuple[Any, Any, Any] | None = None,
                 case_timeout_s: float = 90) -> None:
        self.case_timeout_s = case_timeout_s
        # With tensor parallelism the model lives in vLLM's worker processes: this process must not
        # touch the GPU (a CUDA context here would take memory from rank 0), so no peaks are read.
        self.local_gpu = kwargs.get("tensor_parallel_size", 1) == 1
        if modules is None:
            import torch
            from vllm import LLM, SamplingParams

            modules = (torch, LLM, SamplingParams)
        self.torch: Any = modules[0]
        self.SamplingParams: Any = modules[2]
        self.llm: Any = modules[1](**kwargs)

    def params(self, max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> Any:
        return self.SamplingParams(**sampling_kwargs(max_tokens, logprobs))

    def generate(self, prompts: list[dict[str, list[int]]], params: Any) -> list[Any]:
        """LLM.generate with a time limit: an engine an earlier failure left inconsistent must not hang."""
        self.llm.enqueue(prompts, params, use_tqdm=False)
        return self.run_until_done()

    def run_until_done(self, pending: set[str] | None = None) -> list[Any]:
        """Steps until no request (or none of ``pending``) is unfinished."""
        engine = self.llm.llm_engine
        deadline = time.monotonic() + self.case_timeout_s
        outputs = []
        while engine.has_unfinished_requests() if pending is None else pending:
            if pending is not None and not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine finished without requests {sorted(pending)}")
            if time.monotonic() > deadline:
                what = "requests" if pending is None else f"requests {sorted(pending)}"
                raise TimeoutError(f"{what} unfinished after {self.case_timeout_s:.0f} s")
            for out in engine.step():
                if out.finished:
                    outputs.append(out)
                    (pending or set()).discard(external_id(out.request_id))
        return sorted(outputs, key=lambda out: int(external_id(out.request_id)))

    def abort_all(self) -> int:
        """Aborts whatever a failed call left in the engine (LLM.generate does not)."""
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)
        return len(ids)

    def memory(self) -> dict[str, int]:
        if not self.local_gpu:
            return {}
        cuda = self.torch.cuda
        free, total = cuda.mem_get_info()
        return {"allocated": cuda.memory_allocated(), "reserved": cuda.memory_reserved(), "free": free,
                "total": total}

    def engine_info(self) -> dict[str, Any]:
        """The KV cache the engine got at start-up (the in-process EngineCore's scheduler holds the
        KVCacheConfig), and which attention implementation runs; None where vLLM moved a field."""
        engine = self.llm.llm_engine

        def cache() -> Any:
            return engine.vllm_config.cache_config

        def core() -> Any:
            return engine.engine_core.engine_core

        def layers() -> list[Any]:
            return list(engine.vllm_config.compilation_config.static_forward_context.values())

        reads: dict[str, Callable[[], Any]] = {
            "num_gpu_blocks": lambda: cache().num_gpu_blocks, "block_size": lambda: cache().block_size,
            "kv_cache_size_tokens": lambda: cache().kv_cache_size_tokens,
            "kv_cache_max_concurrency": lambda: cache().kv_cache_max_concurrency,
            "kv_available_bytes": lambda: core().available_gpu_memory_for_kv_cache,
            "kv_cache_bytes": lambda: kv_tensor_bytes(core().scheduler.kv_cache_config.kv_cache_tensors),
            "kv_cache_groups": lambda: [type(g.kv_cache_spec).__name__
                                        for g in core().scheduler.kv_cache_config.kv_cache_groups],
            "attention_backends": lambda: sorted({x.attn_backend.get_name() for x in layers()
                                                  if hasattr(x, "attn_backend")}),
            "attention_impls": lambda: sorted({f"{type(x.impl).__module__}.{type(x.impl).__qualname__}"
                                               for x in layers() if hasattr(x, "impl")}),
        }
        info: dict[str, Any] = {}
        for key, read in reads.items():
            try:  # an attribute moved in another vLLM costs one field, not the run
                info[key] = read()
            except Exception as exc:
                info[key] = None
                info.setdefault("info_errors", {})[key] = error_text(exc)
        return info


def kv_tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of the KV cache tensors; packed ones (``block_stride`` set) all alias one buffer."""
    packed = [t.size for t in tensors if getattr(t, "block_stride", 0)]
    return sum(int(t.size) for t in tensors if not getattr(t, "block_stride", 0)) + max(packed, default=0)


def measured(bench: Bench, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``body`` between peak-memory resets (not with tensor parallelism: the workers hold the memory);
    an exception becomes the result."""
    cuda = bench.torch.cuda if bench.local_gpu else None
    if cuda is not None:
        try:
            cuda.synchronize()
            cuda.reset_peak_memory_stats()
            before = bench.memory()
        except Exception as exc:  # a sticky CUDA error from an earlier case
            return {"status": "error", "error": f"the GPU failed before the case began: {error_text(exc)}",
                    "oom": False, "elapsed_s": 0.0}
    t0 = time.perf_counter()
    result: dict[str, Any] = {"status": "ok", "error": None, "oom": False}
    try:
        result.update(body())
    except Exception as exc:  # the result of a case, e.g. stock's CUDA OOM
        result.update(failure(exc))
    result["elapsed_s"] = time.perf_counter() - t0
    if cuda is None:
        return result
    try:
        cuda.synchronize()
    except Exception as exc:  # a sticky CUDA error shows here
        result.setdefault("sync_error", error_text(exc))
    result.update(memory_before=before, peak_allocated_bytes=cuda.max_memory_allocated(),
                  peak_reserved_bytes=cuda.max_memory_reserved())
    result["peak_over_before_bytes"] = result["peak_allocated_bytes"] - before["allocated"]
    try:
        result["memory_after"] = bench.memory()
    except Exception as exc:
        result.update(memory_after=None, sync_error=result.get("sync_error") or error_text(exc))
    return result


def run_prompts_case(bench: Bench, case: str) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": ids} for ids in case_prompts(case)]
    max_tokens = CASE_MAX_TOKENS.get(case, MAX_TOKENS)

    def body() -> dict[str, Any]:
        outputs = [{"prompt_len": len(out.prompt_token_ids or []), "finish_reason": out.outputs[0].finish_reason,
                    "token_ids": [int(t) for t in out.outputs[0].token_ids]}
                   for out in bench.generate(prompts, bench.params(max_tokens))]
        return {"outputs": outputs, "requests_with_all_tokens": sum(len(o["token_ids"]) == max_tokens for o in outputs)}

    result = measured(bench, body)
    result.update(prompt_lens=CASE_PROMPTS[case], prompt_tokens=sum(CASE_PROMPTS[case]), max_tokens=max_tokens)
    result["tokens_back"] = result.get("requests_with_all_tokens") == len(prompts)
    if result["status"] == "ok" and result["elapsed_s"] > 0:
        result["prompt_tok_s"] = result["prompt_tokens"] / result["elapsed_s"]
    return result


def time_single(bench: Bench, length: int, seed: int) -> float:
    """Prompt tokens/s of one prompt, max_tokens 1."""
    prompt = token_prompt(length, random.Random(seed))
    t0 = time.perf_counter()
    outputs = bench.generate([prompt], bench.params(max_tokens=1))
    dt = time.perf_counter() - t0
    if len(outputs) != 1 or len(outputs[0].outputs[0].token_ids) != 1:
        raise RuntimeError("no token came back")
    return length / dt


def time_mixed(bench: Bench, seed: int) -> float:
    """Prefill tokens/s of two 16K prompts arriving while eight requests decode (mixed steps)."""
    rng = random.Random(seed)
    decoders = [token_prompt(MIXED_DECODER_LEN, rng) for _ in range(MIXED_DECODERS)]
    bench.llm.enqueue(decoders, bench.params(max_tokens=MIXED_DECODE_TOKENS), use_tqdm=False)
    for _ in range(2):  # their prefill step, then a decode step
        bench.llm.llm_engine.step()
    prefills = [token_prompt(n, rng) for n in MIXED_PREFILLS]
    t0 = time.perf_counter()
    ids = bench.llm.enqueue(prefills, bench.params(max_tokens=1), use_tqdm=False)
    bench.run_until_done({external_id(i) for i in ids})
    dt = time.perf_counter() - t0
    bench.run_until_done()  # the decoders finish outside the timing
    return sum(MIXED_PREFILLS) / dt


def run_throughput(bench: Bench, repeats: int) -> dict[str, Any]:
    workloads: dict[str, Callable[[int], float]] = {
        "prefill_8k": lambda seed: time_single(bench, 8192, seed),
        "prefill_32k": lambda seed: time_single(bench, 32768, seed),
        "mixed": lambda seed: time_mixed(bench, seed),
    }

    def body() -> dict[str, Any]:
        samples: dict[str, list[float]] = {name: [] for name in workloads}
        for i, fn in enumerate(workloads.values()):  # warm-up: the first use of a shape compiles kernels
            fn(90_000 + i)
        for r in range(repeats):  # interleaved, so drift hits every workload alike
            for i, (name, fn) in enumerate(workloads.items()):
                samples[name].append(fn(100_000 + 1000 * r + i))
        return {"tok_s": samples, "median_tok_s": {k: statistics.median(v) for k, v in samples.items()},
                "repeats": repeats}

    return {**measured(bench, body), "workloads": THROUGHPUT_TITLES}


def run_same_function(bench: Bench) -> dict[str, Any]:
    prompt = token_prompt(16384, random.Random(SAME_FUNCTION_SEED))

    def body() -> dict[str, Any]:
        runs = []
        for _ in range(2):  # twice: is the backend deterministic on its own?
            (out,) = bench.generate([prompt], bench.params(MAX_TOKENS, logprobs=TOP_LOGPROBS))
            completion = out.outputs[0]
            # per generated position, [token, logprob] pairs, best first
            top = [sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()), key=lambda p: -p[1])
                   for pos in completion.logprobs or []]
            runs.append({"token_ids": [int(t) for t in completion.token_ids], "top_logprobs": top})
        return {"runs": runs, "token_ids": runs[0]["token_ids"],
                "repeat_identical": runs[0]["token_ids"] == runs[1]["token_ids"]}

    result = measured(bench, body)
    result.update(prompt_len=16384, prompt_seed=SAME_FUNCTION_SEED, max_tokens=MAX_TOKENS, greedy=True)
    result["tokens_back"] = len(result.get("token_ids", [])) == MAX_TOKENS
    return result


def run_case(bench: Bench, case: str, repeats: int) -> dict[str, Any]:
    if case == "throughput":
        return run_throughput(bench, repeats)
    return run_same_function(bench) if case == "same_function" else run_prompts_case(bench, case)


def planner_settings() -> dict[str, Any]:
    """The planned backend's scratch budget as it reads it, or why it could not."""
    try:
        from mla_planner.vllm_backend import read_settings

        s = read_settings()
    except Exception as exc:
        return {"error": error_text(exc)}
    return {"scratch_mb": s.scratch_mb, "source": s.source, "replace_flashmla_sparse": s.replace_flashmla_sparse}


def versions() -> dict[str, str]:
    found = {}
    for dist in ("vllm", "torch", "mla-planner", "transformers", "tokenizers"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if args.backend == "stock":  # with it set, our backend would stand in for FLASHMLA_SPARSE
        os.environ.pop(REPLACE_VAR, None)
    model = model_variant(MODEL_DIR, args.out.parent, heads=args.heads)
    kwargs = engine_kwargs(args.backend, args.util, args.mnbt, model=model, tp=args.tp, block_size=args.block_size)
    data: dict[str, Any] = {
        "schema": 1, "run": {"backend": args.backend, "util": args.util, "mnbt": args.mnbt, "cases": args.cases,
                             "repeats": args.repeats, "faults": args.faults},
        "engine_kwargs": kwargs, "env": {k: os.environ.get(k) for k in [*ENV_DEFAULTS, *PLANNER_VARS]},
        "case_titles": {c: CASE_TITLES[c] for c in args.cases}, "startup": {"status": "started"}, "cases": {},
        "finished": False,
    }
    if args.dry_run:
        data.update(problems=check_engine_kwargs(kwargs),
                    prompt_lens={c: CASE_PROMPTS[c] for c in args.cases if c in CASE_PROMPTS})
        print(json.dumps(data, indent=1))
        return 1 if data["problems"] else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data["versions"] = versions()
    if args.backend == "planned":
        data["planner_settings"] = planner_settings()
    write_json(args.out, data)
    if args.faults is not None:
        faults.install()
    t0 = time.perf_counter()
    try:
        if args.fake_engine:
            import fakes
        bench = Bench(kwargs, fakes.modules() if args.fake_engine else None, args.case_timeout_s)
        data["startup"] = {"status": "ok", "elapsed_s": time.perf_counter() - t0, **bench.engine_info(),
                           "memory": bench.memory(),
                           "device": bench.torch.cuda.get_device_name() if bench.local_gpu else f"{args.tp} GPUs"}
    except Exception as exc:
        data.update(startup={**failure(exc), "elapsed_s": time.perf_counter() - t0}, finished=True)
        write_json(args.out, data)
        print(f"engine start-up failed: {data['startup']['error']}", file=sys.stderr)
        return 2
    write_json(args.out, data)
    kv_bytes = data["startup"].get("kv_cache_bytes")
    print(f"engine up in {data['startup']['elapsed_s']:.0f} s: {data['startup'].get('num_gpu_blocks')} KV blocks, "
          f"{kv_bytes / (1 << 30) if isinstance(kv_bytes, int) else float('nan'):.2f} GiB KV cache", flush=True)

    failures: list[str] = []
    dead: str | None = None
    for mode, case_name in [(m, c) for m in args.faults or [None] for c in args.cases]:
        case = case_name if mode is None else f"{mode}/{case_name}"
        if dead is not None:
            data["cases"][case] = {"status": "skipped", "error": dead}
            continue
        data["cases"][case] = {"status": "started", "after_failure_in": list(failures)}
        write_json(args.out, data)
        if mode is not None:
            faults.arm(mode)
        result = run_case(bench, case_name, args.repeats)
        if mode is not None:
            result["faults"] = {**faults.read(), "reserved_bytes": faults.reserved_bytes()}
        result["after_failure_in"] = list(failures)
        if result["status"] != "ok":
            failures.append(case)
            try:
                result["aborted_requests"] = bench.abort_all()
            except Exception as exc:  # the engine cannot even drop the failed requests
                dead = f"engine dead after case {case}: {error_text(exc)}"
                result["abort_error"] = error_text(exc)
        data["cases"][case] = result
        write_json(args.out, data)
        fault = result.get("faults")
        print(f"case {case}: {result['status']} in {result['elapsed_s']:.1f} s"
              + (f" ({result['error'][:200]})" if result["error"] else "")
              + (f"; {fault['faults_fired']} faults, attention peak {fault['attention_peak_bytes'] / 2**20:.0f} MiB "
                 f"of {(fault['reserved_bytes'] or 0) / 2**20:.0f} MiB reserved, {fault['kernel_launches']} launches "
                 f"of the plugin's, steps {fault['step_counts']}" if fault else ""), flush=True)
    data["finished"] = True
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
