"""On the GPU: a small `mla-planner calibrate` run writes a profile the cost model accepts, whose
tables are measured times (positive, non-decreasing) at the sizes asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_planner import CostModel, StepConfig
from mla_planner.cli import main

from gpu_helpers import PROVIDER

pytestmark = pytest.mark.gpu


def _gather_op() -> str:
    try:
        from vllm import _custom_ops  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return "torch"
    return "vllm"


def test_small_calibration_writes_a_valid_profile(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = ["calibrate", "-o", str(out), "--provider", PROVIDER, "--gather", _gather_op(), "--heads", "64",
            "--tokens", "64,512,4096", "--rows", "1024,65536", "--runs", "10", "--warmup", "1"]  # fmt: skip
    assert main(args) == 0
    profile = json.loads(out.read_text())
    model = CostModel.from_json(out.read_text())
    assert model.decode_heads == [64]
    # On sm90 the prefill kernel is also timed at 16 and 32 native heads where the build runs them
    # (the FlashMLA of a release with native_prefill_kernels, tests/releases); a build that refuses
    # them (another release's, sgl-flash-mla's legacy one) has none.
    native = [16, 32] if model.arch == "sm90" and "16" in profile["sparse_prefill"] else []
    assert model.prefill_heads == [*native, 64]
    tables = [("sparse_decode", "64"), ("sparse_prefill", "64"), *(("sparse_prefill", str(h)) for h in native)]
    for kernel, heads in tables:
        points = profile[kernel][heads]
        assert [size for size, _ in points] == [64, 512, 4096]
        times = [us for _, us in points]
        assert 0 < times[0] <= times[1] <= times[2]
    assert [size for size, _ in profile["gather_upconvert"]] == [1024, 65536]
    assert profile["environment"]["kernels"].startswith("vllm" if PROVIDER == "vllm" else "sgl-flash-mla")
    config = StepConfig(16, arch=model.arch, num_sms=model.num_sms, scratch_budget_bytes=1 << 30,
                        gather_workspace_rows=1 << 20, indexer_workspace_rows=1 << 22, force_mqa=True)
    prediction = model.predict([4096], [0], 0, config)
    assert prediction.mixed is not None and prediction.separate is not None


def test_first_start_grid_measures_a_profile_that_prices_the_engine() -> None:
    """The reduced grid an engine measures at its first start, on a small engine: a profile the
    cost model accepts for the engine, with the prefill kernel at native heads where the
    installed kernels run them, measured in seconds."""
    import time

    from mla_planner.calibration.grid import first_start_grid
    from mla_planner.calibration.measure import json_text, measure

    if PROVIDER != "vllm":
        pytest.skip("the first-start measurement times vLLM's kernels (MLA_PLANNER_PROVIDER=vllm)")
    import torch

    config = StepConfig(16, arch="sm90", num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                        scratch_budget_bytes=1 << 30, max_model_len=8192, force_mqa=True, execution="vllm")
    grid = first_start_grid(config, 2048, 8192, native=True)
    started = time.monotonic()
    profile = measure(grid, command="test", progress=print)
    seconds = time.monotonic() - started
    model = CostModel.from_json(json_text(profile))
    model.check(config)
    assert [size for size, _ in profile["sparse_decode"]["64"]] == grid.tokens[64]
    print(f"first-start grid at max_num_batched_tokens 2,048: {seconds:.1f} s; native 16 heads priced: "
          f"{model.prices_native_prefill(config)}")
