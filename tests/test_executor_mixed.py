"""The mixed-batch executor on the float32 reference provider (CPU, CI)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mla_planner
from mla_planner import ALLOCATOR_RESERVE_BYTES
from mla_planner.calibration.synthetic import MixedCase, mixed_case
from mla_planner.executor import Buffers, MixedBatchExecutor, ReferenceProvider
from mla_planner.executor.layout import as_slots
from mla_planner.executor.reference import sparse_attention
from mla_planner.executor.providers import ReferenceSchedule
from fixtures import gen  # noqa: F401  (a pytest fixture)
from harness.mixed import mixed_for_heads, plan_tokens, run_plan

SCALE = 576**-0.5
UNBOUNDED = 1 << 50



class RecordingProvider(ReferenceProvider):
    """The reference, remembering what each launch was given."""

    def __init__(self, takes_out: bool) -> None:
        super().__init__(takes_out)
        self.launches: list[dict[str, Any]] = []
        self.schedules_created = 0

    def new_decode_schedule(self) -> ReferenceSchedule:
        self.schedules_created += 1
        return super().new_decode_schedule()

    def sparse_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        schedule: Any,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.launches.append({"q_ptr": q.data_ptr(), "q": q.clone(), "schedule": id(schedule), "out": out is not None})
        return super().sparse_decode(q, kv_cache, indices, schedule, softmax_scale, out)


def executor_for(provider: ReferenceProvider, heads: int, budget: int = UNBOUNDED, *, topk: int = 2048,
                 translated: bool = False) -> MixedBatchExecutor:
    return mixed_for_heads(provider, heads, budget, topk=topk, translated_indices=translated)


def lengths_of(plan: mla_planner.StepPlan) -> list[int]:
    return [end - start for start, end in plan.launches[:, :2].tolist()]


def _run(case: MixedCase, provider: ReferenceProvider, budget: int) -> tuple[torch.Tensor, mla_planner.StepPlan]:
    t, h, _ = case.q.shape
    executor = executor_for(provider, h, budget, topk=case.indices.shape[1])
    plan = plan_tokens(executor, t)
    out = torch.full((t, h, 512), float("nan"))  # poison: every element must be written
    run_plan(executor, plan, case.q, case.kv_cache, case.indices, out)
    assert bool(torch.isfinite(out).all()), "some output element was never written"
    return out, plan


def _budget_for(length: int, heads: int, in_place: bool) -> int:
    """A budget whose plan has launches of about ``length`` tokens."""
    return mla_planner.decode_scratch(1, length, heads, out_preallocated=in_place).total_bytes + ALLOCATOR_RESERVE_BYTES


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("takes_out", [True, False], ids=["out=", "copy"])
def test_chunked_equals_whole_and_the_reference(gen: torch.Generator, heads: int, takes_out: bool) -> None:
    t = int(torch.randint(100, 200, (1,), generator=gen))
    case = mixed_case(t, heads, 128, 320, gen)
    in_place = executor_for(ReferenceProvider(takes_out), heads).writes_in_place
    assert in_place == (takes_out and heads in (64, 128))

    whole, whole_plan = _run(case, ReferenceProvider(takes_out), UNBOUNDED)
    assert len(whole_plan) == 1
    provider = RecordingProvider(takes_out)
    chunked, plan = _run(case, provider, _budget_for(t // 3 + 7, heads, in_place))
    assert len(plan) >= 2

    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6 * float(whole.abs().max()))
    expected, _ = sparse_attention(case.q, as_slots(case.kv_cache), case.indices, SCALE)
    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    assert all(launch["out"] == in_place for launch in provider.launches)


def test_one_schedule_per_distinct_length_and_one_reused_q_buffer(gen: torch.Generator) -> None:
    t, heads = 299, 16
    case = mixed_case(t, heads, 128, 256, gen)
    provider = RecordingProvider(takes_out=True)
    _, plan = _run(case, provider, _budget_for(140, heads, in_place=False))

    lengths = lengths_of(plan)
    assert len(set(lengths)) == 2, lengths
    assert provider.schedules_created == 2
    by_length: dict[int, set[int]] = {}
    for length, launch in zip(lengths, provider.launches):
        by_length.setdefault(length, set()).add(launch["schedule"])
    assert all(len(ids) == 1 for ids in by_length.values()), "each length reuses its schedule"
    assert len({launch["q_ptr"] for launch in provider.launches}) == 1, "one padded-q buffer for all launches"


def test_head_padding_is_zero_and_real_heads_are_copied(gen: torch.Generator) -> None:
    t, heads = 200, 16
    case = mixed_case(t, heads, 128, 256, gen)
    provider = RecordingProvider(takes_out=True)
    _, plan = _run(case, provider, _budget_for(80, heads, in_place=False))
    for (start, end), launch in zip(plan.launches[:, :2].tolist(), provider.launches):
        q_kernel = launch["q"]
        assert q_kernel.shape == (1, end - start, 64, 576)
        assert torch.equal(q_kernel[0, :, :heads], case.q[start:end])
        assert not bool(q_kernel[0, :, heads:].any()), "padded heads must stay zero"


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("takes_out", [True, False], ids=["out=", "copy"])
def test_without_out_one_launch_returns_the_kernels_output(gen: torch.Generator, heads: int, takes_out: bool) -> None:
    """No ``out``: a plan of one launch returns the kernel's own output, its real heads (a
    strided view where heads are padded, in the caller's out buffer when it gave one), as stock's
    call returns it; a plan of several returns a new output. Both equal a run into ``out``."""
    t = 150
    case = mixed_case(t, heads, 128, 256, gen)
    whole, whole_plan = _run(case, ReferenceProvider(takes_out), UNBOUNDED)
    executor = executor_for(RecordingProvider(takes_out), heads, topk=128)
    out_buffer = torch.full((t, 64, 512), float("nan"))
    result = run_plan(executor, whole_plan, case.q, case.kv_cache, case.indices, buffers=Buffers(kernel_out=out_buffer))
    torch.testing.assert_close(result, whole, rtol=0, atol=0)
    assert result.shape == (t, heads, 512)
    padded_into_buffer = takes_out and heads == 16  # the kernel writes the caller's buffer
    assert (result.data_ptr() == out_buffer.data_ptr()) == padded_into_buffer
    assert result.is_contiguous() == (heads == 64)

    budget = _budget_for(t // 3 + 7, heads, executor.writes_in_place)
    chunked, plan = _run(case, ReferenceProvider(takes_out), budget)
    split = executor_for(ReferenceProvider(takes_out), heads, budget, topk=128)
    assert len(plan) >= 2
    result = run_plan(split, plan, case.q, case.kv_cache, case.indices, buffers=Buffers(kernel_out=out_buffer))
    torch.testing.assert_close(result, chunked, rtol=0, atol=0)
    assert result.is_contiguous() and result.data_ptr() != out_buffer.data_ptr()


def test_caller_buffers_hold_the_padded_q_and_kernel_output(gen: torch.Generator) -> None:
    """vLLM's workspace views (in the releases that have them): the padded q and the kernel's
    padded output go in the caller's buffers (their old contents overwritten; padded heads zeroed),
    with the same result."""
    t, heads = 200, 16
    case = mixed_case(t, heads, 128, 256, gen)
    expected, _ = _run(case, ReferenceProvider(True), _budget_for(80, heads, in_place=False))
    provider = RecordingProvider(takes_out=True)
    executor = executor_for(provider, heads, _budget_for(80, heads, in_place=False), topk=128)
    plan = plan_tokens(executor, t)
    longest = plan.longest_launch("sparse_decode")
    q_buffer = torch.full((longest + 5, 64, 576), 7.0)  # poison: stale workspace contents
    out_buffer = torch.full((longest + 5, 64, 512), float("nan"))
    out = torch.full((t, heads, 512), float("nan"))
    run_plan(executor, plan, case.q, case.kv_cache, case.indices, out, buffers=Buffers(q_buffer, out_buffer))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(plan) >= 2 and len(provider.launches) == len(plan)
    assert {launch["q_ptr"] for launch in provider.launches} == {q_buffer.data_ptr()}
    assert all(launch["out"] for launch in provider.launches), "the kernel writes into the out buffer"
    assert not bool(q_buffer[:longest, heads:].any()), "padded heads zeroed"
    # A buffer of another shape or dtype is not used (a layer call must not fail on it): the run
    # allocates its own, with the same result; so does a provider whose kernel takes no out=.
    for bad in (torch.full((longest - 1, 64, 576), 7.0), torch.full((longest, 16, 576), 7.0),
                torch.full((longest, 64, 576), 7.0, dtype=torch.bfloat16)):
        out.fill_(float("nan"))
        run_plan(executor, plan, case.q, case.kv_cache, case.indices, out, buffers=Buffers(q_padded=bad))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert bool((bad == 7.0).all()), "an unfit buffer is left alone"
    unused = torch.full_like(out_buffer, float("nan"))
    out.fill_(float("nan"))
    run_plan(executor_for(ReferenceProvider(False), heads, _budget_for(80, heads, in_place=False), topk=128),
             plan, case.q, case.kv_cache, case.indices, out, buffers=Buffers(kernel_out=unused))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert bool(unused.isnan().all()), "a kernel that takes no out= leaves the out buffer alone"


def test_plan_uses_the_executors_out_handling(gen: torch.Generator) -> None:
    for takes_out, heads in [(True, 64), (False, 64), (True, 16)]:
        executor = executor_for(ReferenceProvider(takes_out), heads, 1 << 30)
        plan = plan_tokens(executor, 4096)
        held_q = mla_planner.decode_scratch(1, plan.longest_launch("sparse_decode"), heads).buffers.get("q_padded", 0)
        for length, launch_bytes in zip(lengths_of(plan), plan.launch_bytes.tolist()):
            scratch = mla_planner.decode_scratch(1, length, heads, out_preallocated=executor.writes_in_place)
            assert launch_bytes == scratch.total_bytes - scratch.buffers.get("q_padded", 0) + held_q
            assert ("out" in scratch.buffers) == (not executor.writes_in_place)
        assert plan.peak_bytes <= (1 << 30) - ALLOCATOR_RESERVE_BYTES


def test_a_provider_without_out_needs_a_config_that_says_so() -> None:
    config = mla_planner.StepConfig(64, max_model_len=1024)
    with pytest.raises(ValueError, match="decode_takes_out"):
        MixedBatchExecutor(ReferenceProvider(takes_out=False), config)


def test_rejects_inputs_that_do_not_match_the_plan(gen: torch.Generator) -> None:
    case = mixed_case(100, 16, 128, 128, gen)
    executor = executor_for(ReferenceProvider(), 16, topk=128)
    out = torch.empty((100, 16, 512))
    with pytest.raises(ValueError, match="plan covers"):
        run_plan(executor, plan_tokens(executor, 99), case.q[:100], case.kv_cache, case.indices, out)
    with pytest.raises(ValueError, match="indices"):
        run_plan(executor, plan_tokens(executor, 100), case.q, case.kv_cache, case.indices.long(), out)
    with pytest.raises(ValueError, match="num_heads"):
        executor_for(ReferenceProvider(), 129)


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_the_shared_q_buffer_is_counted_and_fits_the_budget(heads: int) -> None:
    for num_tokens in (1, 40, 67, 130, 173, 299, 1000, 5000):
        for budget in (24 << 20, 40 << 20, 100 << 20, 1 << 30):
            executor = executor_for(ReferenceProvider(takes_out=False), heads, budget)
            try:
                plan = plan_tokens(executor, num_tokens)
            except ValueError:
                continue  # below the minimum for one token
            assert plan.peak_bytes <= budget - ALLOCATOR_RESERVE_BYTES
            longest = plan.longest_launch("sparse_decode")
            held_q = mla_planner.decode_scratch(1, longest, heads).buffers.get("q_padded", 0)
            for length, launch_bytes in zip(lengths_of(plan), plan.launch_bytes.tolist()):
                own = mla_planner.decode_scratch(1, length, heads)
                assert launch_bytes == own.total_bytes - own.buffers.get("q_padded", 0) + held_q


def test_an_empty_batch_is_a_no_op() -> None:
    executor = executor_for(ReferenceProvider(), 16, 1 << 30, topk=128)
    plan = plan_tokens(executor, 0)
    assert len(plan) == 0 and plan.peak_bytes == 0
    empty = torch.empty((0, 16, 576))
    run_plan(executor, plan, empty, torch.empty((1, 64, 1, 656), dtype=torch.uint8), torch.empty((0, 128), dtype=torch.int32),
                 torch.empty((0, 16, 512)))


def test_translating_executor_takes_a_function_and_only_a_function(gen: torch.Generator) -> None:
    case = mixed_case(40, 16, 64, 128, gen)
    translated = executor_for(ReferenceProvider(), 16, topk=64, translated=True)
    plan = plan_tokens(translated, 40)
    assert "slot_indices" in mla_planner.decode_scratch(1, 40, 16, topk=64, translated_indices=True).buffers
    out = torch.full((40, 16, 512), float("nan"))
    asked: list[tuple[int, int]] = []

    def slots(rows: slice) -> torch.Tensor:
        asked.append((rows.start, rows.stop))
        return case.indices[rows]

    run_plan(translated, plan, case.q, case.kv_cache, slots, out)
    assert asked == [tuple(c) for c in plan.launches[:, :2].tolist()]
    expected = sparse_attention(case.q, as_slots(case.kv_cache), case.indices, SCALE)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="function"):
        run_plan(translated, plan, case.q, case.kv_cache, case.indices, out)
    with pytest.raises(ValueError, match="function"):
        run_plan(executor_for(ReferenceProvider(), 16, topk=64), plan, case.q, case.kv_cache, slots, out)
