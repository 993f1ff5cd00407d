"""Provider glue on the CPU: lazy kernel imports, clear errors, and the exact calls made into
sgl-flash-mla's Python API (checked against a stand-in with the same signatures)."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest
import torch

import mla_planner
from mla_planner.calibration.synthetic import mixed_case, prefill_case
from mla_planner.executor import (
    FlashMLAProvider,
    MixedBatchExecutor,
    ProviderUnavailable,
    get_provider,
)
from mla_planner.executor.layout import as_slots
from mla_planner.executor.providers import ReferenceProvider, ReferenceSchedule
from mla_planner.executor.reference import sparse_attention, sparse_decode_reference, sparse_prefill_reference

from fixtures import gen  # noqa: F401  (a pytest fixture)
from harness.mixed import plan_tokens, run_plan
from harness.separate_prefill import SeparatePrefillExecutor

SCALE = 576**-0.5



def test_importing_the_executor_loads_no_kernels() -> None:
    code = "import sys, mla_planner.executor; print(sorted(m for m in ('flash_mla', 'vllm') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_unavailable_providers_say_why() -> None:
    for name in ("flash_mla", "vllm"):
        try:
            get_provider(name)
        except ProviderUnavailable as exc:
            assert str(exc)
    with pytest.raises(ValueError, match="unknown kernel provider"):
        get_provider("triton")


def _fake_flash_mla(calls: list[tuple[str, dict[str, Any]]]) -> types.ModuleType:
    """sgl-flash-mla 1.0.0's Python signatures (no ``out=`` anywhere), computing with the reference."""
    fm = types.ModuleType("flash_mla")

    def has_legacy() -> bool:
        return True

    def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[ReferenceSchedule, None]:
        return ReferenceSchedule(), None

    def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: Any, cache_seqlens: Any, head_dim_v: int,
                               tile_scheduler_metadata: ReferenceSchedule, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool | None = None,
                               indices: torch.Tensor | None = None, attn_sink: Any = None, extra_k_cache: Any = None,
                               extra_indices_in_kvcache: Any = None, topk_length: Any = None, extra_topk_length: Any = None,
                               enable_batch_invariant: bool = False, use_legacy: bool = False, kv_format: Any = None,
                               descale_q: Any = None, descale_k: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(("decode", {"use_legacy": use_legacy, "is_fp8_kvcache": is_fp8_kvcache, "head_dim_v": head_dim_v,
                                 "heads": q.shape[2], "scale": softmax_scale}))
        assert indices is not None and softmax_scale is not None
        shape = (*q.shape, indices.shape[-1])
        assert tile_scheduler_metadata.shape in (None, shape), "schedule reused across shapes"
        tile_scheduler_metadata.shape = shape
        return sparse_decode_reference(q, k_cache, indices, softmax_scale)

    def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                             attn_sink: Any = None, topk_length: Any = None, use_legacy: bool = False,
                             return_log2_lse: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(("prefill", {"use_legacy": use_legacy, "d_v": d_v, "heads": q.shape[1], "log2": return_log2_lse}))
        out, lse = sparse_prefill_reference(q, kv, indices, sm_scale)
        return out, lse, lse

    for fn in (has_legacy, get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd):
        setattr(fm, fn.__name__, fn)
    return fm


def test_flash_mla_provider_calls_the_legacy_kernels_without_out(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(calls))
    provider = FlashMLAProvider()

    case = mixed_case(150, 64, 128, 256, gen)
    config = mla_planner.StepConfig(64, topk=128, scratch_budget_bytes=40 << 20, max_model_len=4096,
                                    decode_takes_out=provider.decode_takes_out)
    executor = MixedBatchExecutor(provider, config)
    assert not executor.writes_in_place, "sgl-flash-mla takes no out=: the plan must count the kernel's out"
    plan = plan_tokens(executor, 150)
    out = torch.full((150, 64, 512), float("nan"))
    run_plan(executor, plan, case.q, case.kv_cache, case.indices, out)
    expected, _ = sparse_attention(case.q, as_slots(case.kv_cache), case.indices, SCALE)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    assert calls and all(c == ("decode", {"use_legacy": True, "is_fp8_kvcache": True, "head_dim_v": 512, "heads": 64, "scale": SCALE})
                         for c in calls)

    calls.clear()
    pcase = prefill_case([30, 90], [10, 100], 16, 128, gen)
    prefill = SeparatePrefillExecutor(provider, 16)
    chunks = prefill.plan([30, 90], [10, 100], 100)
    pout = torch.full((120, 16, 512), float("nan"))
    prefill.run(chunks, pcase.q, pcase.kv_cache, pcase.block_table, [30, 90], [10, 100], pcase.indices, pout)
    reference = SeparatePrefillExecutor(ReferenceProvider(), 16)
    rout = torch.empty_like(pout)
    reference.run(chunks, pcase.q, pcase.kv_cache, pcase.block_table, [30, 90], [10, 100], pcase.indices, rout)
    torch.testing.assert_close(pout, rout, rtol=1e-6, atol=1e-6 * float(rout.abs().max()))
    assert calls and all(c == ("prefill", {"use_legacy": True, "d_v": 512, "heads": 64, "log2": None}) for c in calls)
