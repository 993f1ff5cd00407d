"""Float32 reference for the FlashMLA sparse kernels: ``fp8_ds_mla`` dequantisation and sparse
attention over per-query top-k rows. Pure torch, so it runs on the CPU (CI) and on the GPU (as
the yardstick for the real kernels).

Conventions follow FlashMLA's own test reference: an index is valid iff ``0 <= i < num_rows``;
a query with no valid index gets an all-zero output and ``lse = +inf``.
"""

from __future__ import annotations

import torch

from mla_planner.executor.layout import D_NOPE, D_QK, D_V, NUM_TILES, ROPE_START, SCALES_START, TILE, as_slots, page_of, slot_of

# Keeps the gathered (queries, topk, 576) float32 block near 64 MiB whatever topk is.
_BLOCK_ELEMENTS = 1 << 24


def dequantize_fp8_ds_mla(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(..., 656)`` uint8 rows -> ``(..., 576)`` rows of ``dtype``.

    Exact in float32, and in bfloat16 too: every float8_e4m3 value is a bfloat16 value and the
    scales are powers of two.
    """
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, packed.shape[-1])
    nope = rows[:, :SCALES_START].view(torch.float8_e4m3fn).to(dtype).reshape(-1, NUM_TILES, TILE)
    scales = rows[:, SCALES_START:ROPE_START].contiguous().view(torch.float32).to(dtype)
    rope = rows[:, ROPE_START:].contiguous().view(torch.bfloat16).to(dtype)
    out = torch.cat([(nope * scales.unsqueeze(-1)).reshape(-1, D_NOPE), rope], dim=1)
    return out.reshape(*lead, D_QK)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(s, h, 576)``, keys ``(s, k, 576)``, valid ``(s, k)`` -> out ``(s, h, 512)``, lse ``(s, h)``."""
    scores = torch.einsum("shd,skd->shk", q, keys) * softmax_scale
    scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A lonely query has lse = -inf; shifting by 0 instead makes its weights exp(-inf) = 0.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.einsum("shk,skd->shd", torch.exp(scores - shift.unsqueeze(-1)), keys[..., :D_V])
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def sparse_attention(
    q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA in float32.

    q ``(s, h, 576)``; kv_rows ``(n, 576)`` float rows, or ``(n, 656)`` uint8 ``fp8_ds_mla``
    rows (dequantised as they are gathered); indices ``(s, topk)`` into those rows.
    Returns out ``(s, h, 512)`` and lse ``(s, h)``, both float32.
    """
    s, h, _ = q.shape
    num_rows, topk = kv_rows.shape[0], indices.shape[1]
    out = torch.empty((s, h, D_V), dtype=torch.float32, device=q.device)
    lse = torch.empty((s, h), dtype=torch.float32, device=q.device)
    block = max(1, _BLOCK_ELEMENTS // (topk * D_QK))
    for start in range(0, s, block):
        end = min(start + block, s)
        idx = indices[start:end].long()
        valid = (idx >= 0) & (idx < num_rows)
        gathered = kv_rows[idx.clamp(0, num_rows - 1)]
        keys = dequantize_fp8_ds_mla(gathered) if kv_rows.dtype == torch.uint8 else gathered.float()
        keys.masked_fill_(~valid.unsqueeze(-1), 0.0)  # an unused slot's row, even NaN, weighs nothing
        out[start:end], lse[start:end] = _attend(q[start:end].float(), keys, valid, softmax_scale)
    return out, lse


def sparse_decode_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache`` (sparse, FP8) in float32, same shapes in and out:
    q ``(b, s, h, 576)``, kv_cache ``(pages, page_size, 1, 656)``, indices ``(b, s, topk)`` slots
    -> out ``(b, s, h, 512)`` in q's dtype, lse ``(b, h, s)`` float32."""
    b, s, h, _ = q.shape
    out, lse = sparse_attention(q.reshape(b * s, h, D_QK), as_slots(kv_cache), indices.reshape(b * s, -1), softmax_scale)
    return out.reshape(b, s, h, D_V).to(q.dtype), lse.reshape(b, s, h).transpose(1, 2)


def sparse_prefill_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_sparse_fwd`` in float32: q ``(s, h, 576)``, kv ``(n, 1, 576)`` BF16 rows,
    indices ``(s, 1, topk)`` -> out ``(s, h, 512)`` in q's dtype, lse ``(s, h)`` float32.
    ``topk_length`` ``(s,)``: only each query's first that many indices count."""
    if topk_length is not None:
        past = torch.arange(indices.shape[-1], device=indices.device) >= topk_length.view(-1, 1, 1)
        indices = indices.masked_fill(past, -1)
    out, lse = sparse_attention(q, kv.reshape(kv.shape[0], D_QK), indices.reshape(indices.shape[0], -1), softmax_scale)
    return out.to(q.dtype), lse


GATHER_BLOCK_ROWS = 4096
"""Rows :func:`gather_upconvert` converts at a time: about 4 KiB of temporaries a row, 16 MiB."""


def gather_upconvert(kv_cache: torch.Tensor, block_table_row: torch.Tensor, key_start: int, key_end: int,
                     workspace: torch.Tensor) -> None:
    """One request's positions ``[key_start, key_end)`` from ``kv_cache`` (``(pages, page_size,
    ...)`` 656-byte rows) into ``workspace`` (``(key_end - key_start, 576)``), dequantised to its
    dtype. Plain torch, in blocks of :data:`GATHER_BLOCK_ROWS` rows so the temporaries stay
    bounded: the calibration's ``torch`` gather, the test harness's, and (request by request)
    :func:`gather_upconvert_reference`."""
    page_size = kv_cache.shape[1]
    slots = as_slots(kv_cache)
    for start in range(key_start, key_end, GATHER_BLOCK_ROWS):
        end = min(start + GATHER_BLOCK_ROWS, key_end)
        pos = torch.arange(start, end, device=kv_cache.device)
        slot = slot_of(block_table_row[page_of(pos, page_size)], pos, page_size)
        workspace[start - key_start : end - key_start] = dequantize_fp8_ds_mla(slots[slot], workspace.dtype)


def gather_upconvert_reference(kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                               workspace_starts: torch.Tensor, num_requests: int) -> None:
    """vLLM's ``cp_gather_and_upconvert_fp8_kv_cache`` in torch: request ``r``'s positions from 0,
    dequantised to ``workspace``'s dtype, into its rows from ``workspace_starts[r]`` up to the next
    request's start (the last request's up to the workspace's end)."""
    starts = workspace_starts[:num_requests].tolist() + [workspace.shape[0]]
    for r in range(num_requests):
        gather_upconvert(kv_cache, block_table[r], 0, starts[r + 1] - starts[r], workspace[starts[r] : starts[r + 1]])
