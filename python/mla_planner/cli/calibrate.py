"""`mla-planner calibrate`: time the sparse-MLA kernels on this GPU and write a cost profile.

The full grid: per padded head count, token counts from 16 up to the longest single launch the
int32 stride limit allows, for the decode kernel (``b = 1, s_q = T``) and the BF16 prefill
kernel; on sm90 the prefill kernel at 16 and 32 native heads; row counts for the
gather-and-up-convert (:mod:`mla_planner.calibration.grid`). How it is timed and what the profile
holds: :mod:`mla_planner.calibration.measure`. Profile format: docs/routing.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mla_planner import NATIVE_PREFILL_HEADS
from mla_planner.calibration.grid import (
    DEFAULT_ROWS,
    KERNEL_HEADS,
    Grid,
    case_bytes,
    gather_bytes,
    launch_limit,
    token_grid,
)

from .atomic import atomic_files, check_file
from .checks import MAX_TOPK
from .config import CliError
from .units import format_bytes, size_arg

DEFAULT_OUTPUT = Path("mla-planner-profile.json")
MIN_RUNS = 10
# Rough H200 magnitudes at top-k 2048, only for --dry-run's time estimate; other GPUs differ.
ROUGH_US_PER_TOKEN = {("sparse_decode", 64): 0.82, ("sparse_decode", 128): 1.55,
                      ("sparse_prefill", 64): 0.50, ("sparse_prefill", 128): 0.97,
                      ("sparse_prefill", 16): 0.61, ("sparse_prefill", 32): 1.00}  # fmt: skip
ROUGH_LAUNCH_US = 30.0
ROUGH_SETUP_US_PER_INDEX = 0.0002  # drawing T x topk random indices and translating them
ROUGH_SETUP_US_PER_ROW = 0.02  # random rows, quantised, up-converted
ROUGH_OVERHEAD_US_PER_CALL = 800.0  # L2 flush, GPU sleep, host work
ROUGH_STARTUP_S = 30.0  # CUDA context, kernel libraries, first-call compilation


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return sorted(set(values))


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "calibrate",
        help="time the sparse kernels on this GPU and write a cost profile (for plan --profile and routing)",
        description=(
            "Time the FP8 sparse decode kernel, the BF16 sparse prefill kernel and the gather-and-up-convert "
            "over a grid of sizes on this CUDA GPU and write a cost profile (docs/routing.md). "
            "Needs a GPU; --dry-run prints the grid and an estimate of the time without one."
        ),
    )
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help=f"profile to write (default {DEFAULT_OUTPUT})")
    p.add_argument("--provider", choices=("vllm", "flash_mla"), default="vllm",
                   help="decode and prefill kernels: vLLM's FlashMLA build or sgl-flash-mla (default vllm)")  # fmt: skip
    p.add_argument("--gather", choices=("vllm", "torch"), default="vllm",
                   help="gather op: vLLM's cp_gather_and_upconvert_fp8_kv_cache or the executor's torch one (default vllm)")  # fmt: skip
    p.add_argument("--heads", type=_int_list, default=list(KERNEL_HEADS), help="padded head counts (default 64,128)")
    p.add_argument("--no-native-heads", dest="native_heads", action="store_false",
                   help="on sm90, skip timing the prefill kernel at 16 and 32 unpadded heads (by default timed "
                        "where the installed FlashMLA runs them)")  # fmt: skip
    p.add_argument("--tokens", type=_int_list, help="token grid (default: 16 up to the longest single launch)")
    p.add_argument("--rows", type=_int_list, help="gather row grid (default: 64, 128, ... 1,048,576)")
    p.add_argument("--topk", type=int, default=2048, help="top-k the kernels run at (default 2048)")
    p.add_argument("--runs", type=int, default=15, help=f"timed rounds; each point is their median (default 15, at least {MIN_RUNS})")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2, at least 1)")
    p.add_argument("--max-memory", type=size_arg, help="skip cases predicted to need more (default: 80%% of free GPU memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the grid and the estimated time; touch no GPU")
    p.set_defaults(run=run)


# --- the grid -------------------------------------------------------------------------


def estimate_seconds(args: argparse.Namespace, grids: dict[int, list[int]], rows: list[int],
                     native_grids: dict[int, list[int]] | None = None) -> float:
    rounds: int = args.warmup + args.runs
    us = 0.0
    cases: list[tuple[int, int, tuple[str, ...]]] = [
        (h, t, ("sparse_decode", "sparse_prefill")) for h, tokens in grids.items() for t in tokens]
    cases += [(h, t, ("sparse_prefill",)) for h, tokens in (native_grids or {}).items() for t in tokens]
    for heads, t, kernels_timed in cases:
        kernels = sum(ROUGH_LAUNCH_US + ROUGH_US_PER_TOKEN[(k, heads)] * t for k in kernels_timed)
        setup = ROUGH_SETUP_US_PER_INDEX * t * args.topk + ROUGH_SETUP_US_PER_ROW * max(t, args.topk)
        us += kernels + setup + len(kernels_timed) * ROUGH_OVERHEAD_US_PER_CALL
    us += sum(ROUGH_LAUNCH_US + ROUGH_SETUP_US_PER_ROW * r + ROUGH_OVERHEAD_US_PER_CALL for r in rows)
    return ROUGH_STARTUP_S + rounds * us / 1e6


def _check_args(args: argparse.Namespace) -> None:
    if args.runs < MIN_RUNS:
        raise CliError(f"--runs must be at least {MIN_RUNS} (each point is a median of the runs)")
    if args.warmup < 1:
        raise CliError("--warmup must be at least 1 (the first call fills each decode schedule)")
    if bad := [h for h in args.heads if h not in KERNEL_HEADS]:
        raise CliError(f"--heads: the kernels run 64 or 128 padded heads (fewer are zero-padded up; on sm90 the prefill "
                       f"kernel is also timed at 16 and 32 native heads unless --no-native-heads), got {bad[0]}")
    if args.topk < 128 or args.topk % 128 or args.topk > MAX_TOPK:
        raise CliError(f"--topk must be a multiple of 128 from 128 to {MAX_TOPK:,}, got {args.topk}")


def _grids(args: argparse.Namespace) -> tuple[dict[int, list[int]], list[int]]:
    grids = {h: token_grid(h, args.tokens) for h in args.heads}
    rows: list[int] = args.rows or DEFAULT_ROWS
    for h, g in grids.items():
        if len(g) < 2:
            raise CliError(f"--tokens: at {h} heads fewer than 2 sizes fit one launch ({launch_limit(h, False):,} tokens at most)")
    if len(rows) < 2:
        raise CliError("--rows needs at least 2 sizes")
    return grids, rows


def native_grids(args: argparse.Namespace, arch: str | None) -> dict[int, list[int]]:
    """The prefill kernel's grids at native heads: on sm90 (``arch=None``: wherever it may be
    sm90, for the dry run) unless ``--no-native-heads``; each only where the kernel later proves
    to accept those heads."""
    if not args.native_heads or arch not in (None, "sm90"):
        return {}
    return {h: token_grid(h, args.tokens, native=True) for h in NATIVE_PREFILL_HEADS}


def dry_run(args: argparse.Namespace, grids: dict[int, list[int]], rows: list[int]) -> int:
    print(f"calibrate (dry run): {args.provider} kernels, {args.gather} gather, topk {args.topk}")
    for h, tokens in grids.items():
        peak = max(case_bytes(h, t, args.topk) for t in tokens)
        print(f"  {h:3d} padded heads: sparse_decode and sparse_prefill at {len(tokens)} sizes, tokens "
              f"{', '.join(f'{t:,}' for t in tokens)} (largest case ~{format_bytes(peak)})")  # fmt: skip
    native = native_grids(args, None)
    for h, tokens in native.items():
        peak = max(case_bytes(h, t, args.topk, native=True) for t in tokens)
        print(f"  {h:3d} native heads (sm90, where the installed FlashMLA runs them): sparse_prefill at {len(tokens)} "
              f"sizes, tokens {', '.join(f'{t:,}' for t in tokens)} (largest case ~{format_bytes(peak)})")  # fmt: skip
    print(f"  gather_upconvert at {len(rows)} sizes, rows {', '.join(f'{r:,}' for r in rows)}")
    n = sum(2 * len(t) for t in grids.values()) + sum(len(t) for t in native.values()) + len(rows)
    print(f"  {args.warmup} warm-up + {args.runs} timed rounds of {n} measurements, fresh inputs each")
    minutes = estimate_seconds(args, grids, rows, native) / 60
    print(f"estimated time: {minutes:.1f} min on an H200-class GPU (a rough guess; other GPUs differ)")
    return 0


# --- the run --------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    grids, rows = _grids(args)
    if args.dry_run:
        return dry_run(args, grids, rows)
    try:
        import torch
    except ImportError as e:
        raise CliError(f"calibrate needs torch and a CUDA GPU: {e}") from None
    if not torch.cuda.is_available():
        raise CliError("calibrate needs a CUDA GPU and torch sees none; --dry-run shows the grid without one")
    check_file(args.output, "--output")  # before the measurements, not after minutes of them
    return measure(args, grids, rows)


def measure(args: argparse.Namespace, grids: dict[int, list[int]], rows: list[int]) -> int:
    import torch

    from mla_planner.calibration.measure import CalibrationError, arch_of, json_text
    from mla_planner.calibration.measure import measure as measure_grid

    try:
        native = native_grids(args, arch_of(torch.cuda.get_device_capability()))
        grid = Grid(grids, native, rows, args.topk, args.runs, args.warmup, args.seed, args.max_memory)
        profile = measure_grid(grid, provider=args.provider, gather=args.gather,
                               command="mla-planner " + " ".join(sys.argv[1:]), progress=_progress)
    except CalibrationError as e:
        raise CliError(str(e)) from None
    with atomic_files() as files:
        files.write_bytes(args.output, json_text(profile).encode())
    _progress(f"wrote {args.output} ({profile['environment']['gpu']}, {profile['calibration']['seconds']:.0f} s)")
    return 0


def _progress(message: str) -> None:
    print(f"mla-planner calibrate: {message}", file=sys.stderr, flush=True)
