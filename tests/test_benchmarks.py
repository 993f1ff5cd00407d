"""Every benchmark the docs name runs: ``python benchmarks/X.py --help`` exits 0 on a machine with
no GPU (a benchmark checks for one after reading its options), so an import that rots fails here;
and what a GPU benchmark does before its first kernel (planning) runs here too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import mla_planner
from mla_planner.profiles import REFERENCE_GPU, packaged_for_gpu
from releases import ALL

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_found() -> None:
    assert {"kernel_bench.py", "route_bench.py"} <= {p.name for p in BENCHMARKS}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_help_runs(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=script.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def load_benchmark(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS[0].parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernels", [f"vllm {facts.version}" for facts in ALL.values()])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("tokens", [512, 32768])
def test_route_bench_plans_each_route_as_the_backend_would(kernels: str, heads: int, tokens: int) -> None:
    """route_bench's planning, which runs before any kernel: each route planned under the current
    API, within the budget where one is set, the chosen route's plan the model's own."""
    bench = load_benchmark("route_bench")
    path = packaged_for_gpu("sm90", REFERENCE_GPU, kernels)
    assert path is not None
    model = mla_planner.CostModel.from_json(path.read_text())
    budget, topk = 1 << 30, 2048
    context = max(0, topk + 1 - tokens)
    routes, choice = bench.plan_routes(model, heads, tokens, context, budget, topk)
    mixed, separate, stock = routes
    assert [r.name for r in routes] == ["mixed", "separate", "stock"]
    assert mixed.plan.mode == "mixed_batch" and separate.plan.mode == "separate_prefill_decode"
    assert stock.plan.mode == mla_planner.step_mode(heads, kv_dtype="fp8")
    for route in routes:
        assert route.plan.launches[-1, 1] == tokens, f"{route.name} covers every token"
    for route in (mixed, separate):
        assert route.predicted_us is not None and route.predicted_us > 0
        assert route.plan.peak_bytes <= budget
    assert stock.predicted_us is None
    assert bench.kernel_heads(mixed, heads) == mla_planner.padded_heads(heads)
    assert bench.kernel_heads(separate, heads) == separate.plan.prefill_heads
    chosen = mixed if choice.mixed_batch else separate
    assert chosen.plan.launches.tolist() == choice.plan.launches.tolist()


def test_step_overhead_bench_times_what_each_engine_runs() -> None:
    """step_overhead_bench (one repeat, two layers; its figures are not checked, only what it
    says each layer call ran): decode-only steps run stock's call on every engine; the long
    prompt runs the plan's launches; the mid-sized one the plan's one launch where stock's call is
    over what the engine holds (beside a vLLM workspace), stock's call where the reservation holds it."""
    from mla_planner.vllm_backend.releases import release

    script = BENCHMARKS[0].parent / "step_overhead_bench.py"
    done = subprocess.run([sys.executable, str(script), "--repeats", "1", "--layers", "2"], capture_output=True,
                          text=True, timeout=600, cwd=script.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    runs = {(cells[1], cells[2]): cells[3] for line in done.stdout.splitlines()
            if line.startswith("| ") and len(cells := [c.strip() for c in line.split("|")]) > 4}
    engines = ("stock", "planned", "planned+profile")
    for step in ("decode", "capture", "chat"):
        assert [runs[step, engine] for engine in engines] == ["stock's 1 call"] * 3, step
    assert runs["long", "stock"] == runs["mid", "stock"] == "stock's 1 call"
    assert runs["long", "planned"] == "4 launches (mixed_batch)"
    assert runs["mid", "planned"] == ("1 launch (mixed_batch)" if release.stock_workspace else "stock's 1 call")
    assert runs["mid", "planned+profile"].endswith("launches (separate_prefill_decode)")


def test_mma_variants_edit_the_module_as_it_is_and_compile_without_spilling() -> None:
    """mma_variants.py's candidate forms are text edits of fp8_mma.py: each still applies to the module
    (the script exits naming the edit that no longer does), changes it, and compiles for sm90 (no GPU)
    without a spill; the reduce-scatter form keeps one more barrier a block (two a loop iteration)."""
    import re

    import triton

    variants = load_benchmark("mma_variants")
    sources = variants.variant_sources()
    assert len(set(sources.values())) == len(sources) == 4
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    barriers = {}
    with tempfile.TemporaryDirectory() as folder:
        modules = variants.load_variants(Path(folder))
        for name in ("module", "reduce_scatter"):
            with variants.running(modules[name]):
                compiled = variants.bench.compile_wgmma(16, "mma")
            assert variants.bench.ptxas_usage(compiled.asm["ptx"], bin_dir / "ptxas")[1] == "0", name
            barriers[name] = len(re.findall(r"bar\.sync", compiled.asm["ptx"]))
    assert barriers["reduce_scatter"] == barriers["module"] + 2
