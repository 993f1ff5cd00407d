"""Candidate forms of the ``mma.sync`` FP8-direct kernel (mla_planner.kernels.fp8_mma), made by text
edits of its source, side by side with the module's own; a form replaces the module's only once
measured faster and correct (docs/fp8-direct.md, "Candidate forms").

* ``module``: the module as it is.
* ``fill_late``: each block starts the next block's copies after its score dots, not before them.
* ``reduce_scatter``: each warp sums and softmaxes one chunk of 16 keys, not all 64. The four tiles'
  partial scores go to shared memory in one store; warp w sums chunk w's, takes its maximum per
  head, its probabilities over that maximum and their sums, and writes them back; past a second
  barrier every warp rescales each chunk's probabilities to the block's maximum. Each warp reads
  4 KB of partial scores a block instead of 16 KB and takes 16 exponentials a head instead of 64,
  for one more barrier a block.
* ``reduce_scatter_fill_late``: both.

    python benchmarks/mma_variants.py --compile-report   # no GPU: registers, spills, barriers, the loop's SASS
    python benchmarks/mma_variants.py --tokens 2048,32768 --repeats 5

On the GPU each form runs on the benchmark's inputs (fp8_direct_bench.case_inputs, 16 heads, top-k
2,048), timed interleaved in a fresh order each repeat, L2 flushed before each call, medians; at
2,048 tokens each is checked against the float32 reference as fp8_direct_bench checks its configs,
and every form's output is compared with the module's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_direct_bench as bench  # noqa: E402

from mla_planner.kernels import fp8_mma  # noqa: E402

_FILL = """    _fill(next_keys, next_rope, next_scales, next_flags, next_entries, kv_u8, start + 64, n_end, num_rows,
          page_stride_u8, PAGE, CONTIGUOUS)
    _fetch_entries(entries, idx_row, start + 128, n_end)
    async_copy.commit_group()
"""
_SCORES = """    s, scale0 = _score_chunk(q16, qr, keys.index(0), rope.index(0), scales.index(0), flags.index(0))
    parts0.store(s)
    s, scale1 = _score_chunk(q16, qr, keys.index(1), rope.index(1), scales.index(1), flags.index(1))
    parts1.store(s)
    s, scale2 = _score_chunk(q16, qr, keys.index(2), rope.index(2), scales.index(2), flags.index(2))
    parts2.store(s)
    s, scale3 = _score_chunk(q16, qr, keys.index(3), rope.index(3), scales.index(3), flags.index(3))
    parts3.store(s)
"""

# (old, new) in order: the reduce-scatter softmax.
_REDUCE_SCATTER = [
    ("\n_PARTS = gl.constexpr(gl.PaddedSharedLayout(", '''
# All four chunks' partial scores (chunk, tile, heads, keys), head bit 1 XORed into key bit 3 so that
# a half-warp's 8-byte accesses meet 32 banks; the chunks' probabilities likewise; their maxima and
# sums (chunk, heads). Each as allocated and as the one view that stores or loads it whole.
_ALL_PARTS4 = gl.constexpr(gl.SharedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 1, 0],
                                                  [0, 0, 2, 8], [0, 0, 4, 0], [0, 0, 8, 0], [0, 1, 0, 0],
                                                  [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0]]))
_PROBS = gl.constexpr(gl.SharedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 8], [4, 0], [8, 0]]))
_ALL_PROBS = gl.constexpr(gl.SharedLinearLayout([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 8],
                                                 [0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0]]))
_STATS = gl.constexpr(gl.SharedLinearLayout([[1], [2], [4], [8]]))
_ALL_STATS = gl.constexpr(gl.SharedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0]]))
# (chunk, tile, heads, keys): warp w holds chunk w, each thread all four tiles of its elements.
_CHUNK_PARTS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 8, 0], [0, 0, 0, 8], [0, 1, 0, 0], [0, 2, 0, 0]],
    lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 4, 16, 16]))
_PARTS = gl.constexpr(gl.PaddedSharedLayout('''),
    ("    return t, h0, n_end, idx_ptr + t * stride_it, q16, qr, gl.expand_dims(down * scale_log2, 1)",
     "    down = gl.convert_layout(down * scale_log2, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(1, _CHUNK_PARTS))))\n"
     "    return t, h0, n_end, idx_ptr + t * stride_it, q16, qr, down"),
    ('''    return (gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PARTS))
''', '''    return (gl.allocate_shared_memory(gl.float32, [4, 4, 16, 16], _ALL_PARTS4),
            gl.allocate_shared_memory(gl.float32, [4, 16, 16], _PROBS),
            gl.allocate_shared_memory(gl.float32, [4, 16], _STATS),
            gl.allocate_shared_memory(gl.float32, [4, 16], _STATS))


@gluon.jit
def _reduce_chunk(parts, probs, maxes, sums, down):
    """Warp w: chunk w's summed score (heads, 16 keys) in base-2 units, its maximum a head, the
    probabilities over that maximum and their sums, into shared memory."""
    s = gl.sum(parts.load(_CHUNK_PARTS), axis=1) * gl.expand_dims(gl.expand_dims(down, 0), 2)
    mc = gl.max(s, axis=2)
    p = gl.exp2(s - gl.expand_dims(gl.where(mc == float("-inf"), 0.0, mc), 2))
    probs._reinterpret(gl.float32, [4, 16, 16], _ALL_PROBS).store(p)
    maxes._reinterpret(gl.float32, [4, 16], _ALL_STATS).store(mc)
    sums._reinterpret(gl.float32, [4, 16], _ALL_STATS).store(gl.sum(p, axis=2))
'''),
    ("def _softmax_step(parts0, parts1, parts2, parts3, down, m, l, unit, acc, scale0, scale1, scale2, scale3):",
     '''def _softmax_step(probs, maxes, sums, m, l, unit, acc, scale0, scale1, scale2, scale3):
    """The block's online softmax step from its chunks' maxima, sums and probabilities, as
    :func:`_softmax_step_whole`'s, each chunk's probabilities rescaled to the block's maximum."""
    vl: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, _MMA))
    pl: gl.constexpr = gl.SliceLayout(0, _MMA)
    m0 = maxes.index(0).load(vl)
    m1 = maxes.index(1).load(vl)
    m2 = maxes.index(2).load(vl)
    m3 = maxes.index(3).load(vl)
    m_new = gl.maximum(m, gl.maximum(gl.maximum(m0, m1), gl.maximum(m2, m3)))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_safe)
    f0 = gl.exp2(m0 - m_safe)
    f1 = gl.exp2(m1 - m_safe)
    f2 = gl.exp2(m2 - m_safe)
    f3 = gl.exp2(m3 - m_safe)
    l = l * alpha + (f0 * sums.index(0).load(vl) + f1 * sums.index(1).load(vl)) + (
        f2 * sums.index(2).load(vl) + f3 * sums.index(3).load(vl))
    p0 = probs.index(0).load(pl) * gl.expand_dims(f0, 1)
    p1 = probs.index(1).load(pl) * gl.expand_dims(f1, 1)
    p2 = probs.index(2).load(pl) * gl.expand_dims(f2, 1)
    p3 = probs.index(3).load(pl) * gl.expand_dims(f3, 1)
    unit_new = gl.maximum(gl.maximum(unit, gl.maximum(gl.max(scale0, axis=1), gl.max(scale1, axis=1))),
                          gl.maximum(gl.max(scale2, axis=1), gl.max(scale3, axis=1)))
    inv_unit = gl.where(unit_new > 0.0, 1.0 / unit_new, 0.0)
    acc = acc * (_per_tile(gl.where(unit_new > 0.0, unit * inv_unit, 1.0)) * _per_head(alpha))
    return p0, p1, p2, p3, inv_unit, m_new, l, unit_new, acc


@gluon.jit
def _softmax_step_whole(parts0, parts1, parts2, parts3, down, m, l, unit, acc, scale0, scale1, scale2, scale3):'''),
    ("           parts0, parts1, parts2, parts3, q16, qr, down, m, l, unit, acc, kv_u8, idx_row, start, n_end, num_rows,",
     "           parts, probs, maxes, sums, q16, qr, down, m, l, unit, acc, kv_u8, idx_row, start, n_end, num_rows,"),
    (_SCORES, '''    s0, scale0 = _score_chunk(q16, qr, keys.index(0), rope.index(0), scales.index(0), flags.index(0))
    s1, scale1 = _score_chunk(q16, qr, keys.index(1), rope.index(1), scales.index(1), flags.index(1))
    s2, scale2 = _score_chunk(q16, qr, keys.index(2), rope.index(2), scales.index(2), flags.index(2))
    s3, scale3 = _score_chunk(q16, qr, keys.index(3), rope.index(3), scales.index(3), flags.index(3))
    # One store (chunk 2 j + i at [..., i, j]): stores into one buffer one after another each get a barrier.
    s = gl.join(gl.join(s0, s1), gl.join(s2, s3))
    parts.store(gl.reshape(gl.permute(s, [4, 3, 0, 1, 2]), [4, 4, 16, 16]))
    _cta_barrier()
    _reduce_chunk(parts, probs, maxes, sums, down)
'''),
    ("_softmax_step(parts0, parts1, parts2, parts3, down, m, l, unit, acc,", "_softmax_step(probs, maxes, sums, m, l, unit, acc,"),
    ("    parts0, parts1, parts2, parts3 = _parts()", "    parts, probs, maxes, sums = _parts()"),
    ("parts0, parts1, parts2, parts3, q16, qr, down, m, l, unit, acc, kv_u8,", "parts, probs, maxes, sums, q16, qr, down, m, l, unit, acc, kv_u8,"),
]


def _edit(src: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        if old not in src:
            raise SystemExit(f"mma_variants: fp8_mma.py no longer has {old.strip().splitlines()[0]!r}: update the edits")
        src = src.replace(old, new)
    return src


def variant_sources() -> dict[str, str]:
    """Each form's source, from the module's."""
    src = Path(fp8_mma.__file__).read_text()
    fill_late = [(_FILL, ""), ("    parts3.store(s)\n", "    parts3.store(s)\n" + _FILL)]
    rs = _edit(src, _REDUCE_SCATTER)
    last_score = "    s3, scale3 = _score_chunk(q16, qr, keys.index(3), rope.index(3), scales.index(3), flags.index(3))\n"
    return {"module": src, "fill_late": _edit(src, fill_late), "reduce_scatter": rs,
            "reduce_scatter_fill_late": _edit(rs, [(_FILL, ""), (last_score, last_score + _FILL)])}


def load_variants(folder: Path) -> dict[str, ModuleType]:
    """Each form as a module of its own (Gluon reads a kernel's source from its file)."""
    modules = {}
    for name, src in variant_sources().items():
        path = folder / f"fp8_mma_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


@contextlib.contextmanager
def running(module: ModuleType) -> Iterator[None]:
    """``sparse_attention_fp8`` (and ``compile_wgmma``) take ``module`` for fp8_mma meanwhile."""
    import mla_planner.kernels as package

    saved = sys.modules["mla_planner.kernels.fp8_mma"]
    sys.modules["mla_planner.kernels.fp8_mma"] = package.fp8_mma = module
    try:
        yield
    finally:
        sys.modules["mla_planner.kernels.fp8_mma"] = package.fp8_mma = saved


def loop_sass(cubin: bytes, bin_dir: Path) -> collections.Counter[str]:
    """Opcodes from the kernel's first MMA to its last (the loop, two blocks)."""
    ops = bench.sass_opcodes(cubin, bin_dir)
    mmas = [i for i, op in enumerate(ops) if op == "HMMA"]
    return collections.Counter(ops[mmas[0]:mmas[-1] + 1])


def compile_report(modules: dict[str, ModuleType]) -> None:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    print(f"triton {triton.__version__}, sm_90a, 16 heads")
    print("| form | registers | spill bytes | shared bytes | bar.sync | loop SASS (two blocks) | its largest opcodes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, module in modules.items():
        with running(module):
            compiled = bench.compile_wgmma(16, "mma")
        ptx = compiled.asm["ptx"]
        regs, spill = bench.ptxas_usage(ptx, bin_dir / "ptxas")
        ops = loop_sass(compiled.asm["cubin"], bin_dir)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        barriers = len(re.findall(r"bar\.sync", ptx))
        print(f"| {name} | {regs} | {spill} | {compiled.metadata.shared:,} | {barriers} "
              f"| {sum(ops.values()):,} | {top} |", flush=True)


def time_forms(modules: dict[str, ModuleType], tokens: int, repeats: int, gen: torch.Generator,
               timer: Callable[[Callable[[], object]], float]) -> None:
    from mla_planner.executor.layout import D_QK, D_V, as_slots
    from mla_planner.kernels.fp8_direct import MMA_CONFIG, sparse_attention_fp8

    shape = bench.Shape(tokens, 16)
    _, inputs, slots = bench.case_inputs(shape, 2048, gen)
    scale = D_QK**-0.5
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    runs: dict[str, Callable[[], object]] = {}
    for name, module in modules.items():
        out = torch.empty((tokens, 16, D_V), dtype=torch.bfloat16, device=gen.device)
        lse = torch.empty((tokens, 16), dtype=torch.float32, device=gen.device)

        def run(module: ModuleType = module, out: torch.Tensor = out, lse: torch.Tensor = lse) -> None:
            with running(module):
                sparse_attention_fp8(inputs.q, inputs.kv_cache, slots, scale, out=out, lse=lse, config=MMA_CONFIG)

        try:  # compiles; a form that fails is reported and left out
            run()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"T={tokens}: {name} {bench.failure_note(exc)}", flush=True)
            continue
        runs[name], outs[name] = run, (out, lse)
    bench.time_interleaved(shape, runs, repeats, 0, timer)
    base_out, base_lse = outs["module"]
    for name, (out, lse) in outs.items():
        print(f"T={tokens} H=16 {name}: median {shape.median(name):,.1f} us (of {[round(t) for t in shape.times[name]]}), "
              f"max |out - module's| {float((out.float() - base_out.float()).abs().max()):.3g}, "
              f"max |lse - module's| {float((lse - base_lse).abs().max()):.3g}", flush=True)
    if tokens == bench.CHECK_TOKENS:
        from mla_planner.executor.reference import sparse_attention

        ref, ref_lse = sparse_attention(inputs.q, as_slots(inputs.kv_cache), slots, scale)
        for name, (out, lse) in outs.items():
            print(f"  {bench.accuracy(name, out.float(), ref)}, lse max abs error "
                  f"{float((lse - ref_lse.to(lse.device)).abs()[torch.isfinite(ref_lse)].max()):.3g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-report", action="store_true", help="no GPU: compile each form for sm90 and report")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        modules = load_variants(Path(folder))
        if args.compile_report:
            compile_report(modules)
            return
        if not torch.cuda.is_available():
            raise SystemExit("mma_variants: no CUDA GPU here (--compile-report needs none)")
        from mla_planner.calibration.kernel_timing import Timer

        gen = torch.Generator(device="cuda").manual_seed(0)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        for tokens in (int(t) for t in args.tokens.split(",")):
            time_forms(modules, tokens, args.repeats, gen, Timer(gen.device))


if __name__ == "__main__":
    main()
