"""vLLM 0.33: the backend's view of this release, as what changed since 0.26 (:mod:`.v0_26`).

``F`` = ``vllm/v1/attention/backends/mla/flashmla_sparse.py``, ``L`` =
``vllm/model_executor/layers/attention/mla_attention.py``, ``S`` =
``vllm/model_executor/layers/attention/sparse_mla_attention.py`` of the 0.33.0 wheel.

* the FP8 forwards return ``(out, lse | None)`` (F:972, F:1190);
* ``_build_fp8_mixed_decode_prefill()`` takes no argument (F:488);
* the impl reserves a workspace at construction from vLLM's workspace manager (F:793-832): the
  separate path's BF16 gather workspace is its second ``workspace_specs`` entry, served per call,
  and its padded-q and kernel-output views are what the backend's launches use;
* ``triton_convert_req_index_to_global_index`` takes ``BLOCK_STRIDE_ROWS`` (sparse_utils.py:493),
  the cache's rows per block from ``_fp8_kv_pages`` (F:136), which views a cache whose blocks are
  not 64 rows as the kernel's 64-row pages;
* ``get_prefill_workspace_size`` takes the ``VllmConfig`` (F:337: a configurable factor, 5 up to
  256K tokens, else 2);
* the prefill heads pad to 64 on Hopper and Blackwell alike, and FlashMLA's SM90 BF16 sparse
  prefill kernel also runs 16 and 32 heads unpadded;
* the builder keeps vLLM's route under HiSparse, PCP+DCP and DCP (F:442-486);
* models whose layers share one indexer's result (index groups) convert top-k once per group;
* masked-MHA prefill (SM100, FA4, a non-quantized KV cache): the layer asks the impl's
  ``masked_mha_workspace_fits`` and runs the prefills through its ``forward_mha`` (L:990-1000,
  1215-1240): :class:`MaskedMha033`;
* ``CommonAttentionMetadata.unpadded`` keeps ``seq_lens_cpu_upper_bound``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from mla_planner.engine_model import sizing
from mla_planner.vllm_backend.releases import v0_26
from mla_planner.vllm_backend.releases.v0_26 import stock, utils
from mla_planner.vllm_backend.vllm_api import PLANNED_KV, installed_version
from mla_planner.vllm_backend.workspace import Slot, WorkspaceLayout, WorkspaceViews

# Modules a layer call reads, imported once (stock's module imports them already): an import
# statement in a layer call costs the host on every call. Any-typed, as ``stock``.
_workspace: Any = importlib.import_module("vllm.v1.worker.workspace")
_ubatching: Any = importlib.import_module("vllm.v1.worker.ubatching")
_index_group: Any = importlib.import_module("vllm.v1.attention.backends.mla.index_group")
_workspace_lane: Any = getattr(_workspace, "_workspace_lane", None)
"""The context variable of the current workspace lane (private): without it a step's layers make
their workspace views each call (:meth:`Vllm033.workspace_views`), never another lane's."""

_LAYOUTS: dict[WorkspaceLayout, WorkspaceLayout] = {}
"""One instance per distinct layout, so that every layer of a model shares its layer's views."""


class Vllm033(v0_26.Vllm026):
    """vLLM 0.33.x: 0.26's view with this module's overrides."""

    version = "0.33"
    forward_returns_lse = True
    stock_workspace = True
    prefill_padding: int | None = 64
    native_prefill_kernels = True

    def __init__(self) -> None:
        self.masked_mha = MaskedMha033(self)

    def stock_route_reason(self, vllm_config: Any) -> str | None:
        """The builder fixes the route under HiSparse (host-backed cache, gathered by the index
        group) and context parallelism (PCP+DCP gathers KV shards; DCP needs the LSE of every
        token), none of which the plan's launches do (F:442-486: the builder's ``use_hisparse``,
        ``pcp_dcp_kv_gather`` and ``dcp_world_size``, from these settings)."""
        if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
            return "HiSparse"
        parallel = vllm_config.parallel_config
        dcp = getattr(parallel, "decode_context_parallel_size", 1)
        if dcp > 1 and getattr(parallel, "prefill_context_parallel_size", 1) > 1:
            return "PCP+DCP"
        if dcp > 1:
            return "DCP"
        return None

    def prefills_run_dense(self, metadata: Any) -> bool:
        """The builder records it (``prefill.use_dense_mha``, S:408-413)."""
        return metadata.prefill is not None and bool(metadata.prefill.use_dense_mha)

    def build_fp8_mixed(self, builder: Any, common: Any) -> Any:
        """Built from nothing: the scheduler initialises lazily from the query shape."""
        return builder._build_fp8_mixed_decode_prefill()

    def model_topk(self, vllm_config: Any) -> int:
        """Read where this release's sparse-MLA layer reads it: ``hf_text_config.index_topk``."""
        return int(vllm_config.model_config.hf_text_config.index_topk)

    def prefill_workspace_rows(self, vllm_config: Any) -> int:
        return int(stock.get_prefill_workspace_size(vllm_config))

    def split_indexer_prefill_chunks(self) -> Any:
        """A static method of the indexer's metadata builder here."""
        from vllm.v1.attention.backends.mla import indexer as indexer_module

        indexer: Any = indexer_module
        return indexer.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks

    def fp8_kv_pages(self, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int | None]:
        pages, stride = stock._fp8_kv_pages(kv_cache, block_size)
        return pages, stride

    def convert_indices(self, req_id: torch.Tensor, block_table: torch.Tensor, topk: torch.Tensor, *,
                        block_size: int, block_stride_rows: int | None, **workspace: Any) -> Any:
        return utils.triton_convert_req_index_to_global_index(
            req_id, block_table, topk, BLOCK_SIZE=block_size, NUM_TOPK_TOKENS=topk.shape[1],
            BLOCK_STRIDE_ROWS=block_stride_rows, **workspace,
        )

    def fill_group_topk(self, impl: Any, topk_indices: torch.Tensor, metadata: Any, kv_cache: torch.Tensor) -> None:
        """Before a plan runs a decode-only layer call of the first layer of an index group that
        other layers share: convert the step's top-k positions into the group's buffer of slots,
        as stock's first layer does (``SparseMLAIndexGroup._convert_once``, index_group.py:114).
        The plan translates per launch and converts nothing there, while a later layer of the
        group that runs vLLM's code (a layer whose plan could not run, or one on a BF16 cache)
        reads that buffer. With the valid counts and the valid slots first, as the separate
        route's and the BF16 readers take them; the mixed route's reader masks the ``-1`` slots
        wherever they are. On the current stream, so that it is ordered before the group's later
        layers."""
        group: Any = getattr(impl, "index_group", None)
        if type(group) is not _index_group.SparseMLAIndexGroup:  # none, or a HiSparse group (never planned)
            return
        rows = topk_indices.shape[0]
        if (impl.index_group_index != 0 or group.num_layers < 2 or rows != metadata.num_decode_tokens
                or rows > group.physical_topk_indices.shape[0]):
            return  # no later layer reads it; other steps' readers convert for themselves
        _, block_stride_rows = self.fp8_kv_pages(kv_cache, metadata.block_size)
        self.convert_indices(metadata.req_id_per_token[:rows], metadata.block_table, topk_indices,
                             block_size=metadata.block_size, block_stride_rows=block_stride_rows,
                             return_valid_counts=True, out=group.physical_topk_indices[:rows],
                             valid_counts_out=group.valid_topk_counts[:rows])

    def verification_len(self, vllm_config: Any) -> int:
        """vLLM's own longest decode query under speculative decoding (``max_decode_query_len``,
        v1/attention/backend.py:658)."""
        from vllm.v1.attention import backend as attention_backend

        api: Any = attention_backend
        return int(api.max_decode_query_len(vllm_config))

    def with_cpu_seq_lens(self, common: Any) -> Any:
        """``unpadded`` keeps the CPU sequence lengths here: ``common`` as it is."""
        return common

    def workspace_padded_heads(self, vllm_config: Any, num_heads: int) -> int | None:
        """The prefill padding of the heads (F:815-831), on an FP8 cache."""
        if vllm_config.cache_config.cache_dtype != PLANNED_KV:
            return None
        assert self.prefill_padding is not None
        return sizing.padded_heads(num_heads, self.prefill_padding)

    def workspace_layout(self, impl: Any) -> WorkspaceLayout | None:
        """The impl's workspace layout, read from where vLLM's ``get_simultaneous`` put each of its
        ``workspace_specs`` (F:793-832) and checked. Only ``q_concat`` where no plan runs (a BF16 or
        ``nvfp4_ds_mla`` cache, PCP+DCP: stock's code runs those steps)."""
        manager = _workspace.current_workspace_manager()
        specs = [(tuple(shape), dtype) for shape, dtype in impl.workspace_specs]
        views = manager.get_simultaneous(*specs)  # stock's construction asked for as much: no growth
        base = _byte_offset(views[0])
        slots = [Slot(_byte_offset(view) - base, shape, dtype) for view, (shape, dtype) in zip(views, specs)]
        span = slots[-1].offset + views[-1].numel() * views[-1].element_size()
        buffer = _span_of(manager, span)
        for slot, view in zip(slots, views):  # the views this layout carves are vLLM's own
            mine = slot.of(buffer)
            if (mine.shape, mine.stride(), mine.dtype, _byte_offset(mine)) != (view.shape, view.stride(), view.dtype,
                                                                              _byte_offset(view)):
                raise RuntimeError(f"mla-planner: vLLM {installed_version()}'s workspace manager placed {slot.shape} {slot.dtype} "
                                   f"elsewhere than this backend reads it; install a supported vLLM")
        if impl.kv_cache_dtype != PLANNED_KV or getattr(impl, "pcp_dcp_kv_gather", False):
            q_concat_only = WorkspaceLayout(slots[0], None, None, None, None, span)
            return _LAYOUTS.setdefault(q_concat_only, q_concat_only)
        heads, width, rank = impl.num_heads, impl.q_head_size, impl.kv_lora_rank
        padded = sizing.padded_heads(heads, impl.prefill_padding)
        expected = [((padded, width), torch.bfloat16), ((padded, rank), torch.bfloat16), ((heads, rank), torch.bfloat16)]
        gather = tuple(impl.prefill_workspace_shape)
        if len(slots) != 5 or slots[1].shape != gather or [(s.shape[1:], s.dtype) for s in slots[-3:]] != expected:
            raise RuntimeError(
                f"mla-planner: vLLM {installed_version()}'s FlashMLA sparse workspace is {impl.workspace_specs}, not the "
                f"layout this backend knows (q_concat, the gather workspace {gather}, then {expected}); install a supported vLLM"
            )
        q_concat, gather_slot, q_padded, padded_out, compact_out = slots
        layout = WorkspaceLayout(q_concat, gather_slot, q_padded, padded_out, compact_out, span)
        return _LAYOUTS.setdefault(layout, layout)

    def workspace_views(self, impl: Any, memo: dict[Any, WorkspaceViews] | None = None) -> WorkspaceViews:
        """One view of the manager's buffer, in bytes, as long as all of the impl's specs
        together, makes sure the buffer holds them all as stock's own request does; the call then
        makes only the views it uses from it: five views of vLLM's request cost the host more than
        a launch. These views may not outlive the layer call while the manager may still grow its
        buffer (another layer may grow it before vLLM locks it). Once vLLM has locked it (it
        serves), its buffers stay put, and ``memo`` (a step's, shared by its layers) keeps the
        first layer's views for the rest, by micro-batch and lane: each has a buffer of its own."""
        layout: WorkspaceLayout | None = getattr(impl, "workspace_layout", None)
        if layout is None:  # vLLM's tests' stand-in ``self``
            layout = self.workspace_layout(impl)
        assert layout is not None
        manager = _workspace.current_workspace_manager()
        if memo is None or _workspace_lane is None or not manager.is_locked():
            return WorkspaceViews(_span_of(manager, layout.span), layout)
        key = (id(layout), _ubatching.dbo_current_ubatch_id(), _workspace_lane.get())
        views = memo.get(key)
        if views is None:
            views = memo[key] = WorkspaceViews(_span_of(manager, layout.span), layout)
        return views


def _byte_offset(view: torch.Tensor) -> int:
    return int(view.storage_offset()) * view.element_size()


def _span_of(manager: Any, span: int) -> torch.Tensor:
    """The manager's buffer for this micro-batch and lane, its first ``span`` bytes: one request,
    which sizes the buffer as stock's request of every spec does."""
    buffer: torch.Tensor = manager.get_simultaneous(((span,), torch.uint8))[0]
    return buffer


def _layer_modules() -> tuple[Any, Any]:
    """The MLA layer module and its sparse-MLA part, Any-typed (mypy may read another release)."""
    return (importlib.import_module("vllm.model_executor.layers.attention.mla_attention"),
            importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention"))


SPARSE_MQA_UNSUPPORTED = ("q_pad_num_heads", "is_aiter_triton_fp4_bmm_enabled", "is_aiter_triton_fp8_bmm_enabled",
                          "is_amx_bmm_enabled")
"""Layer settings whose weight paths :meth:`MaskedMha033.sparse_mqa_rows` does not take: it runs
the layer's decode path for a BF16 cache on CUDA (no head padding, no ROCm or CPU weight kernels;
masked MHA runs on SM100 only)."""


class MaskedMha033:
    """What masked-MHA prefill asks of vLLM's layer and metadata (:mod:`..masked_mha` plans it)."""

    def __init__(self, release: Vllm033) -> None:
        self.release = release

    def layer_takes_masked_mha(self, builder: Any, metadata: Any) -> bool:
        """``MLAAttention._use_sparse_mha``'s masked-MHA clause for this step (L:1215-1240), all but
        its last test (the workspace fit), from the builder's side: masked MHA available (the
        builder's mask workspace exists), no HiSparse, no DCP, not forced to MQA, not dense MHA
        already, and vLLM's speed table (``_use_masked_mha``, L:1872) choosing it for the step's
        longest query and sequence. The backend reports ``FLASHMLA_SPARSE``'s name, as the layer
        asks it."""
        prefill = metadata.prefill
        config = builder.vllm_config
        attention = config.attention_config
        if (prefill is None or getattr(builder, "topk_mask_workspace", None) is None or prefill.use_dense_mha
                or attention.hisparse_config is not None or attention.sparse_mla_force_mqa
                or builder.dcp_world_size > 1):
            return False
        mla, _sparse = _layer_modules()
        dims = builder.mla_dims
        return bool(mla._use_masked_mha(
            backend_name=stock.FlashMLASparseBackend.get_name(),
            tensor_parallel_size=config.parallel_config.tensor_parallel_size,
            qk_head_dim=dims.qk_nope_head_dim + dims.qk_rope_head_dim,
            v_head_dim=dims.v_head_dim,
            query_len=prefill.max_query_len,
            seq_len=metadata.prefill_max_seq_len,
            has_context=prefill.chunked_context is not None,
        ))

    def masked_mha_set_fits(self, prefill: Any) -> bool:
        """vLLM's whole-set fit test (``masked_mha_workspace_fits``, S:896-919) without its warning
        that the step falls back to sparse MQA (the backend may not)."""
        _mla, sparse = _layer_modules()
        chunked = prefill.chunked_context
        return bool(sparse._masked_mha_workspace_fits(
            batch_size=len(prefill.query_lens_cpu),
            max_query_len=prefill.max_query_len,
            max_context_chunk_seq_len=0 if chunked is None else max(chunk.max_seq_len for chunk in chunked.chunks),
            workspace_numel=prefill.topk_mask_workspace.numel(),
        ))

    def stock_masked_mha_workspace_fits(self, prefill: Any) -> bool:
        """Stock's impl's answer to the layer's fit question, warning included."""
        return bool(stock.FlashMLASparseImpl.masked_mha_workspace_fits(prefill))

    def topk_mask_workspace_bytes(self, prefill: Any) -> int:
        """Bytes of the builder's top-k mask workspace (128 MiB: ``GLOBAL_TOPK_MASK_MAX_BYTES``, S:67)."""
        workspace = prefill.topk_mask_workspace
        return int(workspace.numel() * workspace.element_size())

    def clone_prefill_backend(self, builder: Any) -> Any:
        """A fresh dense prefill backend like the builder's (vLLM's own ``clone()``): one holds one
        prepared set of prefills."""
        return builder._prefill_backend.clone()

    def prefill_metadata_of(self, builder: Any, metadata: Any, common: Any, r0: int, r1: int, backend: Any) -> Any:
        """Prefill metadata for the step's prefills ``[r0, r1)`` alone, as stock's ``build`` makes
        it for a step whose prefills they are (S:398-418): their block table and query starts,
        their chunked context by the builder's own method, and for a dense group ``backend``,
        prepared for them (``None``: masked MHA, which uses none)."""
        _mla, sparse = _layer_modules()
        prefill = metadata.prefill
        query_lens = prefill.query_lens_cpu[r0:r1]
        group = sparse.SparseMLAPrefillMetadata(
            block_table=prefill.block_table[r0:r1],
            query_start_loc=prefill.query_start_loc[r0 : r1 + 1] - prefill.query_start_loc[r0],
            max_query_len=int(query_lens.max()),
            query_lens_cpu=query_lens,
            chunked_context=builder._build_chunked_context_fields(common, metadata.num_decodes + r0, r1 - r0,
                                                                  query_lens),
            q_data_type=prefill.q_data_type,
            output_dtype=prefill.output_dtype,
            prefill_backend=backend,
            use_dense_mha=backend is not None,
            topk_mask_workspace=prefill.topk_mask_workspace,
        )
        if backend is not None:
            backend.prepare_metadata(group)
        return group

    def link_sparse_mqa_layers(self, builder: Any) -> str | None:
        """Ready the builder's layers for :meth:`sparse_mqa_rows` before it plans a step's groups
        (a sparse-MQA group, and the fallback of every plan, run there): give each impl its
        ``MLAAttention`` layer (``impl.mla_layer``), so that the impl's forward needs no lookup of
        its own; or say why some layer could not run those rows. Each layer is found by name in
        vLLM's ``static_forward_context`` (where every layer registers itself, and the forward
        context's layers come from), with its impl, and none of :data:`SPARSE_MQA_UNSUPPORTED` set."""
        layers = builder.vllm_config.compilation_config.static_forward_context
        for name in builder.layer_names:
            layer = layers.get(name)
            if getattr(layer, "impl", None) is None:
                return f"layer {name} has no impl in vLLM's forward context"
            unsupported = [setting for setting in SPARSE_MQA_UNSUPPORTED if getattr(layer, setting, None)]
            if unsupported:
                return f"layer {name} sets {', '.join(unsupported)}"
            layer.impl.mla_layer = layer
        return None

    def sparse_mqa_rows(self, impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_rows: slice, metadata: Any,
                        out: torch.Tensor) -> None:
        """Prefill rows on sparse MQA, as the layer runs every token of a step whose masks do not
        fit: q absorbed by ``W_UK_T`` (L:1104-1105), concatenated with its rope part in the impl's
        ``q_concat`` workspace (``FlashMLASparseImpl.forward_mqa``'s BF16 branch), stock's BF16
        sparse kernel call on the rows' ``topk_rows`` of the top-k buffer under ``metadata``, and
        the ``W_UV`` up-projection into ``out`` (``_v_up_proj``)."""
        from vllm import _custom_ops as ops

        layer = impl.mla_layer
        if layer is None:
            raise LookupError("no MLAAttention layer linked to this impl (the builder links them before planning "
                              "sparse-MQA rows)")
        n, heads = q.shape[0], impl.num_heads
        q_nope, q_pe = torch.split(q, [impl.qk_nope_head_dim, impl.qk_rope_head_dim], dim=-1)
        ql_nope = q_nope.new_empty((n, heads, impl.kv_lora_rank))
        torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T, out=ql_nope.transpose(0, 1))
        q_mqa = self.release.workspace_views(impl).q_concat(n)
        assert q_mqa is not None
        if q_pe.shape[-1] == 0:  # NoPE: no rope part to concatenate (stock's branch)
            q_mqa[:, :heads, : impl.kv_lora_rank].copy_(ql_nope)
            if impl.q_head_size > impl.kv_lora_rank:
                q_mqa[..., impl.kv_lora_rank :].zero_()
        else:
            ops.concat_mla_q(ql_nope, q_pe, q_mqa)
        topk = impl.topk_indices_buffer[topk_rows]
        attn_out, _lse = impl._forward_bf16_kv(q_mqa, kv_cache, topk, metadata, heads)
        layer._v_up_proj(attn_out, out=out)


RELEASE = Vllm033()
