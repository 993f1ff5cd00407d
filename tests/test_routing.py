"""The cost model from Python (CPU only): profiles, route predictions, `mla_planner.routing`,
and `mla-planner calibrate` / `plan --profile` on a synthetic profile."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_planner
from mla_planner import COST_PROFILE_FORMAT, CostModel, StepConfig
from mla_planner.calibration import kernel_timing
from mla_planner.calibration.grid import Grid, full_tokens, token_grid
from mla_planner.calibration.measure import build_profile, non_decreasing
from mla_planner.cli.calibrate import native_grids
from mla_planner.executor.providers import ReferenceProvider, ReferenceSchedule
from mla_planner import routing
from mla_planner.routing import load_profile, stale_keys
from releases import ALL, NEWEST

GIB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    """Each test sees the fall-back warnings as a fresh process would (they are logged once each)."""
    routing._WARNED.clear()


ENV = {
    "gpu": "Test GPU",
    "driver": "1.0",
    "cuda": "12.9",
    "torch": "2.11.0",
    "kernels": f"vllm {NEWEST.version}",
    "gather": f"vllm {NEWEST.version} cp_gather_and_upconvert_fp8_kv_cache",
}
# Exactly linear kernels (as the Rust tests): decode 10 + T us; prefill 200 + T/2 us at 64 heads and
# 200 + 4T at 128; gather 5 + R/1000 us.
SYNTHETIC: dict[str, Any] = {
    "format": COST_PROFILE_FORMAT,
    "arch": "sm90",
    "num_sms": 132,
    "topk": 2048,
    "environment": ENV,
    "sparse_decode": {"64": [[1, 11], [65536, 65546]], "128": [[1, 11], [65536, 65546]]},
    "sparse_prefill": {"64": [[2, 201], [65536, 32968]], "128": [[1, 204], [65536, 262344]]},
    "gather_upconvert": [[1000, 6], [1000000, 1005]],
}
CONFIG = StepConfig(
    16, scratch_budget_bytes=64 * GIB, gather_workspace_rows=163_840 * 5, indexer_workspace_rows=163_840 * 40
)


def profile_text(**changes: Any) -> str:
    return json.dumps({**SYNTHETIC, **changes})


@pytest.fixture
def model() -> CostModel:
    return CostModel.from_json(profile_text())


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "sm90.json"
    path.write_text(profile_text())
    return path


# --- CostModel ------------------------------------------------------------------------


def test_tables_interpolate_and_extrapolate(model: CostModel) -> None:
    assert model.time_us("sparse_prefill", 2, padded_heads=64) == 201.0
    assert model.time_us("sparse_prefill", 65536, padded_heads=64) == 32968.0
    assert model.time_us("sparse_decode", 1000, padded_heads=64) == pytest.approx(1010.0)
    assert model.time_us("gather_upconvert", 2_000_000) == pytest.approx(2005.0)  # past the last point
    assert model.time_us("gather_upconvert", 10) == 6.0  # below the first: its time
    assert (model.arch, model.num_sms, model.topk, model.environment) == ("sm90", 132, 2048, ENV)
    assert model.decode_heads == model.prefill_heads == [64, 128]


@pytest.mark.parametrize(
    "tokens, mixed", [(16, True), (410, True), (411, False), (32_768, False)]
)
def test_route_flips_where_the_tables_cross(model: CostModel, tokens: int, mixed: bool) -> None:
    # One prefill after 10,000 tokens of context. Mixed: 10 + T; separate: gather 5 + (T +
    # 10,000)/1000 plus prefill 200 + T/2 = 215 + 0.501 T. They cross at T = 410.8.
    choice = model.choose_route([tokens], [10_000], 0, CONFIG)
    p = choice.prediction
    assert p.mixed is not None and p.separate is not None
    assert p.mixed.total_us == pytest.approx(10 + tokens)
    assert p.separate.total_us == pytest.approx(215 + 0.501 * tokens)
    assert choice.mixed_batch is mixed
    assert choice.mode == ("mixed_batch" if mixed else "separate_prefill_decode")
    assert routing.choose_plan(model, [tokens], [10_000], 0, CONFIG).mode == choice.mode
    # The plan handed back is the planner's plan of the chosen route.
    again = mla_planner.plan_step([tokens], [10_000], 0, CONFIG.replace(mode=choice.mode))
    assert choice.plan.mode == again.mode
    assert choice.plan.launches.tolist() == again.launches.tolist()


# SYNTHETIC with the prefill kernel at 16 native heads: 50 + T/10 us, cheaper than 64 padded heads.
NATIVE_16 = {**SYNTHETIC["sparse_prefill"], "16": [[1, 50.1], [65536, 6603.6]]}


def test_native_prefill_heads_are_priced_and_the_cheaper_taken() -> None:
    native = CostModel.from_json(profile_text(sparse_prefill=NATIVE_16))
    assert native.prefill_heads == [16, 64, 128] and native.prices_native_prefill(CONFIG)
    assert not native.prices_native_prefill(CONFIG.replace(num_heads=32))
    choice = native.choose_route([32_768], [10_000], 0, CONFIG)
    assert choice.mode == "separate_prefill_decode" and choice.config.native_prefill_heads
    assert choice.config == CONFIG.replace(mode="separate_prefill_decode", native_prefill_heads=True)
    assert choice.prediction.separate is not None and choice.prediction.separate.prefill_heads == 16
    assert choice.plan.prefill_heads == 16
    assert choice.plan.launches.tolist() == mla_planner.plan_step([32_768], [10_000], 0, choice.config).launches.tolist()
    assert routing.choose_plan(native, [32_768], [10_000], 0, CONFIG).prefill_heads == 16
    # Slower native heads, or none in the profile: vLLM's padding.
    slow = CostModel.from_json(profile_text(sparse_prefill={**NATIVE_16, "16": [[1, 1000], [65536, 100_000]]}))
    for m in (slow, CostModel.from_json(profile_text())):
        c = m.choose_route([32_768], [10_000], 0, CONFIG)
        assert (c.plan.prefill_heads, c.config.native_prefill_heads) == (64, False)
        assert c.prediction.separate is not None and c.prediction.separate.prefill_heads == 64
    assert c.prediction.mixed is not None and c.prediction.mixed.prefill_heads == 0
    # Asked for, native heads need a native table.
    with pytest.raises(ValueError, match="no sparse_prefill table at 16 native heads"):
        CostModel.from_json(profile_text()).check(CONFIG.replace(native_prefill_heads=True))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arch": "sm100", "sparse_prefill": NATIVE_16}, "native-head tables are for sm90 only"),
        ({"sparse_prefill": {**SYNTHETIC["sparse_prefill"], "48": [[1, 1], [2, 2]]}}, "or 16 or 32 on sm90"),
        ({"sparse_decode": {**SYNTHETIC["sparse_decode"], "16": [[1, 1], [2, 2]]}}, "sparse_decode: padded heads must be 64 or 128"),
    ],
)
def test_native_tables_only_where_the_prefill_kernel_runs_them(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CostModel.from_json(profile_text(**changes))


def test_a_route_that_does_not_fit_is_not_taken(model: CostModel) -> None:
    config = CONFIG.replace(scratch_budget_bytes=8 << 20)  # below one decode launch, enough for prefill pieces
    p = model.predict([300], [10_000], 0, config)
    assert p.mixed is None and p.mixed_error is not None and "give at least" in p.mixed_error
    assert p.separate is not None and p.separate_error is None
    plan = routing.choose_plan(model, [300], [10_000], 0, config)
    assert plan.mode == "separate_prefill_decode"
    assert plan.peak_bytes <= config.launch_budget_bytes
    # Neither route fits: the planner's error, not a guess.
    with pytest.raises(ValueError, match="give at least"):
        routing.choose_plan(model, [300], [10_000], 0, config.replace(scratch_budget_bytes=128 << 10))
    # A budget no launch could use is refused by the configuration itself.
    with pytest.raises(ValueError, match="reserve"):
        config.replace(scratch_budget_bytes=1024)


def test_launches_are_held_to_the_budget_less_the_reserve(model: CostModel) -> None:
    # A budget that holds a mixed-batch launch only with the allocator's reserve counted in:
    # the largest single-token launch needs exactly this many bytes.
    need = int(mla_planner.plan_step([1], [10], 1, CONFIG).launch_bytes.max())
    tight = CONFIG.replace(scratch_budget_bytes=need)
    assert tight.launch_budget_bytes == need - mla_planner.ALLOCATOR_RESERVE_BYTES
    with pytest.raises(ValueError, match="give at least"):
        routing.choose_plan(model, [1], [10], 1, tight)
    roomy = CONFIG.replace(scratch_budget_bytes=need + mla_planner.ALLOCATOR_RESERVE_BYTES)
    assert routing.choose_plan(model, [1], [10], 1, roomy).peak_bytes == need


def test_no_model_is_vllms_rule() -> None:
    assert routing.choose_plan(None, [32_768], [0], 0, CONFIG).mode == "mixed_batch"
    assert routing.choose_plan(None, [32_768], [0], 0, CONFIG.replace(num_heads=32)).mode == "separate_prefill_decode"


def test_fixed_mode_and_bf16_plan_without_the_model(model: CostModel) -> None:
    # The model would take the decode kernel for this short prefill (see above) ...
    assert routing.choose_plan(model, [16], [10_000], 0, CONFIG).mode == "mixed_batch"
    # ... but a fixed mode is kept, and a BF16 cache has no FP8 route to choose.
    fixed = CONFIG.replace(mode="separate_prefill_decode")
    plan = routing.choose_plan(model, [16], [10_000], 0, fixed)
    assert plan.mode == "separate_prefill_decode"
    assert plan.launches.tolist() == mla_planner.plan_step([16], [10_000], 0, fixed).launches.tolist()
    bf16 = CONFIG.replace(kv_dtype="bf16")
    assert routing.choose_plan(model, [16], [10_000], 0, bf16).mode == "bf16"


def test_chosen_plan_is_the_planners_plan_of_its_mode(model: CostModel) -> None:
    """For random steps and budgets, the cost model's plan equals ``plan_step`` under the chosen
    mode, launch for launch."""
    rng = np.random.default_rng(0)
    modes: set[str] = set()
    checked = 0
    for _ in range(60):
        decodes = int(rng.integers(0, 9))
        s_q = int(rng.integers(1, 5))
        prefills = int(rng.integers(0 if decodes else 1, 4))
        q = [s_q] * decodes + [int(x) for x in rng.integers(1, 20_000, prefills)]
        c = [int(x) for x in rng.integers(0, 30_000, decodes + prefills)]
        budget = int(rng.choice([64 << 20, 256 << 20, GIB, 8 * GIB]))
        config = CONFIG.replace(scratch_budget_bytes=budget, num_heads=int(rng.choice([16, 64, 128])))
        try:
            choice = model.choose_route(q, c, decodes, config)
        except ValueError:
            continue  # no route fits this budget
        expected = mla_planner.plan_step(q, c, decodes, config.replace(mode=choice.mode))
        got = choice.plan
        assert got.mode == expected.mode == choice.mode
        np.testing.assert_array_equal(got.launches, expected.launches)
        np.testing.assert_array_equal(got.launch_bytes, expected.launch_bytes)
        np.testing.assert_array_equal(got.gather_chunks, expected.gather_chunks)
        assert got.launch_kernels == expected.launch_kernels
        assert got.peak_bytes == expected.peak_bytes <= config.launch_budget_bytes
        routed = routing.choose_plan(model, q, c, decodes, config)
        np.testing.assert_array_equal(routed.launches, expected.launches)
        modes.add(choice.mode)
        checked += 1
    assert checked >= 30
    assert modes == {"mixed_batch", "separate_prefill_decode"}  # both routes were exercised


def test_choice_is_fast(model: CostModel) -> None:
    q = np.array([1] * 64 + [8192])
    c = np.array([5000] * 64 + [3000])
    routing.choose_plan(model, q, c, 64, CONFIG)
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        routing.choose_plan(model, q, c, 64, CONFIG)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} us per step"  # tens of us expected; generous for CI


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[]", "not a cost profile"),
        (profile_text(format="mla-planner.cost-profile/0"), "re-run `mla-planner calibrate`"),
        (profile_text(arch="sm80"), "sm80"),
        (profile_text(environment={**ENV, "torch": ""}), "environment.torch"),
        (profile_text(sparse_decode={"64": [[64, 10], [128, 9]]}), "must not fall"),
        (profile_text(sparse_decode={"96": [[64, 10], [128, 19]]}), "64 or 128"),
        (profile_text(gather_upconvert=[[10, 1]]), "at least 2 points"),
        (profile_text(topk=-1), "expected u32 at line 1"),
        (profile_text(extra=1), "unknown field"),
    ],
)
def test_malformed_profiles_are_value_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="cost profile") as e:
        CostModel.from_json(text)
    assert message in str(e.value)


def test_bytes_are_accepted_and_other_types_refused() -> None:
    assert CostModel.from_json(profile_text().encode()).arch == "sm90"
    for bad in (None, 3, b"\xff"):
        with pytest.raises(ValueError, match="cost profile"):
            CostModel.from_json(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arch": "sm100"}, "measured on sm90 with 132 SMs, asked about sm100"),
        ({"num_sms": 114}, "asked about sm90 with 114 SMs"),
        ({"topk": 512}, "topk 512"),
    ],
)
def test_other_configurations_are_refused(model: CostModel, changes: dict[str, Any], message: str) -> None:
    config = CONFIG.replace(**changes)
    with pytest.raises(ValueError, match=message):
        model.predict([4096], [0], 0, config)
    with pytest.raises(ValueError, match=message):
        model.choose_route([4096], [0], 0, config)
    with pytest.raises(ValueError, match=message):
        model.check(config)
    model.check(CONFIG)  # the profile's own configuration is priced


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_heads": 200}, "between 1 and 128"),
        ({"scratch_budget_bytes": -1}, "scratch_budget_bytes must be a non-negative integer"),
    ],
)
def test_invalid_configurations_never_reach_the_model(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CONFIG.replace(**changes)


def test_missing_head_table_is_refused() -> None:
    only64 = CostModel.from_json(profile_text(sparse_prefill={"64": SYNTHETIC["sparse_prefill"]["64"]}))
    only64.check(CONFIG.replace(num_heads=64))
    with pytest.raises(ValueError, match="no sparse_prefill table at 128 padded heads"):
        only64.choose_route([4096], [0], 0, CONFIG.replace(num_heads=100))
    with pytest.raises(ValueError, match="no sparse_prefill table at 128 padded heads"):
        only64.check(CONFIG.replace(num_heads=100))


def test_bad_steps_and_lookups_are_value_errors(model: CostModel) -> None:
    with pytest.raises(ValueError, match="context_lens"):
        model.predict([1, 2], [0], 0, CONFIG)
    with pytest.raises(ValueError, match="non-negative"):
        model.predict([-1], [0], 0, CONFIG)
    with pytest.raises(ValueError, match="decode query lengths"):
        model.predict([1, 2], [0, 0], 2, CONFIG)
    with pytest.raises(ValueError, match="prefill query lengths must be at least 1"):
        model.choose_route([1, 0], [0, 0], 1, CONFIG)
    with pytest.raises(ValueError, match="needs padded_heads"):
        model.time_us("sparse_decode", 10)
    with pytest.raises(ValueError, match="kernel must be"):
        model.time_us("indexer", 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no sparse_decode table at 96"):
        model.time_us("sparse_decode", 10, padded_heads=96)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(edits=st.dictionaries(st.sampled_from(sorted(SYNTHETIC)), json_values, max_size=3))
def test_any_corrupted_profile_is_a_value_error_never_a_panic(edits: dict[str, Any]) -> None:
    text = json.dumps({**SYNTHETIC, **edits})
    try:
        CostModel.from_json(text)
    except ValueError:
        pass


# --- routing.load_profile ---------------------------------------------------------------


def test_load_profile_applies_where_measured(profile_path: Path) -> None:
    model = load_profile(profile_path, environment=ENV, config=CONFIG)
    assert model is not None and model.environment == ENV
    assert load_profile(profile_path) is not None  # no machine check: offline planning


def test_stale_profile_falls_back_with_a_warning(profile_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    here = {**ENV, "driver": "2.0", "kernels": "vllm 0.27.0"}
    with caplog.at_level(logging.WARNING, logger="mla_planner.routing"):
        assert load_profile(profile_path, environment=here) is None
    (record,) = caplog.records
    assert "measured elsewhere" in record.message and "driver '2.0' here, '1.0' in the profile" in record.message
    assert "vllm 0.27.0" in record.message and "vLLM's rule" in record.message
    assert "`mla-planner calibrate` writes one for this machine" in record.message  # what to do about it
    assert stale_keys(ENV, ENV) == []
    assert len(stale_keys(ENV, {})) == len(ENV)  # nothing known about this machine: stale


def test_missing_profile_falls_back_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mla_planner.routing"):
        assert load_profile(tmp_path / "absent.json") is None
        assert load_profile(tmp_path / "other.json") is None
        assert load_profile(tmp_path / "absent.json") is None  # a second builder: no second warning
    assert len(caplog.records) == 2
    assert all("no such file" in r.message and "vLLM's rule" in r.message for r in caplog.records)


def test_uncovered_configuration_falls_back(profile_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mla_planner.routing"):
        assert load_profile(profile_path, environment=ENV, config=CONFIG.replace(topk=512)) is None
        assert load_profile(profile_path, environment=ENV, config=CONFIG.replace(num_sms=114)) is None
    assert "topk 512" in caplog.records[0].message
    assert "114 SMs" in caplog.records[1].message


def test_malformed_profile_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match=f"{path}: cost profile"):
        load_profile(path)


def test_packaged_profiles_are_valid_and_named_by_their_kernels_and_gpu() -> None:
    """Each packaged profile parses, and is found for its architecture, kernel build and GPU."""
    from importlib import resources

    from mla_planner import profiles
    from mla_planner.routing import PROFILE_DIR

    packaged = sorted((p for p in (resources.files("mla_planner.data") / PROFILE_DIR).iterdir() if p.name.endswith(".json")),
                      key=lambda p: p.name)
    assert packaged, "no packaged profile"
    for entry in packaged:
        model = CostModel.from_json(entry.read_text())
        env = model.environment
        assert entry.name == profiles.packaged_name(model.arch, env["kernels"], env["gpu"])
        assert profiles.packaged_for(model.arch, env, env["kernels"]) is not None
        assert profiles.packaged_for_gpu(model.arch, env["gpu"], env["kernels"]) is not None
    for facts in ALL.values():  # the offline default of each release
        assert profiles.packaged_for_gpu("sm90", profiles.REFERENCE_GPU, f"vllm {facts.version}") is not None


# --- calibrate's arithmetic -------------------------------------------------------------


def test_non_decreasing_is_the_least_squares_monotone_fit() -> None:
    assert non_decreasing([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert non_decreasing([5, 1, 1, 1]) == [2, 2, 2, 2]
    assert non_decreasing([1, 2, 3]) == [1, 2, 3]


def test_default_token_grid_ends_at_the_launch_limit() -> None:
    grid = full_tokens(58_254)
    assert grid[:5] == [16, 32, 64, 96, 128] and grid[-3:] == [32_768, 49_152, 58_254]
    assert grid == sorted(set(grid))


def test_built_profile_is_accepted_by_the_cost_model() -> None:
    grid = Grid({64: []}, {}, [], topk=2048, runs=10, warmup=1)
    samples = {
        ("sparse_decode", 64): {16: [20.0, 21.0, 19.0], 64: [22.0, 18.0, 20.0], 4096: [900.0] * 3},
        ("sparse_prefill", 64): {16: [30.0] * 3, 64: [32.0] * 3, 4096: [500.0] * 3},
        ("gather_upconvert", 0): {64: [5.0] * 3, 65536: [40.0] * 3},
    }
    profile = build_profile(grid, "sm90", 132, samples, ENV, 1.0, "test")
    model = CostModel.from_json(json.dumps(profile))
    assert model.decode_heads == [64]
    # 20 then 20 (noise pooled flat), never falling; the raw medians are kept beside.
    assert profile["sparse_decode"]["64"][:2] == [[16, 20.0], [64, 20.0]]
    assert profile["calibration"]["raw_median_us"]["sparse_decode"]["64"][1] == [64, 20.0]


def test_native_head_tables_go_to_the_prefill_kernel_on_sm90_only() -> None:
    args = argparse.Namespace(topk=2048, runs=10, warmup=1, seed=0, native_heads=True, tokens=None)
    grids = native_grids(args, "sm90")
    assert list(grids) == [16, 32]
    # A launch at 16 native heads may be longer than one at 64 padded heads: so is its grid.
    assert grids[16][-1] > token_grid(64, None)[-1] and grids[16][:3] == [16, 32, 64]
    assert native_grids(args, "sm100") == {} and native_grids(argparse.Namespace(**{**vars(args), "native_heads": False}), "sm90") == {}
    samples = {
        ("sparse_decode", 64): {16: [20.0] * 3, 4096: [900.0] * 3},
        ("sparse_prefill", 64): {16: [30.0] * 3, 4096: [500.0] * 3},
        ("sparse_prefill", 16): {16: [25.0] * 3, 4096: [600.0] * 3},
        ("gather_upconvert", 0): {64: [5.0] * 3, 65536: [40.0] * 3},
    }
    profile = build_profile(Grid(grids, {}, [], topk=2048, runs=10, warmup=1), "sm90", 132, samples, ENV, 1.0, "test")
    model = CostModel.from_json(json.dumps(profile))
    assert (model.decode_heads, model.prefill_heads) == ([64], [16, 64])
    assert model.time_us("sparse_prefill", 4096, padded_heads=16) == 600.0


class _Recorder(ReferenceProvider):
    """The float32 reference kernels, keeping each kernel's last output."""

    def __init__(self, native_prefill_heads: bool = False) -> None:
        super().__init__(takes_out=False, native_prefill_heads=native_prefill_heads)
        self.outputs: dict[str, torch.Tensor] = {}
        self.schedules_created = 0

    def new_decode_schedule(self) -> ReferenceSchedule:
        self.schedules_created += 1
        return super().new_decode_schedule()

    def sparse_decode(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = super().sparse_decode(*args, **kwargs)
        self.outputs["sparse_decode"] = out[0]
        return out, lse

    def sparse_prefill(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = super().sparse_prefill(*args, **kwargs)
        self.outputs["sparse_prefill"] = out
        return out, lse


class _CpuTimer:
    def __init__(self, device: torch.device) -> None:
        pass

    def __call__(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)


def test_calibration_cases_give_both_kernels_the_same_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the reference kernels: the decode kernel (cache slots) and the prefill kernel (gathered
    rows) compute the same attention for a token case, so the two tables price the same work."""
    monkeypatch.setattr(kernel_timing, "Timer", _CpuTimer)
    provider = _Recorder()
    gen = torch.Generator().manual_seed(0)
    bench = kernel_timing.KernelBench(provider, kernel_timing.GatherOp("torch"), 128, gen)
    for case in (kernel_timing.TokenCase(64, 16), kernel_timing.TokenCase(128, 200), kernel_timing.TokenCase(64, 16)):
        times = bench.token_case(case)
        assert set(times) == {"sparse_decode", "sparse_prefill"} and min(times.values()) > 0
        decode, prefill = provider.outputs["sparse_decode"].float(), provider.outputs["sparse_prefill"].float()
        assert decode.shape == (case.tokens, case.heads, 512)
        torch.testing.assert_close(decode, prefill, rtol=2e-2, atol=2e-2)
    assert provider.schedules_created == 2  # one per shape, reused
    assert bench.gather_case(kernel_timing.GatherCase(300)) > 0


@pytest.mark.parametrize("runs_native", [False, True])
def test_calibration_probes_native_prefill_heads_once(monkeypatch: pytest.MonkeyPatch, runs_native: bool) -> None:
    """A kernel build without native 16-head kernels says so in one line; one with them times the
    prefill kernel alone on an unpadded q, computing what the padded one does."""
    monkeypatch.setattr(kernel_timing, "Timer", _CpuTimer)
    provider = _Recorder(native_prefill_heads=runs_native)
    bench = kernel_timing.KernelBench(provider, kernel_timing.GatherOp("torch"), 128, torch.Generator().manual_seed(0))
    refused = bench.refuses_native_prefill(16)
    if not runs_native:
        assert refused is not None and "got 16" in refused and "\n" not in refused
        return
    assert refused is None
    times = bench.token_case(kernel_timing.TokenCase(16, 200, native=True))
    assert set(times) == {"sparse_prefill"} and times["sparse_prefill"] > 0
    assert provider.outputs["sparse_prefill"].shape == (200, 16, 512)
    assert provider.schedules_created == 0, "no decode kernel at native heads"


# --- the command line -------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "mla_planner.cli", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_calibrate_without_a_gpu_is_a_one_line_error(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    r = cli("calibrate", "-o", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "mla-planner calibrate: error: calibrate needs a CUDA GPU" in r.stderr
    assert not out.exists()


def test_calibrate_dry_run_prints_the_grid_and_a_time() -> None:
    r = cli("calibrate", "--dry-run", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "64 padded heads: sparse_decode and sparse_prefill at 23 sizes" in r.stdout
    assert "58,254" in r.stdout and "29,127" in r.stdout and "1,048,576" in r.stdout
    assert "16 native heads (sm90, where the installed FlashMLA runs them): sparse_prefill at 23 sizes" in r.stdout
    minutes = float(r.stdout.rsplit("estimated time: ", 1)[1].split()[0])
    assert 0 < minutes < 4
    without = cli("calibrate", "--dry-run", "--no-native-heads", env={"CUDA_VISIBLE_DEVICES": ""}).stdout
    assert "native heads" not in without
    assert float(without.rsplit("estimated time: ", 1)[1].split()[0]) < minutes


@pytest.mark.parametrize(
    "args, message",
    [(["--runs", "5"], "--runs must be at least 10"), (["--heads", "96"], "64 or 128"), (["--tokens", "70000"], "fewer than 2")],
)
def test_calibrate_bad_options(args: list[str], message: str) -> None:
    r = cli("calibrate", "--dry-run", *args)
    assert r.returncode == 2 and message in r.stderr


def test_plan_with_a_profile_takes_the_faster_route(profile_path: Path) -> None:
    text = cli("plan", "--profile", str(profile_path)).stdout
    assert "routes   cost model measured on Test GPU" in text
    # Mixed: 14 decode launches of at most 2,508 tokens (1 GiB less the allocator's reserve), 10 + T
    # each: 32,908 us. Separate: one gather of 32,768 rows (37.768 us) and 5 prefill launches of at
    # most 7,681 tokens (16 heads run padded to 64, so the kernel allocates its own out), 200 + T/2
    # each: 17,421.768 us. 32,908 / 17,421.768 = 1.89.
    assert "taken: separate prefill/decode, predicted 1.89x faster" in text
    doc = json.loads(cli("plan", "--json", "--profile", str(profile_path)).stdout)
    routing = doc["routing"]
    assert routing["rule"] == "cost_model" and routing["route"] == doc["mode"] == "separate_prefill_decode"
    assert routing["mixed"]["total_us"] > routing["separate"]["total_us"]
    assert routing["mixed"]["total_us"] == pytest.approx(32_908.0)
    assert routing["separate"]["total_us"] == pytest.approx(17_421.768)
    assert (routing["mixed"]["decode_launches"], routing["separate"]["prefill_launches"]) == (14, 5)
    assert {x["kernel"] for x in doc["planned"]["launches"]} == {"sparse_prefill"}
    assert doc["stock"]["launches"][0]["kernel"] == "sparse_decode"  # stock stays vLLM's
    assert routing["separate"]["prefill_heads"] == 64 and "prefill 17.384 ms x5 at 64 heads" in text
    # A short prefill is faster through the decode kernel.
    short = cli("plan", "--json", "--profile", str(profile_path), "--query-lens", "100", "--context-lens", "9000")
    assert json.loads(short.stdout)["routing"]["route"] == "mixed_batch"


def test_plan_with_a_profile_of_native_heads_plans_them(tmp_path: Path) -> None:
    path = tmp_path / "native.json"
    path.write_text(profile_text(sparse_prefill=NATIVE_16))
    text = cli("plan", "--profile", str(path)).stdout
    assert "at 16 heads" in text and "taken: separate prefill/decode" in text
    doc = json.loads(cli("plan", "--json", "--profile", str(path)).stdout)
    assert doc["routing"]["separate"]["prefill_heads"] == 16
    # The planned policy runs what was priced: the kernel at 16 heads, no padded q.
    prefills = [x for x in doc["planned"]["launches"] if x["kernel"] == "sparse_prefill"]
    assert prefills and all("q_padded" not in x["buffers"] for x in prefills)


def test_plan_without_a_usable_profile(tmp_path: Path, profile_path: Path) -> None:
    r = cli("plan", "--profile", str(tmp_path / "absent.json"))
    assert r.returncode == 0
    assert "no such file; routing steps by vLLM's rule" in r.stderr
    assert "route    vLLM's rule (mixed batch below 32 heads per rank)" in r.stdout
    for args, message in [
        (["--arch", "sm100"], "measured on sm90 with 132 SMs, asked about sm100"),
        (["--kv-dtype", "bf16"], "drop --profile"),
    ]:
        r = cli("plan", "--profile", str(profile_path), *args)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = cli("plan", "--profile", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_a_profile_that_is_not_utf8_or_not_a_file_names_its_path(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"format": "caf\xe9"}')
    with pytest.raises(ValueError, match=r"latin1\.json: cost profile is not UTF-8 text \(byte 0xe9 at offset 15\)"):
        load_profile(latin1)
    with pytest.raises(ValueError, match=f"{tmp_path}: cannot read cost profile"):
        load_profile(tmp_path)
