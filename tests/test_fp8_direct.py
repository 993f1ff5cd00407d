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
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_planner.executor.layout import FP8_BYTES_PER_TOKEN, PAGE_SIZE, ROPE_START, SCALES_START, as_slots
from mla_planner.executor.reference import dequantize_fp8_ds_mla
from mla_planner.kernels.fp8_direct import (DEQUANT_MODES, MMA_CONFIG, WGMMA_CONFIG, WGMMA_RA_CONFIG, WGMMA_WS_CONFIG, KernelConfig,
                                            no_dequant_bound_probe, sparse_attention_fp8)

from harness.interpreter import run_interpreted
from harness.fp8_direct import SCALE, Fp8Case, check_output, lse_max_error, make_case, probability_rounding_bound, reference

# FlashMLA's criteria and tolerances live in tests/gpu/gpu_helpers.py (pure torch).
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_helpers import PREFILL_OUT  # noqa: E402

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
    special_bytes: bool = False
    """NoPE bytes replaced by every non-NaN e4m3 code (:func:`_special_nope`)."""


HM = KernelConfig(block_n=32, num_warps=4, num_stages=2, keys_as_m=False)
KM = KernelConfig(block_n=32, num_warps=4, num_stages=2, keys_as_m=True)
HM_BITS = dataclasses.replace(HM, dequant="bits")
KM_BITS = dataclasses.replace(KM, dequant="bits")
HM_V4 = dataclasses.replace(HM, scales="v4")
KM_V4 = dataclasses.replace(KM, scales="v4")
HM_DV2 = dataclasses.replace(HM, dv_split=2)
WG = dataclasses.asdict(WGMMA_CONFIG)
MMA = dataclasses.asdict(MMA_CONFIG)
KM_DV2 = dataclasses.replace(KM, dv_split=2)
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
    Spec("h16 topk64 heads-as-M, bits dequant", 16, 64, HM_BITS),
    Spec("h32 topk128 keys-as-M block 64, bits dequant", 32, 128, dataclasses.replace(KM_BITS, block_n=64)),
    Spec("h16 topk128 lengths+sink, bits dequant", 16, 128, HM_BITS, lengths=True, sink=True),
    Spec("h16 magnitude spread, padded pages, bits dequant", 16, 64, KM_BITS, spread=1.0, page_pad_bytes=48),
    Spec("h16 every e4m3 code, f32 dequant", 16, 64, HM, special_bytes=True),
    Spec("h16 every e4m3 code, bits dequant", 16, 64, HM_BITS, special_bytes=True),
    # The 16-byte tile-scale load (its PTX carried out by the interpreter's patch).
    Spec("h16 topk64 heads-as-M, 16-byte scales", 16, 64, HM_V4),
    Spec("h32 topk128 lengths+sink keys-as-M block 64, 16-byte scales", 32, 128, dataclasses.replace(KM_V4, block_n=64),
         lengths=True, sink=True),
    Spec("h16 magnitude spread, padded pages, 16-byte scales", 16, 64, KM_V4, spread=1.0, page_pad_bytes=48),
    Spec("h16 every e4m3 code, 16-byte scales", 16, 64, HM_V4, special_bytes=True),
    Spec("h16 every e4m3 code, 16-byte scales, bits dequant", 16, 64, dataclasses.replace(KM_V4, dequant="bits"),
         special_bytes=True),
    # The output split over two programs a token.
    Spec("h16 topk64 heads-as-M, split output", 16, 64, HM_DV2),
    Spec("h16 topk64 keys-as-M, split output", 16, 64, KM_DV2),
    Spec("h16 topk128 lengths+sink, split output", 16, 128, HM_DV2, lengths=True, sink=True),
    Spec("h32 topk128 lengths+sink keys-as-M block 64, split output", 32, 128, dataclasses.replace(KM_DV2, block_n=64),
         lengths=True, sink=True),
    Spec("h32 topk64 sink, two head groups, split output", 32, 64, dataclasses.replace(HM_DV2, head_block=16), sink=True),
    Spec("h16 topk80 keys-as-M, split output", 16, 80, KM_DV2, lengths=True),
    Spec("h16 strided out, padded pages, split output", 16, 64, KM_DV2, out_pad_heads=3, page_pad_bytes=48),
    Spec("h16 every e4m3 code, split output", 16, 64, HM_DV2, special_bytes=True),
    Spec("h16 every e4m3 code, split output, bits dequant", 16, 64, dataclasses.replace(KM_DV2, dequant="bits"),
         special_bytes=True),
    Spec("h8 split output, 16-byte scales, register cap", 8, 64, dataclasses.replace(HM_DV2, scales="v4", max_regs=168),
         sink=True),
]

# Every e4m3 code but the two NaNs (0x7F, 0xFF): +-0, the 14 subnormals (0x01-0x07, 0x81-0x87), the
# normals up to +-448 (0x7E, 0xFE).
E4M3_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
# Tile scales 2^-20 .. 2^7: down past the quantiser's floor (1e-4) and up to the largest the bits
# path takes (its factor scale x 2^120 must stay finite).
SPECIAL_SCALES = torch.exp2(torch.arange(-20, 8, dtype=torch.float32))


def _special_nope(rows: int, gen: torch.Generator, scales_from: torch.Tensor = SPECIAL_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, 512)`` NoPE bytes cycling through every non-NaN e4m3 code (a random phase per row)
    and ``(rows, 4)`` tile scales drawn from ``scales_from`` (row 0: its smallest and largest)."""
    phase = torch.randint(0, E4M3_CODES.numel(), (rows, 1), generator=gen)
    nope = E4M3_CODES[(phase + torch.arange(512)) % E4M3_CODES.numel()]
    scales = scales_from[torch.randint(0, scales_from.numel(), (rows, 4), generator=gen)]
    scales[0, 0], scales[0, 1] = scales_from[0], scales_from[-1]
    return nope, scales


def _with_special_bytes(case: Fp8Case, gen: torch.Generator) -> Fp8Case:
    """The case's cache with every row's NoPE bytes and scales from :func:`_special_nope`, scales
    2^-20 .. 2^-4 (keys up to 28: larger ones make the scores, and lse's rounding, large enough to
    leave lse's absolute limit; the dequantisation alone is checked up to 2^7)."""
    pages = case.kv_cache.shape[0]
    rows = case.kv_cache.reshape(pages * PAGE_SIZE, FP8_BYTES_PER_TOKEN).clone()
    nope, scales = _special_nope(rows.shape[0], gen, SPECIAL_SCALES[SPECIAL_SCALES <= 2.0**-4])
    rows[:, :SCALES_START] = nope
    rows[:, SCALES_START:ROPE_START] = scales.view(torch.uint8)
    return dataclasses.replace(case, kv_cache=rows.view(case.kv_cache.shape))


def _tiles_reversed(case: Fp8Case) -> Fp8Case:
    """The case's cache with each row's four tile scales in reverse order: what a scale load that
    hands the scales to the wrong tiles would compute."""
    rows = as_slots(case.kv_cache).clone()
    scales = rows[:, SCALES_START:ROPE_START].contiguous().view(torch.float32).flip(1).contiguous()
    rows[:, SCALES_START:ROPE_START] = scales.view(torch.uint8)
    return dataclasses.replace(case, kv_cache=rows.view(case.kv_cache.shape))


@pytest.mark.parametrize("spec", ["h16 every e4m3 code, 16-byte scales", "h16 every e4m3 code, split output"])
def test_the_check_catches_tile_scales_in_the_wrong_order(interpreted: dict[str, tuple[Fp8Case, dict[str, Any]]], spec: str) -> None:
    """The cases of the 16-byte scale load and of the split output tell the tiles apart: the
    kernel's output fails against a reference whose tile scales are reversed within each row."""
    case, result = interpreted[spec]
    wrong = _tiles_reversed(case)
    ref_out, _ = reference(wrong)
    with pytest.raises(AssertionError):
        check_output(spec, result["out"].float(), ref_out, probability_rounding_bound(wrong), **PREFILL_OUT)


def _doubled_scales(case: Fp8Case) -> Fp8Case:
    """The case's cache with every tile scale doubled: what a dequantisation whose exponent bias is
    off by one would compute."""
    rows = as_slots(case.kv_cache).clone()
    scales = rows[:, SCALES_START:ROPE_START].contiguous().view(torch.float32) * 2
    rows[:, SCALES_START:ROPE_START] = scales.view(torch.uint8)
    return dataclasses.replace(case, kv_cache=rows.view(case.kv_cache.shape))


DEQUANT_ROWS = 64
"""Rows of the direct dequantisation cases (:func:`test_dequant_is_bit_exact`)."""


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
        if spec.special_bytes:
            case = _with_special_bytes(case, gen)
        if spec.page_pad_bytes:
            case = _cache_with_page_padding(case, spec.page_pad_bytes)
        cases[spec.name] = case
    attention = [
        {"q": c.q, "kv_cache": c.kv_cache, "indices": c.indices, "topk_length": c.topk_length, "attn_sink": c.attn_sink,
         "softmax_scale": SCALE, "config": dataclasses.asdict(s.config), "out_pad_heads": s.out_pad_heads}
        for s, c in zip(SPECS, cases.values())
    ]
    nope, scales = _special_nope(DEQUANT_ROWS, gen)
    # The kernel's dequantisation alone: each mode on the special rows, and each mode with the
    # scales halved (an exponent off by one; halved, not doubled, so 2^7 stays in the bits path's
    # range), which the bit-exact criterion must reject.
    dequant = [{"nope": nope, "scales": s, "dequant": mode} for s in (scales, scales / 2) for mode in DEQUANT_MODES]
    payload = {"attention": attention, "dequant": dequant}
    results = run_interpreted("fp8_direct_interpret.py", payload, tmp_path_factory.mktemp("fp8_direct"))
    by_name: dict[str, tuple[Any, dict[str, Any]]] = {
        name: (case, result) for (name, case), result in zip(cases.items(), results["attention"])}
    for entry, values in zip(dequant, results["dequant"]):
        halved = "halved scales" if entry["scales"] is not scales else "scales"
        by_name[f"dequant {entry['dequant']} {halved}"] = ((nope, scales), {"k": values})
    return by_name


def _dequant_mismatches(k: torch.Tensor, nope: torch.Tensor, scales: torch.Tensor) -> int:
    """Elements of the kernel's BF16 ``k`` whose bits differ from the float32 reference's
    dequantisation rounded to BF16 (exact: each value is a BF16 value), signed zeros included."""
    packed = torch.zeros((nope.shape[0], FP8_BYTES_PER_TOKEN), dtype=torch.uint8)
    packed[:, :SCALES_START] = nope
    packed[:, SCALES_START:ROPE_START] = scales.contiguous().view(torch.uint8)
    ref = dequantize_fp8_ds_mla(packed)[:, :SCALES_START].to(torch.bfloat16)
    return int((k.view(torch.int16) != ref.view(torch.int16)).sum())


@pytest.mark.parametrize("mode", sorted(DEQUANT_MODES))
def test_dequant_is_bit_exact(interpreted: dict[str, tuple[Any, dict[str, Any]]], mode: str) -> None:
    """Every non-NaN e4m3 code (zeros, subnormals, +-448) times scales 2^-20 .. 2^7: each mode's
    BF16 bits equal the float32 reference's."""
    (nope, scales), result = interpreted[f"dequant {mode} scales"]
    assert _dequant_mismatches(result["k"], nope, scales) == 0


@pytest.mark.parametrize("mode", sorted(DEQUANT_MODES))
def test_dequant_check_catches_an_exponent_off_by_one(interpreted: dict[str, tuple[Any, dict[str, Any]]], mode: str) -> None:
    """The bit-exact criterion rejects a dequantisation off by a factor of two (here: the mode run
    on halved scales), on every element but the zeros."""
    (nope, scales), result = interpreted[f"dequant {mode} halved scales"]
    zeros = int((nope & 0x7F == 0).sum())
    assert _dequant_mismatches(result["k"], nope, scales) == nope.numel() - zeros


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


@pytest.mark.parametrize("fields", [{"block_n": 24}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}, {"head_block": 8},
                                    {"dequant": "none"}, {"dequant": "widen"}, {"dequant": "bf16"}, {"scales": "v2"},
                                    {"dv_split": 4}, {"dv_split": 0}, {"max_regs": 100}, {"max_regs": 256}, {"max_regs": 16},
                                    # The wgmma kernel's layout is fixed: only WGMMA_CONFIG, with 16 or 32 heads a program.
                                    {"wgmma": True}, {**WG, "block_n": 32}, {**WG, "num_warps": 8}, {**WG, "keys_as_m": False},
                                    {**WG, "dequant": "bits"}, {**WG, "dv_split": 2}, {**WG, "head_block": 64},
                                    {"warp_specialized": True}, {"a_in_registers": True},
                                    {**WG, "warp_specialized": True, "a_in_registers": True},
                                    # So is the mma.sync kernel's: MMA_CONFIG only.
                                    {"mma_sync": True}, {**MMA, "head_block": 32}, {**MMA, "block_n": 32},
                                    {**MMA, "wgmma": True}, {**MMA, "keys_as_m": True}])
def test_bad_configs_raise_value_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KernelConfig(**fields)


def test_the_wgmma_config_runs_the_wgmma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """WGMMA_CONFIG hands the checked arguments to fp8_wgmma.launch with its heads a program,
    WGMMA_RA_CONFIG the same with a_in_registers, and WGMMA_WS_CONFIG to fp8_wgmma_ws.launch (never
    the Triton kernel); the bound probes refuse it."""
    from mla_planner.kernels import fp8_direct, fp8_wgmma, fp8_wgmma_ws

    calls: list[tuple[int, float, bool]] = []
    ws_calls: list[int] = []
    monkeypatch.setattr(fp8_wgmma, "launch", lambda *a, a_in_registers: calls.append((a[-1], a[-2], a_in_registers)))
    monkeypatch.setattr(fp8_wgmma_ws, "launch", lambda *a: ws_calls.append(a[-1]))
    monkeypatch.setattr(fp8_direct, "_sparse_fp8_kernel", None)
    args = _good(heads=32)
    sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=WGMMA_CONFIG)
    sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"],
                         config=dataclasses.replace(WGMMA_CONFIG, head_block=16))
    sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=WGMMA_WS_CONFIG)
    sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=WGMMA_RA_CONFIG)
    assert [(block_h, ra) for block_h, _, ra in calls] == [(32, False), (16, False), (32, True)] and ws_calls == [32]
    assert calls[0][1] == pytest.approx(args["softmax_scale"] * fp8_direct.LOG2E)
    with pytest.raises(ValueError, match="no bound probes"):
        no_dequant_bound_probe(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=WGMMA_CONFIG)


def test_the_mma_config_runs_the_mma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """MMA_CONFIG hands the checked arguments (the cache as pages, its page stride, the base-2
    scale) to fp8_mma.launch, never another kernel; the bound probes refuse it."""
    from mla_planner.kernels import fp8_direct, fp8_mma, fp8_wgmma

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(fp8_mma, "launch", lambda *a: calls.append(a))
    monkeypatch.setattr(fp8_wgmma, "launch", None)
    monkeypatch.setattr(fp8_direct, "_sparse_fp8_kernel", None)
    args = _good(heads=32)
    sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=MMA_CONFIG)
    (call,) = calls
    assert call[1].dim() == 3 and call[1].shape[-1] == 656 and call[7] == call[1].stride(0)
    assert call[8] == pytest.approx(args["softmax_scale"] * fp8_direct.LOG2E)
    with pytest.raises(ValueError, match="no bound probes"):
        no_dequant_bound_probe(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=MMA_CONFIG)


def _combine(bases: list[list[int]], index: int, rank: int) -> list[int]:
    """What a linear layout's ``bases`` map ``index`` to: the XOR of the bases of its set bits."""
    coords = [0] * rank
    for bit, basis in enumerate(bases):
        if index >> bit & 1:
            coords = [c ^ b for c, b in zip(coords, basis)]
    return coords


def _at(layout: Any, offset: int) -> list[int]:
    """The logical coordinates a shared linear layout puts at ``offset`` (its bases map offset bits)."""
    return _combine(layout.offset_bases, offset, len(layout.offset_bases[0]))


@pytest.mark.parametrize("buffer", ["nope keys", "nope values", "rope", "scales"])
def test_the_mma_kernels_load_views_name_the_bytes_its_copies_wrote(buffer: str) -> None:
    """No GPU: in each buffer of a stage, chunk j's load view puts at every offset the (key, column)
    that the copy view put at chunk j's offset plus it, with keys and columns as the dots' load
    layouts address them: the score dot's (tile, key, c, byte) is column 128 tile + 32 c + byte,
    the value dot's (tile, k3, c, k0, g, j) key 8 k3 + 2 c + k0 and column 128 tile + 16 g + j,
    the RoPE part's (w, key, c, e) column 16 w + 4 c + e, the scales' (tile, key) column tile."""
    from mla_planner.kernels import fp8_mma

    key_col: Any
    copied, view, key_col = {
        "nope keys": (fp8_mma._NOPE, fp8_mma._NOPE_KEYS, lambda t, n, c, b: (n, 128 * t + 32 * c + b)),
        "nope values": (fp8_mma._NOPE, fp8_mma._NOPE_VALUES,
                        lambda t, k3, c, k0, g, j: (8 * k3 + 2 * c + k0, 128 * t + 16 * g + j)),
        "rope": (fp8_mma._ROPE, fp8_mma._ROPE_KEYS, lambda w, n, c, e: (n, 16 * w + 4 * c + e)),
        "scales": (fp8_mma._SCALES, fp8_mma._SCALE_KEYS, lambda t, n: (n, t)),
    }[buffer]
    copied, view = copied.value, view.value
    chunk = 1 << len(view.offset_bases)
    assert 4 * chunk == 1 << len(copied.offset_bases)  # four chunks of 16 keys a stage
    seen = set()
    for j in range(4):
        for offset in range(chunk):
            key, col = key_col(*_at(view, offset))
            assert [key + 16 * j, col] == _at(copied, j * chunk + offset)
            seen.add((key, col))
    assert len(seen) == chunk  # every (key, column) of a chunk once


@pytest.mark.parametrize("load", ["nope keys", "nope values", "rope"])
def test_the_mma_kernels_shared_loads_meet_no_bank_conflict(load: str) -> None:
    """No GPU: each of the mma kernel's vector loads from shared memory (16 bytes a lane, 8 for
    the RoPE part), as its register layout and its view's swizzle place them, has every phase of the
    warp (8 lanes for 16 bytes, 16 for 8) on distinct banks: one shared-memory wavefront a phase.
    Without the swizzle each of these loads meets conflicts."""
    from mla_planner.kernels import fp8_mma

    layout, view, element = {"nope keys": (fp8_mma._KEY_LOAD, fp8_mma._NOPE_KEYS, 1),
                             "nope values": (fp8_mma._VALUE_LOAD, fp8_mma._NOPE_VALUES, 1),
                             "rope": (fp8_mma._ROPE_LOAD, fp8_mma._ROPE_KEYS, 2)}[load]
    layout, view = layout.value, view.value
    offset_of = {tuple(_at(view, o)): o * element for o in range(1 << len(view.offset_bases))}
    rank = len(layout.shape)
    # A lane's vector: the leading register bases that step the last dimension by 1, 2, 4, ..., up
    # to 16 bytes (the widest shared load).
    vec_bits = 0
    while ((2 << vec_bits) * element <= 16 and vec_bits < len(layout.reg_bases)
           and layout.reg_bases[vec_bits] == [0] * (rank - 1) + [1 << vec_bits]):
        vec_bits += 1
    vector = (1 << vec_bits) * element
    assert vector in (8, 16)
    phase = 128 // vector  # lanes a wavefront serves

    other_regs = layout.reg_bases[vec_bits:]
    for warp in range(1 << len(layout.warp_bases)):
        for reg in range(1 << len(other_regs)):
            base = [a ^ b for a, b in zip(_combine(layout.warp_bases, warp, rank), _combine(other_regs, reg, rank))]
            offsets = [offset_of[tuple(a ^ b for a, b in zip(base, _combine(layout.lane_bases, lane, rank)))]
                       for lane in range(32)]
            assert all(o % vector == 0 for o in offsets)
            for first in range(0, 32, phase):
                groups = {o // vector % phase for o in offsets[first:first + phase]}
                assert len(groups) == phase, (load, warp, reg, first, offsets[first:first + phase])


def test_the_mma_kernel_compiles_for_sm90() -> None:
    """No GPU: the mma.sync kernel compiles for sm90 with both dots as f16 ``mma.sync`` (and the RoPE
    part's in bf16) on e4m3 bytes converted in registers, no ``wgmma``; it copies each block's rows
    by 16-byte ``cp.async`` that zero-fills an invalid entry's (a source-size operand), reads both
    dots' operands from shared memory by 16-byte loads and gathers nothing itself; between its first
    and last MMA (the loop) it loads nothing from global memory, its indices copied too; its shared
    memory (two stages of 64 rows of 656 bytes, their indices, and the partial scores) leaves room
    for two programs an SM (227 KB), and it does not spill."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fp8_direct_bench import compile_wgmma, ptxas_usage

    compiled = compile_wgmma(16, "mma")
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" not in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
    assert copies and all(line.rstrip(";").split(",")[-2].strip() == "0x10" and "%r" in line.split(",")[-1]
                          for line in copies)
    assert "cp.async.wait_group" in ptx and "ld.shared.v4.b32" in ptx
    assert "ld.global.v4.b32" not in ptx and "prefetch.global" not in ptx
    lines = ptx.splitlines()
    mmas = [i for i, line in enumerate(lines) if "mma.sync" in line]
    assert not [line for line in lines[mmas[0]:mmas[-1]] if "ld.global" in line]
    assert 2 * 64 * 656 < compiled.metadata.shared <= (227 * 1024) // 2
    import triton
    _, spill = ptxas_usage(ptx, Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
    assert spill == "0"


@pytest.mark.parametrize("variant", ["wg", "ws", "ra"])
@pytest.mark.parametrize("heads", [16, 32])
def test_the_wgmma_kernels_compile_for_sm90(heads: int, variant: str) -> None:
    """No GPU: the Gluon kernels compile for sm90 into warpgroup MMAs, their shared tiles within
    what fits an SM: two programs of the one-warpgroup kernels at 16 heads, one otherwise. The
    warp-specialised one hands its tiles over through mbarriers; the ``ra`` one's score dots take
    their A operand from registers (in the PTX, a register list where the others name a descriptor)
    and its key tiles arrive by 16-byte loads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fp8_direct_bench import compile_wgmma

    compiled = compile_wgmma(heads, variant)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    programs = 2 if heads == 16 and variant != "ws" else 1
    assert compiled.metadata.shared <= (228 * 1024) // programs - 1024
    if variant == "ws":
        assert "mbarrier.arrive" in ptx and "mbarrier.try_wait" in ptx
    register_a = [line for line in ptx.splitlines() if "wgmma.mma_async" in line and ", {%r" in line.split("}", 1)[1]]
    assert bool(register_a) == (variant == "ra")
    if variant == "ra":
        assert "ld.global.v4.b32" in ptx


def test_the_bound_probe_takes_only_its_probes() -> None:
    """The probes are reached through no_dequant_bound_probe alone, by name; a config cannot ask for
    them (test_bad_configs_raise_value_errors) and an unknown name raises before any launch."""
    args = _good()
    with pytest.raises(ValueError, match="probe must be"):
        no_dequant_bound_probe(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], probe="f32")


def test_the_launch_follows_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the launcher hands Triton: the default launch as before (one program a token and head
    group, no register cap, the scales' masked load, no split); a split doubles the programs along
    the token axis; a register cap becomes maxnreg."""
    from mla_planner.kernels import fp8_direct

    launches: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(fp8_direct, "_sparse_fp8_kernel", Recorder())
    args = _good(heads=32)
    for config in (KernelConfig(), dataclasses.replace(HM, head_block=16, scales="v4", dv_split=2, max_regs=168)):
        sparse_attention_fp8(args["q"], args["kv_cache"], args["indices"], args["softmax_scale"], config=config)
    (grid, default), (split_grid, split) = launches
    assert grid == (3, 1) and "maxnreg" not in default
    assert (default["SCALES_V4"], default["DV_SPLIT"]) == (False, 1)
    assert split_grid == (6, 2) and split["maxnreg"] == 168
    assert (split["SCALES_V4"], split["DV_SPLIT"]) == (True, 2)


def test_config_labels_are_distinct() -> None:
    configs = {HM, KM, dataclasses.replace(KM, block_n=64), dataclasses.replace(KM, num_stages=3), dataclasses.replace(HM, head_block=16),
               HM_BITS, dataclasses.replace(KM_BITS, head_block=16), HM_V4, HM_DV2, dataclasses.replace(HM_DV2, max_regs=168),
               dataclasses.replace(KM_BITS, scales="v4", dv_split=2, max_regs=200), WGMMA_CONFIG,
               dataclasses.replace(WGMMA_CONFIG, head_block=16), WGMMA_WS_CONFIG, WGMMA_RA_CONFIG, MMA_CONFIG}
    assert len(configs) == 16
    assert len({c.label() for c in configs}) == len(configs)
    assert all(KernelConfig.parse(c.label()) == c for c in configs)
    with pytest.raises(ValueError):
        KernelConfig.parse("n64 x3")


@pytest.mark.parametrize("fault", ["scale 2% off", "sink ignored", "rope ignored", "dequant exponent off by one"])
@pytest.mark.parametrize("spec", ["h16 topk128 lengths+sink", "h16 topk128 lengths+sink, bits dequant",
                                  "h16 topk128 lengths+sink, split output"])
def test_the_check_catches_a_wrong_result(interpreted: dict[str, tuple[Fp8Case, dict[str, Any]]], fault: str, spec: str) -> None:
    """The criterion is not vacuous: the kernel's own output fails it against a reference with a
    small semantic fault."""
    case, result = interpreted[spec]
    scale = SCALE
    if fault == "scale 2% off":
        scale = SCALE * 1.02
    elif fault == "sink ignored":
        case = dataclasses.replace(case, attn_sink=None)
    elif fault == "dequant exponent off by one":
        case = _doubled_scales(case)
    else:
        q = case.q.clone()
        q[..., 512:] = 0
        case = dataclasses.replace(case, q=q)
    ref_out, _ = reference(case, scale)
    with pytest.raises(AssertionError):
        check_output(fault, result["out"].float(), ref_out, probability_rounding_bound(case, scale), **PREFILL_OUT)
