"""On the GPU: the FP8-direct Triton kernel (mla_planner.kernels.fp8_direct) against the float32
reference, on the shapes of vLLM's sparse-MLA tests at DeepSeek-V3.2's per-rank heads (16 and 32
heads, top-k 512 and 2,048, attention sinks on and off), with FlashMLA's sparse prefill
tolerances (tests/harness/fp8_direct.check_output).

Unlike the rest of tests/gpu this needs no FlashMLA: only a CUDA GPU and triton. It runs with
``python -m pytest -m gpu tests/gpu/test_gpu_fp8_direct.py -q``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_planner.calibration.synthetic import prefill_case
from mla_planner.executor.layout import PAGE_SIZE, page_of, slot_of
from mla_planner.kernels.fp8_direct import (DEFAULT_CONFIG, MMA_CONFIG, WGMMA_CONFIG, WGMMA_RA_CONFIG, WGMMA_WS_CONFIG,
                                            KernelConfig, sparse_attention_fp8)

from gpu_helpers import PREFILL_OUT, peak_delta_bytes
from harness.fp8_direct import SCALE, Fp8Case, check_output, lse_max_error, make_case, probability_rounding_bound, reference

pytestmark = pytest.mark.gpu

CONFIGS = [DEFAULT_CONFIG, KernelConfig(block_n=64, num_warps=8, num_stages=2, keys_as_m=True),
           KernelConfig(block_n=64, num_warps=8, num_stages=2, keys_as_m=False),
           KernelConfig(block_n=32, num_warps=4, num_stages=2, keys_as_m=False, dequant="bits"), WGMMA_CONFIG,
           WGMMA_RA_CONFIG, MMA_CONFIG]
LSE_LIMIT = 1e-3
WS_TIMEOUT_S = 300
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _needs_gpu_kernels() -> None:
    """Overrides conftest's check (FlashMLA present): this kernel needs a CUDA GPU and triton only."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")


def _run_and_check(name: str, case: Fp8Case, config: KernelConfig) -> None:
    t, h = case.q.shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((t, h), float("nan"), dtype=torch.float32, device="cuda")
    sparse_attention_fp8(case.q, case.kv_cache, case.indices, SCALE, out=out, lse=lse,
                         topk_length=case.topk_length, attn_sink=case.attn_sink, config=config)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(case)
    assert not bool(out.isnan().any()), f"{name}: elements of out left unwritten"
    check_output(f"{name} out", out.float(), ref_out, probability_rounding_bound(case), **PREFILL_OUT)
    err = lse_max_error(lse, ref_lse)
    print(f"{name} lse: max abs error {err:.3g}")
    assert err <= LSE_LIMIT, f"{name} lse: max abs error {err:.3g} > {LSE_LIMIT}"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.label() for c in CONFIGS])
@pytest.mark.parametrize("sink", [False, True], ids=["no sink", "sink"])
@pytest.mark.parametrize("topk", [512, 2048])
@pytest.mark.parametrize("heads", [16, 32])
def test_matches_the_reference(gen: torch.Generator, heads: int, topk: int, sink: bool, config: KernelConfig) -> None:
    # Plain Gaussian rows (spread 0), the distribution FlashMLA's tolerances were set for; 256
    # tokens over 8,192 cache slots, with topk_length on when the sink is (both of the V3.2
    # prefill path's optional inputs at once).
    case = make_case(256, heads, topk, 128, gen, lengths=sink, sink=sink)
    _run_and_check(f"h{heads} topk{topk} {'sink' if sink else 'no sink'} {config.label()}", case, config)


@pytest.mark.parametrize("heads", [16, 32])
def test_the_warp_specialised_kernel_matches_the_reference(heads: int) -> None:
    """WGMMA_WS_CONFIG on test_matches_the_reference's cases at top-k 2,048, in a child process.
    Its partitions hand tiles over through mbarriers, and a wrong handover hangs instead of
    failing: the timeout turns a hang into this test's failure, not a stuck session."""
    code = (
        "import torch, test_gpu_fp8_direct as t\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "for s in (False, True):\n"
        f"    case = t.make_case(256, {heads}, 2048, 128, g, lengths=s, sink=s)\n"
        f"    t._run_and_check(f'ws h{heads} sink {{s}}', case, t.WGMMA_WS_CONFIG)\n"
    )
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WS_TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the warp-specialised kernel at {heads} heads did not finish in {WS_TIMEOUT_S} s (a hang)")
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("heads", [16, 24])
def test_the_mma_kernel_on_padded_pages_with_nan_slots(gen: torch.Generator, heads: int) -> None:
    """MMA_CONFIG where its shortcuts could show: pages not back to back (a padded page stride, so
    the general row address), rows of different magnitudes (so tile scales differ from key to key,
    which its value dot divides by the largest seen), every slot no valid index names filled with
    NaN bytes, row 0 among them (an invalid index's copy points at row 0 and must land as zeros), and a head
    count that leaves half of the second program's heads padded."""
    case = make_case(256, heads, 2048, 128, gen, lengths=True, sink=True, spread=1.5)
    assert case.topk_length is not None
    pages, page_size, row = case.kv_cache.shape[0], case.kv_cache.shape[1], case.kv_cache.shape[-1]
    flat = case.kv_cache.reshape(pages * page_size, row)
    used = torch.zeros(pages * page_size, dtype=torch.bool, device="cuda")
    cols = torch.arange(case.indices.shape[1], device="cuda")[None, :]
    ok = (case.indices >= 0) & (case.indices < pages * page_size) & (cols < case.topk_length[:, None])
    used[case.indices[ok].long()] = True
    used[0] = False
    case.indices[ok & (case.indices == 0)] = -1  # row 0 is NaN now: no valid index may name it
    flat[~used] = 0xFF
    padded = torch.full((pages, page_size * row + 48), 0xFF, dtype=torch.uint8, device="cuda")
    padded[:, : page_size * row] = flat.view(pages, page_size * row)
    strided = padded[:, : page_size * row].view(pages, page_size, 1, row)
    assert strided.stride(0) == page_size * row + 48
    _run_and_check(f"mma h{heads} padded pages, NaN slots", Fp8Case(case.q, strided, case.indices, case.topk_length,
                                                                     case.attn_sink), MMA_CONFIG)


@pytest.mark.parametrize("heads", [16, 32])
def test_causal_prefill_indices(gen: torch.Generator, heads: int) -> None:
    """The benchmark's inputs: one 3,000-token prompt's causal top-k over shuffled pages."""
    inputs = prefill_case([3000], [0], heads, 2048, gen, dtype=torch.bfloat16, spread=0.0)
    pos = inputs.indices
    slots = slot_of(inputs.block_table[0][page_of(pos, PAGE_SIZE)], pos, PAGE_SIZE).to(torch.int32)
    case = Fp8Case(inputs.q, inputs.kv_cache, slots, None, None)
    _run_and_check(f"h{heads} causal 3000 tokens", case, DEFAULT_CONFIG)


def test_allocates_nothing_beyond_out_and_lse(gen: torch.Generator) -> None:
    case = make_case(512, 16, 2048, 64, gen)
    out = torch.empty((512, 16, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((512, 16), dtype=torch.float32, device="cuda")

    def run() -> None:
        sparse_attention_fp8(case.q, case.kv_cache, case.indices, SCALE, out=out, lse=lse)

    run()  # compiles
    assert peak_delta_bytes(run) == 0
