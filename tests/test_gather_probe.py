"""benchmarks/gather_probe.py's gather-only kernel (``fp8_direct_bench.py --gather-probe``) on
the CPU: under Triton's interpreter (one subprocess, tests/harness/gather_probe_interpret.py) each
token's per-column sums of its valid rows' int32 words must equal torch's sums of the same rows,
so the kernel reads every valid row's 656 bytes at the right place and nothing else: not ``-1``
entries, not slots past the cache, not the bytes between padded pages, not a row twice."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_planner.executor.layout import FP8_BYTES_PER_TOKEN, PAGE_SIZE

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from gather_probe import GATHER_SWEEP, GatherConfig, reference_sums, sequential_slots, valid_mask  # noqa: E402

from harness.interpreter import run_interpreted  # noqa: E402

PAGES = 5
NUM_ROWS = PAGES * PAGE_SIZE
TOPK = 80
"""Not a multiple of any block_n: the last block of each token is partly past the top-k list."""
CONFIGS = sorted({GatherConfig(c.block_n, c.num_warps, 1, c.programs_per_sm).label() for c in GATHER_SWEEP}
                 | {"n16 w8 s1", "n32 w4 s1 c4"})
"""Every (block_n, num_warps, programs_per_sm) of the sweep (num_stages changes nothing the
interpreter runs), 16 rows a block at 8 warps (the smallest block, folded into 8 NoPE rows, the
RoPE and scales not folded), and 4 programs over 6 tokens (the worker counts one SM: programs
that loop over two tokens and over one)."""


def make_cache(gen: torch.Generator, pad: int) -> torch.Tensor:
    """``(PAGES, PAGE_SIZE, 1, 656)`` random bytes; with ``pad`` > 0 a view whose pages are each
    followed by ``pad`` other random bytes (a page stride above 64 x 656)."""
    row_bytes = PAGE_SIZE * FP8_BYTES_PER_TOKEN
    raw = torch.randint(0, 256, (PAGES, row_bytes + pad), generator=gen, dtype=torch.uint8)
    return raw[:, :row_bytes].view(PAGES, PAGE_SIZE, 1, FP8_BYTES_PER_TOKEN)


def make_indices(gen: torch.Generator) -> torch.Tensor:
    """``(6, TOPK)`` int32 slots: random valid rows (repeats allowed: a row named twice is read
    twice), ``-1``s and out-of-range slots mixed in; token 0 names no valid row, token 1 only
    valid rows, token 5 the last row of the cache and the first past it."""
    idx = torch.randint(0, NUM_ROWS, (6, TOPK), generator=gen, dtype=torch.int32)
    unused = torch.rand((6, TOPK), generator=gen) < 0.2
    idx[unused] = -1
    past = torch.rand((6, TOPK), generator=gen) < 0.1
    idx[past] = NUM_ROWS + torch.randint(0, 1 << 20, (int(past.sum()),), generator=gen, dtype=torch.int32)
    idx[0] = torch.where(torch.arange(TOPK) % 2 == 0, -1, NUM_ROWS)
    idx[1] = torch.randint(0, NUM_ROWS, (TOPK,), generator=gen, dtype=torch.int32)
    idx[5, :2] = torch.tensor([NUM_ROWS - 1, NUM_ROWS], dtype=torch.int32)
    return idx


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Each case (cache x index set x config) and the interpreted kernel's output."""
    gen = torch.Generator().manual_seed(7)
    caches = {"contiguous": make_cache(gen, 0), "padded pages": make_cache(gen, 48)}
    random_idx = make_indices(gen)
    index_sets = {"random": random_idx, "sequential": sequential_slots(random_idx, NUM_ROWS, gen)}
    cases = [{"name": f"{c} {i} {config}", "kv_cache": kv, "indices": idx, "config": config}
             for c, kv in caches.items() for i, idx in index_sets.items() for config in CONFIGS]
    results: list[torch.Tensor] = run_interpreted("gather_probe_interpret.py", cases, tmp_path_factory.mktemp("gather_probe"))
    assert len(results) == len(cases)
    return list(zip(cases, results))


def test_the_gather_sums_equal_torchs_over_the_valid_rows(interpreted: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
    wrong = [case["name"] for case, out in interpreted if not torch.equal(out, reference_sums(case["kv_cache"], case["indices"]))]
    assert not wrong, f"gather sums differ from torch's in: {wrong}"


def test_the_cases_reach_their_corners(interpreted: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
    """Token 0 reads nothing (sums 0); the padded cache has bytes between its pages that a wrong
    page stride would read; every case has invalid entries of both kinds."""
    case, out = interpreted[0]
    idx = case["indices"]
    assert bool((out[0] == 0).all())
    assert bool((idx == -1).any()) and bool((idx >= NUM_ROWS).any())
    padded = next(c["kv_cache"] for c, _ in interpreted if c["name"].startswith("padded"))
    assert padded.stride(0) == PAGE_SIZE * FP8_BYTES_PER_TOKEN + 48


def test_the_check_catches_a_missed_row_and_a_stray_one() -> None:
    """The criterion has teeth: dropping one valid entry, or naming one past-the-end slot as row
    0, changes the sums."""
    gen = torch.Generator().manual_seed(8)
    kv, idx = make_cache(gen, 0), make_indices(gen)
    ref = reference_sums(kv, idx)
    missed = idx.clone()
    missed[1, 3] = -1
    stray = idx.clone()
    stray[0, 0] = 0
    assert not torch.equal(reference_sums(kv, missed)[1], ref[1])
    assert not torch.equal(reference_sums(kv, stray)[0], ref[0])


def test_sequential_slots_keep_the_valid_pattern_in_runs() -> None:
    gen = torch.Generator().manual_seed(9)
    idx = make_indices(gen)
    seq = sequential_slots(idx, NUM_ROWS, gen)
    valid = valid_mask(idx, NUM_ROWS)
    assert torch.equal(valid_mask(seq, NUM_ROWS), valid)
    assert bool((seq[~valid] == -1).all())
    for t in range(idx.shape[0]):
        j = torch.nonzero(valid[t]).flatten()
        if len(j) > 1:
            start = (int(seq[t, j[0]]) - int(j[0])) % NUM_ROWS
            assert torch.equal(seq[t, j].long(), (start + j) % NUM_ROWS)


def test_gather_config_labels_round_trip() -> None:
    assert len(GATHER_SWEEP) == 21
    assert GatherConfig.parse("n32 w4 s1 c2") == GatherConfig(32, 4, 1, programs_per_sm=2)
    for config in GATHER_SWEEP:
        assert GatherConfig.parse(config.label()) == config
    with pytest.raises(ValueError):
        GatherConfig.parse("n48 w4 s1")
    with pytest.raises(ValueError):
        GatherConfig.parse("n32 x4")
