"""vLLM 0.26: the backend's view of this release (:class:`..Release`), and the base that later
releases' modules subclass, overriding what changed.

``F`` = ``vllm/v1/attention/backends/mla/flashmla_sparse.py`` of the 0.26.0 wheel. What this
release has and has not:

* the FP8 forwards return ``out`` (no LSE);
* ``_build_fp8_mixed_decode_prefill`` takes the step's common metadata;
* the impl reserves no workspace: the separate path's BF16 gather workspace is the impl's own
  ``prefill_bf16_workspace``, and the backend's reservation holds the whole budget;
* the cache's blocks are the FP8 kernels' 64-row pages, so index translation takes no block stride;
* ``get_prefill_workspace_size`` takes ``max_model_len`` (a factor of 5);
* FlashMLA's SM90 sparse prefill kernel runs 64 and 128 heads only; vLLM pads the prefill heads by
  its own rule (64 on Hopper, 128 on Blackwell: the planner's default);
* no masked-MHA prefill, and the builder fixes no route (no HiSparse, no decode context parallelism
  in the sparse builder);
* ``CommonAttentionMetadata.unpadded`` (what the MTP draft gets after a target step padded for a
  full CUDA graph) drops ``seq_lens_cpu_upper_bound`` but keeps ``_seq_lens_cpu``, the runner's
  same CPU array (gpu_model_runner.py:2343-2344, 2405-2407, v1/attention/backend.py:563-594);
  under async scheduling with speculative decoding it keeps none (gpu_model_runner.py:2354-2356).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import vllm.v1.attention.backends.mla.flashmla_sparse as _stock_module
import vllm.v1.attention.backends.mla.sparse_utils as _utils_module

from mla_planner.engine_model import sizing
from mla_planner.vllm_backend.releases import MaskedMha
from mla_planner.vllm_backend.workspace import WorkspaceLayout, WorkspaceViews

# Any-typed: members called through these differ in signature between releases, and mypy reads
# whichever release is installed.
stock: Any = _stock_module
utils: Any = _utils_module


class Vllm026:
    """vLLM 0.26.x, and what later releases inherit unless their module overrides it."""

    version = "0.26"
    forward_returns_lse = False
    """Whether the FP8 forwards return ``(out, lse | None)`` rather than ``out``."""
    stock_workspace = False
    """Whether the impl reserves its workspace at construction (model memory, so the KV cache leaves
    it): the backend's reservation then holds only what a launch needs beyond it."""
    prefill_padding: int | None = None
    """The head multiple vLLM pads the sparse prefill kernel's q to (its impl's ``prefill_padding``,
    set in ``__init__``, so not readable before an impl exists); ``None`` leaves the planner's
    default (64 on Hopper, 128 on Blackwell)."""
    native_prefill_kernels = False
    """Whether FlashMLA runs the SM90 sparse prefill kernel at 16 and 32 heads unpadded, so that a
    plan made for native prefill heads can run."""
    masked_mha: MaskedMha | None = None
    """Masked-MHA prefill, where the release has it."""

    def forward_result(self, out: torch.Tensor) -> Any:
        """What the FP8 forwards return for an output of this backend (which needs no LSE: the
        backend runs no plan where vLLM wants one, see :meth:`stock_route_reason`)."""
        return (out, None) if self.forward_returns_lse else out

    def stock_route_reason(self, vllm_config: Any) -> str | None:
        """Why this engine's steps must keep vLLM's own route and code, or ``None``."""
        return None

    def prefills_run_dense(self, metadata: Any) -> bool:
        """vLLM's own verdict, from a step's metadata, that its prefills run dense MHA (every
        prefill sequence within top-k tokens), so that only its decodes reach the sparse kernels.
        Whether a dense prefill backend exists, or ``sparse_mla_force_mqa`` overrides it, is the
        caller's (``StepConfig.force_mqa``). Here the layer decides from the metadata's longest
        prefill sequence and top-k (mla_attention.py:756-765)."""
        return bool(metadata.num_prefills > 0 and metadata.prefill_max_seq_len <= metadata.topk_tokens)

    def build_fp8_mixed(self, builder: Any, common: Any) -> Any:
        """vLLM's mixed-batch FP8 metadata for a step."""
        return builder._build_fp8_mixed_decode_prefill(common)

    def build_fp8_separate(self, builder: Any, common: Any, metadata: Any) -> Any:
        """vLLM's separate-route FP8 metadata for a step."""
        return builder._build_fp8_separate_prefill_decode(common, metadata)

    def dense_prefill_backend(self, builder: Any) -> Any:
        """The builder's dense prefill backend (``None``: there is none, so no prefill runs dense)."""
        return getattr(builder, "_prefill_backend", None)

    def stock_fp8_forward(self, impl: Any, mixed: bool, q: torch.Tensor, kv_cache: torch.Tensor,
                          topk_indices: torch.Tensor, metadata: Any) -> Any:
        """vLLM's own FP8 forward of a step on the mixed or the separate route."""
        if mixed:
            return stock.FlashMLASparseImpl._forward_fp8_kv_mixed_batch(impl, q, kv_cache, topk_indices, metadata)
        return stock.FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode(impl, q, kv_cache, topk_indices,
                                                                                metadata)

    def model_topk(self, vllm_config: Any) -> int:
        """The model's top-k, read where this release's sparse-MLA layer reads it
        (``hf_config.index_topk``; vLLM 0.26's own sparse-MLA tests replace ``hf_text_config``
        with a namespace that has no ``index_topk``)."""
        return int(vllm_config.model_config.hf_config.index_topk)

    def prefill_workspace_rows(self, vllm_config: Any) -> int:
        """Rows of vLLM's BF16 gather workspace (its ``split_prefill_chunks`` limit)."""
        return int(stock.get_prefill_workspace_size(vllm_config.model_config.max_model_len))

    def split_indexer_prefill_chunks(self) -> Any:
        """vLLM's indexer prefill chunking, for the planner's equivalence tests."""
        from vllm.v1.attention.backends.mla import indexer as indexer_module

        indexer: Any = indexer_module
        return indexer.split_indexer_prefill_chunks

    def fp8_kv_pages(self, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int | None]:
        """The cache as the FP8 kernels' 64-token pages, and the rows per block when a block spans
        several pages (``None``: blocks are the pages)."""
        return kv_cache, None

    def convert_indices(self, req_id: torch.Tensor, block_table: torch.Tensor, topk: torch.Tensor, *,
                        block_size: int, block_stride_rows: int | None, **workspace: Any) -> Any:
        """vLLM's Triton translation of request-relative top-k positions (``workspace``: its
        prefill-workspace arguments)."""
        assert block_stride_rows is None, "this release has 64-row blocks only"
        return utils.triton_convert_req_index_to_global_index(
            req_id, block_table, topk, BLOCK_SIZE=block_size, NUM_TOPK_TOKENS=topk.shape[1], **workspace,
        )

    def fill_group_topk(self, impl: Any, topk_indices: torch.Tensor, metadata: Any, kv_cache: torch.Tensor) -> None:
        """Before a plan runs a decode-only layer call of the first layer of an index group that
        other layers share: fill the group's converted top-k slots as stock's first layer does.
        This release has no index groups."""

    def decode_threshold(self, vllm_config: Any, num_heads: int, arch: str) -> int:
        """The longest request the FlashMLA sparse builder counts as a decode: its table by heads
        per rank and architecture, raised to a speculative verification's length
        (``_init_reorder_batch_threshold``, v1/attention/backend.py:651). tests/test_vllm_backend.py
        holds it against the builder's own."""
        spec = vllm_config.speculative_config
        speculative = spec is not None and spec.num_speculative_tokens is not None
        return sizing.decode_threshold(num_heads, arch, self.verification_len(vllm_config) if speculative else None)

    def verification_len(self, vllm_config: Any) -> int:
        """The query tokens of a speculative verification, as vLLM raises its decode threshold to them
        (this release's V1 model runner appends a mask slot per draft for parallel drafting)."""
        spec = vllm_config.speculative_config
        return sizing.verification_len(int(spec.num_speculative_tokens), bool(spec.parallel_drafting))

    def with_cpu_seq_lens(self, common: Any) -> Any:
        """``common`` with its CPU sequence lengths (``seq_lens_cpu_upper_bound``: exact for
        prefills, an upper bound for speculative decodes), which planning and vLLM's own
        separate-route build read: where the MTP draft's metadata after a padded target step lacks
        them but keeps ``_seq_lens_cpu``, a copy with it filled in; ``common`` itself where it has
        them, or has neither."""
        exact = getattr(common, "_seq_lens_cpu", None)
        if common.seq_lens_cpu_upper_bound is not None or exact is None:
            return common
        return dataclasses.replace(common, seq_lens_cpu_upper_bound=exact)

    def release_from_sleep_mode_pool(self, address: int) -> bool:
        """Unmap the free segment at ``address`` from vLLM's CuMem allocator, where one holds it.

        Under sleep mode (``--enable-sleep-mode``) vLLM builds the model in a memory pool of its
        own (``use_memory_pool(tag="weights")``, v1/worker/gpu_worker.py:424-431), and so the
        reservation. Freed, its segment stays mapped there: PyTorch's ``empty_cache()`` leaves a
        pluggable allocator's live pool alone, and vLLM releases a pool's free segments only when
        its context exits or the tag is entered again. This does that for the one segment: nothing
        allocates from the model's pool after loading. Returns whether it unmapped one; never
        imports the allocator (vLLM has, where it runs)."""
        cumem: Any = sys.modules.get("vllm.device_allocator.cumem")
        allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
        if allocator is None:
            return False
        for entry in list(allocator.allocator_and_pools.values()):
            for pool, _ in entry if isinstance(entry, list) else [entry]:  # later releases keep a list per tag
                for segment in pool.snapshot():
                    start = segment["address"]
                    if not start <= address < start + segment["total_size"]:
                        continue
                    data = allocator.pointer_to_data.get(start)
                    if segment["allocated_size"] or data is None or data.is_asleep:
                        return False  # shared with a live block, or already off the GPU
                    cumem.unmap_and_release(allocator._python_free_callback(start))
                    return True
        return False

    def workspace_padded_heads(self, vllm_config: Any, num_heads: int) -> int | None:
        """Heads of the impl's padded-q and kernel-output workspace views (``None``: it has none)."""
        return None

    def workspace_layout(self, impl: Any) -> WorkspaceLayout | None:
        """The impl's workspace layout (``None``: it reserves none)."""
        return None

    def workspace_views(self, impl: Any, memo: dict[Any, WorkspaceViews] | None = None) -> WorkspaceViews:
        """This call's workspace: the impl's own gather workspace alone."""
        return WorkspaceViews(None, None, getattr(impl, "prefill_bf16_workspace", None))


RELEASE = Vllm026()
