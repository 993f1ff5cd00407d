"""The separate path's prefill executor on the float32 reference provider (CPU, CI)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from mla_planner.calibration.synthetic import PrefillCase, prefill_case
from mla_planner.executor import ReferenceProvider
from mla_planner.executor.layout import as_slots
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

from fixtures import gen  # noqa: F401  (a pytest fixture)
from harness.separate_prefill import SeparatePrefillExecutor

SCALE = 576**-0.5



def _expected(case: PrefillCase) -> torch.Tensor:
    """Each request's queries against all of its own KV rows, in one go."""
    slots, outs, first = as_slots(case.kv_cache), [], 0
    for r, (qlen, clen) in enumerate(zip(case.query_lens.tolist(), case.context_lens.tolist())):
        pos = torch.arange(qlen + clen)
        rows = dequantize_fp8_ds_mla(slots[case.block_table[r][pos // 64].long() * 64 + pos % 64])
        out, _ = sparse_attention(case.q[first : first + qlen], rows, case.indices[first : first + qlen], SCALE)
        outs.append(out)
        first += qlen
    return torch.cat(outs)


def _run(case: PrefillCase, provider: ReferenceProvider, workspace_rows: int) -> tuple[torch.Tensor, np.ndarray]:
    t, heads, _ = case.q.shape
    executor = SeparatePrefillExecutor(provider, heads)
    chunks = executor.plan(case.query_lens, case.context_lens, workspace_rows)
    out = torch.full((t, heads, 512), float("nan"))  # poison: every element must be written
    executor.run(chunks, case.q, case.kv_cache, case.block_table, case.query_lens, case.context_lens, case.indices, out)
    assert bool(torch.isfinite(out).all()), "some output element was never written"
    return out, chunks


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("takes_out", [True, False], ids=["out=", "copy"])
def test_whole_request_chunks_equal_the_reference(gen: torch.Generator, heads: int, takes_out: bool) -> None:
    case = prefill_case([40, 70, 1, 25], [30, 0, 90, 64], heads, 128, gen)
    out, chunks = _run(case, ReferenceProvider(takes_out), workspace_rows=130)
    assert len(chunks) >= 3 and bool((chunks[:, 2] == -1).all())
    expected = _expected(case)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("takes_out", [True, False], ids=["out=", "copy"])
def test_split_request_merged_by_lse_equals_the_unsplit_reference(gen: torch.Generator, heads: int, takes_out: bool) -> None:
    # Request 1 (160 context + 100 new rows) is longer than the 80-row workspace.
    case = prefill_case([20, 100, 10], [10, 160, 5], heads, 128, gen)
    case.indices[30, :] = -1  # a query with no key at all: output 0
    split, chunks = _run(case, ReferenceProvider(takes_out), workspace_rows=80)
    pieces = chunks[chunks[:, 2] >= 0]
    assert len(pieces) > len(np.unique(pieces[:, 2])) > 1, "query pieces, some over several key windows"
    assert int(chunks[:, 6].max()) <= 80

    whole, whole_chunks = _run(case, ReferenceProvider(takes_out), workspace_rows=1000)
    assert len(whole_chunks) == 1
    expected = _expected(case)
    tol = 2e-6 * float(expected.abs().max())
    torch.testing.assert_close(whole, expected, rtol=1e-6, atol=tol)
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=tol)
    assert not bool(split[30].any())


def test_predicted_bytes_come_from_the_planner(gen: torch.Generator) -> None:
    import mla_planner

    executor = SeparatePrefillExecutor(ReferenceProvider(takes_out=False), 16)
    chunks = executor.plan([100, 50], [20, 0], 200)
    indices = mla_planner.prefill_scratch(150, 16, translated_indices=True).buffers["workspace_indices"]
    assert indices == 150 * mla_planner.DEFAULT_TOPK * 4  # the (tokens, topk) int32 buffer run() allocates
    expected = mla_planner.gather_workspace_bytes(170) + mla_planner.prefill_scratch(150, 16).total_bytes + indices
    assert executor.predicted_peak_bytes(chunks, [100, 50], [20, 0]) == expected
