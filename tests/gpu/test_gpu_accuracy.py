"""On the GPU: chunked kernel outputs against the float32 reference, with FlashMLA's own
tolerances (its tests/test-sparse-decode.py and tests/test-sparse-prefill.py).

Inputs are plain Gaussian rows (``spread=0``), the distribution FlashMLA's tolerances were set
for; the CPU tests cover the per-row magnitude spread.
"""

from __future__ import annotations

import pytest
import torch

from mla_planner.executor import KernelProvider, MixedBatchExecutor, SeparatePrefillExecutor
from mla_planner.executor.layout import as_slots
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention
from mla_planner.executor.synthetic import mixed_case, prefill_case

from gpu_helpers import MiB, assert_close_flashmla

pytestmark = pytest.mark.gpu

TOPK = 2048
SCALE = 576**-0.5


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_chunked_decode_matches_the_reference(provider: KernelProvider, gen: torch.Generator, heads: int) -> None:
    num_tokens = 3000
    case = mixed_case(num_tokens, heads, TOPK, 65536, gen, dtype=torch.bfloat16, spread=0.0)
    executor = MixedBatchExecutor(provider, heads)
    plan = executor.plan(num_tokens, 256 * MiB, topk=TOPK)
    assert len(plan) > 1
    out = torch.full((num_tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.run(plan, case.q, case.kv_cache, case.indices, out)

    expected, _ = sparse_attention(case.q, as_slots(case.kv_cache), case.indices, SCALE)
    assert_close_flashmla("decode out", out, expected.to(torch.bfloat16), abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_separate_prefill_with_a_split_request_matches_the_reference(provider: KernelProvider, gen: torch.Generator, heads: int) -> None:
    query_lens, context_lens = [700, 300, 1500], [500, 0, 3000]
    case = prefill_case(query_lens, context_lens, heads, TOPK, gen, dtype=torch.bfloat16, spread=0.0)
    executor = SeparatePrefillExecutor(provider, heads)
    chunks = executor.plan(query_lens, context_lens, 2048)  # request 2 (4,500 rows) is split
    assert bool((chunks[:, 2] >= 0).any())
    t = sum(query_lens)
    out = torch.full((t, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.run(chunks, case.q, case.kv_cache, case.block_table, query_lens, context_lens, case.indices, out)

    slots, expected, first = as_slots(case.kv_cache), [], 0
    for r, (qlen, clen) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(qlen + clen, device="cuda")
        rows = dequantize_fp8_ds_mla(slots[case.block_table[r][pos // 64].long() * 64 + pos % 64])
        expected.append(sparse_attention(case.q[first : first + qlen], rows, case.indices[first : first + qlen], SCALE)[0])
        first += qlen
    assert_close_flashmla("prefill out", out.float(), torch.cat(expected), abs_tol=8e-4, rel_tol=3.01 / 128, cos_diff_tol=1e-5)
