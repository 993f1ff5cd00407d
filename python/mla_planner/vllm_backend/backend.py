"""FlashMLA sparse attention for vLLM 0.26 and 0.33 that runs each step exactly as mla-planner plans it.

Subclasses vLLM's ``FlashMLASparse*`` classes and changes only what the plan changes:

* the builder holds one :class:`~mla_planner.StepConfig` for the engine (:mod:`.engine_config`)
  and, once per step with prefill tokens (or a long decode-only one, below), plans it on the CPU
  (:func:`mla_planner.routing.plan_step`: the cost model's faster FP8 route where a profile
  measured on this machine exists, vLLM's rule otherwise) and attaches the
  :class:`~mla_planner.StepPlan` to the step's metadata, shared by every layer;
* the impl runs that plan's launches, one kernel call each, and nothing else decides a launch
  boundary: mixed-batch steps through :class:`~mla_planner.executor.MixedBatchExecutor`, separate
  steps through :class:`SeparateStep` (decode batches, then each gather chunk's prefill launches);
  a plan of one launch is the one kernel call stock's forward makes for the step, so stock's
  code runs it, unchanged (:meth:`PlannedFlashMLASparseImpl.runs_stock_call`);
* decode-only steps of at most ``max_num_seqs`` tokens run stock code where that many one-token
  decodes are one launch (the builder checks once); longer ones, which vLLM 0.33's decode
  threshold (128 to 1,024 query tokens, by heads and GPU) allows, are planned like any step;
* BF16-KV steps run stock code, except, on vLLM 0.33, a step whose masked-MHA prefills do not fit
  vLLM's mask workspace together: the builder plans them in the planner's groups and the impl's
  ``forward_mha`` runs those that fit as masked MHA, group by group, and only the rest on sparse
  MQA, where stock runs them all on sparse MQA (:mod:`.masked_mha`).

What every layer of a step would derive from its plan the same way is derived once per step, by
:class:`PlannedStep`; nothing in a layer call synchronizes with the GPU.

Overrides call stock's method by its class, never through zero-argument ``super()``, and fall
back to stock's behaviour when ``self`` lacks this backend's state: vLLM's own tests call these
methods on the class with a stand-in ``self`` (tests/test_vllm_own_tests.py runs them).

Where vLLM 0.26 and 0.33 differ, the backend goes through :mod:`.vllm_api` (the version seam).
The budget is reserved from vLLM's KV-cache sizing by :mod:`.reservation`: all of it on 0.26, on 0.33
what its largest launch allocates beyond the workspace stock's impl reserves at construction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)
from vllm.v1.attention.ops.flashmla import flash_mla_sparse_fwd  # type: ignore[attr-defined]  # a re-export
from vllm.v1.kv_cache_interface import AttentionSpec

import mla_planner
from mla_planner import routing
from mla_planner.executor.mixed_batch import Launches, MixedBatchExecutor
from mla_planner.executor.providers import KernelProvider, VllmProvider
from mla_planner.vllm_backend import engine_config, reservation, vllm_api, warmup
from mla_planner.vllm_backend.settings import read_settings

if vllm_api.MASKED_MHA:  # vLLM 0.33's masked-MHA prefill; 0.26 has none and never imports it
    from mla_planner.vllm_backend import masked_mha

# Under vLLM's logger, so the lines come out with vLLM's format and VLLM_LOGGING_LEVEL.
logger = init_logger("vllm.mla_planner")

FP8_KV = vllm_api.PLANNED_KV


def kernel_provider() -> KernelProvider:
    """The kernels plans run on: vLLM's own FlashMLA build. Tests put a recording fake here."""
    return VllmProvider()


class StepLaunch(NamedTuple):
    """One launch of a step's plan, as a layer runs it."""

    rows: slice
    """Its tokens: rows of the step's sparse q."""
    kernel: str
    """``sparse_decode`` or ``sparse_prefill``."""
    batch: int
    """Its requests."""
    chunk: int
    """Its gather chunk (a prefill launch of the separate route), -1 otherwise."""


class PlannedStep:
    """One step's plan and what runs it, shared by the step's layers. What each layer would
    otherwise derive from the plan the same way is derived here, once per step: the builder
    computes what every step needs (whether the plan is stock's one call), the first layer that
    runs the plan's launches the rest (cached properties), so a step run by stock's code derives
    nothing it does not use."""

    def __init__(self, plan: mla_planner.StepPlan, config: mla_planner.StepConfig, provider: KernelProvider,
                 mixed: MixedBatchExecutor | None) -> None:
        self.plan, self.config, self.provider, self.mixed = plan, config, provider, mixed
        self.schedules: dict[Any, Any] = {}
        """FlashMLA schedules by launch shape, filled by the first layer and reused by the rest."""
        ends = plan.launches[:, 1]
        self.sparse_tokens = int(ends[-1]) if len(ends) else 0
        """The tokens the launches cover, in order from 0: the step's tokens vLLM hands the sparse
        kernels (all of them, or only the decodes where the prefills run dense MHA)."""
        # Stock pads the prefill kernel's q as vLLM does: a plan made for native prefill heads is
        # not its call, whatever its length.
        stock_heads = "sparse_prefill" not in plan.launch_kernels or plan.prefill_heads == config.prefill_padded_heads
        self.stock_call_bytes = int(plan.launch_bytes[0]) if len(ends) == 1 and stock_heads else None
        """A plan of one launch is the one kernel call stock's forward makes for the step (and its
        gather, on the separate route): the bytes the plan counts for it. ``None`` for a plan of
        several launches, or one that runs the prefill kernel at native heads, which only this
        backend's executors run."""

    @functools.cached_property
    def launches(self) -> tuple[StepLaunch, ...]:
        return tuple(StepLaunch(slice(t0, t1), kernel, r1 - r0, chunk) for (t0, t1, r0, r1, chunk), kernel
                     in zip(self.plan.launches.tolist(), self.plan.launch_kernels))

    @functools.cached_property
    def mixed_launches(self) -> Launches:
        """The mixed-batch executor's view of the plan (a mixed_batch plan's)."""
        return Launches.of(self.plan)

    @functools.cached_property
    def longest_prefill(self) -> int:
        return self.plan.longest_launch("sparse_prefill")

    @functools.cached_property
    def decode_heads(self) -> int:
        """The heads the decode kernel runs (the real ones padded to 64 or 128)."""
        return self.config.decode_heads


@dataclasses.dataclass
class PlannedFlashMLASparseMetadata(FlashMLASparseMetadata):
    planned: PlannedStep | None = None
    """FP8 steps with prefill tokens, or decodes of several tokens each: the plan the impl
    executes."""


class PlannedFlashMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    metadata_cls = PlannedFlashMLASparseMetadata

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        FlashMLASparseMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        settings = read_settings()
        self.scratch_budget_bytes = settings.scratch_bytes
        self.cost_profile = settings.cost_profile
        self.step_config = engine_config.step_config(
            vllm_config, self, device, self.scratch_budget_bytes, has_prefill_backend=self._prefill_backend is not None,
            native_prefill_heads=settings.native_prefill_heads,
        )
        self.force_mqa = self.step_config.force_mqa
        self.provider = kernel_provider()
        # Steps are planned on fp8_ds_mla only (0.33's nvfp4_ds_mla takes vLLM's FP8 path but has
        # other rows and another gather), and not where vLLM fixes the route (vllm_api).
        self.stock_reason = vllm_api.stock_route_reason(self)
        kv_dtype = vllm_config.cache_config.cache_dtype
        self.plans_steps = self.use_fp8_kv_cache and kv_dtype == FP8_KV and self.stock_reason is None
        if self.stock_reason is not None:
            logger.info_once("mla-planner: %s: every step runs vLLM's own code", self.stock_reason)
        self.mixed_executor = MixedBatchExecutor(self.provider, self.step_config) if self.plans_steps else None
        self.group_prefill_backends: list[Any] = []
        """vLLM 0.33, masked MHA: a dense prefill backend per dense-MHA group of a step (clones of
        vLLM's), kept across steps (:func:`.masked_mha.group_prefill_backend`)."""
        self.cost_model = None if settings.vllm_rule else routing.load_for_engine(self.cost_profile, self.step_config)
        if (self.cost_model is not None and not vllm_api.NATIVE_PREFILL_HEADS
                and self.cost_model.prices_native_prefill(self.step_config)):
            # It could choose a prefill kernel this vLLM's FlashMLA does not have.
            logger.warning_once("mla-planner: cost profile %s prices the prefill kernel at %d native heads, which "
                                "vLLM %s's FlashMLA does not run; routing FP8 steps by %s (calibrate under this vLLM)",
                                self.cost_profile or "(packaged)", self.step_config.num_heads, vllm_api.VLLM_VERSION,
                                routing.VLLM_RULE)
            self.cost_model = None
        # What the impls allow a stock call (they compute it alike, from stock's workspace spec:
        # its padded q's heads are vLLM's prefill padding of the rank's heads).
        launches = (largest_engine_launches(vllm_config, self.step_config.num_heads, device, self.scratch_budget_bytes,
                                            self.step_config.prefill_padded_heads)
                    if self.plans_steps and vllm_api.STOCK_WORKSPACE else None)
        self.stock_call_allowance = stock_call_allowance(launches, self.scratch_budget_bytes)
        self.stock_decode_tokens = self._stock_decode_tokens(vllm_config) if self.plans_steps else 0
        if self.plans_steps:
            # A cost profile may route a step either way; vLLM's rule takes one route.
            warmup.expect_routes({"mixed_batch", "separate_prefill_decode"} if self.cost_model is not None
                                 else {self.step_config.mode})
        # Once per process, like the budget: which rule routes FP8 steps.
        logger.info_once("mla-planner: FP8 steps routed by %s",
                         "the cost profile" if self.cost_model is not None
                         else f"{routing.VLLM_RULE}: {self.step_config.mode}")

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashMLASparseMetadata:
        # vLLM's tests call builder methods on the class with a stand-in `self` (a stock builder,
        # a namespace of the attributes stock reads): without this builder's state that is
        # stock's build, with no plan and no process-wide effect.
        if getattr(self, "step_config", None) is None:
            return FlashMLASparseMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, fast_build)
        metadata = FlashMLASparseMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, fast_build)
        assert isinstance(metadata, PlannedFlashMLASparseMetadata)
        if vllm_api.MASKED_MHA and metadata.prefill is not None:
            # Masked MHA needs a non-quantized cache: no FP8 step has a plan from both.
            masked_mha.attach_plan(self, metadata, common_attn_metadata)
        if not self.plans_steps:
            hand_over_reservation()  # stock's code runs every step: its calls may have the bytes
            return metadata
        if self.runs_stock_decodes(metadata):
            # Logged like a plan, so that a step log (tests/e2e/step_log.py) sees every FP8 step.
            logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, stock's code",
                         common_attn_metadata.num_actual_tokens, metadata.num_decode_tokens, metadata.num_prefills)
            return metadata
        # The reservation is freed for the first planned step, not at the first build: vLLM's
        # CUDA-graph memory profiling builds decode steps before it sizes the KV cache, and bytes
        # freed inside it lower its estimate, so the KV cache shrinks by less or not at all (on the
        # H200, vLLM 0.33: estimate 0.64 GiB below stock's, KV cache equal). Those steps run
        # stock's code unplanned (``runs_stock_decodes``); the first planned step comes after.
        hand_over_reservation()
        plan = self.plan(metadata, common_attn_metadata)
        mixed = self.mixed_executor if plan.mode == "mixed_batch" else None
        metadata.planned = PlannedStep(plan, self.step_config, self.provider, mixed)
        if logger.isEnabledFor(logging.DEBUG):  # the arguments are calls into the plan: none unless logged
            logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, %s, %d launches, peak %d B, "
                         "bound %s", plan.num_tokens, metadata.num_decode_tokens, metadata.num_prefills, plan.mode,
                         len(plan), plan.peak_bytes, plan.bound)
        return metadata

    def runs_stock_decodes(self, metadata: PlannedFlashMLASparseMetadata) -> bool:
        """Whether the step's sparse tokens are decodes only, no more than ``stock_decode_tokens``:
        a decode-only step, or decodes beside prefills that vLLM runs dense (a chat step with a new
        short prompt). Stock's one decode call then holds them within the budget, and the step
        runs vLLM's code with no plan: planning it would cost the builder its time and change
        nothing."""
        if metadata.num_decode_tokens > self.stock_decode_tokens:
            return False
        return metadata.num_prefills == 0 or (not self.force_mqa and vllm_api.prefills_run_dense(metadata))

    def _stock_decode_tokens(self, vllm_config: VllmConfig) -> int:
        """The decode tokens a step may hand the sparse kernels and still run stock's code unplanned:
        ``max_num_seqs`` (every step of a chat's decode phase, and the CUDA graphs vLLM captures for
        them) where every uniform decode batch of that many tokens vLLM may send -- one-token
        decodes, or fewer requests of more tokens each, up to its decode threshold (speculative
        decoding; vLLM 0.33 counts requests of up to 128 query tokens as decodes at 16 heads) -- is
        one decode launch in the budget whose bytes stock's call may allocate
        (``stock_call_allowance``); 0 where one is not. A batch's bytes grow with its query length
        as well as its token count, so one-token decodes alone do not bound them. Longer steps are
        planned like any step: vLLM 0.33's start-up warm-up sends 32,768 decode tokens through the
        kernel at once (8 GiB of accumulators in stock's one call)."""
        n = vllm_config.scheduler_config.max_num_seqs
        topk = self.step_config.topk
        longest = min(n, self.reorder_batch_threshold or 1, mla_planner.MAX_DECODE_QUERY_LEN)
        for s_q in range(1, longest + 1):
            batch = n // s_q  # the most requests of s_q tokens; fewer cost less
            try:
                plan = mla_planner.plan_step(np.full(batch, s_q, np.int64), np.full(batch, topk, np.int64), batch,
                                             self.step_config)
            except ValueError:  # not even one request of s_q tokens fits: planned, and refused, per step
                return 0
            if len(plan) != 1 or plan.peak_bytes > self.stock_call_allowance:
                return 0
        return n

    def plan(self, metadata: PlannedFlashMLASparseMetadata, common: CommonAttentionMetadata) -> mla_planner.StepPlan:
        """The step's plan, with vLLM's FP8 metadata rebuilt for its route where that is not the
        route vLLM's rule took."""
        # vLLM's int32 CPU copies as they are: the planner widens them itself, and a copy to int64
        # here cost more than the planning of a small step.
        starts = common.query_start_loc_cpu.numpy()
        query_lens = starts[1:] - starts[:-1]
        seq_lens = common.seq_lens_cpu_upper_bound
        assert seq_lens is not None
        context_lens = seq_lens.numpy()[: len(query_lens)] - query_lens
        plan = routing.plan_step(self.cost_model, query_lens, context_lens, metadata.num_decodes, self.step_config)
        mixed = plan.mode == "mixed_batch"
        if mixed != metadata.fp8_use_mixed_batch:
            metadata.fp8_use_mixed_batch = mixed
            metadata.fp8_extra_metadata = (
                vllm_api.build_fp8_mixed(self, common)
                if mixed
                else self._build_fp8_separate_prefill_decode(common, metadata)
            )
        if not mixed:
            engine_config.check_gather_chunks(plan, metadata.fp8_extra_metadata, metadata.num_decodes)
        return plan


def hand_over_reservation() -> None:
    """Free the process's scratch reservation into PyTorch's caching allocator, where the kernels'
    scratch allocations find it; once per process (:mod:`.reservation`)."""
    if reservation.release():
        logger.info("mla-planner: scratch reservation of %d MiB handed to the kernels", reservation.reserved_bytes() >> 20)


def warm_up(md: FlashMLASparseMetadata, kv_cache: torch.Tensor, topk_indices: torch.Tensor) -> None:
    """:func:`.warmup.maybe_warm_up` with this call's block table, block size and cache. A function,
    not a method: vLLM's own tests call the forwards with a stand-in ``self``."""
    _pages, block_stride_rows = vllm_api.fp8_kv_pages(kv_cache, md.block_size)
    warmup.maybe_warm_up(md.block_table, md.block_size, block_stride_rows, topk_indices.shape[1])


def translate_indices(
    md: FlashMLASparseMetadata,
    topk_indices: torch.Tensor,
    rows: slice,
    block_stride_rows: int | None,
    prefill: FlashMLASparseMetadata.FP8SeparatePrefillDecode.Prefill | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton translation of ``rows`` of request-relative top-k positions, into a fresh
    tensor for those rows only: cache slots; with ``prefill`` (the separate path), prefill rows
    become rows of their chunk's workspace (the builder made the workspace starts chunk-local),
    decode rows (request id -1) stay cache slots, and the valid counts come back too.
    ``block_stride_rows``: the cache's rows per block where a block spans several 64-row pages
    (:func:`.vllm_api.fp8_kv_pages`)."""
    workspace: dict[str, Any] = {} if prefill is None else dict(
        HAS_PREFILL_WORKSPACE=True,
        prefill_workspace_request_ids=prefill.request_ids[rows],
        prefill_workspace_starts=prefill.workspace_starts,
        return_valid_counts=True,
    )
    return cast("torch.Tensor | tuple[torch.Tensor, torch.Tensor]", vllm_api.convert_indices(
        md.req_id_per_token[rows], md.block_table, topk_indices[rows], block_size=md.block_size,
        block_stride_rows=block_stride_rows, **workspace,
    ))


def largest_engine_launches(vllm_config: VllmConfig, num_heads: int, device: torch.device, scratch_bytes: int,
                            workspace_heads: int | None) -> list[reservation.LaunchReservation]:
    """vLLM 0.33: the largest launch each FP8 route may run in this engine, whose bytes beyond
    stock's workspace the impl reserves (:func:`.reservation.largest_launches`).
    ``workspace_heads``: the heads of stock's padded q and output workspace views. With or without
    ``MLA_PLANNER_NATIVE_PREFILL_HEADS``, a cost profile may run a step at native prefill heads
    wherever this vLLM and these heads have the kernel: reserved for too."""
    config = engine_config.config_for(vllm_config, num_heads, vllm_config.model_config.hf_text_config.index_topk,
                                      True, device, scratch_bytes, has_prefill_backend=False)
    return reservation.largest_launches(config, vllm_config.scheduler_config.max_num_batched_tokens, workspace_heads,
                                        native_prefill=vllm_api.NATIVE_PREFILL_HEADS and config.native_prefill_heads_possible)


def stock_call_allowance(launches: list[reservation.LaunchReservation] | None, scratch_bytes: int) -> int:
    """The most one stock kernel call may allocate and stay within what the backend reserved. Stock
    allocates the whole call itself, padded q and kernel output too, where this backend's
    executors take those from vLLM 0.33's workspace views: on 0.33 it is what the reservation
    holds beyond the workspace (``launches``); on 0.26 the reservation holds the whole budget."""
    return scratch_bytes if launches is None else max(launch.transient_bytes for launch in launches)


class PlannedFlashMLASparseImpl(FlashMLASparseImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FlashMLASparseImpl.__init__(self, *args, **kwargs)
        if self.kv_cache_dtype != FP8_KV:
            return
        settings = read_settings()
        # On 0.33 stock's __init__ has just reserved its workspace, whose padded q and output views
        # hold those of any launch: the KV cache need leave room only for the rest.
        self.reserved_launches = self.largest_launches(settings.scratch_bytes) if vllm_api.STOCK_WORKSPACE else None
        self.stock_call_allowance = stock_call_allowance(self.reserved_launches, settings.scratch_bytes)
        # Model construction: vLLM counts this as model memory, so the KV cache leaves room. Not
        # the profile run: vLLM 0.33's DeepSeek-V3.2 layer returns there before any impl hook.
        device = get_current_vllm_config().device_config.device  # resolved from "auto" by now
        if reservation.reserve(self.stock_call_allowance, torch.device(device or "cuda")):  # once per process
            if self.reserved_launches is None:
                logger.info("mla-planner: sparse MLA scratch budget %d MiB (%s), reserved from the KV cache; "
                            "%d heads per rank", settings.scratch_mb, settings.source, self.num_heads)
            else:
                logger.info("mla-planner: sparse MLA scratch budget %d MiB (%s), %d MiB of it reserved from the KV "
                            "cache, the rest held in vLLM's workspace (largest launches: %s); %d heads per rank",
                            settings.scratch_mb, settings.source, self.stock_call_allowance >> 20,
                            ", ".join(f"{l.route}: {l.tokens} tokens, {l.transient_bytes >> 20} MiB"
                                      for l in self.reserved_launches), self.num_heads)

    reserved_launches: list[reservation.LaunchReservation] | None = None
    """vLLM 0.33, FP8 cache: the largest launch of each route, whose bytes beyond stock's workspace
    the reservation holds."""

    stock_call_allowance = 0
    """The most a one-launch plan may take and still run as stock's own call: stock allocates the
    whole launch itself (padded q and kernel output too, which this backend's executors take from
    vLLM 0.33's workspace views), so it must fit in what the reservation holds for scratch."""

    def runs_stock_call(self, step: PlannedStep, q: torch.Tensor) -> bool:
        """Whether a layer runs the step's plan as stock's own forward: the plan is one launch, the
        one kernel call stock makes for the step, and its bytes fit what was reserved. Stock's code
        then runs unchanged, with nothing re-derived from the plan per layer."""
        if q.shape[0] != step.sparse_tokens:
            raise RuntimeError(
                f"mla-planner: vLLM hands the sparse kernels {q.shape[0]} tokens, the plan covers {step.sparse_tokens}; "
                "please report this step (the planner must follow vLLM's dense/sparse prefill rule)"
            )
        return step.stock_call_bytes is not None and step.stock_call_bytes <= self.stock_call_allowance

    mla_layer: Any = None
    """vLLM 0.33, masked MHA: the ``MLAAttention`` layer of this impl, found when a step first
    runs prefills on sparse MQA inside ``forward_mha`` (:func:`.masked_mha.attention_layer`)."""

    def largest_launches(self, scratch_bytes: int) -> list[reservation.LaunchReservation]:
        vllm_config = get_current_vllm_config()
        device = torch.device(vllm_config.device_config.device or "cuda")
        return largest_engine_launches(vllm_config, self.num_heads, device, scratch_bytes,
                                       vllm_api.workspace_padded_heads(self))

    @staticmethod
    def masked_mha_workspace_fits(prefill: Any) -> bool:
        """vLLM 0.33 (0.26 has no masked MHA and never calls this): ``MLAAttention._use_sparse_mha``
        asks it last, once masked MHA is otherwise the layer's choice for the step. Yes where the
        builder planned the step's prefills in groups that fit; stock's answer otherwise."""
        return masked_mha.workspace_fits(prefill)

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        # vLLM 0.33: a step whose prefills the builder planned in masked-MHA groups runs them
        # group by group; any other (and every step on 0.26) is stock's.
        prefill = getattr(attn_metadata, "prefill", None)
        partial = masked_mha.plan_of(prefill) if vllm_api.MASKED_MHA and prefill is not None else None
        if partial is None:
            FlashMLASparseImpl.forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                                           output, output_scale)
            return
        assert output_scale is None, "masked MHA writes no quantized output (stock's masked path neither)"
        masked_mha.forward(self, partial, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, k_scale, output)

    def _forward_fp8_kv_mixed_batch(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # vllm_api: 0.33 returns (out, lse | None) and takes kernel_metadata= (its PCP+DCP decode
        # rows, which never carry a plan); 0.26 returns out.
        if warmup.pending:
            warm_up(attn_metadata, kv_c_and_k_pe_cache, topk_indices)
        step = getattr(attn_metadata, "planned", None)
        if step is None or args or kwargs.get("kernel_metadata") is not None or self.runs_stock_call(step, q):
            return FlashMLASparseImpl._forward_fp8_kv_mixed_batch(
                self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata, *args, **kwargs
            )
        assert step.mixed is not None, "a separate-route plan reached the mixed-batch path"
        out = q.new_empty((q.shape[0], self.num_heads, self.kv_lora_rank))
        pages, block_stride_rows = vllm_api.fp8_kv_pages(kv_c_and_k_pe_cache, attn_metadata.block_size)

        def slots(rows: slice) -> torch.Tensor:
            return cast(torch.Tensor, translate_indices(attn_metadata, topk_indices, rows, block_stride_rows))

        # On 0.33 the padded q and kernel output go in stock's BF16-prefill workspace views, which
        # this route never otherwise uses: the reservation counts them as served.
        views = vllm_api.workspace_views(self)
        launches, heads = step.mixed_launches, step.decode_heads
        step.mixed.softmax_scale = self.softmax_scale
        step.mixed.run_launches(launches, q, pages.view(torch.uint8).unsqueeze(-2), slots, out,
                                schedules=step.schedules,
                                q_buffer=fits(views.q_padded, (launches.longest, heads, q.shape[2]), q.dtype),
                                out_buffer=fits(views.padded_out, (launches.longest, heads, self.kv_lora_rank), q.dtype))
        return vllm_api.forward_result(out)

    def _forward_fp8_kv_separate_prefill_decode(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
    ) -> Any:
        if warmup.pending:
            warm_up(attn_metadata, kv_c_and_k_pe_cache, topk_indices)
        step = getattr(attn_metadata, "planned", None)
        if step is None or self.runs_stock_call(step, q):
            return FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode(
                self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata
            )
        fp8 = attn_metadata.fp8_extra_metadata
        assert isinstance(fp8, FlashMLASparseMetadata.FP8SeparatePrefillDecode)
        return vllm_api.forward_result(SeparateStep(self, step, attn_metadata, fp8, kv_c_and_k_pe_cache, topk_indices).run(q))


class SeparateStep:
    """A separate-route plan on one layer: each launch of the plan, in order, one kernel call --
    decode batches through the decode kernel, then for each gather chunk its gather and its prefill
    launches through the BF16 prefill kernel, indices translated per launch."""

    def __init__(self, impl: PlannedFlashMLASparseImpl, step: PlannedStep, md: FlashMLASparseMetadata,
                 fp8: FlashMLASparseMetadata.FP8SeparatePrefillDecode, kv_cache: torch.Tensor,
                 topk_indices: torch.Tensor) -> None:
        self.impl, self.step, self.md, self.fp8 = impl, step, md, fp8
        self.kv_cache, self.topk_indices = kv_cache, topk_indices
        self.pages, self.block_stride_rows = vllm_api.fp8_kv_pages(kv_cache, md.block_size)
        self.provider = step.provider

    def translate(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots and valid counts; a decode-only step has no prefill workspace, and no counts."""
        if self.fp8.prefill is None:
            return cast(torch.Tensor, translate_indices(self.md, self.topk_indices, rows, self.block_stride_rows)), None
        return cast(tuple[torch.Tensor, torch.Tensor],
                    translate_indices(self.md, self.topk_indices, rows, self.block_stride_rows, self.fp8.prefill))

    def run(self, q: torch.Tensor) -> torch.Tensor:
        # Once per layer call: on 0.33 views of the workspace manager's buffer, valid for this call.
        views = vllm_api.workspace_views(self.impl)
        assert views.gather is not None
        gather_workspace = views.gather
        out_shape = (q.shape[0], self.impl.num_heads, self.impl.kv_lora_rank)
        # 0.33's stock writes the step's output into its workspace, so it allocates none: this
        # route must not either (the budget does not count the output).
        out = view_or_new(views.compact_out, out_shape, q)
        prefill_call: PaddedPrefill | None = None  # a decode-only step has none
        gathered = -1
        for rows, kernel, batch, chunk_index in self.step.launches:
            if kernel == "sparse_decode":
                self.decode(q[rows], rows, batch, out[rows])
                continue
            assert self.fp8.prefill is not None
            if prefill_call is None:
                prefill_call = PaddedPrefill(self.impl, self.step.plan, q, self.step.longest_prefill, views)
            chunk = self.fp8.prefill.chunks[chunk_index]
            workspace = gather_workspace[: chunk.chunk_tot_seqlen]
            if chunk_index != gathered:
                ops.cp_gather_and_upconvert_fp8_kv_cache(
                    self.kv_cache, workspace, chunk.block_table, chunk.workspace_starts, len(chunk.block_table)
                )
                gathered = chunk_index
            indices, lengths = self.translate(rows)
            assert lengths is not None
            prefill_call(q[rows], workspace, indices, lengths, out[rows])
        return out

    def decode(self, q: torch.Tensor, rows: slice, batch: int, out: torch.Tensor) -> None:
        """One decode launch of ``batch`` requests of equal query length (vLLM's decodes are uniform):
        q zero-padded to the kernel's heads for this launch, as the plan's bytes count it."""
        config = self.step.config
        s_q = q.shape[0] // batch
        heads = self.step.decode_heads
        q = q.view(batch, s_q, q.shape[1], q.shape[2])
        if heads != q.shape[2]:
            padded = q.new_zeros((batch, s_q, heads, q.shape[3]))
            padded[:, :, : q.shape[2]] = q
            q = padded
        slots = self.translate(rows)[0].view(batch, s_q, -1)
        schedule = self.step.schedules.setdefault(("decode", batch, s_q), self.provider.new_decode_schedule())
        kv = self.pages.view(torch.uint8).unsqueeze(-2)
        if config.decode_writes_in_place:
            self.provider.sparse_decode(q, kv, slots, schedule, self.impl.softmax_scale, out=out.view(batch, s_q, *out.shape[1:]))
            return
        o, _lse = self.provider.sparse_decode(q, kv, slots, schedule, self.impl.softmax_scale)
        out.copy_(o[:, :, : out.shape[1]].reshape(out.shape))


def fits(view: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The first ``shape[0]`` rows of a workspace view, if it has ``shape``'s other dimensions,
    enough rows and ``dtype``; ``None`` otherwise."""
    if view is None or view.dtype != dtype or view.shape[1:] != shape[1:] or view.shape[0] < shape[0]:
        return None
    return view[: shape[0]]


def view_or_new(view: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """:func:`fits`'s view, or a new uninitialised tensor like ``like``."""
    fitted = fits(view, shape, like.dtype)
    return like.new_empty(shape) if fitted is None else fitted


class PaddedPrefill:
    """The BF16 sparse prefill kernel over one step's prefill launches, with the zero-padded q
    (heads padded as the plan says its launches run them: vLLM's padding, or none for a plan made
    for native heads) and the kernel's output allocated once for the plan's longest prefill launch
    and reused by every launch, as the plan's launch bytes count them."""

    def __init__(self, impl: FlashMLASparseImpl, plan: mla_planner.StepPlan, q: torch.Tensor, max_tokens: int,
                 views: vllm_api.WorkspaceViews) -> None:
        self.impl = impl
        self.num_heads = q.shape[1]
        # The plan's, not the engine configuration's: the cost model may price a step at native heads.
        heads = plan.prefill_heads
        in_place = plan.prefill_writes_in_place
        # On 0.33 stock reserves both in the workspace (padded to its heads): where the plan's
        # kernel heads are those, use them rather than allocate.
        self.q_padded = None
        if heads != self.num_heads:
            q_shape = (max_tokens, heads, q.shape[2])
            self.q_padded = fits(views.q_padded, q_shape, q.dtype)
            if self.q_padded is None:
                self.q_padded = q.new_zeros(q_shape)
            else:
                self.q_padded[:, self.num_heads :].zero_()
        out_shape = (max_tokens, heads, impl.kv_lora_rank)
        self.out = None if in_place else view_or_new(views.padded_out, out_shape, q)

    def __call__(self, q: torch.Tensor, workspace: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor,
                 out: torch.Tensor) -> None:
        n = q.shape[0]
        kv = workspace.view(-1, 1, workspace.shape[-1])
        if self.out is None:  # the kernel's heads are the caller's: in place
            flash_mla_sparse_fwd(q, kv, indices.view(n, 1, -1), self.impl.softmax_scale, topk_length=lengths, out=out)
            return
        q_kernel, out_kernel = q, self.out[:n]
        if self.q_padded is not None:
            q_kernel = self.q_padded[:n]
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
