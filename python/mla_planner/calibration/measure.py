"""Time a :class:`.grid.Grid` on this GPU and make the cost profile's JSON object.

Each round measures every case once, in a fresh shuffled order, on fresh random inputs; warm-up
rounds are discarded; each point is the median of the timed rounds, and each table is then made
non-decreasing (pool-adjacent-violators), since the cost model refuses a table whose time falls
as the size grows. The raw medians are kept in the profile's ``calibration`` section.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from mla_planner import COST_PROFILE_FORMAT, CostModel

from .grid import Grid, case_bytes, gather_bytes

Progress = Callable[[str], None]


class CalibrationError(RuntimeError):
    """The grid cannot be measured here (no such kernels, a case that fails, too little memory
    for a valid profile); the message is one line that says what to change."""


def arch_of(capability: tuple[int, int]) -> str:
    major, minor = capability
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    raise CalibrationError(f"this GPU is sm{major}{minor}; the FlashMLA sparse kernels run on sm90 (Hopper) and sm100 (Blackwell)")


def measure(grid: Grid, *, provider: str = "vllm", gather: str = "vllm", command: str,
            progress: Progress = lambda message: None) -> dict[str, Any]:
    """The cost profile (its JSON object, checked to parse) of ``grid`` timed on the current CUDA
    device with ``provider``'s kernels and ``gather``'s op; ``command`` is recorded as what made
    it. Frees what it allocated (the caching allocator's blocks too) before it returns."""
    import torch

    from mla_planner.executor.providers import ProviderUnavailable, get_provider
    from mla_planner.routing import current_environment

    from .kernel_timing import GatherCase, GatherOp, KernelBench, TokenCase

    arch = arch_of(torch.cuda.get_device_capability())
    try:
        kernels = get_provider(provider)
        gather_op = GatherOp(gather)
    except (ProviderUnavailable, RuntimeError) as e:
        raise CalibrationError(str(e)) from None
    free, _total = torch.cuda.mem_get_info()
    budget = grid.max_memory or int(0.8 * free)
    gen = torch.Generator(device="cuda").manual_seed(grid.seed)
    bench = KernelBench(kernels, gather_op, grid.topk, gen)
    cases: list[TokenCase | GatherCase] = []
    native = dict(grid.native_tokens)
    for h in list(native):
        # One tiny call: a FlashMLA build without the kernel refuses these heads.
        refused = bench.refuses_native_prefill(h)
        if refused is not None:
            progress(f"not timing the prefill kernel at {h} native heads: {provider}'s kernel refused them ({refused})")
            del native[h]
    grid_cases = [(h, t, False) for h, tokens in grid.tokens.items() for t in tokens]
    grid_cases += [(h, t, True) for h, tokens in native.items() for t in tokens]
    for h, t, is_native in grid_cases:
        need = case_bytes(h, t, grid.topk, native=is_native)
        if need > budget:
            kind = "native" if is_native else "padded"
            progress(f"skipping {t:,} tokens at {h} {kind} heads: ~{need / 2**20:,.0f} MiB > {budget / 2**20:,.0f} MiB")
        else:
            cases.append(TokenCase(h, t, native=is_native))
    cases += [GatherCase(r) for r in grid.rows if gather_bytes(r) <= budget]

    order = random.Random(grid.seed)
    samples: dict[tuple[str, int], dict[int, list[float]]] = {}
    started = time.monotonic()
    rounds = grid.warmup + grid.runs
    try:
        for r in range(rounds):
            warm = r < grid.warmup
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
                    raise CalibrationError(f"{case}: {str(e).splitlines()[0]}; lower the memory allowed or shrink the grid") from None
            torch.cuda.empty_cache()
            progress(f"round {r + 1}/{rounds}{' (warm-up)' if warm else ''}, {time.monotonic() - started:.0f} s")
    finally:
        del bench, cases
        torch.cuda.empty_cache()

    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    environment = current_environment(provider, gather)
    profile = build_profile(grid, arch, num_sms, samples, environment, time.monotonic() - started, command)
    try:
        CostModel.from_json(json_text(profile))  # the planner accepts what it will be given
    except ValueError as e:  # e.g. so many cases skipped that a table has under 2 points
        raise CalibrationError(f"the measurements make no valid profile: {e}") from None
    return profile


def json_text(profile: dict[str, Any]) -> str:
    """A profile as its file holds it."""
    import json

    return json.dumps(profile, indent=1) + "\n"


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


def build_profile(
    grid: Grid,
    arch: str,
    num_sms: int,
    samples: dict[tuple[str, int], dict[int, list[float]]],
    environment: dict[str, str],
    seconds: float,
    command: str,
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
        "topk": grid.topk,
        "environment": environment,
        "calibration": {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "runs": grid.runs,
            "warmup": grid.warmup,
            "seed": grid.seed,
            "statistic": "median of the timed rounds, made non-decreasing per table",
            "seconds": round(seconds, 1),
            "raw_median_us": raw,
        },
        **tables,
    }
