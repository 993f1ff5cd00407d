"""mla-planner: keep sparse-MLA attention inside a memory budget.

Exact byte models of every scratch buffer the FlashMLA sparse kernels
allocate, and planners that cut a scheduler step into kernel launches that
fit a budget. The arithmetic lives in Rust (``mla_planner._core``); this
package re-exports it and adds the command line and the vLLM backend.
"""

from mla_planner._core import (
    DEFAULT_TOPK,
    GLOBAL_TOPK_MASK_MAX_BYTES,
    H200_NUM_SMS,
    MIN_HEADS_FOR_BF16_PREFILL,
    MixedBatchPlan,
    PrefillGroups,
    Scratch,
    StepPlan,
    __version__,
    decode_scratch,
    gather_workspace_bytes,
    indexer_logits_bytes,
    masked_mha_workspace_fits,
    max_tokens_per_launch,
    plan_gather_chunks,
    plan_mixed_batch,
    plan_prefill_groups,
    plan_step,
    prefill_launch_tokens,
    prefill_scratch,
    split_indexer_prefill_chunks,
    split_prefill_chunks,
    step_mode,
    topk_mask_bytes,
    topk_mask_shape,
)

__all__ = [
    "DEFAULT_TOPK",
    "GLOBAL_TOPK_MASK_MAX_BYTES",
    "H200_NUM_SMS",
    "MIN_HEADS_FOR_BF16_PREFILL",
    "MixedBatchPlan",
    "PrefillGroups",
    "Scratch",
    "StepPlan",
    "__version__",
    "decode_scratch",
    "gather_workspace_bytes",
    "indexer_logits_bytes",
    "masked_mha_workspace_fits",
    "max_tokens_per_launch",
    "plan_gather_chunks",
    "plan_mixed_batch",
    "plan_prefill_groups",
    "plan_step",
    "prefill_launch_tokens",
    "prefill_scratch",
    "split_indexer_prefill_chunks",
    "split_prefill_chunks",
    "step_mode",
    "topk_mask_bytes",
    "topk_mask_shape",
]
