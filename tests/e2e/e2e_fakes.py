"""Stand-ins for torch.cuda and vLLM's LLM, for CPU tests of run_cases.py, run_e2e.py and the report.

They copy the shape of what run_cases touches in vLLM 0.26.0 (``LLM.enqueue``, ``llm_engine.step``/
``has_unfinished_requests``/``abort_request``/``output_processor.request_states``,
the cache config and the engine core's KV cache config) and nothing of its behaviour beyond a toy
scheduler: prompts are prefilled under the token budget in order, then decode one token a step.
The stock stand-in at gpu_memory_utilization >= 0.95 raises a CUDA-OOM-like error on any step that
prefills more than 16,384 tokens (stock dies on 32K steps at 0.95: docs/kernels.md), leaving its requests
in the engine as vLLM does. No number they produce means anything.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

GIB = 1 << 30
TOTAL = 140 * GIB
OOM_STEP_TOKENS = 16384


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
        self.allocated = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    def synchronize(self) -> None:
        pass

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def max_memory_reserved(self) -> int:
        return self.peak

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.allocated

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
        CUDA.allocated = 0
        CUDA.alloc(2 * GIB + blocks * block_bytes)

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
        if self.oom and prefill > OOM_STEP_TOKENS:
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
