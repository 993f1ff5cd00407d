"""On the GPU: chunked kernel outputs against the float32 reference, with FlashMLA's own
tolerances (its tests/test-sparse-decode.py and tests/test-sparse-prefill.py).

Inputs are plain Gaussian rows (``spread=0``), the distribution FlashMLA's tolerances were set
for; the CPU tests cover the per-row magnitude spread.

A split request's merged rows are held to FlashMLA's tolerance or the merge's error bound,
whichever is larger (``lse_merge.merge_error_bound``; docs/executor.md, "Accuracy of split
requests"); the bound assumes each window's kernel call meets FlashMLA's criteria, which the test
checks call by call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from mla_planner.calibration.synthetic import mixed_case, prefill_case
from mla_planner.executor import KernelProvider
from mla_planner.executor.layout import as_slots
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

from gpu_helpers import (
    PREFILL_OUT,
    MiB,
    assert_close_flashmla,
    assert_within_split_bound,
    cosine_difference,
    kernel_call_accuracy,
    lse_error,
)
from harness.lse_merge import merge_error_bound
from harness.mixed import mixed_for_heads, plan_tokens, run_plan
from harness.separate_prefill import SeparatePrefillExecutor

pytestmark = pytest.mark.gpu

TOPK = 2048
SCALE = 576**-0.5


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_chunked_decode_matches_the_reference(provider: KernelProvider, gen: torch.Generator, heads: int) -> None:
    num_tokens = 3000
    case = mixed_case(num_tokens, heads, TOPK, 65536, gen, dtype=torch.bfloat16, spread=0.0)
    executor = mixed_for_heads(provider, heads, 256 * MiB, topk=TOPK)
    plan = plan_tokens(executor, num_tokens)
    assert len(plan) > 1
    out = torch.full((num_tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    run_plan(executor, plan, case.q, case.kv_cache, case.indices, out)

    expected, _ = sparse_attention(case.q, as_slots(case.kv_cache), case.indices, SCALE)
    assert_close_flashmla("decode out", out, expected.to(torch.bfloat16), abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)


class _Recorder:
    """The kernels under test, passed through; keeps every sparse prefill call's real heads. The
    executor makes one call per chunk row (one key window), in plan order."""

    def __init__(self, inner: KernelProvider, heads: int) -> None:
        self.inner = inner
        self.heads = heads
        self.name = inner.name
        self.decode_takes_out = inner.decode_takes_out
        self.prefill_takes_out = inner.prefill_takes_out
        self.prefill_calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def new_decode_schedule(self) -> Any:
        return self.inner.new_decode_schedule()

    def sparse_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, schedule: Any, softmax_scale: float, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.sparse_decode(q, kv_cache, indices, schedule, softmax_scale, out=out)

    def sparse_prefill(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, out: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = self.inner.sparse_prefill(q, kv, indices, softmax_scale, out=out, topk_length=topk_length)
        self.prefill_calls.append((o[:, : self.heads].clone(), lse[:, : self.heads].clone()))
        return o, lse

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        self.inner.gather_upconvert(kv_cache, workspace, block_table, workspace_starts, num_requests)


def _split_pieces(chunks: npt.NDArray[np.int64]) -> dict[tuple[int, int, int], list[tuple[int, int, int]]]:
    """(request, query start, query end) of each query piece of a split request -> its windows
    as (chunk row, key start, key end), in plan order (the order the executor merges them)."""
    pieces: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for row, (request, _, q_start, q_end, key_start, key_end, _) in enumerate(chunks.tolist()):
        if q_start >= 0:
            pieces.setdefault((request, q_start, q_end), []).append((row, key_start, key_end))
    return pieces


# How far the split bound may go past FlashMLA's tolerance, in units of its abs tolerance: on
# this case's inputs the largest extra is about 20 (median about 2); docs/executor.md.
MAX_EXTRA = 32.0


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_separate_prefill_with_a_split_request_matches_the_reference(provider: KernelProvider, gen: torch.Generator, heads: int) -> None:
    query_lens, context_lens = [700, 300, 1500], [500, 0, 3000]
    case = prefill_case(query_lens, context_lens, heads, TOPK, gen, dtype=torch.bfloat16, spread=0.0)
    recorder = _Recorder(provider, heads)
    executor = SeparatePrefillExecutor(recorder, heads)
    chunks = executor.plan(query_lens, context_lens, 2048)  # request 2 (4,500 rows) is split
    assert bool((chunks[:, 2] >= 0).any())
    t = sum(query_lens)
    out = torch.full((t, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.run(chunks, case.q, case.kv_cache, case.block_table, query_lens, context_lens, case.indices, out)
    assert len(recorder.prefill_calls) == len(chunks)

    slots, expected, first = as_slots(case.kv_cache), [], 0

    def request_rows(r: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device="cuda")
        return dequantize_fp8_ds_mla(slots[case.block_table[r][pos // 64].long() * 64 + pos % 64])

    for r, (qlen, clen) in enumerate(zip(query_lens, context_lens)):
        expected.append(sparse_attention(case.q[first : first + qlen], request_rows(r, 0, qlen + clen), case.indices[first : first + qlen], SCALE)[0])
        first += qlen
    reference = torch.cat(expected)

    # Every check runs and prints before the test fails, so one GPU run shows them all.
    failures: list[str] = []

    def check(run: Callable[[], None]) -> None:
        try:
            run()
        except AssertionError as exc:
            failures.append(str(exc))

    query_starts = np.concatenate([[0], np.cumsum(query_lens)])
    whole = torch.ones(t, dtype=torch.bool, device="cuda")
    pieces = []
    for (request, q_start, q_end), windows in _split_pieces(chunks).items():
        tokens = slice(int(query_starts[request]) + q_start, int(query_starts[request]) + q_end)
        whole[tokens] = False
        pieces.append((request, tokens, windows))

    # Rows computed by one kernel call each (whole requests): the kernel's own accuracy, the
    # yardstick for the split rows below.
    single_call_misses: list[float] = []
    check(lambda: single_call_misses.append(
        kernel_call_accuracy("prefill out (whole requests)", out[whole].float(), reference[whole], **PREFILL_OUT)))

    # A split request: each window's call against its own float32 reference (FlashMLA's output
    # criterion: the bound's assumption; the lse's measured error goes into the bound), then the
    # merged rows against the unsplit reference within the bound.
    for request, tokens, windows in pieces:
        positions = case.indices[tokens]
        parts, lses, lse_errs = [], [], []
        for row, key_start, key_end in windows:
            inside = (positions >= key_start) & (positions < key_end)
            o, lse = sparse_attention(case.q[tokens], request_rows(request, key_start, key_end), torch.where(inside, positions - key_start, -1), SCALE)
            kernel_o, kernel_lse = recorder.prefill_calls[row]
            window = f"window {row} (rows {tokens.start}-{tokens.stop}, keys {key_start}-{key_end})"
            check(lambda: single_call_misses.append(kernel_call_accuracy(f"{window} out", kernel_o.float(), o, **PREFILL_OUT)))
            try:
                lse_errs.append(lse_error(f"{window} lse", kernel_lse, lse))
            except AssertionError as exc:
                failures.append(str(exc))
                lse_errs.append(torch.zeros_like(lse, dtype=torch.float64))  # failure recorded above
            parts.append(o)
            lses.append(lse)
        bound = merge_error_bound(
            torch.stack(parts), torch.stack(lses), out.dtype,
            out_abs=PREFILL_OUT["abs_tol"], out_rel=PREFILL_OUT["rel_tol"], lse_abs=torch.stack(lse_errs),
        ).bound
        name = f"prefill out (rows {tokens.start}-{tokens.stop}, {len(windows)} windows merged)"
        check(lambda: assert_within_split_bound(
            name, out[tokens].float(), reference[tokens], bound,
            abs_tol=PREFILL_OUT["abs_tol"], rel_tol=PREFILL_OUT["rel_tol"], max_extra=MAX_EXTRA,
        ))
        # And no less accurate than one kernel call: the share of elements outside FlashMLA's
        # element-wise criterion is at most the worst single call's.
        merged = kernel_call_accuracy(f"{name}, element-wise", out[tokens].float(), reference[tokens], **PREFILL_OUT)
        if single_call_misses and merged > max(single_call_misses):
            failures.append(f"{name}: {merged:.4%} outside FlashMLA's element-wise criterion, "
                            f"more than a single kernel call's {max(single_call_misses):.4%}")

    # FlashMLA's cosine criterion over the whole output, as for an unsplit step.
    cos_diff = cosine_difference(out.float(), reference)
    print(f"prefill out (all rows): cos diff {cos_diff:.3g}")
    if cos_diff > PREFILL_OUT["cos_diff_tol"]:
        failures.append(f"prefill out (all rows): cos diff {cos_diff:.3g} > {PREFILL_OUT['cos_diff_tol']}")
    assert not failures, "\n".join(failures)
