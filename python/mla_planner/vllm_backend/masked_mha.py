"""Masked-MHA prefill, partial instead of all-or-nothing (called only where the installed release
has it: ``release.masked_mha``, which holds what it asks of vLLM's layer and metadata).

On SM100 with FA4 and a non-quantized KV cache, vLLM runs long prefills as MHA under a bit-packed
top-k mask. The layer decides once per step for the whole prefill set
(``MLAAttention._use_sparse_mha``): masked MHA if vLLM's speed table says so and
``impl.masked_mha_workspace_fits(prefill)`` finds that the set's mask fits the 128 MiB workspace
(``GLOBAL_TOPK_MASK_MAX_BYTES``); one prefill too many and every prefill token of the step goes to
sparse MQA.

Here, once per step, where the layer would take masked MHA but for the fit, the builder cuts the
prefills into the planner's fewest groups whose masks fit (:func:`mla_planner.plan_prefill_groups`,
contiguous, in vLLM's order) and attaches the result, a :class:`PartialPrefill`, to the step's
prefill metadata. The impl's ``masked_mha_workspace_fits`` then says yes, the layer hands every
prefill token to the impl's ``forward_mha``, and that runs each group into its own rows of the
output: a masked-MHA (or, all its sequences within top-k, dense-MHA) group through stock's
``forward_mha`` on the group's own prefill metadata; a group that fits no mask through the layer's
sparse-MQA path for just its rows. The layer itself is not changed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import numpy as np
import torch

import mla_planner
from mla_planner.vllm_backend import fallback, log
from mla_planner.vllm_backend.log import logger
from mla_planner.vllm_backend.releases import MaskedMha, release
from mla_planner.vllm_backend.vllm_api import FlashMLASparseImpl

def mha() -> MaskedMha:
    """The installed release's masked MHA (the backend calls this module only where there is one)."""
    if release.masked_mha is None:
        raise LookupError("this vLLM release has no masked-MHA prefill")
    return release.masked_mha


PLAN_ATTRIBUTE = "mla_planner_partial"
"""The attribute of a step's prefill metadata that holds its :class:`PartialPrefill`: the impl's
``masked_mha_workspace_fits`` is given the prefill metadata only."""


@dataclasses.dataclass(frozen=True)
class GroupRun:
    """One group of a step's prefills and how it runs."""

    path: str
    """``"masked_mha"``, ``"dense_mha"`` or ``"sparse_mqa"`` (the planner's path)."""
    requests: tuple[int, int]
    """Its prefill requests, ``[start, end)``, counted from the step's first prefill."""
    rows: slice
    """Its tokens among the step's prefill tokens: the rows of ``forward_mha``'s q and output."""
    topk_rows: slice
    """The same tokens' rows in the step's top-k index buffer (decode tokens come first)."""
    metadata: Any
    """The step's metadata narrowed to this group. MHA: the group's own prefill metadata (block
    table, query starts, chunked context, a prefill backend prepared for it where dense), and
    ``num_decode_tokens`` at the group's first top-k row, where stock's ``forward_mha`` reads its
    top-k rows from (F:1181). Sparse MQA: the group's request ids per token and no decode tokens,
    as stock's BF16 sparse kernel call reads them (``_forward_bf16_kv``)."""


@dataclasses.dataclass(frozen=True)
class PartialPrefill:
    """A step's prefills in the planner's groups: the fewest MHA groups whose masks fit, sparse
    MQA for the prefills that fit in none, where stock would run them all on sparse MQA."""

    groups: mla_planner.PrefillGroups
    runs: tuple[GroupRun, ...]
    stock: GroupRun
    """Every prefill on sparse MQA, as stock runs the step: what a layer call whose groups cannot
    run falls back to."""

    def describe(self) -> str:
        return ", ".join(f"{r.requests[0]}..{r.requests[1]} {r.path} ({r.rows.stop - r.rows.start} tokens)"
                         for r in self.runs)


def plan_of(prefill: Any) -> PartialPrefill | None:
    """The :class:`PartialPrefill` the builder attached to a step's prefill metadata, if any."""
    partial = getattr(prefill, PLAN_ATTRIBUTE, None)
    return partial if isinstance(partial, PartialPrefill) else None


# -- the builder, once per step -------------------------------------------------------------------


def attach_plan(builder: Any, metadata: Any, common: Any) -> PartialPrefill | None:
    """Plan the step's prefills in groups where the layer would take masked MHA but for the mask's
    fit, and attach the plan to ``metadata.prefill``; nothing where stock runs the step as it is
    (masked MHA not available or not chosen, or the whole set fits, or no prefill fits any mask)."""
    partial = partial_prefill(builder, metadata, common)
    if partial is not None:
        setattr(metadata.prefill, PLAN_ATTRIBUTE, partial)
        log.once(logging.INFO, "mla-planner: a step's top-k masks do not fit vLLM's masked-MHA workspace together: "
                         "its prefills run in the planner's groups (stock: all on sparse MQA)")
        logger.debug("mla-planner masked MHA: %d prefills in %d groups: %s",
                     metadata.num_prefills, len(partial.runs), partial.describe())
    return partial


def partial_prefill(builder: Any, metadata: Any, common: Any) -> PartialPrefill | None:
    """The step's :class:`PartialPrefill` (see :func:`attach_plan`)."""
    if not mha().layer_takes_masked_mha(builder, metadata):
        return None
    prefill = metadata.prefill
    if mha().masked_mha_set_fits(prefill):
        return None
    decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    query_lens = prefill.query_lens_cpu.numpy().astype(np.int64)
    seq_lens = common.seq_lens_cpu_upper_bound[decodes : decodes + num_prefills].numpy().astype(np.int64)
    # The planner's fit test bounds a context chunk's keys by the chunked-context workspace's rows,
    # never below vLLM's chunks: a group it passes passes vLLM's own test (F:84) and
    # _run_masked_mha's (F:1021-1027).
    groups = mla_planner.plan_prefill_groups(
        query_lens, seq_lens - query_lens, topk=metadata.topk_tokens,
        workspace_bytes=mha().topk_mask_workspace_bytes(prefill),
        context_chunk_rows=builder.chunked_prefill_workspace_size,
    )
    paths = groups.paths
    if len(paths) < 2:
        return None  # one group: stock's route for the whole set (sparse MQA, as stock found)
    # Every plan can fall back to sparse MQA for all its prefills (as some groups run): where
    # this backend cannot run the layer's sparse-MQA path, the builder's guard runs vLLM's own
    # choice, counted and said once.
    unsupported = mha().link_sparse_mqa_layers(builder)
    if unsupported is not None:
        raise ValueError(f"the layer's sparse-MQA path cannot run prefill rows here: {unsupported}")
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    starts = (qsl[decodes : decodes + num_prefills + 1] - qsl[decodes]).tolist()
    runs = []
    dense = 0
    for (r0, r1), path in zip(groups.requests.tolist(), paths):
        t0, t1 = starts[r0], starts[r1]
        if path == "sparse_mqa":
            runs.append(sparse_mqa_run(metadata, r0, r1, t0, t1))
            continue
        backend = None
        if path == "dense_mha":
            backend = group_prefill_backend(builder, dense)
            dense += 1
        group = mha().prefill_metadata_of(builder, metadata, common, r0, r1, backend)
        top0 = metadata.num_decode_tokens + t0
        narrowed = dataclasses.replace(
            metadata, prefill=group, num_prefills=r1 - r0, num_decode_tokens=top0,
            prefill_max_seq_len=int(seq_lens[r0:r1].max()),
        )
        runs.append(GroupRun(path, (r0, r1), slice(t0, t1), slice(top0, top0 + t1 - t0), narrowed))
    return PartialPrefill(groups, tuple(runs), sparse_mqa_run(metadata, 0, num_prefills, 0, starts[-1]))


def sparse_mqa_run(metadata: Any, r0: int, r1: int, t0: int, t1: int) -> GroupRun:
    """Prefills ``[r0, r1)``, their tokens ``[t0, t1)`` among the step's prefill tokens, on the
    layer's sparse-MQA path: the step's metadata with their request ids per token and no decodes."""
    topk_rows = slice(metadata.num_decode_tokens + t0, metadata.num_decode_tokens + t1)
    narrowed = dataclasses.replace(
        metadata, prefill=None, num_decodes=0, num_decode_tokens=0, num_prefills=r1 - r0,
        num_actual_tokens=t1 - t0, req_id_per_token=metadata.req_id_per_token[topk_rows],
    )
    return GroupRun("sparse_mqa", (r0, r1), slice(t0, t1), topk_rows, narrowed)


def group_prefill_backend(builder: Any, index: int) -> Any:
    """The dense prefill backend of the step's ``index``-th dense-MHA group: a clone of the
    builder's, kept for later steps. A backend holds one prepared set of prefills
    (``prepare_metadata``), so each dense group of a step needs its own."""
    pool: list[Any] = builder.group_prefill_backends
    while len(pool) <= index:
        pool.append(mha().clone_prefill_backend(builder))
    return pool[index]


# -- the impl, every layer ------------------------------------------------------------------------


def workspace_fits(prefill: Any) -> bool:
    """The impl's ``masked_mha_workspace_fits``: yes for a step the builder planned in groups
    that fit; stock's answer otherwise."""
    if plan_of(prefill) is not None:
        return True
    return mha().stock_masked_mha_workspace_fits(prefill)


def forward(impl: Any, partial: PartialPrefill, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
            kv_cache: torch.Tensor, k_scale: torch.Tensor, output: torch.Tensor) -> None:
    """The step's prefill tokens (``forward_mha``'s inputs), group by group into their rows of
    ``output``: an MHA group through stock's ``forward_mha`` on its own metadata, a sparse-MQA
    group through the layer's sparse-MQA path for just its rows. Where a group cannot run (any
    error: after start-up nothing raises), every prefill token runs on sparse MQA, as stock runs
    the step, logged once per reason and counted."""
    try:
        run_groups(impl, partial, q, kv_c_normed, k_pe, kv_cache, k_scale, output)
    except fallback.CAUGHT as exc:
        left_to_vllm(f"the layer's masked-MHA groups could not run ({type(exc).__name__})", fallback.describe(exc))
        whole = partial.stock
        mha().sparse_mqa_rows(impl, q, kv_cache, whole.topk_rows, whole.metadata, output)


left: collections.Counter[str] = collections.Counter()
"""Steps (builder) and layer calls (impl) whose masked-MHA prefills were left to vLLM's choice, by
reason."""


def left_to_vllm(reason: str, detail: str) -> None:
    """A step's masked-MHA prefills left to vLLM's own choice (a BF16 cache's prefill, which the
    scratch budget does not cover), said once per reason and counted."""
    left[reason] += 1
    log.once(logging.WARNING, "mla-planner: a step's prefills run as vLLM chooses: %s: %s (said once per reason)",
             reason, detail)
    logger.debug("mla-planner layer: vLLM's masked-MHA choice (%s)", reason)


def run_groups(impl: Any, partial: PartialPrefill, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
               kv_cache: torch.Tensor, k_scale: torch.Tensor, output: torch.Tensor) -> None:
    for run in partial.runs:
        rows = run.rows
        if run.path == "sparse_mqa":
            mha().sparse_mqa_rows(impl, q[rows], kv_cache, run.topk_rows, run.metadata, output[rows])
        else:
            FlashMLASparseImpl.forward_mha(impl, q[rows], kv_c_normed[rows], k_pe[rows], kv_cache, run.metadata,
                                           k_scale, output[rows])
