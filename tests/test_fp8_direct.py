"""The FP8-direct sparse-MLA Triton kernel (mla_planner.kernels.fp8_direct) on the CPU.

The kernel runs under Triton's interpreter in one subprocess for the whole module
(tests/harness/fp8_direct_interpret.py: ``TRITON_INTERPRET`` must be set before the kernel is
decorated, and the rest of the session keeps the compiled path); its outputs are checked here
against the float32 reference (tests/harness/fp8_direct.py) with FlashMLA's sparse prefill
tolerances, widened where needed to the error of rounding the probabilities to bfloat16
(harness.fp8_direct.probability_rounding_bound: these cases' top-k of 64-128 spreads the weight
over fewer keys than the 2,048 FlashMLA's tolerances were set for). The argument checks run in-process: they raise before any launch.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_planner.executor.layout import FP8_BYTES_PER_TOKEN, PAGE_SIZE
from mla_planner.kernels.fp8_direct import KernelConfig, sparse_attention_fp8

from harness.fp8_direct import SCALE, Fp8Case, check_output, lse_max_error, make_case, probability_rounding_bound, reference

# FlashMLA's criteria and tolerances live in tests/gpu/gpu_helpers.py (pure torch).
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_helpers import PREFILL_OUT  # noqa: E402

HERE = Path(__file__).resolve().parent
LSE_LIMIT = 1e-3  # natural log: a weight off by 0.1 % (tests/gpu/gpu_helpers.lse_error's limit)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    heads: int
    topk: int
    config: KernelConfig
    tokens: int = 5
    pages: int = 4
    lengths: bool = False
    sink: bool = False
    spread: float = 0.0
    out_pad_heads: int = 0
    page_pad_bytes: int = 0
    """Extra bytes after each page: the cache is a view with a page stride above 64 x 656."""


HM = KernelConfig(block_n=32, num_warps=4, num_stages=2, keys_as_m=False)
KM = KernelConfig(block_n=32, num_warps=4, num_stages=2, keys_as_m=True)
SPECS = [
    Spec("h16 topk64 heads-as-M", 16, 64, HM),
    Spec("h16 topk64 keys-as-M", 16, 64, KM),
    Spec("h16 topk64 default config", 16, 64, KernelConfig()),
    Spec("h16 topk64 block 64", 16, 64, KernelConfig(block_n=64, keys_as_m=False)),
    Spec("h32 topk128 heads-as-M", 32, 128, HM),
    Spec("h32 topk128 keys-as-M block 64", 32, 128, dataclasses.replace(KM, block_n=64)),
    Spec("h16 topk128 lengths+sink", 16, 128, HM, lengths=True, sink=True),
    Spec("h32 topk128 lengths+sink keys-as-M", 32, 128, KM, lengths=True, sink=True),
    Spec("h32 topk64 sink, two head groups", 32, 64, dataclasses.replace(HM, head_block=16), sink=True),
    Spec("h16 topk80 (not a multiple of 32)", 16, 80, HM, lengths=True),
    Spec("h16 topk80 (not a multiple of 64) keys-as-M", 16, 80, dataclasses.replace(KM, block_n=64)),
    Spec("h8 (padded to a 16-head program)", 8, 64, HM, sink=True),
    Spec("h16 per-row magnitude spread", 16, 64, HM, spread=1.0),
    Spec("h16 strided out, padded pages", 16, 64, KM, out_pad_heads=3, page_pad_bytes=48),
]


def _cache_with_page_padding(case: Fp8Case, pad: int) -> Fp8Case:
    """The same cache bytes, each page followed by ``pad`` garbage bytes (0xFF: NaN in e4m3)."""
    pages = case.kv_cache.shape[0]
    raw = torch.full((pages, PAGE_SIZE * FP8_BYTES_PER_TOKEN + pad), 0xFF, dtype=torch.uint8)
    raw[:, : PAGE_SIZE * FP8_BYTES_PER_TOKEN] = case.kv_cache.reshape(pages, -1)
    view = raw[:, : PAGE_SIZE * FP8_BYTES_PER_TOKEN].view(pages, PAGE_SIZE, 1, FP8_BYTES_PER_TOKEN)
    return dataclasses.replace(case, kv_cache=view)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Fp8Case, dict[str, Any]]]:
    """Every spec's case and the interpreted kernel's results, from one subprocess."""
    gen = torch.Generator().manual_seed(20240953)
    cases = {}
    for spec in SPECS:
        case = make_case(spec.tokens, spec.heads, spec.topk, spec.pages, gen, lengths=spec.lengths, sink=spec.sink, spread=spec.spread)
        if spec.page_pad_bytes:
            case = _cache_with_page_padding(case, spec.page_pad_bytes)
        cases[spec.name] = case
    payload = [
        {"q": c.q, "kv_cache": c.kv_cache, "indices": c.indices, "topk_length": c.topk_length, "attn_sink": c.attn_sink,
         "softmax_scale": SCALE, "config": dataclasses.asdict(s.config), "out_pad_heads": s.out_pad_heads}
        for s, c in zip(SPECS, cases.values())
    ]
    tmp = tmp_path_factory.mktemp("fp8_direct")
    torch.save(payload, tmp / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    worker = HERE / "harness" / "fp8_direct_interpret.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp / "cases.pt"), str(tmp / "results.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout}\n{done.stderr}"
    results = torch.load(tmp / "results.pt")
    return {name: (case, result) for (name, case), result in zip(cases.items(), results)}


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_kernel_matches_the_float32_reference(interpreted: dict[str, tuple[Fp8Case, dict[str, Any]]], spec: Spec) -> None:
    case, result = interpreted[spec.name]
    out, lse = result["out"], result["lse"]
    print(f"{spec.name}: {result['seconds']:.2f} s interpreted")
    assert result["in_place"], "the launcher must return the caller's out and lse"
    assert result["pad_untouched"], "the kernel wrote outside its out slice"
    assert not bool(out.isnan().any()), "the kernel left elements of out unwritten"
    ref_out, ref_lse = reference(case)
    check_output(f"{spec.name} out", out.float(), ref_out, probability_rounding_bound(case), **PREFILL_OUT)
    err = lse_max_error(lse, ref_lse)
    assert err <= LSE_LIMIT, f"{spec.name} lse: max abs error {err:.3g} > {LSE_LIMIT}"
    # The cases do reach the corners they are built for.
    if spec.tokens > 1:
        assert bool((out[1] == 0).all()) and bool((lse[1] == float("inf")).all()), "a row with no valid index: zeros, lse +inf"
    if spec.lengths:
        assert bool((lse[0] == float("inf")).all()), "topk_length 0: no valid index"
    if spec.sink:
        assert bool((out[:, 1] == 0).all()), "a +inf sink zeroes its head"


# Argument checks: each raises before any launch, so they run without the interpreter.


def _good(heads: int = 16, topk: int = 64) -> dict[str, Any]:
    case = make_case(3, heads, topk, 1, torch.Generator().manual_seed(1))
    return {"q": case.q, "kv_cache": case.kv_cache, "indices": case.indices, "softmax_scale": SCALE}


BAD: list[tuple[str, Any, str]] = [
    ("q float32", lambda a: a.update(q=a["q"].float()), "q must be bfloat16"),
    ("q head dim", lambda a: a.update(q=a["q"][..., :512]), "q must be"),
    ("q 2-D", lambda a: a.update(q=a["q"][0]), "q must be"),
    ("kv dtype", lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), "kv_cache must be uint8"),
    ("kv row size", lambda a: a.update(kv_cache=a["kv_cache"][..., :576]), "fp8_ds_mla rows"),
    ("kv two heads", lambda a: a.update(kv_cache=a["kv_cache"].expand(-1, -1, 2, -1)), "one KV head"),
    ("indices int64", lambda a: a.update(indices=a["indices"].long()), "indices must be int32"),
    ("indices rows", lambda a: a.update(indices=a["indices"][:2]), "indices must be"),
    ("indices 3-D, 2 heads", lambda a: a.update(indices=a["indices"].unsqueeze(1).expand(-1, 2, -1)), "one KV head"),
    ("topk_length dtype", lambda a: a.update(topk_length=torch.zeros(3, dtype=torch.int64)), "topk_length must be"),
    ("topk_length shape", lambda a: a.update(topk_length=torch.zeros(4, dtype=torch.int32)), "topk_length must be"),
    ("sink shape", lambda a: a.update(attn_sink=torch.zeros(8)), "attn_sink must be"),
    ("sink dtype", lambda a: a.update(attn_sink=torch.zeros(16, dtype=torch.bfloat16)), "attn_sink must be"),
    ("out shape", lambda a: a.update(out=torch.empty(3, 16, 576, dtype=torch.bfloat16)), "out must be"),
    ("out dtype", lambda a: a.update(out=torch.empty(3, 16, 512)), "out must be"),
    ("out last dim strided", lambda a: a.update(out=torch.empty(3, 16, 1024, dtype=torch.bfloat16)[..., ::2]), "last dim"),
    ("lse shape", lambda a: a.update(lse=torch.empty(16, 3)), "lse must be"),
    ("page stride not 16-byte", lambda a: a.update(kv_cache=torch.zeros(2, 64 * 656 + 4, dtype=torch.uint8)[:, : 64 * 656].view(2, 64, 1, 656)), "16-byte"),
]


@pytest.mark.parametrize(("name", "mutate", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_value_errors(name: str, mutate: Any, message: str) -> None:
    args = _good()
    mutate(args)
    kwargs = {k: args.pop(k) for k in ("out", "lse", "topk_length", "attn_sink") if k in args}
    with pytest.raises(ValueError, match=message):
        sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], **kwargs)


@pytest.mark.parametrize("fields", [{"block_n": 24}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}, {"head_block": 8}])
def test_bad_configs_raise_value_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KernelConfig(**fields)


def test_config_labels_are_distinct() -> None:
    configs = {HM, KM, dataclasses.replace(KM, block_n=64), dataclasses.replace(KM, num_stages=3), dataclasses.replace(HM, head_block=16)}
    assert len(configs) == 5
    assert len({c.label() for c in configs}) == len(configs)
    assert all(KernelConfig.parse(c.label()) == c for c in configs)
    with pytest.raises(ValueError):
        KernelConfig.parse("n64 x3")


@pytest.mark.parametrize("fault", ["scale 2% off", "sink ignored", "rope ignored"])
def test_the_check_catches_a_wrong_result(interpreted: dict[str, tuple[Fp8Case, dict[str, Any]]], fault: str) -> None:
    """The criterion is not vacuous: the kernel's own output fails it against a reference with a
    small semantic fault."""
    case, result = interpreted["h16 topk128 lengths+sink"]
    scale = SCALE
    if fault == "scale 2% off":
        scale = SCALE * 1.02
    elif fault == "sink ignored":
        case = dataclasses.replace(case, attn_sink=None)
    else:
        q = case.q.clone()
        q[..., 512:] = 0
        case = dataclasses.replace(case, q=q)
    ref_out, _ = reference(case, scale)
    with pytest.raises(AssertionError):
        check_output(fault, result["out"].float(), ref_out, probability_rounding_bound(case, scale), **PREFILL_OUT)
