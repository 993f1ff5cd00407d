"""The fp8_ds_mla quantiser and the float32 sparse-attention reference (CPU, CI)."""

from __future__ import annotations


import pytest
import torch

from mla_planner.calibration.synthetic import random_kv_rows
from mla_planner.executor.layout import D_NOPE, NUM_TILES, ROPE_START, SCALES_START, TILE, as_pages, as_slots
from mla_planner.executor.quant import quantize_fp8_ds_mla
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

from fixtures import gen  # noqa: F401  (a pytest fixture)
from harness.lse_merge import merge_window, start_merge

SCALE = 576**-0.5



def test_quantiser_round_trips_within_fp8_e4m3_precision(gen: torch.Generator) -> None:
    kv = random_kv_rows(300, gen)
    packed = quantize_fp8_ds_mla(kv)
    assert packed.shape == (300, 656) and packed.dtype == torch.uint8
    back = dequantize_fp8_ds_mla(packed)

    scales = packed[:, SCALES_START:ROPE_START].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round())), "scales are powers of two"
    amax = kv[:, :D_NOPE].abs().reshape(-1, NUM_TILES, TILE).amax(-1)
    assert bool(((amax / scales > 224) & (amax / scales <= 448)).all()), "each tile uses the top binade of e4m3"

    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals step 2^-9 x scale.
    per_value_scale = scales.repeat_interleave(TILE, dim=1)
    bound = kv[:, :D_NOPE].abs() * 2**-4 + per_value_scale * 2**-10
    assert bool(((back[:, :D_NOPE] - kv[:, :D_NOPE]).abs() <= bound).all())
    assert torch.equal(back[:, D_NOPE:], kv[:, D_NOPE:].to(torch.bfloat16).float()), "RoPE is kept in bf16"
    assert not torch.equal(back, torch.zeros_like(back))


def test_bf16_dequantisation_is_exact(gen: torch.Generator) -> None:
    packed = quantize_fp8_ds_mla(random_kv_rows(128, gen))
    assert torch.equal(dequantize_fp8_ds_mla(packed, torch.bfloat16).float(), dequantize_fp8_ds_mla(packed))


def test_page_views_round_trip(gen: torch.Generator) -> None:
    rows = quantize_fp8_ds_mla(random_kv_rows(192, gen))
    pages = as_pages(rows)
    assert pages.shape == (3, 64, 1, 656)
    assert torch.equal(as_slots(pages), rows)
    with pytest.raises(ValueError, match="pages"):
        as_pages(rows[:100])


def _dense_softmax(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Plain attention of q (h, 576) over keys (n, 576), n >= 1."""
    weights = torch.softmax((q.double() @ keys.double().T) * SCALE, dim=-1)
    return (weights @ keys.double()[:, :512]).float()


def test_reference_matches_dense_attention_over_valid_slots_only(gen: torch.Generator) -> None:
    rows = quantize_fp8_ds_mla(random_kv_rows(256, gen))
    q = torch.randn((40, 8, 576), generator=gen)
    indices = torch.randint(1, 255, (40, 128), generator=gen, dtype=torch.int32)
    indices[torch.rand((40, 128), generator=gen) < 0.3] = -1
    indices[7] = -1  # a lonely query
    poisoned = rows.clone()
    poisoned[0, :512] = 0x7F  # e4m3 NaN in the rows -1 could alias: slot 0 and the last slot
    poisoned[-1, :512] = 0x7F

    out, lse = sparse_attention(q, poisoned, indices, SCALE)
    keys = dequantize_fp8_ds_mla(rows)
    for t in range(40):
        valid = indices[t][indices[t] >= 0].long()
        if len(valid) == 0:
            assert torch.equal(out[t], torch.zeros_like(out[t])) and bool((lse[t] == float("inf")).all())
            continue
        expected = _dense_softmax(q[t], keys[valid])
        # float32 logits of O(100) carry ~1e-5 absolute error into the exponent
        torch.testing.assert_close(out[t], expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert bool(torch.isfinite(out).all())


def test_lse_merge_of_key_windows_equals_attention_over_all_keys(gen: torch.Generator) -> None:
    rows = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(random_kv_rows(300, gen)))
    q = torch.randn((30, 4, 576), generator=gen)
    indices = torch.randint(0, 300, (30, 128), generator=gen, dtype=torch.int32)
    indices[3, :] = torch.randint(0, 100, (128,), generator=gen)  # all keys in the first window
    indices[5, :] = -1  # no key anywhere
    whole, whole_lse = sparse_attention(q, rows, indices, SCALE)

    out = torch.full_like(whole, float("nan"))
    lse = start_merge(out)
    for lo, hi in ((0, 100), (100, 250), (250, 300)):
        window = torch.where((indices >= lo) & (indices < hi), indices - lo, -1)
        part, part_lse = sparse_attention(q, rows[lo:hi], window, SCALE)
        merge_window(out, lse, part, part_lse)

    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))
    finite = torch.isfinite(whole_lse)
    torch.testing.assert_close(lse[finite], whole_lse[finite], rtol=1e-6, atol=1e-5)
    assert bool((lse[5] == float("-inf")).all()) and torch.equal(out[5], torch.zeros_like(out[5]))


def test_slots_of_positions_through_a_block_table() -> None:
    from mla_planner.executor.layout import page_of, slot_of

    block_table_row = torch.tensor([7, 3, 9])
    positions = torch.tensor([0, 63, 64, 130, -1])
    pages = block_table_row[page_of(positions, 64)]
    assert slot_of(pages, positions, 64).tolist() == [7 * 64, 7 * 64 + 63, 3 * 64, 9 * 64 + 2, -1]
