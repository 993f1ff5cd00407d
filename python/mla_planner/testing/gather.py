"""The separate prefill path's gather: FP8 cache rows of a request -> BF16 workspace rows, and
top-k indices from request positions -> workspace rows.

Plain torch (vLLM does the gather with its own ``cp_gather_and_upconvert_fp8_kv_cache``). Work
goes in blocks so the temporaries stay bounded whatever the chunk size: at most
``GATHER_BLOCK_ROWS`` cache rows (about 4 KiB of intermediates per row, 16 MiB) and
``TRANSLATE_BLOCK_TOKENS x topk`` indices (three bool masks, 6 MiB at topk 2048).
"""

from __future__ import annotations

import torch

from mla_planner.executor.layout import as_slots, page_of, slot_of
from mla_planner.executor.reference import dequantize_fp8_ds_mla

GATHER_BLOCK_ROWS = 4096
TRANSLATE_BLOCK_TOKENS = 1024


def gather_upconvert(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, key_start: int, key_end: int, workspace: torch.Tensor
) -> None:
    """Write the request's positions ``[key_start, key_end)`` from kv_cache
    ``(pages, page_size, 1, 656)`` into workspace ``(key_end - key_start, 576)`` as BF16 (exact)."""
    page_size = kv_cache.shape[1]
    slots = as_slots(kv_cache)
    for start in range(key_start, key_end, GATHER_BLOCK_ROWS):
        end = min(start + GATHER_BLOCK_ROWS, key_end)
        pos = torch.arange(start, end, device=kv_cache.device)
        slot = slot_of(block_table_row[page_of(pos, page_size)], pos, page_size)
        workspace[start - key_start : end - key_start] = dequantize_fp8_ds_mla(slots[slot], torch.bfloat16)


def to_workspace_indices(positions: torch.Tensor, key_start: int, key_end: int, row_offset: int, out: torch.Tensor) -> None:
    """Translate request positions ``(s, topk)`` to workspace rows, in place into ``out``: a
    position in ``[key_start, key_end)`` lands on row ``position - key_start + row_offset``;
    anything else (``-1``, or a key outside this window) becomes ``-1``."""
    for start in range(0, positions.shape[0], TRANSLATE_BLOCK_TOKENS):
        src = positions[start : start + TRANSLATE_BLOCK_TOKENS]
        outside = (src < key_start) | (src >= key_end)
        dst = out[start : start + src.shape[0]]
        dst.copy_(src).add_(row_offset - key_start).masked_fill_(outside, -1)
