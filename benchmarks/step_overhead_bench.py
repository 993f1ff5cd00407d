"""The CPU-side overhead the planned backend adds to a vLLM step, next to stock FlashMLA sparse:
microseconds per metadata build and per layer call on the same steps, with fake kernels.

    .venv/bin/python benchmarks/step_overhead_bench.py [--repeats 500] [--layers 61] [--baseline TREE]

It times the ``mla_planner`` the environment has installed (``scripts/test.sh`` installs this
checkout's into ``.venv``): install again after a change. ``tests/`` (vLLM's CPU stand-ins) it finds
itself.

What it measures is Python and torch-dispatch work only. Nothing runs on a GPU: the FlashMLA
kernels, vLLM's Triton index translation and its gather op are fakes that return an output of the
right shape, and every tensor the step touches is on PyTorch's ``meta`` device (shapes and no
data), so a tensor op costs its dispatch and no memory traffic, much as a CUDA launch costs the
CPU its launch and not the kernel. Meta ops dispatch through Python-level meta kernels, so one op
costs a few to 20 us here, more than a CUDA launch's: read the figures as "how much host work",
compared between the two backends on the same machine, not as GPU step times.

The engine is the end-to-end tests' tiny DeepSeek-V3.2 shape: 16 heads per rank, top-k 2048, FP8
cache (``fp8_ds_mla``), a dense-MHA prefill backend (short prefills, under top-k tokens, never
reach the sparse kernels), the default 1 GiB scratch budget, and DeepSeek-V3.2's 61 attention
layers per step (``--layers``): a step's first layer call does work its later ones reuse (FlashMLA's
schedules; the plugin's workspace views, where the release's impl keeps a workspace), so the number
of layers weighs it. The steps:

* ``decode``: 64 decodes of 1,000 tokens of context (uniform decode, what FULL CUDA graphs replay);
* ``capture``: ``build_for_cudagraph_capture`` of 64 one-token requests, as vLLM's capture loop
  builds them;
* ``chat``: the 64 decodes plus one new 1,000-token prompt, which runs dense MHA: the sparse
  kernels see the 64 decode tokens only (vLLM bench serve's chat workload);
* ``mid``: the 64 decodes plus one 2,500-token prompt, past top-k, so every token is sparse, in one
  call: over what the engine holds where the release's impl keeps a workspace, so the plan runs it
  as one launch; within it where it keeps none (the reservation holds the whole budget), so stock's
  call runs it;
* ``long``: the 64 decodes plus one 8,000-token prompt, past top-k, so every token is sparse; the
  planner splits it under the budget.

Each engine builds the step and runs its layer calls; engines take turns within every repeat, in
an order drawn afresh for each step (seeded), so that drift and whichever engine ran just before
hit them alike. A layer call's figure is the step's layer calls' time over its layers; the figures
are medians over the repeats. "runs" counts the kernel calls a layer call made: stock's, or the
plan's launches. "planned" routes by
vLLM's rule (``MLA_PLANNER_COST_PROFILE=none``); "planned+profile" by the packaged H200 cost
profile (no GPU here, so the machine check is skipped, as in the CPU tests).

``--baseline TREE`` adds the backend of another checkout (e.g. ``git archive COMMIT python | tar
-x -C TREE``) as "baseline" engines in the same process, so a before/after comparison is not
confounded by the machine's speed drifting between runs: its ``vllm_backend`` and ``executor``
packages are copied under the package name ``baseline``; the rest of ``mla_planner`` (the Rust
core, routing) is the installed one's, so the two must share it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from vllm_cpu import (  # noqa: E402  (tests/ is a plain directory of helpers)
    KernelRecorder,
    common_metadata,
    cpu_vllm,
    model_dir,
    patch_if_present,
    vllm_config,
)

META = torch.device("meta")
NUM_HEADS, TOPK, LAYERS = 16, 2048, 61
MAX_MODEL_LEN, MAX_TOKENS, MAX_SEQS = 16384, 8192, 256
DECODES, CONTEXT = 64, 1000
STEPS = {
    "decode": ([1] * DECODES, [CONTEXT] * DECODES),
    "capture": ([1] * DECODES, [0] * DECODES),
    "chat": ([1] * DECODES + [1000], [CONTEXT] * DECODES + [0]),
    "mid": ([1] * DECODES + [2500], [CONTEXT] * DECODES + [0]),
    "long": ([1] * DECODES + [8000], [CONTEXT] * DECODES + [0]),
}


KERNEL_CALLS = {"stock": 0, "plan": 0}
"""Calls of the fake kernels since the last reset: through stock's code, or the plan's provider."""


def decode_out(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    o = q.new_empty((*q.shape[:3], 512)) if out is None else out
    return o, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def prefill_out(q: torch.Tensor, d_v: int, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    o = q.new_empty((q.shape[0], q.shape[1], d_v)) if out is None else out
    return o, q.new_empty(q.shape[:2], dtype=torch.float32)


class FakeKernels(KernelRecorder):
    """vLLM's FlashMLA kernels: an output of the right shape, nothing computed."""

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, *args: Any,
                               out: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        KERNEL_CALLS["stock"] += 1
        return decode_out(q, out)

    def flash_mla_sparse_fwd(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, topk_length: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        KERNEL_CALLS["stock"] += 1
        o, lse = prefill_out(q, d_v, out)
        return o, lse, lse


class FakeProvider:
    """The planned executor's kernel provider, with the same fake kernels."""

    name = "fake"
    decode_takes_out = True
    prefill_takes_out = True

    def new_decode_schedule(self) -> Any:
        return object()

    def sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, schedule: Any,
                      softmax_scale: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        KERNEL_CALLS["plan"] += 1
        return decode_out(q, out)

    def sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                       out: torch.Tensor | None = None,
                       topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        KERNEL_CALLS["plan"] += 1
        return prefill_out(q, 512, out)

    def gather_upconvert(self, *args: Any) -> None:
        """vLLM's ``cp_gather_and_upconvert_fp8_kv_cache``."""


TRANSLATION_US = [0.0]
"""Time spent inside the fake index translation since the last reset (time_step reads it per layer call)."""


def fake_translation(req_id: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor, *args: Any,
                     return_valid_counts: bool = False, **kwargs: Any) -> Any:
    """vLLM's Triton index translation: fresh slots (and valid counts) of the right shape. Its own
    time is counted apart: a meta-device allocation costs tens of microseconds, a CUDA one a few
    (where the Triton launch costs its own instead)."""
    start = time.perf_counter()
    slots = torch.empty_like(token_indices)
    result = (slots, token_indices.new_empty(token_indices.shape[0])) if return_valid_counts else slots
    TRANSLATION_US[0] += (time.perf_counter() - start) * 1e6
    return result


def no_gather(*args: Any) -> None:
    """vLLM's ``cp_gather_and_upconvert_fp8_kv_cache``."""


@contextmanager
def fake_vllm(monkeypatch: pytest.MonkeyPatch, backend_packages: list[str]) -> Iterator[None]:
    """tests/vllm_cpu.py's CPU stand-ins for vLLM's GPU-only pieces, with kernels that do nothing,
    for this checkout's backend and every package in ``backend_packages`` (a baseline's)."""
    import vllm.v1.attention.backends.mla.flashmla_sparse as stock

    with cpu_vllm(monkeypatch, FakeProvider(), FakeKernels()):  # type: ignore[arg-type]  # duck-typed fakes
        for name in ("flashmla_sparse", "sparse_utils", "index_group"):
            patch_if_present(monkeypatch, f"vllm.v1.attention.backends.mla.{name}",
                             "triton_convert_req_index_to_global_index", fake_translation)
        monkeypatch.setattr(stock.ops, "cp_gather_and_upconvert_fp8_kv_cache", no_gather, raising=False)
        for package in ["mla_planner.vllm_backend", *backend_packages]:
            fake_backend_kernels(monkeypatch, package)
        yield


def fake_backend_kernels(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """What one backend package calls on the GPU: the SM count, its provider (kernels and gather
    behind it), and the host-sized scratch reservation. A baseline of an older layout may call
    the prefill kernel and the gather itself, and count SMs in another module: those too."""
    backend = importlib.import_module(f"{package}.backend")
    reservation = importlib.import_module(f"{package}.reservation")
    for seam in ("vllm_api", "engine_config"):
        patch_if_present(monkeypatch, f"{package}.{seam}", "num_sms", lambda device: 132)
        patch_if_present(monkeypatch, f"{package}.{seam}", "num_compute_units", lambda device_id=None: 132)
    monkeypatch.setattr(backend, "kernel_provider", FakeProvider)
    patch_if_present(monkeypatch, backend.__name__, "flash_mla_sparse_fwd", FakeKernels().flash_mla_sparse_fwd)
    if hasattr(backend, "ops"):
        monkeypatch.setattr(backend.ops, "cp_gather_and_upconvert_fp8_kv_cache", no_gather)
    # No 1 GiB on the host: an engine's reservation (a baseline's may be the process's, a function).
    if hasattr(reservation, "Reservation"):
        monkeypatch.setattr(reservation.Reservation, "reserve", lambda self, num_bytes, device: False)
    else:
        monkeypatch.setattr(reservation, "reserve", lambda num_bytes, device: False)


def load_baseline(tree: pathlib.Path, into: pathlib.Path) -> str:
    """``tree``'s ``vllm_backend`` and ``executor`` as the package ``baseline`` under ``into`` (put
    on ``sys.path``), their imports of each other renamed; returns the backend package's name."""
    source = tree / "python" / "mla_planner"
    package = into / "baseline"
    for sub in ("vllm_backend", "executor"):
        shutil.copytree(source / sub, package / sub)
    (package / "__init__.py").write_text("")
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bmla_planner\.(vllm_backend|executor)\b", r"baseline.\1", text))
    sys.path.insert(0, str(into))
    return "baseline.vllm_backend"


@dataclass
class Engine:
    """One backend's builder and impl for a layer group, and its timings by step."""

    name: str
    builder: Any
    impl: Any
    build_us: dict[str, list[float]] = field(default_factory=dict)
    layer_us: dict[str, list[float]] = field(default_factory=dict)  # per layer call, each repeat's mean
    translation_us: dict[str, list[float]] = field(default_factory=dict)  # of layer_us, in the fake translation
    runs: dict[str, str] = field(default_factory=dict)


def make_engine(name: str, config: Any, package: str | None, profile: str) -> Engine:
    """Stock's builder and impl (``package`` None), or those of a backend package, with the
    packaged cost profile (``profile`` empty) or ``none``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl, FlashMLASparseMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if profile:
        os.environ["MLA_PLANNER_COST_PROFILE"] = profile
    else:
        os.environ.pop("MLA_PLANNER_COST_PROFILE", None)
    builder_cls: Any = FlashMLASparseMetadataBuilder
    impl_cls: Any = FlashMLASparseImpl
    if package is not None:
        backend = importlib.import_module(f"{package}.backend")
        builder_cls, impl_cls = backend.PlannedFlashMLASparseMetadataBuilder, backend.PlannedFlashMLASparseImpl
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                            cache_dtype_str="fp8_ds_mla")
    topk_buffer = torch.empty((MAX_TOKENS, TOPK), dtype=torch.int32, device=META)
    with set_current_vllm_config(config):
        builder = builder_cls(spec, ["layers.0.attn"], config, META)
        impl = impl_cls(NUM_HEADS, 576, 576**-0.5, 1, None, None, "fp8_ds_mla", None, "decoder", None,
                        q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        qk_head_dim=192, v_head_dim=128, kv_b_proj=None, topk_indices_buffer=topk_buffer)
    return Engine(name, builder, impl)


def sparse_tokens(metadata: Any, query_lens: list[int], context_lens: list[int]) -> int:
    """The tokens vLLM's MLA layer hands the sparse kernels (mla_attention.py's forward_impl):
    the decodes, or every token when a prefill is past top-k."""
    prefill_seq = [q + c for q, c in zip(query_lens[metadata.num_decodes:], context_lens[metadata.num_decodes:])]
    dense = bool(prefill_seq) and max(prefill_seq) <= TOPK
    return metadata.num_decode_tokens if dense or not prefill_seq else sum(query_lens)


def time_step(engine: Engine, step: str, common: Any, kv_cache: torch.Tensor, layers: int) -> None:
    query_lens, context_lens = STEPS[step]
    start = time.perf_counter()
    if step == "capture":
        metadata = engine.builder.build_for_cudagraph_capture(common)
    else:
        metadata = engine.builder.build(0, common)
    engine.build_us.setdefault(step, []).append((time.perf_counter() - start) * 1e6)
    tokens = sparse_tokens(metadata, query_lens, context_lens)
    q = torch.empty((tokens, NUM_HEADS, 576), dtype=torch.bfloat16, device=META)
    TRANSLATION_US[0] = 0.0
    KERNEL_CALLS.update(stock=0, plan=0)
    start = time.perf_counter()
    for _ in range(layers):
        engine.impl.forward_mqa(q, kv_cache, metadata, None)
    engine.layer_us.setdefault(step, []).append((time.perf_counter() - start) * 1e6 / layers)
    engine.translation_us.setdefault(step, []).append(TRANSLATION_US[0] / layers)
    planned = getattr(metadata, "planned", None)
    launches, calls = KERNEL_CALLS["plan"] / layers, KERNEL_CALLS["stock"] / layers
    if launches:
        engine.runs[step] = f"{launches:g} launch{'es' * (launches != 1)} ({planned.plan.mode})"
    else:
        engine.runs[step] = f"stock's {calls:g} call{'s' * (calls != 1)}"


def run(repeats: int, layers: int, baseline: pathlib.Path | None) -> list[Engine]:
    with tempfile.TemporaryDirectory() as tmp:
        packages = [] if baseline is None else [load_baseline(baseline, pathlib.Path(tmp))]
        with fake_vllm(pytest.MonkeyPatch(), packages):
            return run_engines(pathlib.Path(tmp), repeats, layers, packages)


def run_engines(tmp: pathlib.Path, repeats: int, layers: int, baseline_packages: list[str]) -> list[Engine]:
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
        lock_workspace,
        unlock_workspace,
    )

    config = vllm_config(model_dir(tmp, num_heads=NUM_HEADS, topk=TOPK), max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS, dense_prefill=True)
    if not is_workspace_manager_initialized():
        init_workspace_manager(META)
    engines = [make_engine("stock", config, None, "")]
    for label, package in [("planned", "mla_planner.vllm_backend")] + [("baseline", p) for p in baseline_packages]:
        engines += [make_engine(label, config, package, "none"), make_engine(f"{label}+profile", config, package, "")]
    kv_cache = torch.empty((4096, 64, 656), dtype=torch.uint8, device=META)
    block_table = torch.zeros((DECODES + 1, MAX_MODEL_LEN // 64), dtype=torch.int32, device=META)
    commons = {step: common_metadata(q, c, block_table[: len(q)]) for step, (q, c) in STEPS.items()}
    order = random.Random(0)
    lock_workspace()  # as vLLM does once warm-up has sized it: serving steps run on a locked workspace
    try:
        for _ in range(repeats):
            for step, common in commons.items():
                # a fresh order each time: an engine's figure must not depend on which ran before it
                for engine in order.sample(engines, len(engines)):
                    time_step(engine, step, common, kv_cache, layers)
    finally:
        unlock_workspace()
    return engines


def report(engines: list[Engine], repeats: int, layers: int) -> str:
    stock = engines[0]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    lines = [f"CPU-side overhead per step, fake kernels, meta-device tensors; {NUM_HEADS} heads, top-k {TOPK}, "
             f"{layers} layers, median of {repeats} interleaved repeats (torch {torch.__version__}, "
             f"vLLM {__import__('vllm').__version__}).", "",
             "| step | engine | a layer call runs | build us | layer call us | vs stock's | of it, index translation us | "
             "layer call less translation us | step us (build + layers) | vs stock |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for step in STEPS:
        stock_layer = med(stock.layer_us[step])
        base = med(stock.build_us[step]) + layers * stock_layer
        for engine in engines:
            build, layer = med(engine.build_us[step]), med(engine.layer_us[step])
            translation = med(engine.translation_us[step])
            own = med([a - b for a, b in zip(engine.layer_us[step], engine.translation_us[step])])
            total = build + layers * layer
            lines.append(f"| {step} | {engine.name} | {engine.runs[step]} | {build:.1f} | {layer:.1f} | "
                         f"{100 * (layer / stock_layer - 1):+.1f}% | {translation:.1f} | {own:.1f} | {total:.1f} | "
                         f"{total - base:+.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--layers", type=int, default=LAYERS, help="attention layers per step")
    parser.add_argument("--baseline", type=pathlib.Path, help="another checkout's tree, run beside this one")
    args = parser.parse_args()
    if args.repeats < 1 or args.layers < 1:
        parser.error("--repeats and --layers take a positive number")
    engines = run(args.repeats, args.layers, args.baseline)
    print(report(engines, args.repeats, args.layers))


if __name__ == "__main__":
    main()
