"""GPU side of `mla-planner calibrate`: fresh inputs per measurement, CUDA-event timing.

A *token case* (H heads, T tokens) is one prefill request of T tokens whose causal top-k
indices come from :mod:`.synthetic`'s inputs, with ``max(0, topk - T)`` tokens of context so
every query has at least top-k keys to choose from. It times the two kernels a route would call
on it: the FP8 sparse decode kernel as ``b = 1, s_q = T`` over the paged cache (the mixed route),
and the BF16 sparse prefill kernel over the request's up-converted rows (the separate route). At
native heads (16 or 32 on sm90, unpadded) only the prefill kernel runs: the decode kernel has no
such kernels, and the planner pads its q whatever the prefill kernel runs.
A *gather case* (R rows) times the gather-and-up-convert of one request's R cache rows, on
shuffled pages, into a BF16 workspace.

Before each timed call: a 256 MiB write evicts L2 (inside a model, other layers run between
two attention calls), then a short GPU sleep keeps the stream busy while the host enqueues the
call, so host launch overhead stays outside the events.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mla_planner.executor.layout import D_QK, PAGE_SIZE, page_of, slot_of
from mla_planner.executor.providers import KernelProvider
from mla_planner.executor.reference import gather_upconvert

from .synthetic import PrefillCase, prefill_case

if TYPE_CHECKING:
    import torch

L2_FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 1_000_000  # ~0.5 ms at 2 GHz: longer than the host needs to enqueue one call
def case_context(tokens: int, topk: int) -> int:
    return max(0, topk - tokens)


@dataclass(frozen=True)
class TokenCase:
    heads: int
    tokens: int
    native: bool = False
    """The prefill kernel alone, at ``heads`` unpadded."""


@dataclass(frozen=True)
class GatherCase:
    rows: int


class GatherOp:
    """One request's FP8 rows -> a BF16 workspace, by vLLM's kernel or :func:`gather_upconvert`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "vllm":
            try:
                from vllm import _custom_ops
            except (ImportError, OSError, RuntimeError) as exc:
                raise RuntimeError(f"cannot import vLLM's cp_gather_and_upconvert_fp8_kv_cache: {exc}") from exc
            self._op: Any = _custom_ops.cp_gather_and_upconvert_fp8_kv_cache
            # Some releases take per-request lengths; others infer them from the workspace.
            self._takes_seq_lens = "seq_lens" in inspect.signature(self._op).parameters

    def __call__(self, case: PrefillCase, rows: int, workspace: torch.Tensor) -> None:
        import torch

        if self.kind == "torch":
            gather_upconvert(case.kv_cache, case.block_table[0], 0, rows, workspace[:rows])
            return
        dev = workspace.device
        cache = case.kv_cache.view(case.kv_cache.shape[0], PAGE_SIZE, -1)  # vLLM's (blocks, 64, 656)
        starts = torch.zeros(1, dtype=torch.int32, device=dev)
        if self._takes_seq_lens:
            lens = torch.full((1,), rows, dtype=torch.int32, device=dev)
            self._op(cache, workspace[:rows], case.block_table, lens, starts, 1)
        else:
            self._op(cache, workspace[:rows], case.block_table, starts, 1)


class Timer:
    def __init__(self, device: torch.device) -> None:
        import torch

        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        """Microseconds of GPU time ``fn`` enqueues."""
        import torch

        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        return 1000.0 * float(start.elapsed_time(end))


class KernelBench:
    """Times the kernels of token and gather cases; inputs are drawn fresh for every call."""

    def __init__(self, provider: KernelProvider, gather: GatherOp, topk: int, gen: torch.Generator) -> None:
        self.provider, self.gather, self.topk, self.gen = provider, gather, topk, gen
        self.timer = Timer(gen.device)
        self.scale = D_QK**-0.5
        # One decode schedule per shape, filled by its first (warm-up) call and reused after, as
        # vLLM reuses one per step across layers.
        self._schedules: dict[TokenCase, Any] = {}
        self._coin = random.Random(gen.initial_seed())  # host-side: no device sync

    def refuses_native_prefill(self, heads: int) -> str | None:
        """Why the prefill kernel will not run ``heads`` unpadded (its error's first line), or
        ``None`` when a tiny call at those heads runs."""
        import torch

        inputs = prefill_case([16], [self.topk], heads, self.topk, self.gen, dtype=torch.bfloat16)
        rows = self.topk + 16
        workspace = torch.empty((rows, D_QK), dtype=torch.bfloat16, device=self.gen.device)
        gather_upconvert(inputs.kv_cache, inputs.block_table[0], 0, rows, workspace)
        try:
            self.provider.sparse_prefill(inputs.q, workspace.unsqueeze(1), inputs.indices.unsqueeze(1), self.scale)
            if inputs.q.is_cuda:
                torch.cuda.synchronize()  # an asynchronous launch failure surfaces here
        except Exception as e:  # whatever the build raises for heads it has no kernel for
            return (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None

    def token_case(self, case: TokenCase) -> dict[str, float]:
        """``{"sparse_decode": us, "sparse_prefill": us}`` on one fresh input (the prefill kernel
        alone for a native case)."""
        import torch

        context = case_context(case.tokens, self.topk)
        inputs = prefill_case([case.tokens], [context], case.heads, self.topk, self.gen, dtype=torch.bfloat16)
        rows = context + case.tokens
        workspace = torch.empty((rows, D_QK), dtype=torch.bfloat16, device=self.gen.device)
        gather_upconvert(inputs.kv_cache, inputs.block_table[0], 0, rows, workspace)
        q, positions = inputs.q, inputs.indices

        def prefill() -> None:
            self.provider.sparse_prefill(q, workspace.unsqueeze(1), positions.unsqueeze(1), self.scale)

        if case.native:
            return {"sparse_prefill": self.timer(prefill)}
        slots = self._slots(inputs)
        if case not in self._schedules:
            self._schedules[case] = self.provider.new_decode_schedule()
        schedule = self._schedules[case]

        def decode() -> None:
            self.provider.sparse_decode(q.unsqueeze(0), inputs.kv_cache, slots.unsqueeze(0), schedule, self.scale)

        order = [("sparse_decode", decode), ("sparse_prefill", prefill)]
        self._coin.shuffle(order)
        return {name: self.timer(fn) for name, fn in order}

    def gather_case(self, case: GatherCase) -> float:
        import torch

        # One query token after rows - 1 of context: a request of `rows` rows, q and indices tiny.
        inputs = prefill_case([1], [case.rows - 1], 64, 64, self.gen, dtype=torch.bfloat16)
        workspace = torch.empty((case.rows, D_QK), dtype=torch.bfloat16, device=self.gen.device)
        return self.timer(lambda: self.gather(inputs, case.rows, workspace))

    def _slots(self, inputs: PrefillCase) -> torch.Tensor:
        """Request positions -> cache slots (what the decode kernel reads), -1 kept."""
        import torch

        pos = inputs.indices
        return slot_of(inputs.block_table[0][page_of(pos, PAGE_SIZE)], pos, PAGE_SIZE).to(torch.int32)
