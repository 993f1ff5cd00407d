"""The error bound of a split request's log-sum-exp merge (docs/executor.md, "Accuracy of split
requests"), checked on the CPU: the kernel is simulated by the float32 reference with its output
rounded to bf16 (what ``ReferenceProvider`` returns for bf16 inputs), and the windows are merged
in bf16 by the executor's own merge.

(a) on fresh random inputs the merged output stays within the bound, and the bound is not loose
    (the worst element uses a good part of it);
(b) the same check fails when the merge is wrong: a window dropped, one window's lse off by 0.03
    (its weight off by 3 %), the partial outputs rounded to 6 significant bits instead of 8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch

from mla_planner.calibration.synthetic import PrefillCase, prefill_case
from mla_planner.executor import ReferenceProvider
from mla_planner.executor.layout import D_V, as_slots
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

from fixtures import gen  # noqa: F401  (a pytest fixture)
from harness.lse_merge import MergeBound, merge_error_bound, merge_window, start_merge
from harness.separate_prefill import SeparatePrefillExecutor

SCALE = 576**-0.5
BF16_U = 2.0**-8
# The simulated kernel: the exact output rounded once to bf16 (|error| <= 2^-8 |ô|), and the
# float32 reference's own lse (off from the exact lse by float32 rounding only).
SIMULATED = {"out_abs": 0.0, "out_rel": BF16_U, "lse_abs": 2.0**-20, "lse_rel": 2.0**-20}
# The GPU test's case at a tenth of its size: request 2 (300 context + 150 new rows) is longer
# than the 205-row workspace; its query pieces run over two and three key windows.
QUERY_LENS, CONTEXT_LENS, WORKSPACE_ROWS, TOPK = [70, 30, 150], [50, 0, 300], 205, 200



@dataclass(frozen=True)
class SplitLaunch:
    """One query piece of a split request: its rows of the step's output and its key windows'
    exact outputs ``(k, s, h, 512)`` and lse ``(k, s, h)``, in the plan's (= merge) order."""

    request: int
    tokens: slice
    part_out: torch.Tensor
    part_lse: torch.Tensor


def _request_rows(case: PrefillCase, request: int, start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    slots = as_slots(case.kv_cache)
    return dequantize_fp8_ds_mla(slots[case.block_table[request][pos // 64].long() * 64 + pos % 64])


def split_launches(case: PrefillCase, chunks: npt.NDArray[np.int64]) -> list[SplitLaunch]:
    """Each query piece's windows computed by the float32 reference, straight from the chunk
    plan (not through the executor): the piece's queries against the window's positions only."""
    query_starts = np.concatenate([[0], np.cumsum(case.query_lens)])
    groups: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for row in chunks.tolist():
        request, _, q_start, q_end, key_start, key_end, _ = row
        if q_start >= 0:
            groups.setdefault((request, q_start, q_end), []).append((key_start, key_end))
    launches = []
    for (request, q_start, q_end), windows in groups.items():
        tokens = slice(int(query_starts[request]) + q_start, int(query_starts[request]) + q_end)
        positions = case.indices[tokens]
        outs, lses = [], []
        for key_start, key_end in windows:
            inside = (positions >= key_start) & (positions < key_end)
            window_indices = torch.where(inside, positions - key_start, -1)
            o, lse = sparse_attention(case.q[tokens], _request_rows(case, request, key_start, key_end), window_indices, SCALE)
            outs.append(o)
            lses.append(lse)
        launches.append(SplitLaunch(request, tokens, torch.stack(outs), torch.stack(lses)))
    return launches


def _case(gen: torch.Generator, heads: int) -> tuple[PrefillCase, npt.NDArray[np.int64]]:
    case = prefill_case(QUERY_LENS, CONTEXT_LENS, heads, TOPK, gen, dtype=torch.bfloat16)
    chunks = SeparatePrefillExecutor(ReferenceProvider(takes_out=False), heads).plan(QUERY_LENS, CONTEXT_LENS, WORKSPACE_ROWS)
    windows_per_piece = np.unique(chunks[chunks[:, 2] >= 0][:, 2], return_counts=True)[1]
    assert set(windows_per_piece.tolist()) >= {2, 3}, f"expected pieces over 2 and 3 windows: {chunks}"
    return case, chunks


def _worst(merged: torch.Tensor, mb: MergeBound) -> tuple[int, float]:
    """Elements over the bound, and the largest error / bound."""
    ratio = (merged.double() - mb.merged).abs() / mb.bound
    return int((ratio > 1).sum()), float(ratio.max())


@pytest.mark.parametrize("heads", [16, 64])
def test_executor_split_request_stays_within_the_bound(gen: torch.Generator, heads: int) -> None:
    case, chunks = _case(gen, heads)
    t = sum(QUERY_LENS)
    out = torch.full((t, heads, D_V), float("nan"), dtype=torch.bfloat16)
    executor = SeparatePrefillExecutor(ReferenceProvider(takes_out=False), heads)
    executor.run(chunks, case.q, case.kv_cache, case.block_table, case.query_lens, case.context_lens, case.indices, out)

    worst = 0.0
    for launch in split_launches(case, chunks):
        mb = merge_error_bound(launch.part_out, launch.part_lse, out.dtype, **SIMULATED)
        # The windows' merge in exact arithmetic is the unsplit reference (float32 apart).
        r = launch.request
        whole_rows = _request_rows(case, r, 0, int(case.context_lens[r] + case.query_lens[r]))
        whole, _ = sparse_attention(case.q[launch.tokens], whole_rows, case.indices[launch.tokens], SCALE)
        torch.testing.assert_close(mb.merged, whole.double(), rtol=1e-5, atol=1e-6 * float(whole.abs().max()))

        over, ratio = _worst(out[launch.tokens], mb)
        assert over == 0, f"{over} elements of rows {launch.tokens} over the bound (worst error/bound {ratio:.3g})"
        worst = max(worst, ratio)
    print(f"worst error / bound: {worst:.3f}")
    # Not loose: some element uses a good part of its bound (observed 0.55-0.65).
    assert worst > 0.3, f"the bound is loose: worst error / bound {worst:.3g}"


def _round_significant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits (bf16 keeps 8), ties to even."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent.to(x.dtype))


Merge = Callable[[SplitLaunch], torch.Tensor]


def _merge(launch: SplitLaunch, *, drop: int | None = None, lse_shift: float = 0.0, bits: int = 8) -> torch.Tensor:
    """The executor's merge of the windows' bf16 outputs into a bf16 output, with a fault."""
    k, s, h, d = launch.part_out.shape
    out = torch.empty((s, h, d), dtype=torch.bfloat16)
    lse = start_merge(out)
    for i in range(k):
        if i == drop:
            continue
        part = _round_significant(launch.part_out[i], bits).to(torch.bfloat16)
        part_lse = launch.part_lse[i] + (lse_shift if i == 0 else 0.0)
        merge_window(out, lse, part, part_lse)
    return out


FAULTS: dict[str, Merge] = {
    "correct": lambda launch: _merge(launch),
    "window dropped": lambda launch: _merge(launch, drop=launch.part_out.shape[0] - 1),
    "lse off by 0.03": lambda launch: _merge(launch, lse_shift=0.03),
    "partials at 6 bits": lambda launch: _merge(launch, bits=6),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_bound_fails_a_wrong_merge(gen: torch.Generator, fault: str) -> None:
    case, chunks = _case(gen, 16)
    over, elements, worst = 0, 0, 0.0
    for launch in split_launches(case, chunks):
        mb = merge_error_bound(launch.part_out, launch.part_lse, torch.bfloat16, **SIMULATED)
        launch_over, ratio = _worst(FAULTS[fault](launch), mb)
        over += launch_over
        elements += mb.bound.numel()
        worst = max(worst, ratio)
    print(f"{fault}: {over} of {elements} elements over the bound, worst error / bound {worst:.3g}")
    if fault == "correct":
        assert over == 0
    else:
        assert over > 0, f"{fault}: the bound did not catch it (worst error / bound {worst:.3g})"
