"""The bindings against the numbers of docs/kernels.md and vLLM 0.26.0's own functions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_planner as mp

GIB = 1 << 30
MIB = 1 << 20


def test_decode_scratch_matches_h200_allocator() -> None:
    # docs/kernels.md, "Sparse decode": o_accum + lse_accum read off the allocator on an H200.
    for batch, s_q, gib in [(1, 1, 0.016), (1, 1024, 0.25), (1, 4096, 1.002), (1, 16384, 4.008), (1, 32768, 8.016), (8, 4096, 4.509)]:
        b = mp.decode_scratch(batch, s_q, 64).buffers
        assert abs((b["o_accum"] + b["lse_accum"]) / GIB - gib) < 0.0005 + 1e-3 * gib


def test_decode_scratch_buffers_and_total() -> None:
    s = mp.decode_scratch(1, 32768, 16)
    assert list(s.buffers) == ["q_padded", "o_accum", "lse_accum", "out", "lse"]
    assert s.buffers["o_accum"] == 8 * GIB
    assert s.total_bytes == sum(s.buffers.values())
    pre = mp.decode_scratch(1, 32768, 16, out_preallocated=True)
    assert "out" not in pre.buffers
    assert s.total_bytes - pre.total_bytes == 32768 * 64 * 512 * 2
    # 64 heads need no padding, so no padded q.
    assert "q_padded" not in mp.decode_scratch(1, 10, 64).buffers


def test_topk_mask_bytes_brief_cases() -> None:
    assert mp.topk_mask_bytes(1, 32768, 32768) == 128 * MIB == mp.GLOBAL_TOPK_MASK_MAX_BYTES
    assert mp.topk_mask_bytes(1, 33024, 33024) == 136_323_072
    assert mp.topk_mask_bytes(2, 16384, 16384) == 64 * MIB
    assert mp.masked_mha_workspace_fits(1, 32768, 0)
    assert not mp.masked_mha_workspace_fits(1, 33024, 0)
    assert mp.topk_mask_shape(2, 129, 129) == (2, 256, 8)
    assert mp.topk_mask_shape(2, 129, 129, reserve_key_starts_word=True) == (2, 256, 8)


def test_hard_limits() -> None:
    assert mp.max_tokens_per_launch(16) == (58_254, "int32_stride")
    assert mp.max_tokens_per_launch(128) == (29_127, "int32_stride")


def test_plan_mixed_batch_default_step() -> None:
    plan = mp.plan_mixed_batch(32768, num_heads=16, budget_bytes=GIB)
    chunks = plan.chunks
    assert chunks.dtype == np.int64 and chunks.shape == (len(plan), 2)
    assert chunks[0, 0] == 0 and chunks[-1, 1] == 32768
    assert (chunks[1:, 0] == chunks[:-1, 1]).all()
    assert len(set((chunks[:, 1] - chunks[:, 0]).tolist())) <= 2
    lengths = chunks[:, 1] - chunks[:, 0]
    expected = [mp.decode_scratch(1, int(n), 16, out_preallocated=True).total_bytes for n in lengths]
    assert plan.launch_bytes.tolist() == expected
    assert plan.peak_bytes == max(expected) <= GIB
    assert plan.bound == "budget"


def test_results_are_immutable() -> None:
    plan = mp.plan_mixed_batch(10_000, num_heads=16, budget_bytes=GIB)
    plan.chunks[0, 0] = 99  # a fresh copy: the plan is unchanged
    assert plan.chunks[0, 0] == 0
    with pytest.raises(AttributeError):
        plan.peak_bytes = 0  # type: ignore[misc]


def test_65536_tokens_in_one_call_is_impossible() -> None:
    plan = mp.plan_mixed_batch(65536, num_heads=64, budget_bytes=1 << 62)
    assert len(plan) == 2 and plan.bound == "int32_stride"


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: mp.decode_scratch(-1, 1, 16), "batch must be a non-negative integer"),
        (lambda: mp.decode_scratch(1, 1.5, 16), "s_q must be a non-negative integer"),  # type: ignore[arg-type]
        (lambda: mp.decode_scratch(1, 1, 0), "num_heads"),
        (lambda: mp.decode_scratch(1, 1, 129), "between 1 and 128"),
        (lambda: mp.decode_scratch(1, 1, 16, arch="sm80"), "unknown architecture"),
        (lambda: mp.decode_scratch(1, 1, 16, topk=100), "multiple of 64"),
        (lambda: mp.decode_scratch(2**40, 2**40, 16), "overflows"),
        (lambda: mp.plan_mixed_batch(100, num_heads=16, budget_bytes=MIB), "give at least 16.7 MiB"),
        (lambda: mp.plan_mixed_batch(2**50, num_heads=16, budget_bytes=GIB), "launches, more than"),
        (lambda: mp.plan_gather_chunks([2**40], [0], 1000), "give a larger gather workspace"),
        (lambda: mp.split_prefill_chunks([1, -2], 5), "seq_lens[1] must be non-negative"),
        (lambda: mp.split_prefill_chunks([[1, 2]], 5), "1-D array of integers"),
        (lambda: mp.split_prefill_chunks([1.0, 2.0], 5), "1-D array of integers"),
        (lambda: mp.split_prefill_chunks([1, 9], 5), "request 1 needs 9 rows"),
        (lambda: mp.plan_gather_chunks([1, 2], [0], 5), "must match"),
        (lambda: mp.split_indexer_prefill_chunks([1, 2], [1], 5, 100), "must match"),
        (lambda: mp.plan_step([1], [0], 2, num_heads=16, budget_bytes=GIB, gather_workspace_rows=10, indexer_workspace_rows=10), "num_decodes"),
        (lambda: mp.plan_step([1], [0], 0, num_heads=16, budget_bytes=GIB, kv_dtype="int4", gather_workspace_rows=10, indexer_workspace_rows=10), "KV-cache dtype"),
    ],
)
def test_bad_input_raises_value_error(call: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)


anything = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-(2**66), max_value=2**66), max_size=4),
)


@settings(max_examples=400, deadline=None)
@given(anything, anything, anything, anything)
def test_fuzzed_arguments_raise_only_value_error(a: object, b: object, c: object, d: object) -> None:
    """Whatever comes in, the answer is a result or a ValueError, never a panic."""
    calls: list[Callable[[], object]] = [
        lambda: mp.decode_scratch(a, b, c, topk=d),  # type: ignore[arg-type]
        lambda: mp.prefill_scratch(a, b, topk=c),  # type: ignore[arg-type]
        lambda: mp.plan_mixed_batch(a, num_heads=b, budget_bytes=c, topk=d),  # type: ignore[arg-type]
        lambda: mp.topk_mask_bytes(a, b, c),  # type: ignore[arg-type]
        lambda: mp.split_prefill_chunks(a, b),  # type: ignore[arg-type]
        lambda: mp.plan_gather_chunks(a, b, c),  # type: ignore[arg-type]
        lambda: mp.split_indexer_prefill_chunks(a, b, c, d),  # type: ignore[arg-type]
        lambda: mp.plan_prefill_groups(a, b, topk=c),  # type: ignore[arg-type]
        lambda: mp.plan_step(a, b, c, num_heads=d, budget_bytes=GIB, gather_workspace_rows=1000, indexer_workspace_rows=1000),  # type: ignore[arg-type]
    ]
    for call in calls:
        try:
            call()
        except ValueError:
            pass


# --- equivalence with vLLM 0.26.0 -------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=70_000), max_size=64),
    st.integers(min_value=1, max_value=200_000),
    st.integers(min_value=0, max_value=8),
)
def test_split_prefill_chunks_equals_vllm(seq_lens: list[int], workspace: int, offset: int) -> None:
    from vllm.v1.attention.backends.utils import split_prefill_chunks

    if any(s > workspace for s in seq_lens):
        with pytest.raises(ValueError):
            mp.split_prefill_chunks(seq_lens, workspace)
        return
    ours = mp.split_prefill_chunks(np.array(seq_lens, dtype=np.int64), workspace, request_offset=offset)
    theirs = split_prefill_chunks(torch.tensor(seq_lens, dtype=torch.int64), workspace, request_offset=offset)
    assert ours.tolist() == [list(t) for t in theirs]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40_000), st.integers(0, 80_000)), max_size=40),
    st.integers(min_value=1, max_value=300_000),
    # From 1 MiB: tinier budgets make vLLM's loop emit one query row per chunk.
    st.integers(min_value=1 << 20, max_value=1 << 31),
    st.integers(min_value=0, max_value=8),
)
def test_split_indexer_prefill_chunks_equals_vllm(
    reqs: list[tuple[int, int]], workspace: int, budget: int, offset: int
) -> None:
    from vllm.v1.attention.backends.mla.indexer import split_indexer_prefill_chunks

    query = [q for q, _ in reqs]
    seq = [q + c for q, c in reqs]
    ours = mp.split_indexer_prefill_chunks(seq, query, workspace, budget, request_offset=offset)
    theirs = split_indexer_prefill_chunks(
        torch.tensor(seq, dtype=torch.int64), torch.tensor(query, dtype=torch.int64), workspace, budget, request_offset=offset
    )
    assert ours[:, :4].tolist() == [[r.start, r.stop, q.start, q.stop] for r, q in theirs]
    for row in ours:
        assert row[4] == sum(seq[row[0] - offset : row[1] - offset])


def test_gather_chunks_split_oversize_request() -> None:
    rows = mp.plan_gather_chunks([5, 150, 7], [0, 100, 3], 100)
    assert rows[0].tolist() == [0, 1, -1, -1, -1, -1, 5]
    split = rows[1:-1]
    assert (split[:, 0] == 1).all() and (split[:, 6] <= 100).all()
    assert split[:, 2:6].tolist() == [[0, 100, 0, 100], [0, 100, 100, 200], [100, 150, 0, 100], [100, 150, 100, 200], [100, 150, 200, 250]]
    assert rows[-1].tolist() == [2, 3, -1, -1, -1, -1, 10]


def test_prefill_groups_keep_masked_mha() -> None:
    stock = mp.plan_prefill_groups([24576, 24576], [0, 0], stock=True)
    assert stock.routes == ["sparse_mqa"]
    planned = mp.plan_prefill_groups([24576, 24576], [0, 0])
    assert planned.routes == ["masked_mha", "masked_mha"]
    assert planned.requests.tolist() == [[0, 1], [1, 2]]
    assert planned.mask_bytes.tolist() == [72 * MIB, 72 * MIB]


def test_plan_step_mixed_batch() -> None:
    plan = mp.plan_step(
        [1, 1, 32768], [100, 5000, 0], 2, num_heads=16, budget_bytes=GIB,
        gather_workspace_rows=70_000 * 5, indexer_workspace_rows=70_000 * 40,
    )
    assert plan.mode == "mixed_batch"
    launches = plan.launches
    assert launches[0, 0] == 0 and launches[-1, 1] == 32770
    assert set(plan.launch_kernels) == {"sparse_decode"}
    assert plan.peak_bytes == int(plan.launch_bytes.max()) <= GIB
    assert plan.prefill_groups.routes == ["sparse_mqa"]
    assert plan.indexer_chunks[0, 0] == 2


def test_plan_step_separate() -> None:
    plan = mp.plan_step(
        [1, 65536], [10, 0], 1, num_heads=64, budget_bytes=GIB, gather_workspace_rows=40_000, indexer_workspace_rows=10**7,
    )
    assert plan.mode == "separate_prefill_decode"
    assert plan.launch_kernels[0] == "sparse_decode"
    assert (plan.gather_chunks[:, 6] <= 40_000).all()
    assert plan.gather_workspace_bytes == mp.gather_workspace_bytes(40_000)


def test_step_mode_is_the_plans_mode() -> None:
    assert mp.step_mode(16) == "mixed_batch"
    assert mp.step_mode(31) == "mixed_batch"
    assert mp.step_mode(32) == "separate_prefill_decode"
    assert mp.step_mode(16, mixed_batch=False) == "separate_prefill_decode"
    assert mp.step_mode(128, kv_dtype="bf16") == "bf16"
    for heads in (16, 64):
        plan = mp.plan_step([4096], [0], 0, num_heads=heads, budget_bytes=GIB, gather_workspace_rows=10**6, indexer_workspace_rows=10**7)
        assert plan.mode == mp.step_mode(heads)
