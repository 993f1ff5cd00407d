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
    # (vLLM 0.33's FlashMLA); a build that refuses them (0.26's, sgl-flash-mla's legacy) has none.
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
