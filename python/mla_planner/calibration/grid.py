"""What a calibration times: per padded head count, token sizes for the decode kernel
(``b = 1, s_q = T``) and the BF16 prefill kernel; per native head count (16 or 32 on sm90) the
prefill kernel alone; row counts for the gather-and-up-convert; and how many rounds.

Two grids: :func:`full_tokens` (`mla-planner calibrate`: every size up to the longest single
launch, both padded head counts) and :func:`first_start_grid` (an engine's first start: the
engine's own heads, its largest step and its longest request, powers of two, fewer rounds).
The cost model interpolates linearly between a table's points and extends the last segment past
the end, so a sparser grid over the sizes an engine can launch prices the same steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mla_planner import StepConfig, decode_scratch, max_tokens_per_launch, prefill_launch_tokens, prefill_scratch

KERNEL_HEADS = (64, 128)
"""The padded head counts the SM90/SM100 sparse kernels run."""
D_QK_BYTES = 576 * 2  # one BF16 query head
DEFAULT_ROWS = [64 << k for k in range(15)]  # 64 ... 1,048,576
FIRST_START_RUNS = 5
FIRST_START_WARMUP = 1


@dataclasses.dataclass(frozen=True)
class Grid:
    tokens: Mapping[int, list[int]]
    """Padded heads -> token sizes timed on both kernels."""
    native_tokens: Mapping[int, list[int]]
    """Native heads -> token sizes timed on the prefill kernel alone (where the installed kernel
    runs them: a build that refuses them is skipped, not failed)."""
    rows: list[int]
    """Gather-and-up-convert sizes."""
    topk: int
    runs: int
    """Timed rounds: each point is their median."""
    warmup: int
    """Untimed rounds first (the first call fills each decode schedule)."""
    seed: int = 0
    max_memory: int | None = None
    """Cases predicted to need more are skipped (default: 80% of the GPU's free memory)."""


def full_tokens(limit: int) -> list[int]:
    """16, 32, then powers of two and their 1.5x midpoints below ``limit``, then ``limit``."""
    grid, n = [16, 32], 64
    while n < limit:
        grid += [n, n * 3 // 2]
        n *= 2
    return [t for t in grid if t < limit] + [limit]


def powers_up_to(first: int, limit: int, factor: int = 2) -> list[int]:
    """``first``, ``first * factor``, ... below ``limit``, then ``limit``: a table needs two
    points, so ``limit`` is at least ``first * factor``."""
    limit = max(limit, first * factor)
    grid, n = [], first
    while n < limit:
        grid.append(n)
        n *= factor
    return grid + [limit]


def launch_limit(heads: int, native: bool) -> int:
    """The most tokens one launch may take at ``heads``, whatever the budget (the int32 stride
    limit): both kernels' at padded heads, the prefill kernel's at native heads."""
    if not native:
        return max_tokens_per_launch(heads)[0]
    return prefill_launch_tokens(heads, budget_bytes=1 << 62, native_heads=True)[0]


def token_grid(heads: int, tokens: list[int] | None, native: bool = False) -> list[int]:
    """Sizes for one head count: the full grid, or ``tokens``; none longer than one launch may be."""
    limit = launch_limit(heads, native)
    return full_tokens(limit) if tokens is None else [t for t in tokens if t <= limit]


def first_start_grid(config: StepConfig, max_step_tokens: int, max_model_len: int, native: bool) -> Grid:
    """The reduced grid an engine measures at its first start: the heads its kernels run
    (``config``'s padded decode and prefill heads; its own heads where ``native``: the installed
    FlashMLA runs the prefill kernel unpadded), token sizes in powers of two up to the engine's
    largest step (no launch carries more), gather rows in powers of four up to its longest
    request, :data:`FIRST_START_RUNS` timed rounds after :data:`FIRST_START_WARMUP`."""
    def sizes(heads: int, is_native: bool) -> list[int]:
        return powers_up_to(16, min(max_step_tokens, launch_limit(heads, is_native)))

    padded = sorted({config.decode_heads, config.prefill_padded_heads})
    return Grid(
        tokens={h: sizes(h, False) for h in padded},
        native_tokens={config.num_heads: sizes(config.num_heads, True)} if native else {},
        rows=powers_up_to(64, max(max_model_len, 128), factor=4),
        topk=config.topk,
        runs=FIRST_START_RUNS,
        warmup=FIRST_START_WARMUP,
    )


def case_bytes(heads: int, tokens: int, topk: int, native: bool = False) -> int:
    """A token case's device memory, generously: inputs, index temporaries, the larger kernel's
    scratch (the planner's byte model; the prefill kernel's only at native heads) and the
    up-converted workspace."""
    rows = max(tokens, topk)
    indices = tokens * topk * 40  # float draws, mask, int32 positions, int64 slot temporaries
    inputs = tokens * heads * D_QK_BYTES + rows * (656 + 2 * 576 + 4 * 576 * 4)
    kernel = prefill_scratch(tokens, heads, topk=topk, native_heads=native).total_bytes
    if not native:
        kernel = max(kernel, decode_scratch(1, tokens, heads, topk=topk).total_bytes)
    return indices + inputs + kernel


def gather_bytes(rows: int) -> int:
    return rows * (656 + 2 * 576 + 4 * 576 * 4)
