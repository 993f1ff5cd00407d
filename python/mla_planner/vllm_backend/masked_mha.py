"""vLLM 0.33's masked-MHA prefill, partial instead of all-or-nothing (imported on vLLM 0.33 only:
``vllm_api.MASKED_MHA``).

On SM100 with FA4 and a non-quantized KV cache, vLLM 0.33 runs long prefills as MHA under a
bit-packed top-k mask (``F`` = ``vllm/model_executor/layers/attention/sparse_mla_attention.py``,
``L`` = ``vllm/model_executor/layers/attention/mla_attention.py``). The layer decides once per step
for the whole prefill set (``MLAAttention._use_sparse_mha``, L:1215-1240): masked MHA if vLLM's
speed table says so and ``impl.masked_mha_workspace_fits(prefill)`` (F:896-919) finds that the set's
mask fits the 128 MiB workspace (``GLOBAL_TOPK_MASK_MAX_BYTES``, F:67); one prefill too many and
every prefill token of the step goes to sparse MQA (L:990-994).

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

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import vllm.model_executor.layers.attention.mla_attention as _mla_module
import vllm.model_executor.layers.attention.sparse_mla_attention as _sparse_mla_module
from vllm import _custom_ops as ops

import mla_planner
from mla_planner.vllm_backend import log, vllm_api
from mla_planner.vllm_backend.log import logger
from mla_planner.vllm_backend.vllm_api import FlashMLASparseBackend, FlashMLASparseImpl

# Any-typed: these modules' masked-MHA members are vLLM 0.33's only (mypy also reads 0.26).
mla: Any = _mla_module
sparse_mla: Any = _sparse_mla_module


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


def layer_takes_masked_mha(builder: Any, metadata: Any) -> bool:
    """``MLAAttention._use_sparse_mha``'s masked-MHA clause for this step, all but its last test
    (the workspace fit), from the builder's side: masked MHA available (the builder's mask
    workspace exists), no HiSparse, no DCP, not forced to MQA, not dense MHA already, and vLLM's
    speed table (``_use_masked_mha``, L:1872) choosing it for the step's longest query and
    sequence. The backend reports ``FLASHMLA_SPARSE``'s name, as the layer asks it."""
    prefill = metadata.prefill
    config = builder.vllm_config
    attention = config.attention_config
    if (prefill is None or getattr(builder, "topk_mask_workspace", None) is None or prefill.use_dense_mha
            or attention.hisparse_config is not None or attention.sparse_mla_force_mqa
            or builder.dcp_world_size > 1):
        return False
    dims = builder.mla_dims
    return bool(mla._use_masked_mha(
        backend_name=FlashMLASparseBackend.get_name(),
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        qk_head_dim=dims.qk_nope_head_dim + dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        query_len=prefill.max_query_len,
        seq_len=metadata.prefill_max_seq_len,
        has_context=prefill.chunked_context is not None,
    ))


def stock_fits(prefill: Any) -> bool:
    """vLLM's whole-set fit test (``masked_mha_workspace_fits``, F:896-919) without its warning
    that the step falls back to sparse MQA (here it may not)."""
    chunked = prefill.chunked_context
    return bool(sparse_mla._masked_mha_workspace_fits(
        batch_size=len(prefill.query_lens_cpu),
        max_query_len=prefill.max_query_len,
        max_context_chunk_seq_len=0 if chunked is None else max(chunk.max_seq_len for chunk in chunked.chunks),
        workspace_numel=prefill.topk_mask_workspace.numel(),
    ))


def partial_prefill(builder: Any, metadata: Any, common: Any) -> PartialPrefill | None:
    """The step's :class:`PartialPrefill` (see :func:`attach_plan`)."""
    if not layer_takes_masked_mha(builder, metadata):
        return None
    prefill = metadata.prefill
    if stock_fits(prefill):
        return None
    decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    query_lens = prefill.query_lens_cpu.numpy().astype(np.int64)
    seq_lens = common.seq_lens_cpu_upper_bound[decodes : decodes + num_prefills].numpy().astype(np.int64)
    workspace = prefill.topk_mask_workspace
    # The planner's fit test bounds a context chunk's keys by the chunked-context workspace's rows,
    # never below vLLM's chunks: a group it passes passes vLLM's own test (F:84) and
    # _run_masked_mha's (F:1021-1027).
    groups = mla_planner.plan_prefill_groups(
        query_lens, seq_lens - query_lens, topk=metadata.topk_tokens,
        workspace_bytes=workspace.numel() * workspace.element_size(),
        context_chunk_rows=builder.chunked_prefill_workspace_size,
    )
    paths = groups.paths
    if len(paths) < 2:
        return None  # one group: stock's route for the whole set (sparse MQA, as stock found)
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    starts = (qsl[decodes : decodes + num_prefills + 1] - qsl[decodes]).tolist()
    runs = []
    dense = 0
    for (r0, r1), path in zip(groups.requests.tolist(), paths):
        t0, t1 = starts[r0], starts[r1]
        top0 = metadata.num_decode_tokens + t0
        topk_rows = slice(top0, top0 + t1 - t0)
        if path == "sparse_mqa":
            narrowed = dataclasses.replace(
                metadata, prefill=None, num_decodes=0, num_decode_tokens=0, num_prefills=r1 - r0,
                num_actual_tokens=t1 - t0, req_id_per_token=metadata.req_id_per_token[topk_rows],
            )
        else:
            backend = None
            if path == "dense_mha":
                backend = group_prefill_backend(builder, dense)
                dense += 1
            group = group_prefill(builder, metadata, common, r0, r1, backend)
            narrowed = dataclasses.replace(
                metadata, prefill=group, num_prefills=r1 - r0, num_decode_tokens=top0,
                prefill_max_seq_len=int(seq_lens[r0:r1].max()),
            )
        runs.append(GroupRun(path, (r0, r1), slice(t0, t1), topk_rows, narrowed))
    return PartialPrefill(groups, tuple(runs))


def group_prefill_backend(builder: Any, index: int) -> Any:
    """The dense prefill backend of the step's ``index``-th dense-MHA group: a clone of the
    builder's (vLLM's own ``clone()``), kept for later steps. A backend holds one prepared set of
    prefills (``prepare_metadata``), so each dense group of a step needs its own."""
    pool: list[Any] = builder.group_prefill_backends
    while len(pool) <= index:
        pool.append(builder._prefill_backend.clone())
    return pool[index]


def group_prefill(builder: Any, metadata: Any, common: Any, r0: int, r1: int, backend: Any) -> Any:
    """Prefill metadata for the step's prefills ``[r0, r1)`` alone, as stock's ``build`` makes it
    for a step whose prefills they are (F:398-418): their block table and query starts, their
    chunked context by the builder's own method, and for a dense group its prefill backend,
    prepared for it. A masked group's has no prefill backend: the masked path uses none."""
    prefill = metadata.prefill
    query_lens = prefill.query_lens_cpu[r0:r1]
    group = sparse_mla.SparseMLAPrefillMetadata(
        block_table=prefill.block_table[r0:r1],
        query_start_loc=prefill.query_start_loc[r0 : r1 + 1] - prefill.query_start_loc[r0],
        max_query_len=int(query_lens.max()),
        query_lens_cpu=query_lens,
        chunked_context=builder._build_chunked_context_fields(common, metadata.num_decodes + r0, r1 - r0, query_lens),
        q_data_type=prefill.q_data_type,
        output_dtype=prefill.output_dtype,
        prefill_backend=backend,
        use_dense_mha=backend is not None,
        topk_mask_workspace=prefill.topk_mask_workspace,
    )
    if backend is not None:
        backend.prepare_metadata(group)
    return group


# -- the impl, every layer ------------------------------------------------------------------------


def workspace_fits(prefill: Any) -> bool:
    """The impl's ``masked_mha_workspace_fits``: yes for a step the builder planned in groups
    that fit; stock's answer otherwise."""
    if plan_of(prefill) is not None:
        return True
    return bool(vllm_api.stock.FlashMLASparseImpl.masked_mha_workspace_fits(prefill))


def forward(impl: Any, partial: PartialPrefill, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
            kv_cache: torch.Tensor, k_scale: torch.Tensor, output: torch.Tensor) -> None:
    """The step's prefill tokens (``forward_mha``'s inputs), group by group into their rows of
    ``output``."""
    layer = None
    for run in partial.runs:
        rows = run.rows
        if run.path == "sparse_mqa":
            layer = layer or attention_layer(impl)
            sparse_mqa(impl, layer, q[rows], kv_cache, run, output[rows])
        else:
            FlashMLASparseImpl.forward_mha(impl, q[rows], kv_c_normed[rows], k_pe[rows], kv_cache, run.metadata,
                                           k_scale, output[rows])


def attention_layer(impl: Any) -> Any:
    """The ``MLAAttention`` layer whose impl ``impl`` is, found once in the forward context's layers
    (vLLM's ``static_forward_context``, where every layer registers itself): its absorbed weights
    run the sparse-MQA rows, as they do in the layer's own decode path."""
    layer = impl.mla_layer
    if layer is None:
        from vllm.forward_context import get_forward_context

        found = [layer for layer in get_forward_context().no_compile_layers.values()
                 if getattr(layer, "impl", None) is impl]
        if len(found) != 1:
            raise RuntimeError(f"mla-planner: {len(found)} layers have this impl in vLLM's forward context, not one")
        layer = impl.mla_layer = found[0]
        # The decode path below is the layer's for a BF16 cache on CUDA: no head padding, no
        # ROCm or CPU weight kernels (masked MHA runs on SM100 only).
        unsupported = [name for name in ("q_pad_num_heads", "is_aiter_triton_fp4_bmm_enabled",
                                         "is_aiter_triton_fp8_bmm_enabled", "is_amx_bmm_enabled")
                       if getattr(layer, name, None)]
        if unsupported:
            raise RuntimeError(f"mla-planner: masked MHA's sparse-MQA rows do not support the layer's {unsupported}")
    return layer


def sparse_mqa(impl: Any, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, run: GroupRun,
               out: torch.Tensor) -> None:
    """A group's rows on sparse MQA, as the layer runs every token of a step that does not fit:
    q absorbed by ``W_UK_T`` (L:1104-1105), concatenated with its rope part in the impl's
    ``q_concat`` workspace (``FlashMLASparseImpl.forward_mqa``'s BF16 branch), stock's BF16 sparse
    kernel call on the group's rows of the top-k buffer, and the ``W_UV`` up-projection into the
    group's output rows (``_v_up_proj``)."""
    n, heads = q.shape[0], impl.num_heads
    q_nope, q_pe = torch.split(q, [impl.qk_nope_head_dim, impl.qk_rope_head_dim], dim=-1)
    ql_nope = q_nope.new_empty((n, heads, impl.kv_lora_rank))
    torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T, out=ql_nope.transpose(0, 1))
    q_concat = vllm_api.workspace_views(impl).q_concat
    assert q_concat is not None
    q_mqa = q_concat[:n]
    if q_pe.shape[-1] == 0:  # NoPE: no rope part to concatenate (stock's branch)
        q_mqa[:, :heads, : impl.kv_lora_rank].copy_(ql_nope)
        if impl.q_head_size > impl.kv_lora_rank:
            q_mqa[..., impl.kv_lora_rank :].zero_()
    else:
        ops.concat_mla_q(ql_nope, q_pe, q_mqa)
    topk = impl.topk_indices_buffer[run.topk_rows]
    attn_out, _lse = impl._forward_bf16_kv(q_mqa, kv_cache, topk, run.metadata, heads)
    layer._v_up_proj(attn_out, out=out)
