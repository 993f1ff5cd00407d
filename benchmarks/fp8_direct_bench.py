"""The FP8-direct sparse-MLA Triton kernel (mla_planner.kernels.fp8_direct) against today's
separate route, on one prefill request per shape.

For T in {512, 2K, 8K, 32K} tokens x H in {16, 32} heads per rank (top-k 2,048): the inputs of
`mla-planner calibrate`'s token cases (calibration/synthetic.py's ``prefill_case``: one request of
T tokens after ``max(0, topk - T)`` tokens of context, causal top-k positions, pages shuffled);
the kernel reads the paged FP8 cache through the positions' cache slots. Timed, interleaved in a
fresh random order each repeat, CUDA events, L2 flushed before every call
(calibration/kernel_timing.py's ``Timer``), medians:

* the kernel under each ``KernelConfig`` of the sweep (``--configs``), the fastest marked;
* where vLLM's FlashMLA loads (``get_provider("vllm")``): the separate route on the same inputs
  -- vLLM's ``cp_gather_and_upconvert_fp8_kv_cache`` of the request's rows into a BF16 workspace,
  q copied into a zero-padded 64-head buffer, FlashMLA's sparse prefill at 64 heads -- and its
  pieces alone (the gather; the prefill at 64 heads; the prefill at the H native heads where the
  installed build takes them). Elsewhere those columns say n/a.

Every config's output (and the separate route's) is checked against the float32 reference at
T = 2,048 (max abs error, the fraction outside FlashMLA's element-wise criterion, 1 - cos).

    python benchmarks/fp8_direct_bench.py --out fp8_direct_bench.md
    python benchmarks/fp8_direct_bench.py --quick
    python benchmarks/fp8_direct_bench.py --compile-report   # no GPU: sm90 registers/spills per config
    python benchmarks/fp8_direct_bench.py --probe --out probe.md   # what the dequantisation costs

``--probe`` asks whether converting the FP8 bytes bounds the kernel: at 16 heads, 2,048 and 32,768
tokens, the two best configs of the H100 sweep under each dequantisation -- ``f32`` (the kernel's
default), ``bits`` (exact, integer bit placement) and ``none`` and the two bound probes of
:func:`no_dequant_bound_probe` (the same kernel with no dequantisation, wrong results by design,
timed only: ``widen`` loads the bytes as the exact modes do and only shifts them into BF16 bits,
``none`` reads them as BF16 and does nothing) -- interleaved, with the time over ``none`` per
converted element. It needs torch and triton only (no vLLM).
``--compile-report`` prints, per config and dequantisation, the PTX and SASS instruction counts
that tell the modes apart.

``--gather-probe`` asks how fast the gather alone can go: on the probe's inputs (16 heads, 2,048
and 32,768 tokens, top-k 2,048), interleaved as above, the gather-only kernel of
benchmarks/gather_probe.py (the attention kernel's launch and row loads, each loaded word only
added into a small integer accumulator: a few dozen registers a thread) under each of
``--gather-configs`` (default: block_n 32/64/128 x 4/8 warps x 1/2/3 stages, a program per
token; then block_n 32/64/128 at 4 warps with two programs an SM looping over the tokens, the
attention kernel's residency: ``c2``), once on the real
top-k slots and once on sequential ones (each token's valid entries a contiguous run of rows,
same count: address randomness against volume), beside the attention kernel at ``--configs``
(default the probe's two). Per run: the median, the gathered rate (valid rows x 656 B / time,
valid rows counted from the indices), the ratio to the faster attention config, the registers
and a hash of the gather kernel's binary (Triton may compile different ``num_stages`` to the same
code). Every gather output is checked against torch's sums of the same rows. Torch and triton
only. With ``--compile-report`` it compiles the gather configs for sm90 instead (no GPU).

    python benchmarks/fp8_direct_bench.py --gather-probe --repeats 10 --out gather.md
    python benchmarks/fp8_direct_bench.py --gather-probe --compile-report   # no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_planner.executor.layout import D_QK, D_V, PAGE_SIZE, as_slots, page_of, slot_of
from mla_planner.kernels.fp8_direct import (
    BOUND_PROBES,
    DEQUANT_MODES,
    WGMMA_CONFIG,
    KernelConfig,
    flops,
    gathered_bytes,
    no_dequant_bound_probe,
    sparse_attention_fp8,
)

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "gpu")]  # tests/harness and gpu_helpers: not in the wheel
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gather_probe, beside this file

from gather_probe import (  # noqa: E402
    GATHER_SWEEP,
    GatherConfig,
    fold_rows,
    gather_rows,
    gather_rows_kernel,
    reference_sums,
    sequential_slots,
    valid_mask,
)

SWEEP = ("n64 w8 s2 hm", "n32 w4 s2 hm", "n32 w8 s2 hm", "n64 w8 s2 km", "n32 w4 s2 km", "n32 w8 s2 km", "n32 w8 s3 km")
"""heads-as-M (mma.sync at 16/32 heads) and keys-as-M (wgmma) at 32 and 64 keys a block: the
configs that compile for sm90 with no or little register spilling (``--compile-report``)."""
FULL_SHAPES = [(t, h) for h in (16, 32) for t in (512, 2048, 8192, 32768)]
QUICK_SHAPES = [(2048, 16), (32768, 16)]
CHECK_TOKENS = 2048
PADDED_HEADS = 64
PROBE_CONFIGS = ("n32 w4 s2 hm", "n32 w4 s2 km")
"""The best configs of the H100 sweep at 16 heads (hm) and 32 heads (km), docs/fp8-direct.md."""
PROBE_SHAPES = [(2048, 16), (32768, 16)]
NO_DEQUANT = "none"
PROBE_MODES = (*DEQUANT_MODES, *BOUND_PROBES)
"""The exact modes, then the bound probes (no dequantisation; outputs meaningless, never checked)."""


@dataclass
class Shape:
    tokens: int
    heads: int
    times: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        t = self.times.get(name)
        return statistics.median(t) if t else None


def load_separate_route() -> tuple[Any, Any, str]:
    """(provider, gather) of vLLM's kernels, or (None, None, why not)."""
    try:
        from mla_planner.calibration.kernel_timing import GatherOp
        from mla_planner.executor import ProviderUnavailable, get_provider
    except Exception as exc:  # the mla_planner extension or its deps missing
        return None, None, f"mla_planner.executor unavailable: {exc}"
    try:
        return get_provider("vllm"), GatherOp("vllm"), ""
    except (ProviderUnavailable, RuntimeError) as exc:
        return None, None, str(exc).splitlines()[0]


def accuracy(name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
    from gpu_helpers import PREFILL_OUT, cosine_difference, flashmla_tolerance

    a, r = out.double(), ref.double()
    err = (a - r).abs()
    outside = float((err >= flashmla_tolerance(r, abs_tol=PREFILL_OUT["abs_tol"], rel_tol=PREFILL_OUT["rel_tol"])).double().mean())
    return (f"{name}: max abs error {float(err.max()):.3g}, {outside:.4%} outside FlashMLA's element-wise criterion, "
            f"1 - cos {cosine_difference(a, r):.3g}")


def case_inputs(shape: Shape, topk: int, gen: torch.Generator) -> tuple[int, Any, torch.Tensor]:
    """The shape's case as calibration draws it (``prefill_case``: one request after its context
    rows): (context rows, the case's inputs, its top-k positions as int32 cache slots)."""
    from mla_planner.calibration.kernel_timing import case_context
    from mla_planner.calibration.synthetic import prefill_case

    context = case_context(shape.tokens, topk)
    inputs = prefill_case([shape.tokens], [context], shape.heads, topk, gen, dtype=torch.bfloat16)
    positions = inputs.indices
    slots = slot_of(inputs.block_table[0][page_of(positions, PAGE_SIZE)], positions, PAGE_SIZE).to(torch.int32)
    return context, inputs, slots


def bench_shape(shape: Shape, configs: list[KernelConfig], args: argparse.Namespace, gen: torch.Generator,
                provider: Any, gather: Any, timer: Callable[[Callable[[], object]], float]) -> None:
    t, h, dev = shape.tokens, shape.heads, gen.device
    context, inputs, slots = case_inputs(shape, args.topk, gen)
    q, positions = inputs.q, inputs.indices
    scale = D_QK**-0.5
    out = torch.empty((t, h, D_V), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((t, h), dtype=torch.float32, device=dev)
    runs: dict[str, Callable[[], object]] = {}
    def ours(config: KernelConfig) -> Callable[[], object]:
        return lambda: sparse_attention_fp8(q, inputs.kv_cache, slots, scale, out=out, lse=lse, config=config)

    for config in configs:
        runs[config.label()] = ours(config)

    outputs: dict[str, torch.Tensor] = {}
    if provider is not None:
        rows = context + t
        workspace = torch.empty((rows, D_QK), dtype=torch.bfloat16, device=dev)
        q64 = torch.zeros((t, PADDED_HEADS, D_QK), dtype=torch.bfloat16, device=dev)
        out64 = torch.empty((t, PADDED_HEADS, D_V), dtype=torch.bfloat16, device=dev)
        out_native = torch.empty((t, h, D_V), dtype=torch.bfloat16, device=dev)
        kv, idx = workspace.unsqueeze(1), positions.unsqueeze(1)

        def prefill64() -> None:
            provider.sparse_prefill(q64, kv, idx, scale, out=out64)

        def route() -> None:
            gather(inputs, rows, workspace)
            q64[:, :h].copy_(q)
            prefill64()

        runs["separate route (gather + pad + prefill@64)"] = route
        runs["gather alone"] = lambda: gather(inputs, rows, workspace)
        runs["prefill@64 alone"] = prefill64
        runs[f"prefill@{h} native alone"] = lambda: provider.sparse_prefill(q, kv, idx, scale, out=out_native)

    for name, run in list(runs.items()):  # warm-up, compiles; a config or kernel that fails is noted
        try:
            run()
            if dev.type == "cuda":
                torch.cuda.synchronize()  # an asynchronous launch failure surfaces here
            if name in shape_config_labels(configs) and t == CHECK_TOKENS:
                outputs[name] = out.clone()
            elif name.startswith("separate route") and t == CHECK_TOKENS:
                outputs[name] = out64[:, :h].clone()
            run()
        except Exception as exc:
            shape.notes[name] = failure_note(exc)
            del runs[name]
    time_interleaved(shape, runs, args.repeats, args.seed, timer)

    if t == CHECK_TOKENS:
        from mla_planner.executor.reference import sparse_attention

        ref, _ = sparse_attention(q, as_slots(inputs.kv_cache), slots, scale)
        for name, o in outputs.items():
            shape.checks.append(accuracy(f"T={t} H={h} {name}", o.float(), ref))
    del inputs, q, out, lse
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def failure_note(exc: Exception) -> str:
    """A run's failure as a table note: the first line of its message, cut to 120 characters."""
    return f"failed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]}"


def time_interleaved(shape: Shape, runs: dict[str, Callable[[], object]], repeats: int, seed: int,
                     timer: Callable[[Callable[[], object]], float]) -> None:
    """Time every run ``repeats`` times into ``shape.times``, in a fresh seeded order each round,
    so that drift over the call falls on every run alike."""
    coin = random.Random(seed)
    order = list(runs.items())
    for _ in range(repeats):
        coin.shuffle(order)
        for name, run in order:
            shape.times.setdefault(name, []).append(timer(run))


def shape_config_labels(configs: list[KernelConfig]) -> set[str]:
    return {c.label() for c in configs}


def markdown(shapes: list[Shape], configs: list[KernelConfig], header: str, topk: int) -> str:
    labels = [c.label() for c in configs]
    lines = [header, "", "### Sweep (our kernel)", "",
             "| tokens | heads | config | median us | vs best | vs first | TFLOP/s (H heads, all top-k) | GB/s (T x top-k x 656 B) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for s in shapes:
        medians = {n: m for n in labels if (m := s.median(n)) is not None}
        best = min(medians.values()) if medians else None
        first = medians.get(labels[0])
        for n in labels:
            m = medians.get(n)
            if m is None or best is None:
                lines.append(f"| {s.tokens} | {s.heads} | {n} | {s.notes.get(n, 'n/a')} | | | | |")
                continue
            mark = " **best**" if m == best else ""
            vs_first = f"{m / first:.2f}x" if first is not None else "n/a"
            lines.append(f"| {s.tokens} | {s.heads} | {n}{mark} | {m:.1f} | {m / best:.2f}x | {vs_first} "
                         f"| {flops(s.tokens, s.heads, topk) / m / 1e6:.0f} | {gathered_bytes(s.tokens, topk) / m / 1e3:.0f} |")
    lines += ["", "### Against the separate route (same inputs, same run)", "",
              "| tokens | heads | ours, best config | us | separate route us | gather us | prefill@64 us "
              "| prefill@H native us | route / ours | prefill@64 / ours |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in shapes:
        medians = {n: m for n in labels if (m := s.median(n)) is not None}
        if not medians:
            continue
        best_name = min(medians, key=lambda n: medians[n])
        ours = medians[best_name]

        def cell(name: str) -> str:
            m = s.median(name)
            return f"{m:.1f}" if m is not None else s.notes.get(name, "n/a")

        def ratio(name: str) -> str:
            m = s.median(name)
            return f"{m / ours:.2f}x" if m is not None else "n/a"

        route = "separate route (gather + pad + prefill@64)"
        native = f"prefill@{s.heads} native alone"
        lines.append(f"| {s.tokens} | {s.heads} | {best_name} | {ours:.1f} | {cell(route)} | {cell('gather alone')} "
                     f"| {cell('prefill@64 alone')} | {cell(native)} | {ratio(route)} | {ratio('prefill@64 alone')} |")
    checks = [c for s in shapes for c in s.checks]
    if checks:
        lines += ["", "### Accuracy against the float32 reference", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines) + "\n"


def probe_label(config: KernelConfig, mode: str) -> str:
    return f"{config.label()} [{mode}]"


def probe_runs(configs: list[KernelConfig], modes: list[str], q: torch.Tensor, kv_cache: torch.Tensor,
               slots: torch.Tensor, outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Callable[[], object]]:
    """One call per (config, mode): the exact modes through sparse_attention_fp8, the bound probes
    through no_dequant_bound_probe; each writes its own ``outs[label]`` buffers."""
    scale = D_QK**-0.5
    runs: dict[str, Callable[[], object]] = {}
    t, h = q.shape[0], q.shape[1]
    for config in configs:
        for mode in modes:
            label = probe_label(config, mode)
            out = torch.empty((t, h, D_V), dtype=torch.bfloat16, device=q.device)
            lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
            outs[label] = (out, lse)
            if mode in DEQUANT_MODES:
                runs[label] = functools.partial(sparse_attention_fp8, q, kv_cache, slots, scale, out=out, lse=lse,
                                                config=dataclasses.replace(config, dequant=mode))
            else:
                runs[label] = functools.partial(no_dequant_bound_probe, q, kv_cache, slots, scale, out=out, lse=lse,
                                                config=config, probe=mode)
    return runs


def probe_checks(shape: Shape, configs: list[KernelConfig], modes: list[str],
                 outs: dict[str, tuple[torch.Tensor, torch.Tensor]], ref: torch.Tensor) -> None:
    """The exact modes run against the float32 reference, and bits against f32 bit for bit where
    both ran (same config: same operands into the same dots). The probes' outputs are never
    looked at."""
    for config in configs:
        for mode in modes:
            if mode in DEQUANT_MODES:
                label = probe_label(config, mode)
                shape.checks.append(accuracy(f"T={shape.tokens} H={shape.heads} {label}", outs[label][0].float(), ref))
        if "f32" in modes and "bits" in modes:
            f32, bits = outs[probe_label(config, "f32")], outs[probe_label(config, "bits")]
            same = torch.equal(f32[0].view(torch.int16), bits[0].view(torch.int16)) and torch.equal(f32[1], bits[1])
            shape.checks.append(f"T={shape.tokens} H={shape.heads} {config.label()}: bits output and lse "
                                f"{'bit-identical to' if same else 'DIFFER from'} f32's")


def probe_shape(shape: Shape, configs: list[KernelConfig], args: argparse.Namespace, gen: torch.Generator,
                timer: Callable[[Callable[[], object]], float]) -> None:
    """Times every (config, mode) on one shape, interleaved in a fresh random order each repeat;
    at CHECK_TOKENS checks the exact modes."""
    t = shape.tokens
    _, inputs, slots = case_inputs(shape, args.topk, gen)
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    runs = probe_runs(configs, args.modes, inputs.q, inputs.kv_cache, slots, outs)
    for name, run in list(runs.items()):  # warm-up and compile; a failure is noted, not fatal
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:
            shape.notes[name] = failure_note(exc)
            del runs[name]
    time_interleaved(shape, runs, args.repeats, args.seed, timer)
    if t == CHECK_TOKENS and not shape.notes:
        from mla_planner.executor.reference import sparse_attention

        ref, _ = sparse_attention(inputs.q, as_slots(inputs.kv_cache), slots, D_QK**-0.5)
        probe_checks(shape, configs, args.modes, outs, ref)
    del inputs, outs, runs
    torch.cuda.empty_cache()


def probe_markdown(shapes: list[Shape], configs: list[KernelConfig], modes: list[str], header: str, topk: int) -> str:
    """Per shape and config: each mode's median, its ratio to f32, and its time over the ``none``
    probe per converted element (T x top-k x 512: the kernel converts every top-k entry's bytes,
    the masked zeros of unused entries too)."""
    lines = [header, "", "### Dequantisation probe", "",
             "| tokens | heads | config | mode | median us | / f32 | over none us | over none ps / element |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    for s in shapes:
        elements = s.tokens * topk * D_V
        for config in configs:
            f32, none = s.median(probe_label(config, "f32")), s.median(probe_label(config, NO_DEQUANT))
            for mode in modes:
                label = probe_label(config, mode)
                m = s.median(label)
                if m is None:
                    lines.append(f"| {s.tokens} | {s.heads} | {config.label()} | {mode} | {s.notes.get(label, 'n/a')} | | | |")
                    continue
                ratio = f"{m / f32:.2f}x" if f32 else "n/a"
                over = f"{m - none:.1f} | {(m - none) * 1e6 / elements:.3f}" if none is not None else "n/a | n/a"
                lines.append(f"| {s.tokens} | {s.heads} | {config.label()} | {mode} | {m:.1f} | {ratio} | {over} |")
    lines += ["", "`none` and `widen` are bound probes: their outputs are wrong by design and never checked. "
              "`none` reads the NoPE bytes as BF16 and does no dequantisation work; `widen` loads them as the exact modes "
              "do and only shifts each byte into BF16 bits."]
    checks = [c for s in shapes for c in s.checks]
    if checks:
        lines += ["", "### Exact modes against the float32 reference", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines) + "\n"


def run_probe(args: argparse.Namespace) -> str:
    """The --probe run: PROBE_SHAPES x PROBE_CONFIGS x PROBE_MODES; returns the Markdown."""
    import triton

    from mla_planner.calibration.kernel_timing import Timer

    configs = [KernelConfig.parse(label) for label in (args.configs or ",".join(PROBE_CONFIGS)).split(",")]
    shapes = [Shape(t, h) for t, h in PROBE_SHAPES]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    timer = Timer(gen.device)
    for shape in shapes:
        print(f"probe T={shape.tokens} H={shape.heads} ...", file=sys.stderr, flush=True)
        probe_shape(shape, configs, args, gen, timer)
    header = (f"FP8-direct dequantisation probe on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}: top-k {args.topk}, calibration's synthetic inputs, L2 flushed before each "
              f"call, median of {args.repeats} interleaved repeats.\n\nCommand: "
              f"`python benchmarks/fp8_direct_bench.py {' '.join(sys.argv[1:])}`")
    return probe_markdown(shapes, configs, args.modes, header, args.topk)


GATHER_PATTERNS = ("random", "sequential")
"""The probe's two index sets: the case's top-k slots, and :func:`gather_probe.sequential_slots`."""


@dataclass
class GatherShape(Shape):
    """A :class:`Shape` of the gather probe: what its table needs besides the times."""

    valid_rows: int = 0
    """Valid top-k entries over all tokens (each one row of 656 bytes gathered), both index sets."""
    top_k_entries: int = 0
    cache_rows: int = 0
    regs: dict[str, str] = field(default_factory=dict)
    binary: dict[str, str] = field(default_factory=dict)
    """A short hash of each gather run's compiled kernel (equal hashes: the same code)."""


def gather_label(config: GatherConfig, pattern: str) -> str:
    return f"gather {config.label()} {pattern}"


def full_label(config: KernelConfig) -> str:
    return f"attention {config.label()}"


def compiled_facts(compiled: Any) -> tuple[str, str]:
    """(registers, a short hash of the kernel's code) of what a Triton launch returned, or n/a."""
    import hashlib

    asm = getattr(compiled, "asm", None) or {}
    code = asm.get("cubin") or asm.get("ptx")
    regs = getattr(compiled, "n_regs", None)
    if isinstance(code, str):
        code = code.encode()
    digest = hashlib.sha1(code).hexdigest()[:8] if isinstance(code, bytes) else "n/a"
    return (str(regs) if regs is not None else "n/a"), digest


def gather_probe_shape(shape: GatherShape, gather_configs: list[GatherConfig], full_configs: list[KernelConfig],
                       args: argparse.Namespace, gen: torch.Generator, timer: Callable[[Callable[[], object]], float]) -> None:
    """Times every gather config on both index sets and the attention kernel at each full
    config, interleaved; then checks every gather output against torch's sums of the same rows."""
    t, h = shape.tokens, shape.heads
    _, inputs, slots = case_inputs(shape, args.topk, gen)
    num_rows = inputs.kv_cache.shape[0] * inputs.kv_cache.shape[1]
    indices = {"random": slots, "sequential": sequential_slots(slots, num_rows, gen)}
    counts = {p: int(valid_mask(i, num_rows).sum()) for p, i in indices.items()}
    assert counts["random"] == counts["sequential"], counts
    shape.valid_rows, shape.top_k_entries, shape.cache_rows = counts["random"], slots.numel(), num_rows

    runs: dict[str, Callable[[], object]] = {}
    gather_outs: dict[str, tuple[str, torch.Tensor]] = {}
    for config in gather_configs:
        for pattern in GATHER_PATTERNS:
            label = gather_label(config, pattern)
            out = torch.empty((t, 164), dtype=torch.int32, device=slots.device)
            gather_outs[label] = (pattern, out)
            runs[label] = functools.partial(gather_rows, inputs.kv_cache, indices[pattern], out, config)
    full_outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for full in full_configs:
        out_full = torch.empty((t, h, D_V), dtype=torch.bfloat16, device=slots.device)
        lse = torch.empty((t, h), dtype=torch.float32, device=slots.device)
        full_outs[full_label(full)] = (out_full, lse)
        runs[full_label(full)] = functools.partial(sparse_attention_fp8, inputs.q, inputs.kv_cache, slots, D_QK**-0.5,
                                                   out=out_full, lse=lse, config=full)
    for name, run in list(runs.items()):  # warm-up and compile; a failure is noted, not fatal
        try:
            result = run()
            if slots.is_cuda:
                torch.cuda.synchronize()  # an asynchronous launch failure surfaces here
        except Exception as exc:
            shape.notes[name] = failure_note(exc)
            del runs[name]
            continue
        if name in gather_outs:
            shape.regs[name], shape.binary[name] = compiled_facts(result[1] if isinstance(result, tuple) else None)
    time_interleaved(shape, runs, args.repeats, args.seed, timer)

    for pattern in GATHER_PATTERNS:
        ref = reference_sums(inputs.kv_cache, indices[pattern])
        ran = [n for n, (p, _) in gather_outs.items() if p == pattern and n in runs]
        wrong = [n for n in ran if not torch.equal(gather_outs[n][1], ref)]
        shape.checks.append(f"T={t} {pattern}: {len(ran) - len(wrong)} of {len(ran)} gather runs' sums equal torch's"
                            + (f"; DIFFER: {', '.join(wrong)}" if wrong else ""))
    if t == CHECK_TOKENS:
        from mla_planner.executor.reference import sparse_attention

        ref_out, _ = sparse_attention(inputs.q, as_slots(inputs.kv_cache), slots, D_QK**-0.5)
        for name, (o, _lse) in full_outs.items():
            if name in runs:
                shape.checks.append(accuracy(f"T={t} H={h} {name}", o.float(), ref_out))
    del inputs, indices, runs, gather_outs, full_outs
    torch.cuda.empty_cache()


def gather_markdown(shapes: list[GatherShape], gather_configs: list[GatherConfig], full_configs: list[KernelConfig],
                    header: str) -> str:
    """Per shape: the attention runs, then each gather config on random and on sequential slots;
    median, gathered GB/s (valid rows x 656 B / median), ratio to the faster attention config."""
    lines = [header]
    for s in shapes:
        gb = s.valid_rows * 656 / 1e9
        lines += ["", f"### {s.tokens} tokens, {s.heads} heads: {s.valid_rows:,} valid rows of {s.top_k_entries:,} top-k "
                      f"entries ({s.valid_rows / max(1, s.top_k_entries):.1%}), {gb:.2f} GB gathered a call from a "
                      f"cache of {s.cache_rows:,} rows ({s.cache_rows * 656 / 1e6:.1f} MB)", "",
                  "| run | median us | gathered GB/s | / attention | registers | binary |", "|---|---:|---:|---:|---:|---|"]
        fulls = {n: m for c in full_configs if (m := s.median(n := full_label(c))) is not None}
        best_full = min(fulls.values()) if fulls else None
        best_full_name = min(fulls, key=lambda n: fulls[n]) if fulls else None
        best_gather = {p: min((m for c in gather_configs if (m := s.median(gather_label(c, p))) is not None), default=None)
                       for p in GATHER_PATTERNS}
        names = [full_label(c) for c in full_configs] + [gather_label(c, p) for p in GATHER_PATTERNS for c in gather_configs]
        for name in names:
            m = s.median(name)
            if m is None:
                lines.append(f"| {name} | {s.notes.get(name, 'n/a')} | | | | |")
                continue
            pattern = name.rsplit(" ", 1)[-1]
            mark = " **best**" if (name == best_full_name or m == best_gather.get(pattern)) else ""
            ratio = f"{m / best_full:.2f}x" if best_full else "n/a"
            lines.append(f"| {name}{mark} | {m:.1f} | {s.valid_rows * 656 / m / 1e3:,.0f} | {ratio} "
                         f"| {s.regs.get(name, '')} | {s.binary.get(name, '')} |")
    lines += ["", "GB/s: valid rows x 656 B / median; a row that several tokens name counts once for each (the "
              "whole cache, its size in each heading, fits in an H100's or H200's L2, 50 MB or more, which is flushed before "
              "each call, so most of these bytes come from L2). / attention: the run's median over the faster "
              "attention config's. registers and binary: of the gather kernel as launched (binary: a hash of its "
              "code; equal hashes mean one kernel). sequential: each token's valid entries a contiguous run of rows "
              "from a random start, same count as random. c2: two programs an SM, each looping over tokens (at 4 "
              "warps the attention kernel's residency); without it, one program a token."]
    checks = [c for s in shapes for c in s.checks]
    if checks:
        lines += ["", "### Checks", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines) + "\n"


def run_gather_probe(args: argparse.Namespace) -> str:
    """The --gather-probe run: PROBE_SHAPES x (gather configs x index sets + attention configs)."""
    import triton

    from mla_planner.calibration.kernel_timing import Timer

    began = time.perf_counter()
    full_configs = [KernelConfig.parse(label) for label in (args.configs or ",".join(PROBE_CONFIGS)).split(",")]
    gather_configs = gather_configs_of(args)
    shapes = [GatherShape(t, h) for t, h in PROBE_SHAPES]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    timer = Timer(gen.device)
    for shape in shapes:
        print(f"gather probe T={shape.tokens} H={shape.heads} ...", file=sys.stderr, flush=True)
        gather_probe_shape(shape, gather_configs, full_configs, args, gen, timer)
    header = (f"Gather-bound probe on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
              f"{triton.__version__}: top-k {args.topk}, calibration's synthetic inputs, L2 flushed before each call, "
              f"median of {args.repeats} interleaved repeats; {time.perf_counter() - began:.0f} s in all.\n\nCommand: "
              f"`python benchmarks/fp8_direct_bench.py {' '.join(sys.argv[1:])}`")
    return gather_markdown(shapes, gather_configs, full_configs, header)


def gather_configs_of(args: argparse.Namespace) -> list[GatherConfig]:
    return [GatherConfig.parse(label) for label in args.gather_configs.split(",")] if args.gather_configs else list(GATHER_SWEEP)


def in_inner_loop(ttgir: str, op: str) -> int:
    """How often ``op`` occurs in the kernel's innermost loops (``scf.for`` bodies with no loop
    inside) in Triton GPU IR: for the gather kernel, the loop over a token's top-k blocks."""
    total = 0
    frames: list[list[int]] = []  # per open loop: [ops counted, loops nested in it]
    for line in ttgir.splitlines():
        if "scf.for" in line:
            if frames:
                frames[-1][1] += 1
            frames.append([0, 0])
        elif frames and "scf.yield" in line:
            count, nested = frames.pop()
            total += count if not nested else 0
        elif frames and op in line:
            frames[-1][0] += 1
    return total


def gather_compile_report(configs: list[GatherConfig]) -> None:
    """Compile each gather config for sm90 (no GPU: Triton's bundled ptxas); print registers,
    spills, shared memory, the global loads in the code by width, the layout conversions left in
    the loop over a token's top-k blocks (each a trip through shared memory with barriers; none
    means the loop only loads and adds) and a hash of the PTX (equal: the same code)."""
    import hashlib

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    print(f"triton {triton.__version__}, sm_90a: gather-only kernel (benchmarks/gather_probe.py)")
    for config in configs:
        compiled = compile_gather(config)
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        regs, spill = ptxas_usage(ptx, ptxas)
        loads = {w: len(re.findall(rf"ld\.global(?:\.\w+)*{w}\.b32", ptx)) for w in (".v4", ".v2", "")}
        loads[""] -= loads[".v4"] + loads[".v2"]  # the plain pattern counts the vector loads too
        print(f"{config.label():<15s} registers {regs:>4s}  spill stores {spill:>4s} B  shared {compiled.metadata.shared:>5d} B  "
              f"global loads (static) v4 {loads['.v4']:>3d} v2 {loads['.v2']:>2d} b32 {loads['']:>3d}  "
              f"layout conversions in the top-k loop {in_inner_loop(ttgir, 'ttg.convert_layout')}  "
              f"ptx {hashlib.sha1(ptx.encode()).hexdigest()[:8]}")


PTX_OPS = ("cvt", "prmt", "lop3", "mma", "wgmma")
"""PTX mnemonics counted per kernel (by prefix: ``cvt`` counts every ``cvt.*``; ``mma`` the
``mma.sync`` only)."""
SASS_OPS = ("F2F", "F2FP", "HADD2", "FMUL", "PRMT", "LOP3", "SHF", "IMAD", "HMMA", "HGMMA")
"""SASS opcodes counted: the conversions (F2F: one value; F2FP: a packed pair, e4m3x2 -> f16x2 or
f32 -> bf16x2), what ptxas makes of the rest of a dequantisation (HADD2: its f16 -> f32; FMUL; the
integer PRMT/LOP3/SHF/IMAD), and the MMAs (HMMA: mma.sync, HGMMA: wgmma)."""


def ptx_counts(ptx: str) -> dict[str, int]:
    """Static count of each ``PTX_OPS`` mnemonic in the kernel's PTX (predicates skipped)."""
    counts = dict.fromkeys(PTX_OPS, 0)
    for line in ptx.splitlines():
        words = line.strip().split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if not words:
            continue
        op = words[0]
        for name in PTX_OPS:
            if op == name or op.startswith(name + ".") and not (name == "mma" and not op.startswith("mma.sync")):
                counts[name] += 1
    return counts


def sass_opcodes(cubin: bytes, bin_dir: Path) -> list[str]:
    """The cubin's opcodes in order, without their modifiers (Triton's bundled ``nvdisasm``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)


def sass_counts(cubin: bytes, bin_dir: Path) -> dict[str, int] | None:
    """Static count of each ``SASS_OPS`` opcode in the cubin, or None where Triton's bundled
    ``nvdisasm`` is missing."""
    if not (bin_dir / "nvdisasm").exists():
        return None
    counts = dict.fromkeys(SASS_OPS, 0)
    for op in sass_opcodes(cubin, bin_dir):
        if op in counts:
            counts[op] += 1
    return counts


def compile_sm90(kernel: Any, types: list[str], consts: dict[str, Any], not_divisible: set[str],
                 options: dict[str, Any]) -> Any:
    """``kernel`` compiled for sm90 (no GPU needed) with Triton's internal API (may need updating
    with Triton): its first ``len(types)`` arguments of those types, each marked divisible by 16
    as the launches pass them except those named in ``not_divisible``, and ``consts`` its
    constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names[: len(types)]) if n not in not_divisible}
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_kernel(config: KernelConfig, heads: int, dequant: int) -> Any:
    """The attention kernel compiled for sm90, for what the launcher passes: 16-byte divisible
    pointers and strides except lse's head stride (1); the softmax scale a float."""
    from mla_planner.kernels.fp8_direct import _sparse_fp8_kernel as kernel

    types = ["*bf16", "*u8", "*fp32", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32"] + ["i32"] * 10 + ["i64"] * 3 + ["fp32"]
    consts = {"PAGE": PAGE_SIZE, "BLOCK_H": config.heads_per_program(heads), "BLOCK_N": config.block_n,
              "HAS_LENGTH": False, "HAS_SINK": False, "KEYS_AS_M": config.keys_as_m, "DEQUANT": dequant,
              "SCALES_V4": config.scales == "v4", "DV_SPLIT": config.dv_split}
    return compile_sm90(kernel, types, consts, {"stride_lh", "scale_log2"},
                        {"num_warps": config.num_warps, "num_stages": config.num_stages,
                         **({} if config.max_regs is None else {"maxnreg": config.max_regs})})


def compile_wgmma(heads: int, variant: str = "wg") -> Any:
    """The warpgroup-MMA kernel (``variant`` "wg", its warp-specialised variant "ws" or the one
    with the score dot's A operand in registers, "ra"), or the ``mma.sync`` kernel ("mma", 16
    heads a program whatever ``heads``), compiled for sm90 as
    :func:`compile_kernel` compiles the Triton one (Gluon's source type; top-k lengths and sinks on;
    pages back to back for "mma")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_planner.kernels import fp8_mma, fp8_wgmma, fp8_wgmma_ws

    types = ["*bf16", "*u8", "*fp32", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32"] + ["i32"] * 10 + ["i64"] * 3 + ["fp32"]
    consts: dict[str, Any] = {"PAGE": PAGE_SIZE, "BLOCK_H": WGMMA_CONFIG.heads_per_program(heads), "BLOCK_N": fp8_wgmma.BLOCK_N,
                              "HAS_LENGTH": True, "HAS_SINK": True}
    if variant == "ws":
        kernel = fp8_wgmma_ws._ws_kernel
        consts |= {"CHUNK": fp8_wgmma_ws.CHUNK, "STAGES": fp8_wgmma_ws.STAGES,
                   "PRODUCER_WARPS": fp8_wgmma_ws.PRODUCER_WARPS, "PRODUCER_REGS": fp8_wgmma_ws.PRODUCER_REGS}
    elif variant == "ra":
        kernel = fp8_wgmma._wgmma_ra_kernel
    elif variant == "mma":
        kernel = fp8_mma._mma_kernel
        consts |= {"BLOCK_H": fp8_mma.BLOCK_H, "BLOCK_N": fp8_mma.BLOCK_N, "CONTIGUOUS": True}
    else:
        kernel = fp8_wgmma._wgmma_kernel
        consts["CHUNK"] = fp8_wgmma.CHUNK
    names = kernel.arg_names
    signature = {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names[: len(types)]) if n not in {"stride_lh", "scale_log2"}}
    src = GluonASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": fp8_wgmma.NUM_WARPS})


def compile_gather(config: GatherConfig) -> Any:
    """The gather-only kernel compiled for sm90, specialised as the bench's launches are:
    pointers, the token count, ``topk``, ``num_rows``, the index stride and the page stride
    divisible by 16 (2,048 or 32,768 tokens, top-k 2,048, a whole number of 64-row pages of 656
    bytes), the output stride (164) not."""
    consts = {"PAGE": PAGE_SIZE, "BLOCK_N": config.block_n, **fold_rows(config),
              "PERSISTENT": config.programs_per_sm is not None}
    return compile_sm90(gather_rows_kernel, ["*i32"] * 3 + ["i32"] * 6, consts, {"stride_ot"},
                        {"num_warps": config.num_warps, "num_stages": config.num_stages})


def ptxas_usage(ptx: str, ptxas: Path) -> tuple[str, str]:
    """(registers, spill-store bytes) that Triton's bundled ptxas reports for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return (regs.group(1) if regs else "?"), (spill.group(1) if spill else "?")


def compile_report(configs: list[KernelConfig], modes: list[str], heads_list: list[int]) -> None:
    """Compile each config under each dequantisation for sm90 (no GPU needed: Triton's bundled
    ptxas and nvdisasm) at 16 and 32 heads; print registers, spills, shared memory, the MMA used
    and static PTX / SASS instruction counts. The SASS counts over the ``none`` probe's, divided
    by the elements a thread dequantises per loop iteration (block_n x 512 / threads), give each
    mode's dequantisation instructions per element (static counts: the loop body is compiled once).
    ``modes`` and ``heads_list`` narrow it (each compile takes seconds)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    codes = {**DEQUANT_MODES, **BOUND_PROBES}
    for heads in heads_list:
        for config in configs:
            sass_by_mode: dict[str, dict[str, int] | None] = {}
            for mode in modes:
                compiled = compile_kernel(config, heads, codes[mode])
                ptx = compiled.asm["ptx"]
                regs, spill = ptxas_usage(ptx, bin_dir / "ptxas")
                mma = "+".join(m for m in ("wgmma", "mma.sync") if m in ptx) or "no MMA"
                ptx_ops = " ".join(f"{k} {v}" for k, v in ptx_counts(ptx).items())
                sass = sass_by_mode[mode] = sass_counts(compiled.asm["cubin"], bin_dir)
                sass_ops = " ".join(f"{k} {v}" for k, v in sass.items()) if sass else "n/a (no nvdisasm)"
                print(f"H{heads:<3d} {config.label():<20s} {mode:<5s} registers {regs:>4s}  spill stores {spill:>5s} B  "
                      f"shared {compiled.metadata.shared:>6d} B  {mma}\n"
                      f"      PTX: {ptx_ops}\n      SASS: {sass_ops}")
            if len(modes) > 1:
                print(dequant_per_element(config, sass_by_mode))


def dequant_per_element(config: KernelConfig, sass_by_mode: dict[str, dict[str, int] | None]) -> str:
    """One line: each other mode's SASS counts minus the ``none`` probe's, per element a thread
    dequantises in a loop iteration."""
    base = sass_by_mode.get(NO_DEQUANT)
    if base is None:
        return "      per element: n/a"
    per_thread = config.block_n * 512 / (32 * config.num_warps)
    parts = []
    for mode in PROBE_MODES:
        counts = sass_by_mode.get(mode)
        if mode == NO_DEQUANT:
            continue
        if counts is None:
            continue
        extra = {k: (counts[k] - base[k]) / per_thread for k in SASS_OPS if counts[k] != base[k]}
        total = sum(extra.values())
        parts.append(f"{mode}: {total:.2f} (" + ", ".join(f"{k} {v:+.2f}" for k, v in extra.items()) + ")")
    return f"      SASS per element over none ({per_thread:.0f} elements/thread/iteration): " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"two shapes {QUICK_SHAPES}, 5 repeats")
    parser.add_argument("--tokens", default="512,2048,8192,32768")
    parser.add_argument("--heads", default="16,32")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--configs", help="comma-separated KernelConfig labels, e.g. 'n64 w8 s2 km' or 'n32 w4 s2 hm dv2 r168' "
                        f"(default: the sweep {', '.join(SWEEP)}; with --probe, {', '.join(PROBE_CONFIGS)})")
    parser.add_argument("--modes", default=",".join(PROBE_MODES),
                        help="with --probe or --compile-report: the dequantisations and bound probes to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-report", action="store_true",
                        help="no GPU: compile the configs for sm90 under each dequantisation; registers and instruction counts")
    parser.add_argument("--probe", action="store_true",
                        help=f"time each dequantisation and the no-dequant bound probes: {PROBE_SHAPES}, configs {PROBE_CONFIGS}")
    parser.add_argument("--gather-probe", action="store_true",
                        help=f"time the gather-only kernel (random and sequential slots) beside the attention kernel: "
                        f"{PROBE_SHAPES}; with --compile-report, compile the gather configs for sm90 instead")
    parser.add_argument("--gather-configs", help="with --gather-probe: comma-separated gather configs, e.g. 'n64 w8 s1' "
                        "(default: block_n 32/64/128 x num_warps 4/8 x num_stages 1/2/3, then 'n32 w4 s1 c2', 'n64 w4 s1 c2', "
                        "'n128 w4 s1 c2': c2 = two programs an SM)")
    parser.add_argument("--out", type=Path, help="also write the Markdown tables here")
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    if unknown := [m for m in args.modes if m not in PROBE_MODES]:
        parser.error(f"unknown --modes {unknown}: choose from {', '.join(PROBE_MODES)}")
    configs = [KernelConfig.parse(label) for label in (args.configs or ",".join(SWEEP)).split(",")]
    if args.compile_report and args.gather_probe:
        gather_compile_report(gather_configs_of(args))
        return
    if args.compile_report:
        compile_report(configs, args.modes, [int(h) for h in args.heads.split(",")])
        return
    if not torch.cuda.is_available():
        sys.exit("fp8_direct_bench.py needs a CUDA GPU (--compile-report runs without one)")
    if args.probe:
        write(run_probe(args), args.out)
        return
    if args.gather_probe:
        write(run_gather_probe(args), args.out)
        return
    if args.quick:
        shapes = [Shape(t, h) for t, h in QUICK_SHAPES]
        args.repeats = min(args.repeats, 5)
    else:
        shapes = [Shape(t, h) for h in map(int, args.heads.split(",")) for t in map(int, args.tokens.split(","))]

    from mla_planner.calibration.kernel_timing import Timer

    provider, gather, why = load_separate_route()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    timer = Timer(gen.device)
    for shape in shapes:
        print(f"T={shape.tokens} H={shape.heads} ...", file=sys.stderr, flush=True)
        bench_shape(shape, configs, args, gen, provider, gather, timer)

    import triton

    header = (
        f"FP8-direct sparse MLA on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: "
        f"top-k {args.topk}, one prefill request per shape (calibration's synthetic inputs), L2 flushed before each call, "
        f"median of {args.repeats} interleaved repeats.\n"
        + (f"Separate route: n/a ({why}).\n" if provider is None else "Separate route: vLLM's gather + FlashMLA sparse prefill.\n")
        + f"\nCommand: `python benchmarks/fp8_direct_bench.py {' '.join(sys.argv[1:])}`"
    )
    write(markdown(shapes, configs, header, args.topk), args.out)


def write(table: str, out: Path | None) -> None:
    """Prints the Markdown, and writes it to ``out`` where given."""
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)


if __name__ == "__main__":
    main()
