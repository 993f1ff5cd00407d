"""One small chunked mixed-batch run and one separate-prefill run with a split request, on the
real kernels; run under ``compute-sanitizer --tool memcheck`` by test_gpu_sanitizer.py.

    python tests/gpu/sanitizer_case.py [flash_mla|vllm]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mla_planner
from mla_planner import ALLOCATOR_RESERVE_BYTES
from mla_planner.calibration.synthetic import mixed_case, prefill_case
from mla_planner.executor import get_provider

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script, not by pytest
from harness.mixed import mixed_for_heads, plan_tokens, run_plan  # noqa: E402
from harness.separate_prefill import SeparatePrefillExecutor  # noqa: E402

TOPK = 512
HEADS = 16


def main(provider_name: str) -> None:
    provider = get_provider(provider_name)
    gen = torch.Generator(device="cuda").manual_seed(0)

    budget = mla_planner.decode_scratch(1, 100, HEADS).total_bytes + ALLOCATOR_RESERVE_BYTES
    mixed = mixed_for_heads(provider, HEADS, budget, topk=TOPK)
    plan = plan_tokens(mixed, 300)
    assert len(plan) > 1, plan
    case = mixed_case(300, HEADS, TOPK, 1024, gen, dtype=torch.bfloat16)
    out = torch.empty((300, HEADS, 512), dtype=torch.bfloat16, device="cuda")
    run_plan(mixed, plan, case.q, case.kv_cache, case.indices, out)

    prefill = SeparatePrefillExecutor(provider, HEADS)
    qlens, clens = [100, 200], [50, 400]
    chunks = prefill.plan(qlens, clens, 256)
    pcase = prefill_case(qlens, clens, HEADS, TOPK, gen, dtype=torch.bfloat16)
    pout = torch.empty((300, HEADS, 512), dtype=torch.bfloat16, device="cuda")
    prefill.run(chunks, pcase.q, pcase.kv_cache, pcase.block_table, qlens, clens, pcase.indices, pout)

    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(pout).all())
    print(f"sanitizer case ok: {len(plan)} decode launches, {len(chunks)} gather chunks")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "flash_mla")
