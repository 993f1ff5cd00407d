"""`mla-planner calibrate`: time the sparse-MLA kernels on this GPU and write a cost profile.

Grid: per padded head count, token counts from 16 up to the longest single launch the int32
stride limit allows, for the decode kernel (``b = 1, s_q = T``) and the BF16 prefill kernel; row
counts for the gather-and-up-convert. Each round measures every case once, in a fresh shuffled
order, on fresh random inputs; warm-up rounds are discarded; each point is the median of the
timed rounds, and each table is then made non-decreasing (pool-adjacent-violators), since the
cost model refuses a table whose time falls as the size grows. The raw medians are kept in the
profile's ``calibration`` section. Profile format: docs/routing.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mla_planner import (
    COST_PROFILE_FORMAT,
    NATIVE_PREFILL_HEADS,
    CostModel,
    decode_scratch,
    max_tokens_per_launch,
    prefill_launch_tokens,
    prefill_scratch,
)

from .atomic import atomic_files, check_file
from .checks import MAX_TOPK
from .config import CliError
from .units import format_bytes, size_arg

DEFAULT_OUTPUT = Path("mla-planner-profile.json")
KERNEL_HEADS = (64, 128)
D_QK_BYTES = 576 * 2  # one BF16 query head
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


def default_tokens(limit: int) -> list[int]:
    """16, 32, then powers of two and their 1.5x midpoints below ``limit``, then ``limit``."""
    grid, n = [16, 32], 64
    while n < limit:
        grid += [n, n * 3 // 2]
        n *= 2
    return [t for t in grid if t < limit] + [limit]


DEFAULT_ROWS = [64 << k for k in range(15)]  # 64 ... 1,048,576


def launch_limit(heads: int, native: bool) -> int:
    """The most tokens one launch may take at ``heads``, whatever the budget (the int32 stride
    limit): both kernels' at padded heads, the prefill kernel's at native heads."""
    if not native:
        return max_tokens_per_launch(heads)[0]
    return prefill_launch_tokens(heads, budget_bytes=1 << 62, native_heads=True)[0]


def token_grid(heads: int, tokens: list[int] | None, native: bool = False) -> list[int]:
    """Sizes for one head count: none longer than one launch may be."""
    limit = launch_limit(heads, native)
    return default_tokens(limit) if tokens is None else [t for t in tokens if t <= limit]


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


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _table(samples: dict[int, list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """(fitted points, raw medians), both ``[[size, us], ...]``."""
    sizes = sorted(samples)
    raw = [statistics.median(samples[s]) for s in sizes]
    fitted = non_decreasing(raw)
    return [[s, round(y, 3)] for s, y in zip(sizes, fitted)], [[s, round(y, 3)] for s, y in zip(sizes, raw)]


def _arch(capability: tuple[int, int]) -> str:
    major, minor = capability
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    raise CliError(f"this GPU is sm{major}{minor}; the FlashMLA sparse kernels run on sm90 (Hopper) and sm100 (Blackwell)")


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

    from mla_planner.executor.providers import ProviderUnavailable, get_provider
    from mla_planner.routing import current_environment

    from .kernel_timing import GatherCase, GatherOp, KernelBench, TokenCase

    arch = _arch(torch.cuda.get_device_capability())
    try:
        provider = get_provider(args.provider)
        gather = GatherOp(args.gather)
    except (ProviderUnavailable, RuntimeError) as e:
        raise CliError(str(e)) from None
    free, _total = torch.cuda.mem_get_info()
    budget = args.max_memory or int(0.8 * free)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    bench = KernelBench(provider, gather, args.topk, gen)
    cases: list[TokenCase | GatherCase] = []
    native = native_grids(args, arch)
    for h in list(native):
        # One tiny call: a FlashMLA build without the kernel (vLLM 0.26's) refuses these heads.
        refused = bench.refuses_native_prefill(h)
        if refused is not None:
            _progress(f"not timing the prefill kernel at {h} native heads: {args.provider}'s kernel refused them ({refused})")
            del native[h]
    grid_cases = [(h, t, False) for h, tokens in grids.items() for t in tokens]
    grid_cases += [(h, t, True) for h, tokens in native.items() for t in tokens]
    for h, t, is_native in grid_cases:
        need = case_bytes(h, t, args.topk, native=is_native)
        if need > budget:
            kind = "native" if is_native else "padded"
            _progress(f"skipping {t:,} tokens at {h} {kind} heads: ~{format_bytes(need)} > {format_bytes(budget)}")
        else:
            cases.append(TokenCase(h, t, native=is_native))
    cases += [GatherCase(r) for r in rows if gather_bytes(r) <= budget]

    order = random.Random(args.seed)
    samples: dict[tuple[str, int], dict[int, list[float]]] = {}
    started = time.monotonic()
    rounds = args.warmup + args.runs
    for r in range(rounds):
        warm = r < args.warmup
        order.shuffle(cases)
        for case in cases:
            try:
                if isinstance(case, TokenCase):
                    times = bench.token_case(case)
                    if not warm:
                        for kernel, us in times.items():
                            samples.setdefault((kernel, case.heads), {}).setdefault(case.tokens, []).append(us)
                else:
                    us = bench.gather_case(case)
                    if not warm:
                        samples.setdefault(("gather_upconvert", 0), {}).setdefault(case.rows, []).append(us)
            except RuntimeError as e:  # includes torch.OutOfMemoryError
                raise CliError(f"{case}: {str(e).splitlines()[0]}; lower --max-memory or shrink the grid") from None
        torch.cuda.empty_cache()
        _progress(f"round {r + 1}/{rounds}{' (warm-up)' if warm else ''}, {time.monotonic() - started:.0f} s")

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    environment = current_environment(args.provider, args.gather)
    profile = build_profile(args, arch, num_sms, samples, environment, time.monotonic() - started)
    text = json.dumps(profile, indent=1) + "\n"
    try:
        CostModel.from_json(text)  # the planner accepts what it will be given
    except ValueError as e:  # e.g. so many cases skipped that a table has under 2 points
        raise CliError(f"the measurements make no valid profile: {e}") from None
    with atomic_files() as files:
        files.write_bytes(args.output, text.encode())
    _progress(f"wrote {args.output} ({profile['environment']['gpu']}, {time.monotonic() - started:.0f} s)")
    return 0


def build_profile(
    args: argparse.Namespace,
    arch: str,
    num_sms: int,
    samples: dict[tuple[str, int], dict[int, list[float]]],
    environment: dict[str, str],
    seconds: float,
) -> dict[str, Any]:
    """The profile's JSON object from the timed samples, ``{(kernel, heads): {size: [us]}}``
    (the gather under heads 0)."""
    tables: dict[str, Any] = {"sparse_decode": {}, "sparse_prefill": {}}
    raw: dict[str, Any] = {"sparse_decode": {}, "sparse_prefill": {}}
    for (kernel, heads), by_size in sorted(samples.items()):
        fitted, medians = _table(by_size)
        if kernel == "gather_upconvert":
            tables[kernel], raw[kernel] = fitted, medians
        else:
            tables[kernel][str(heads)], raw[kernel][str(heads)] = fitted, medians
    return {
        "format": COST_PROFILE_FORMAT,
        "arch": arch,
        "num_sms": num_sms,
        "topk": args.topk,
        "environment": environment,
        "calibration": {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "mla-planner " + " ".join(sys.argv[1:]),
            "runs": args.runs,
            "warmup": args.warmup,
            "seed": args.seed,
            "statistic": "median of the timed rounds, made non-decreasing per table",
            "seconds": round(seconds, 1),
            "raw_median_us": raw,
        },
        **tables,
    }


def _progress(message: str) -> None:
    print(f"mla-planner calibrate: {message}", file=sys.stderr, flush=True)
