"""FlashMLA sparse attention for vLLM 0.26 that runs each step by mla-planner's plan.

Subclasses vLLM's ``FlashMLASparse*`` classes and changes only what the plan changes:

* the builder plans once per step, on the CPU, from metadata it already has, and attaches the
  plan to the step's metadata (shared by every layer); with a cost profile measured on this
  machine it also picks the faster FP8 route for the step (:mod:`mla_planner.routing`);
* FP8 mixed-batch steps with prefill tokens run launch by launch through
  :class:`~mla_planner.executor.mixed_batch.MixedBatchExecutor`, each launch translating its own
  top-k indices, within the scratch budget and the kernel's int32 limit;
* FP8 separate-path steps with prefill tokens run each gathered chunk's prefill-kernel calls in
  pieces of at most ``prefill_launch_tokens`` tokens, translating indices per piece, into one
  padded q and one kernel output reused by every piece (:class:`PaddedPrefill`);
* BF16-KV steps and decode-only steps run stock code.

The budget is reserved from vLLM's KV-cache sizing by :mod:`.reservation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, cast

import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
    get_prefill_workspace_size,
)
from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index
from vllm.v1.attention.backends.utils import reshape_attn_output_for_spec_decode, reshape_query_for_spec_decode
from vllm.v1.attention.ops.flashmla import flash_mla_sparse_fwd  # type: ignore[attr-defined]  # a re-export
from vllm.v1.kv_cache_interface import AttentionSpec

import mla_planner
from mla_planner import routing
from mla_planner.executor.mixed_batch import ALLOCATOR_RESERVE_BYTES, MixedBatchExecutor
from mla_planner.executor.providers import KernelProvider, VllmProvider
from mla_planner.vllm_backend import reservation
from mla_planner.vllm_backend.settings import read_settings

# Under vLLM's logger, so the lines come out with vLLM's format and VLLM_LOGGING_LEVEL.
logger = init_logger("vllm.mla_planner")

FP8_KV = "fp8_ds_mla"


def kernel_provider() -> KernelProvider:
    """The mixed-batch executor's kernels: vLLM's own FlashMLA build. Tests put a recording
    fake here."""
    return VllmProvider()


def device_arch() -> str:
    return "sm100" if current_platform.is_device_capability_family(100) else "sm90"


def step_mode(num_heads: int) -> str:
    return mla_planner.step_mode(num_heads, kv_dtype="fp8")


class MixedBatchStep:
    """One step's mixed-batch launches, shared by its layers: a plan per token count the
    layers ask for (the whole batch, or only its decodes when the prefills run dense MHA), and
    the FlashMLA schedules of each plan, one per launch length."""

    def __init__(self, executor: MixedBatchExecutor, budget_bytes: int, topk: int) -> None:
        self._executor = executor
        self._budget_bytes = budget_bytes
        self._topk = topk
        self._plans: dict[int, mla_planner.MixedBatchPlan] = {}
        self._schedules: dict[int, dict[int, Any]] = {}

    def plan(self, num_tokens: int) -> mla_planner.MixedBatchPlan:
        if num_tokens not in self._plans:
            self._plans[num_tokens] = self._executor.plan(num_tokens, self._budget_bytes, topk=self._topk)
        return self._plans[num_tokens]

    def schedules(self, num_tokens: int) -> dict[int, Any]:
        return self._schedules.setdefault(num_tokens, {})


@dataclasses.dataclass
class PlannedFlashMLASparseMetadata(FlashMLASparseMetadata):
    mixed_batch: MixedBatchStep | None = None
    """Mixed-batch FP8 steps: the step's launches."""
    prefill_launch_tokens: int = 0
    """Separate-path FP8 steps: the most prefill tokens one prefill-kernel call may take."""


class PlannedFlashMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    metadata_cls = PlannedFlashMLASparseMetadata

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        settings = read_settings()
        self.scratch_budget_bytes = settings.scratch_bytes
        # What the launches themselves may take: the executor holds back a little for the allocator.
        usable_bytes = settings.scratch_bytes - ALLOCATOR_RESERVE_BYTES
        self.arch = arch = device_arch()
        self.num_sms = num_compute_units(device.index)
        self.mixed_executor = MixedBatchExecutor(
            kernel_provider(),
            self.num_heads,
            arch=arch,
            num_sms=self.num_sms,
            translates_indices=True,
            align_waves=True,
        )
        # Fails at start-up, not mid-serving, when the budget cannot hold one token.
        self.prefill_launch_tokens, _ = mla_planner.prefill_launch_tokens(
            self.num_heads,
            budget_bytes=usable_bytes,
            arch=arch,
            topk=self.topk_tokens,
            translated_indices=True,
        )
        # Short prefills run dense MHA unless vLLM is told otherwise or has no prefill backend;
        # then every prefill token reaches this backend, and the routes must price them.
        self.force_mqa = bool(vllm_config.attention_config.sparse_mla_force_mqa) or self._prefill_backend is None
        self.cost_model = load_cost_model(settings.cost_profile, arch, self.num_heads, self.num_sms, self.topk_tokens)
        self.route_budget_bytes = usable_bytes
        # Once per process, like the budget: which rule routes FP8 steps.
        logger.info_once("mla-planner: FP8 steps routed by %s",
                         "the cost profile" if self.cost_model is not None
                         else f"{routing.VLLM_RULE}: {step_mode(self.num_heads)}")

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PlannedFlashMLASparseMetadata:
        # The first step comes after vLLM has sized and allocated the KV cache.
        if reservation.release():
            logger.info("mla-planner: scratch reservation of %d MiB handed to the kernels", self.scratch_budget_bytes >> 20)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        assert isinstance(metadata, PlannedFlashMLASparseMetadata)
        if not self.use_fp8_kv_cache or metadata.num_prefills == 0:
            return metadata
        if self.cost_model is not None:
            self._route(metadata, common_attn_metadata)
        if metadata.fp8_use_mixed_batch:
            step = MixedBatchStep(self.mixed_executor, self.scratch_budget_bytes, self.topk_tokens)
            plan = step.plan(metadata.num_actual_tokens)
            metadata.mixed_batch = step
            logger.debug("mla-planner step: %d tokens, mixed batch, %d launches of %s tokens, peak %d B, bound %s",
                         metadata.num_actual_tokens, len(plan), plan.distinct_lengths, plan.peak_bytes, plan.bound)
        else:
            metadata.prefill_launch_tokens = self.prefill_launch_tokens
            logger.debug("mla-planner step: %d tokens, separate prefill/decode, prefill launches of <= %d tokens",
                         metadata.num_actual_tokens, self.prefill_launch_tokens)
        return metadata

    def _route(self, metadata: PlannedFlashMLASparseMetadata, common: CommonAttentionMetadata) -> None:
        """Put the step on the route the cost model predicts faster, rebuilding vLLM's FP8
        metadata for it when that is not the route vLLM's rule took."""
        starts = common.query_start_loc_cpu.numpy().astype("int64")
        query_lens = starts[1:] - starts[:-1]
        seq_lens = common.seq_lens_cpu_upper_bound
        assert seq_lens is not None
        context_lens = seq_lens.numpy().astype("int64")[: len(query_lens)] - query_lens
        max_model_len = self.model_config.max_model_len
        mixed = routing.choose_mixed_batch(
            self.cost_model, query_lens, context_lens, metadata.num_decodes,
            num_heads=self.num_heads, budget_bytes=self.route_budget_bytes,
            gather_workspace_rows=get_prefill_workspace_size(max_model_len),
            indexer_workspace_rows=max_model_len * 40, arch=self.arch, num_sms=self.num_sms, topk=self.topk_tokens,
            force_mqa=self.force_mqa,
        )
        if mixed != metadata.fp8_use_mixed_batch:
            metadata.fp8_use_mixed_batch = mixed
            metadata.fp8_extra_metadata = (
                self._build_fp8_mixed_decode_prefill(common)
                if mixed
                else self._build_fp8_separate_prefill_decode(common, metadata)
            )


def load_cost_model(path: str | None, arch: str, num_heads: int, num_sms: int, topk: int) -> mla_planner.CostModel | None:
    """The cost profile that applies on this machine, or ``None`` (vLLM's rule; the reason is
    logged). No GPU visible, as in tests: the machine check is skipped."""
    environment = routing.current_environment("vllm", "vllm") if torch.cuda.is_available() else None
    return routing.load_profile(path, arch=arch, environment=environment, num_heads=num_heads, num_sms=num_sms, topk=topk)


def translate_indices(
    md: FlashMLASparseMetadata,
    topk_indices: torch.Tensor,
    rows: slice,
    prefill: FlashMLASparseMetadata.FP8SeparatePrefillDecode.Prefill | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton translation of ``rows`` of request-relative top-k positions, into a fresh
    tensor for those rows only: cache slots; with ``prefill`` (the separate path), prefill rows
    become rows of their chunk's workspace (the builder made the workspace starts chunk-local),
    decode rows (request id -1) stay cache slots, and the valid counts come back too."""
    workspace: dict[str, Any] = {} if prefill is None else dict(
        HAS_PREFILL_WORKSPACE=True,
        prefill_workspace_request_ids=prefill.request_ids[rows],
        prefill_workspace_starts=prefill.workspace_starts,
        return_valid_counts=True,
    )
    return triton_convert_req_index_to_global_index(
        md.req_id_per_token[rows],
        md.block_table,
        topk_indices[rows],
        BLOCK_SIZE=md.block_size,
        NUM_TOPK_TOKENS=topk_indices.shape[1],
        **workspace,
    )


def token_pieces(tokens: slice, max_len: int) -> Iterator[slice]:
    """``tokens`` cut into the fewest pieces of at most ``max_len``, balanced."""
    start, total = tokens.start, tokens.stop - tokens.start
    n = -(-total // max_len)
    for i in range(n):
        yield slice(start + total * i // n, start + total * (i + 1) // n)


class PlannedFlashMLASparseImpl(FlashMLASparseImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mixed_executor: MixedBatchExecutor | None = None
        if self.kv_cache_dtype != FP8_KV:
            return
        settings = read_settings()
        self.mixed_executor = MixedBatchExecutor(
            kernel_provider(), self.num_heads, softmax_scale=self.softmax_scale, arch=device_arch(),
            translates_indices=True, align_waves=True,
        )
        # Model construction: vLLM counts this as model memory, so the KV cache leaves room.
        device = get_current_vllm_config().device_config.device  # resolved from "auto" by now
        if reservation.reserve(settings.scratch_bytes, torch.device(device or "cuda")):  # once per process
            logger.info("mla-planner: sparse MLA scratch budget %d MiB (%s), reserved from the KV cache; %d heads per rank",
                        settings.scratch_mb, settings.source, self.num_heads)

    def _forward_fp8_kv_mixed_batch(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
    ) -> torch.Tensor:
        step = getattr(attn_metadata, "mixed_batch", None)
        if step is None or self.mixed_executor is None:
            return super()._forward_fp8_kv_mixed_batch(q, kv_c_and_k_pe_cache, topk_indices, attn_metadata)
        num_tokens = q.shape[0]
        out = q.new_empty((num_tokens, self.num_heads, self.kv_lora_rank))

        def slots(rows: slice) -> torch.Tensor:
            return cast(torch.Tensor, translate_indices(attn_metadata, topk_indices, rows))

        self.mixed_executor.run(
            step.plan(num_tokens),
            q,
            kv_c_and_k_pe_cache.view(torch.uint8).unsqueeze(-2),
            slots,
            out,
            schedules=step.schedules(num_tokens),
        )
        return out

    def _forward_fp8_kv_separate_prefill_decode(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
    ) -> torch.Tensor:
        fp8 = attn_metadata.fp8_extra_metadata
        max_tokens = getattr(attn_metadata, "prefill_launch_tokens", 0)
        assert isinstance(fp8, FlashMLASparseMetadata.FP8SeparatePrefillDecode)
        num_tokens, num_decode_tokens = q.shape[0], fp8.num_decode_tokens
        if num_tokens == num_decode_tokens or not max_tokens:
            return super()._forward_fp8_kv_separate_prefill_decode(q, kv_c_and_k_pe_cache, topk_indices, attn_metadata)
        prefill = fp8.prefill
        assert prefill is not None

        def workspace_indices(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
            return cast(tuple[torch.Tensor, torch.Tensor], translate_indices(attn_metadata, topk_indices, rows, prefill))

        out = q.new_empty((num_tokens, self.num_heads, self.kv_lora_rank))
        if num_decode_tokens:
            decode_rows = slice(0, num_decode_tokens)
            out[decode_rows] = self._decode(q[decode_rows], kv_c_and_k_pe_cache, workspace_indices(decode_rows)[0], fp8)
        pieces = [(chunk, rows) for chunk in prefill.chunks for rows in token_pieces(chunk.tokens_slice, max_tokens)]
        prefill_call = PaddedPrefill(self, q, max(rows.stop - rows.start for _, rows in pieces))
        for i, (chunk, rows) in enumerate(pieces):
            workspace = self.prefill_bf16_workspace[: chunk.chunk_tot_seqlen]
            if i == 0 or chunk is not pieces[i - 1][0]:
                ops.cp_gather_and_upconvert_fp8_kv_cache(
                    kv_c_and_k_pe_cache, workspace, chunk.block_table, chunk.workspace_starts, len(chunk.block_table)
                )
            indices, lengths = workspace_indices(rows)
            prefill_call(q[rows], workspace, indices, lengths, out[rows])
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        slots: torch.Tensor,
        fp8: FlashMLASparseMetadata.FP8SeparatePrefillDecode,
    ) -> torch.Tensor:
        """The step's decodes in one decode-kernel call, as stock (spec-decode shapes too)."""
        assert fp8.decode is not None
        q = reshape_query_for_spec_decode(q, fp8.num_decodes)
        out, _ = self._fp8_flash_mla_kernel(
            q=q,
            kv_c_and_k_pe_cache=kv_c_and_k_pe_cache,
            topk_indices=slots.view(fp8.num_decodes, q.shape[1], -1),
            kernel_metadata=fp8.decode.kernel_metadata,
        )
        result: torch.Tensor = reshape_attn_output_for_spec_decode(out)
        return result


class PaddedPrefill:
    """The BF16 sparse prefill kernel over one step's prefill pieces, with the zero-padded q
    (heads padded to the kernel's 64 or 128) and the kernel's output allocated once for the
    longest piece and reused by every piece, instead of per call as stock does. Same bytes as
    the planner's per-launch ``prefill_scratch`` (``q_padded`` and ``out``), held for the step."""

    def __init__(self, impl: FlashMLASparseImpl, q: torch.Tensor, max_tokens: int) -> None:
        self.impl = impl
        self.num_heads = q.shape[1]
        heads = impl.prefill_padding if self.num_heads % impl.prefill_padding else self.num_heads
        self.q_padded = None if heads == self.num_heads else q.new_zeros((max_tokens, heads, q.shape[2]))
        self.out = None if heads == self.num_heads else q.new_empty((max_tokens, heads, impl.kv_lora_rank))

    def __call__(self, q: torch.Tensor, workspace: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor,
                 out: torch.Tensor) -> None:
        n = q.shape[0]
        kv = workspace.view(-1, 1, workspace.shape[-1])
        if self.q_padded is None or self.out is None:  # heads already a multiple: in place
            flash_mla_sparse_fwd(q, kv, indices.view(n, 1, -1), self.impl.softmax_scale, topk_length=lengths, out=out)
            return
        q_kernel, out_kernel = self.q_padded[:n], self.out[:n]
        q_kernel[:, : self.num_heads].copy_(q)
        flash_mla_sparse_fwd(q_kernel, kv, indices.view(n, 1, -1), self.impl.softmax_scale, topk_length=lengths,
                             out=out_kernel)
        out.copy_(out_kernel[:, : self.num_heads])


class PlannedFlashMLASparseBackend(FlashMLASparseBackend):
    @staticmethod
    def get_name() -> str:
        # vLLM gates FP8 sparse-MLA behaviour on this name (the `fp8` KV alias, Triton warm-up):
        # this backend is a drop-in for FLASHMLA_SPARSE, so it keeps the name.
        return "FLASHMLA_SPARSE"

    @staticmethod
    def get_builder_cls() -> type[PlannedFlashMLASparseMetadataBuilder]:
        return PlannedFlashMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[PlannedFlashMLASparseImpl]:
        return PlannedFlashMLASparseImpl
