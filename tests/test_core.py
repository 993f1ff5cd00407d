"""The bindings against the numbers of docs/kernels.md and the installed vLLM's own functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

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
    chunks = plan.launches
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
    plan.launches[0, 0] = 99  # a fresh copy: the plan is unchanged
    assert plan.launches[0, 0] == 0
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
        (lambda: mp.decode_scratch(1, 1, mp.MAX_HEADS + 1), f"between 1 and {mp.MAX_HEADS}"),
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
        (lambda: mp.plan_step([1], [0], 2, mp.StepConfig(16, gather_workspace_rows=10, indexer_workspace_rows=10)), "num_decodes"),
        (lambda: mp.plan_step([1], [0], 0, mp.StepConfig(16, kv_dtype="int4", gather_workspace_rows=10, indexer_workspace_rows=10)), "kv_dtype"),
        (lambda: mp.plan_step([1, 2], [0, 0], 2, mp.StepConfig(16, max_model_len=1000)), "decode query lengths"),
        (lambda: mp.plan_step([mp.MAX_DECODE_QUERY_LEN + 1], [0], 1, mp.StepConfig(16, max_model_len=2000)),
         f"between 1 and {mp.MAX_DECODE_QUERY_LEN}"),
        (lambda: mp.plan_step([2, 0, 3], [0, 0, 0], 3, mp.StepConfig(16, max_model_len=1000)),
         "2 at request 0 and 3 at request 2"),
        (lambda: mp.plan_step([1, 0], [0, 0], 1, mp.StepConfig(16, max_model_len=1000)), "prefill query lengths must be at least 1"),
        (lambda: mp.step_mode(0), "between 1 and 128"),
        (lambda: mp.step_mode(10**9), "between 1 and 128"),
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
        lambda: mp.plan_step(a, b, c, mp.StepConfig(d, gather_workspace_rows=1000, indexer_workspace_rows=1000)),  # type: ignore[arg-type]
        lambda: mp.StepConfig(16, scratch_budget_bytes=a, max_model_len=b, topk=c, num_sms=d),  # type: ignore[arg-type]
        lambda: mp.StepConfig(16, max_model_len=1000).replace(gather_workspace_rows=a, indexer_logits_bytes=b, num_heads=c),
        lambda: mp.step_mode(a),  # type: ignore[arg-type]
    ]
    for call in calls:
        try:
            call()
        except ValueError:
            pass


# --- equivalence with vLLM (the installed release) --------------------------------------------


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
    from mla_planner.vllm_backend.releases import release

    split_indexer_prefill_chunks = release.split_indexer_prefill_chunks()

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
    assert stock.paths == ["sparse_mqa"]
    planned = mp.plan_prefill_groups([24576, 24576], [0, 0])
    assert planned.paths == ["masked_mha", "masked_mha"]
    assert planned.requests.tolist() == [[0, 1], [1, 2]]
    assert planned.mask_bytes.tolist() == [72 * MIB, 72 * MIB]


def test_plan_step_mixed_batch() -> None:
    config = mp.StepConfig(16, scratch_budget_bytes=GIB, max_model_len=70_000)
    plan = mp.plan_step([1, 1, 32768], [100, 5000, 0], 2, config)
    assert plan.mode == "mixed_batch"
    launches = plan.launches
    assert launches.shape == (len(plan), 5) and len(plan) > 1
    assert launches[0, 0] == 0 and launches[-1, 1] == 32770
    assert (launches[1:, 0] == launches[:-1, 1]).all()
    assert launches[0, 2] == 0 and launches[-1, 3] == 3
    assert (launches[:, 4] == -1).all()  # no gather: every launch is the decode kernel's
    assert set(plan.launch_kernels) == {"sparse_decode"}
    # Launches are held to the budget less the allocator's reserve, not the whole budget.
    assert config.launch_budget_bytes == GIB - mp.ALLOCATOR_RESERVE_BYTES
    assert plan.peak_bytes == int(plan.launch_bytes.max()) <= config.launch_budget_bytes
    assert plan.longest_launch("sparse_decode") == int((launches[:, 1] - launches[:, 0]).max())
    assert plan.longest_launch("sparse_prefill") == 0
    assert plan.prefill_groups.paths == ["sparse_mqa"]
    assert plan.indexer_chunks[0, 0] == 2


def test_plan_step_separate() -> None:
    config = mp.StepConfig(64, scratch_budget_bytes=GIB, gather_workspace_rows=40_000, indexer_workspace_rows=10**7)
    plan = mp.plan_step([1, 65536], [10, 0], 1, config)
    assert plan.mode == "separate_prefill_decode"
    assert plan.launch_kernels[0] == "sparse_decode"
    launches = plan.launches
    assert launches.shape == (len(plan), 5)
    assert launches[0].tolist() == [0, 1, 0, 1, -1]  # the decode: no gather chunk
    prefill = [i for i, k in enumerate(plan.launch_kernels) if k == "sparse_prefill"]
    assert prefill and all(launches[i, 4] >= 0 for i in prefill)
    assert {int(launches[i, 4]) for i in prefill} == set(range(len(plan.gather_chunks)))
    assert plan.peak_bytes <= config.launch_budget_bytes
    assert plan.longest_launch("sparse_decode") == 1
    assert plan.longest_launch("sparse_prefill") == max(int(launches[i, 1] - launches[i, 0]) for i in prefill)
    assert (plan.gather_chunks[:, 6] <= 40_000).all()
    assert plan.gather_workspace_bytes == mp.gather_workspace_bytes(40_000)


@pytest.mark.parametrize("heads", [16, 64])  # the mixed route, the separate one
def test_a_plan_iterates_as_typed_launches(heads: int) -> None:
    """What the executors walk: one frozen Launch per row of the plan's arrays, in order."""
    config = mp.StepConfig(heads, scratch_budget_bytes=GIB // 4, max_model_len=70_000, gather_workspace_rows=350_000,
                           indexer_workspace_rows=10**7, execution="vllm")
    plan = mp.plan_step([2, 2, 0, 40_000], [10, 20, 0, 100], 3, config)
    launches = list(plan)
    assert len(launches) == len(plan) > 2 and all(isinstance(launch, mp.Launch) for launch in launches)
    for i, (launch, row) in enumerate(zip(launches, plan.launches.tolist())):
        assert (launch.tokens, launch.requests) == (slice(row[0], row[1]), slice(row[2], row[3]))
        assert launch.gather_chunk == (None if row[4] < 0 else row[4])
        assert launch.kernel == plan.launch_kernels[i] and launch.bytes == plan.launch_bytes[i]
    assert [launch.tokens.start for launch in launches[1:]] == [launch.tokens.stop for launch in launches[:-1]]
    assert launches[-1].tokens.stop == plan.num_tokens == 40_004
    kernels = {launch.kernel for launch in launches}
    assert kernels == ({"sparse_decode"} if heads == 16 else {"sparse_decode", "sparse_prefill"})
    with pytest.raises(AttributeError):
        launches[0].bytes = 0  # type: ignore[misc]
    assert "Launch(kernel=" in repr(launches[0])


@pytest.mark.parametrize("execution", ["default", "vllm"])
@pytest.mark.parametrize("mode", ["mixed_batch", "separate_prefill_decode"])
def test_a_launchs_scratch_is_what_it_holds(mode: str, execution: Literal["default", "vllm"]) -> None:
    # Launches of unequal length: the mixed route's padded q and the separate route's prefill
    # padded q and output are held at the longest launch's size, everything else (a separate
    # decode launch's buffers all) at the launch's own; together, its bytes.
    config = mp.StepConfig(16, scratch_budget_bytes=GIB, max_model_len=70_000, mode=mode, execution=execution)
    query_lens, num_decodes = [4] * 2_000 + [65_533], 2_000
    plan = mp.plan_step(query_lens, [100] * 2_000 + [0], num_decodes, config)
    mixed = mode == "mixed_batch"
    longest = plan.longest_launch("sparse_decode" if mixed else "sparse_prefill")

    def own(kernel: str, batch: int, s_q: int) -> dict[str, int]:
        if kernel == "sparse_decode":
            return mp.decode_scratch(batch, s_q, 16, out_preallocated=config.decode_writes_in_place,
                                     translated_indices=config.translated_indices).buffers
        return mp.prefill_scratch(s_q, 16, out_preallocated=plan.prefill_writes_in_place, padding=config.prefill_padding,
                                  translated_indices=config.translated_indices).buffers

    lengths: dict[str, set[int]] = {"sparse_decode": set(), "sparse_prefill": set()}
    for launch in plan:
        scratch, kernel = launch.scratch, launch.kernel
        (t0, t1), (r0, r1) = (launch.tokens.start, launch.tokens.stop), (launch.requests.start, launch.requests.stop)
        assert scratch.total_bytes == launch.bytes
        if kernel == "sparse_decode" and not mixed:  # a batch of decodes: nothing shared
            expected = own(kernel, r1 - r0, 4)
        else:
            shared = {"q_padded"} if mixed else {"q_padded", "out"}
            expected = {name: bytes_ if name not in shared else own(kernel, 1, longest)[name]
                        for name, bytes_ in own(kernel, 1, t1 - t0).items()}
        assert scratch.buffers == expected, launch
        lengths[kernel].add(r1 - r0 if kernel == "sparse_decode" and not mixed else t1 - t0)
    # Launches of one length (or one decode batch size) would not tell held buffers from own ones.
    assert len(lengths["sparse_decode"]) > 1
    assert mixed or len(lengths["sparse_prefill"]) > 1


def test_step_mode_is_the_plans_mode() -> None:
    assert mp.step_mode(16) == "mixed_batch"
    assert mp.step_mode(31) == "mixed_batch"
    assert mp.step_mode(32) == "separate_prefill_decode"
    assert mp.step_mode(1) == "mixed_batch" and mp.step_mode(128) == "separate_prefill_decode"
    assert mp.step_mode(128, kv_dtype="bf16") == "bf16"
    for heads in (16, 64):
        config = mp.StepConfig(heads, scratch_budget_bytes=GIB, gather_workspace_rows=10**6, indexer_workspace_rows=10**7)
        assert config.mode == mp.step_mode(heads) and not config.mode_fixed
        plan = mp.plan_step([4096], [0], 0, config)
        assert plan.mode == mp.step_mode(heads)
    # The route fixed by the configuration (what mixed_batch=False did).
    fixed = mp.StepConfig(16, scratch_budget_bytes=GIB, max_model_len=70_000, mode="separate_prefill_decode")
    assert fixed.mode_fixed and fixed.mode == "separate_prefill_decode"
    assert mp.plan_step([4096], [0], 0, fixed).mode == "separate_prefill_decode"
    assert mp.plan_step([4096], [0], 0, fixed.replace(mode="mixed_batch")).mode == "mixed_batch"
    bf16 = mp.StepConfig(16, kv_dtype="bf16", max_model_len=70_000)
    assert bf16.mode == "bf16" and mp.plan_step([4096], [0], 0, bf16).mode == "bf16"


@pytest.mark.parametrize("heads", [0, 129, 10**9])
def test_step_mode_refuses_impossible_head_counts(heads: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 128"):
        mp.step_mode(heads)



# --- StepConfig -------------------------------------------------------------------------


def test_step_config_defaults_and_vllm_workspaces() -> None:
    c = mp.StepConfig(16, max_model_len=70_000)
    assert (c.num_heads, c.arch, c.num_sms, c.topk, c.kv_dtype) == (16, "sm90", mp.H200_NUM_SMS, mp.DEFAULT_TOPK, "fp8")
    assert c.scratch_budget_bytes == GIB
    assert c.launch_budget_bytes == GIB - mp.ALLOCATOR_RESERVE_BYTES
    assert mp.ALLOCATOR_RESERVE_BYTES == 64 << 10
    assert c.max_model_len == 70_000
    # vLLM sizes its workspaces from max_model_len: gather 5x, indexer 40x.
    assert c.gather_workspace_rows == 5 * 70_000
    assert c.indexer_workspace_rows == 40 * 70_000
    assert (c.masked_mha, c.force_mqa) == (False, False)
    # Explicit rows win over the derivation.
    explicit = mp.StepConfig(16, max_model_len=70_000, gather_workspace_rows=1234)
    assert explicit.gather_workspace_rows == 1234 and explicit.indexer_workspace_rows == 40 * 70_000
    rows = mp.StepConfig(16, gather_workspace_rows=10, indexer_workspace_rows=20)
    assert rows.max_model_len is None and (rows.gather_workspace_rows, rows.indexer_workspace_rows) == (10, 20)


def test_step_config_execution_flags() -> None:
    default = mp.StepConfig(128, max_model_len=1000)
    assert (default.translated_indices, default.align_waves) == (False, False)
    assert (default.decode_takes_out, default.prefill_takes_out) == (True, True)
    vllm = mp.StepConfig(128, max_model_len=1000, execution="vllm")
    assert (vllm.translated_indices, vllm.align_waves) == (True, True)
    assert (vllm.decode_takes_out, vllm.prefill_takes_out) == (True, True)
    assert vllm != default
    # Each flag can be set on its own over the execution's defaults.
    own = mp.StepConfig(128, max_model_len=1000, execution="vllm", align_waves=False, decode_takes_out=False)
    assert (own.translated_indices, own.align_waves, own.decode_takes_out, own.prefill_takes_out) == (True, False, False, True)
    # Kernels write in place only when they take out= and run the model's own head count.
    assert (vllm.decode_heads, vllm.prefill_heads) == (128, 128)
    assert vllm.decode_writes_in_place and vllm.prefill_writes_in_place
    assert not own.decode_writes_in_place and own.prefill_writes_in_place
    padded = mp.StepConfig(16, max_model_len=1000, execution="vllm")
    assert padded.decode_heads == 64 and not padded.decode_writes_in_place


def test_step_config_replace_is_a_changed_copy() -> None:
    c = mp.StepConfig(16, max_model_len=70_000)
    d = c.replace(num_heads=64, mode="separate_prefill_decode", scratch_budget_bytes=2 * GIB)
    assert (c.num_heads, c.mode, c.mode_fixed, c.scratch_budget_bytes) == (16, "mixed_batch", False, GIB)
    assert (d.num_heads, d.mode, d.mode_fixed, d.scratch_budget_bytes) == (64, "separate_prefill_decode", True, 2 * GIB)
    assert d.launch_budget_bytes == 2 * GIB - mp.ALLOCATOR_RESERVE_BYTES
    assert d.gather_workspace_rows == c.gather_workspace_rows  # workspaces keep their rows
    assert c.replace() == c and hash(c.replace()) == hash(c)
    assert c.replace(topk=512) != c
    with pytest.raises(AttributeError):
        c.num_heads = 32  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_heads"):
        c.replace(num_heads=0)
    with pytest.raises(TypeError):
        c.replace(no_such_field=1)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_heads": 0, "max_model_len": 1000}, "num_heads"),
        ({"num_heads": 129, "max_model_len": 1000}, "num_heads"),
        ({"num_heads": 16}, "max_model_len"),
        ({"num_heads": 16, "gather_workspace_rows": 10}, "indexer_workspace_rows"),
        ({"num_heads": 16, "indexer_workspace_rows": 10}, "gather_workspace_rows"),
        ({"num_heads": 16, "max_model_len": 0}, "max_model_len"),
        ({"num_heads": 16, "max_model_len": 1000, "scratch_budget_bytes": -1}, "scratch_budget_bytes"),
        ({"num_heads": 16, "max_model_len": 1000, "scratch_budget_bytes": 64 << 10}, "budget"),
        ({"num_heads": 16, "max_model_len": 1000, "kv_dtype": "bf16", "mode": "mixed_batch"}, "mode"),
        ({"num_heads": 16, "max_model_len": 1000, "mode": "fastest"}, "mode"),
        ({"num_heads": 16, "max_model_len": 1000, "execution": "eager"}, "execution"),
        ({"num_heads": 16, "max_model_len": 1000, "topk": 100}, "topk"),
        ({"num_heads": 16, "max_model_len": 1000, "arch": "sm80"}, "architecture"),
        ({"num_heads": 16, "max_model_len": 1000, "kv_dtype": "int4"}, "kv_dtype"),
        ({"num_heads": 16, "max_model_len": 1000, "gather_workspace_rows": -5}, "gather_workspace_rows"),
        ({"num_heads": 64, "max_model_len": 1000, "native_prefill_heads": True}, "16 or 32 heads per rank on sm90"),
        ({"num_heads": 24, "max_model_len": 1000, "native_prefill_heads": True}, "got 24 heads on sm90"),
        ({"num_heads": 16, "max_model_len": 1000, "arch": "sm100", "native_prefill_heads": True}, "got 16 heads on sm100"),
    ],
)
def test_step_config_validation_names_the_argument(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        mp.StepConfig(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


@pytest.mark.parametrize("heads", mp.NATIVE_PREFILL_HEADS)
def test_native_prefill_heads_size_the_plan(heads: int) -> None:
    """Native prefill heads: the kernel at the rank's own heads, so no padded q, the kernel writing
    the step's output, and longer launches in the same budget."""
    assert mp.NATIVE_PREFILL_HEADS == [16, 32]
    padded = mp.StepConfig(heads, max_model_len=70_000, execution="vllm", mode="separate_prefill_decode")
    native = padded.replace(native_prefill_heads=True)
    assert not padded.native_prefill_heads and native.native_prefill_heads and native.to_dict()["native_prefill_heads"]
    assert (padded.prefill_heads, native.prefill_heads, native.prefill_padded_heads) == (64, heads, 64)
    assert native.native_prefill_heads_possible and not mp.StepConfig(64, max_model_len=1).native_prefill_heads_possible
    assert not mp.StepConfig(heads, max_model_len=1, arch="sm100").native_prefill_heads_possible
    q, c = [1, 1, 40_000], [10, 500, 0]
    p, n = mp.plan_step(q, c, 2, padded), mp.plan_step(q, c, 2, native)
    assert (p.prefill_heads, p.prefill_writes_in_place) == (64, False)
    assert (n.prefill_heads, n.prefill_writes_in_place) == (heads, True)
    assert n.longest_launch("sparse_prefill") > p.longest_launch("sparse_prefill")
    assert n.peak_bytes <= native.launch_budget_bytes
    bufs = mp.prefill_scratch(1000, heads, native_heads=True, out_preallocated=True).buffers
    assert "q_padded" not in bufs and bufs["lse"] == 1000 * heads * 4
    assert mp.prefill_scratch(1000, heads).buffers["lse"] == 1000 * 64 * 4
    (tokens, _), (padded_tokens, _) = (mp.prefill_launch_tokens(heads, budget_bytes=1 << 30, native_heads=True),
                                       mp.prefill_launch_tokens(heads, budget_bytes=1 << 30))
    assert tokens > padded_tokens
    with pytest.raises(ValueError, match="native_prefill_heads"):
        mp.prefill_scratch(10, 64, native_heads=True)


def test_prefill_padding_is_vllms_own() -> None:
    """vLLM pads the prefill kernel's q on sm100 to 128 heads, or to 64 where its FlashMLA has the
    64-head Blackwell kernel (tests/releases: each release's ``prefill_padded_heads``): the
    configuration carries the padding its backend uses, and the plan's heads, launches and bytes
    follow it."""
    pad128 = mp.StepConfig(16, arch="sm100", max_model_len=70_000, execution="vllm", mode="separate_prefill_decode")
    pad64 = pad128.replace(prefill_padding=64)
    assert (pad128.prefill_padding, pad128.prefill_padded_heads, pad128.to_dict()["prefill_padding"]) == (128, 128, None)
    assert (pad64.prefill_padding, pad64.prefill_padded_heads, pad64.prefill_heads) == (64, 64, 64)
    assert mp.StepConfig(16, max_model_len=1).prefill_padding == 64  # sm90: 64 under every release
    q, c = [1, 40_000], [10, 0]
    p128, p64 = mp.plan_step(q, c, 1, pad128), mp.plan_step(q, c, 1, pad64)
    assert (p128.prefill_heads, p64.prefill_heads) == (128, 64)
    assert p64.longest_launch("sparse_prefill") > p128.longest_launch("sparse_prefill")
    assert max(p128.peak_bytes, p64.peak_bytes) <= pad128.launch_budget_bytes
    assert mp.prefill_scratch(1000, 16, arch="sm100", padding=64).buffers == mp.prefill_scratch(1000, 16).buffers
    assert mp.prefill_scratch(1000, 16, arch="sm100").buffers["lse"] == 1000 * 128 * 4
    assert mp.padded_heads(16, kernel="sparse_prefill", arch="sm100", padding=64) == 64
    assert mp.padded_heads(16, kernel="sparse_prefill", arch="sm100") == 128
    assert (mp.prefill_launch_tokens(16, budget_bytes=1 << 30, arch="sm100", padding=64)
            == mp.prefill_launch_tokens(16, budget_bytes=1 << 30))
    for bad, message in [(0, "64 or 128"), (96, "64 or 128"), (256, "64 or 128"), (2**40, "64 or 128"),
                         (-1, "a non-negative integer"), (1.5, "a non-negative integer")]:
        with pytest.raises(ValueError, match=f"prefill_padding must be {message}"):
            mp.StepConfig(16, max_model_len=1, prefill_padding=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"prefill_padding must be {message}"):
            mp.prefill_scratch(10, 16, padding=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"prefill_padding must be {message}"):
            mp.prefill_scratch(10, 16, native_heads=True, padding=bad)  # type: ignore[arg-type]


def test_step_config_budget_just_above_the_reserve_is_accepted() -> None:
    c = mp.StepConfig(16, max_model_len=1000, scratch_budget_bytes=(64 << 10) + 1)
    assert c.launch_budget_bytes == 1
    with pytest.raises(ValueError, match="give at least"):
        mp.plan_step([1], [10], 1, c)


def test_replace_keeps_max_model_len_and_sizes_workspaces_from_a_new_one() -> None:
    config = mp.StepConfig(16, max_model_len=70_000)
    assert config.replace(mode="mixed_batch").max_model_len == 70_000
    shorter = config.replace(max_model_len=1_000)
    assert (shorter.max_model_len, shorter.gather_workspace_rows, shorter.indexer_workspace_rows) == (1_000, 5_000, 40_000)
    pinned = config.replace(max_model_len=1_000, gather_workspace_rows=123)
    assert (pinned.gather_workspace_rows, pinned.indexer_workspace_rows) == (123, 40_000)


def test_padded_heads_is_the_planners_rule() -> None:
    assert [mp.padded_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    assert [mp.padded_heads(h, kernel="sparse_prefill") for h in (16, 64, 96)] == [64, 64, 128]
    assert mp.padded_heads(16, kernel="sparse_prefill", arch="sm100") == 128
    assert mp.padded_heads(16) == mp.StepConfig(16, max_model_len=1024).decode_heads
    for bad in (0, 129):
        with pytest.raises(ValueError, match="num_heads"):
            mp.padded_heads(bad)
    with pytest.raises(ValueError, match="kernel"):
        mp.padded_heads(16, kernel="sparse_mqa")  # type: ignore[arg-type]


def test_help_shows_every_compiled_function_and_attribute() -> None:
    """``help()`` and IDEs read ``__doc__``: the extension carries one for everything it exports."""
    undocumented = [name for name in mp.__all__ if callable(getattr(mp, name)) and not (getattr(mp, name).__doc__ or "").strip()]
    for cls in (mp.StepConfig, mp.StepPlan, mp.CostModel, mp.Scratch, mp.MixedBatchPlan, mp.RouteChoice):
        undocumented += [f"{cls.__name__}.{k}" for k, v in vars(cls).items()
                         if not k.startswith("_") and not (getattr(v, "__doc__", None) or "").strip()]
    assert undocumented == []
