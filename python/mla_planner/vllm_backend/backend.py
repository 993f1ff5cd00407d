"""FlashMLA sparse attention for vLLM that runs each step exactly as mla-planner plans it.

Subclasses vLLM's ``FlashMLASparse*`` classes and changes only what the plan changes:

* the builder reads the engine's setup (:mod:`.engine`: made once per process, the budget checked
  there at start-up) and, once per step whose sparse tokens could outgrow one launch, plans those
  tokens on the CPU -- the ones vLLM's own metadata hands the sparse kernels: decodes (CUDA-graph
  padding of length 0 and speculative decodes among them) and the prefills it does not run dense
  -- on the cost model's faster FP8 route where a profile measured here exists, vLLM's rule
  otherwise, in vLLM's own gather chunks; it attaches the :class:`PlannedStep` to the step's
  metadata, shared by every layer;
* the impl runs that plan's launches, one kernel call each, through the executors
  (:mod:`mla_planner.executor`); a plan of one launch whose bytes fit the reservation is the one
  kernel call stock's forward makes, so stock's code runs it unchanged;
* BF16-KV steps run stock code, except, where the release has masked MHA, a step whose masked-MHA
  prefills do not fit vLLM's mask workspace together (:mod:`.masked_mha`).

After start-up nothing here raises but what no bounded path can avoid: a step the planner
refuses, or a layer call that cannot run its plan (tokens not the plan's, an allocation failure in
a launch, any error before its output is returned), falls back to the bounded path
(:mod:`.fallback`), which runs the call within the reservation; the step decides once, for all
of its layers. Every step is counted (:mod:`.stats`), and the counts are said at vLLM's stats
interval.

Overrides call stock's method by its class, never through zero-argument ``super()``, and behave
as stock's where ``self`` lacks this backend's state: vLLM's own tests call these methods on the
class with a stand-in ``self`` (tests/test_vllm_own_tests.py runs them). Everything vLLM-specific
comes through :mod:`.vllm_api` (what every release has alike) and :mod:`.releases` (what differs).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import numpy as np
import torch

import mla_planner
from mla_planner import routing
from mla_planner.executor.buffers import Buffers
from mla_planner.executor.mixed_batch import Launches, MixedBatchExecutor
from mla_planner.executor.providers import KernelProvider, VllmProvider
from mla_planner.executor.separate import SeparateExecutor, SeparateLaunches
from mla_planner.vllm_backend import engine, fallback, log, masked_mha, vllm_api
from mla_planner.vllm_backend.log import logger
from mla_planner.vllm_backend.releases import release
from mla_planner.vllm_backend.reservation import Reservation
from mla_planner.vllm_backend.workspace import WorkspaceViews
from mla_planner.vllm_backend.vllm_api import (
    CommonAttentionMetadata,
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)


FP8_KV = vllm_api.PLANNED_KV


def kernel_provider() -> KernelProvider:
    """The kernels plans run on: vLLM's own FlashMLA build. Tests put a recording fake here."""
    return VllmProvider()


class PlannedStep:
    """One step's plan, shared by the step's layers: what every layer would derive from it the
    same way is derived here, once per step (the executors' launches, FlashMLA's schedules)."""

    def __init__(self, plan: mla_planner.StepPlan, config: mla_planner.StepConfig,
                 vllm_route: tuple[bool, Any] | None, served_heads: int | None = None) -> None:
        self.plan = plan
        self.reserved_peak = plan.peak_beyond_workspace(config.decode_heads, served_heads)
        """The largest launch's bytes beyond vLLM's workspace (``served_heads``: the heads of its
        padded-q and output views, where the release has them): what of the plan's peak the reservation holds."""
        self.schedules: dict[Any, Any] = {}
        """FlashMLA schedules by launch shape, filled by the first layer and reused by the rest."""
        self.workspace: dict[Any, Any] = {}
        """The release's workspace views, made by the first layer and reused by the rest once vLLM
        serves (the release's ``workspace_views``)."""
        self.launches = launches = tuple(plan)
        """The plan's launches, iterated once per step."""
        self.sparse_tokens = launches[-1].tokens.stop if launches else 0
        """The tokens the launches cover, in order from 0: those vLLM hands the sparse kernels."""
        # Stock pads the prefill kernel's q as vLLM does: a plan made for native prefill heads is
        # not its call, whatever its length.
        stock_call = len(launches) == 1 and (launches[0].kernel != "sparse_prefill"
                                              or plan.prefill_heads == config.prefill_padded_heads)
        self.stock_call_bytes = launches[0].bytes if stock_call else None
        """A plan of one launch is the one kernel call stock's forward makes for the step (and its
        gather, on the separate route): the bytes the plan counts for it. ``None`` otherwise."""
        # Derived here, in the builder, where a failure still leaves the step to vLLM's code.
        mixed = plan.mode == "mixed_batch"
        self.mixed_launches = Launches.of(plan, launches) if mixed else None
        self.separate_launches = None if mixed else SeparateLaunches.of(plan, launches)
        self.vllm_route = vllm_route
        """``(fp8_use_mixed_batch, fp8_extra_metadata)`` as vLLM's rule built them, where the
        builder rebuilt the step's FP8 metadata for the plan's route; ``None`` where it kept them."""
        self.bounded: fallback.BoundedStep | None = None
        """Where a layer call could not run the plan: the bounded path the step's layer calls take
        from then on."""


@dataclasses.dataclass
class PlannedFlashMLASparseMetadata(FlashMLASparseMetadata):
    planned: PlannedStep | fallback.BoundedStep | None = None
    """The plan the impl executes; the bounded path where the builder could not plan the step;
    ``None``: the step runs stock's one call, which fits the reservation."""


def vllm_chunks(fp8: Any, num_decodes: int) -> list[list[int]]:
    """The request ranges (decodes first) in which vLLM's separate-route metadata gathers the
    step's prefills (its ``split_prefill_chunks``)."""
    if fp8.prefill is None:
        return []
    return [[num_decodes + c.req_start_idx, num_decodes + c.req_start_idx + len(c.block_table)]
            for c in fp8.prefill.chunks]


class PlannedFlashMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    metadata_cls = PlannedFlashMLASparseMetadata

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        FlashMLASparseMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self.engine = engine.setup(vllm_config, self.num_heads, device)
        # Where vLLM fixes the route (HiSparse, context parallelism) its code runs every step.
        self.stock_reason = self.engine.stock_reason
        self.plans_steps = self.engine.plans_fp8
        # Which prefills run dense is vLLM's call, read from each step's metadata; with
        # sparse_mla_force_mqa, or no dense prefill backend, none does.
        self.force_mqa = bool(vllm_config.attention_config.sparse_mla_force_mqa) or release.dense_prefill_backend(self) is None
        self.group_prefill_backends: list[Any] = []
        """Masked MHA: a dense prefill backend per dense-MHA group of a step (clones of
        vLLM's), kept across steps (:func:`.masked_mha.group_prefill_backend`)."""
        if self.stock_reason is not None:
            log.once(logging.INFO, "mla-planner: %s: every step runs vLLM's own code", self.stock_reason)
        if not self.plans_steps:
            return
        if vllm_api.kv_cache_sized(vllm_config):  # the reservation's hand-over waits for this cache
            self.engine.state.reservation.note_kv_cache_sized()
        if (self.reorder_batch_threshold or 1) > self.engine.max_decode_query_len:
            log.once(logging.WARNING, "mla-planner: vLLM counts requests of up to %d tokens as decodes, the budget was "
                     "checked for %d; a step the budget cannot hold falls back to the bounded path",
                     self.reorder_batch_threshold, self.engine.max_decode_query_len)
        log.once(logging.INFO, "mla-planner: FP8 steps routed by %s; decode-only steps of up to %d tokens run vLLM's "
                 "own call", "the cost profile" if self.engine.cost_model is not None
                 else f"{routing.VLLM_RULE}: {self.engine.config.mode}", self.engine.stock_decode_tokens)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashMLASparseMetadata:
        # The MTP draft's metadata can lack the CPU sequence lengths that planning and
        # vLLM's own separate-route build read.
        common_attn_metadata = release.with_cpu_seq_lens(common_attn_metadata)
        metadata = FlashMLASparseMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, fast_build)
        # vLLM's tests call builder methods on the class with a stand-in `self`: stock's build.
        if getattr(self, "engine", None) is None:
            return metadata
        assert isinstance(metadata, PlannedFlashMLASparseMetadata)
        if release.masked_mha is not None and metadata.prefill is not None:
            # Masked MHA needs a non-quantized cache: no FP8 step has a plan from both.
            try:
                masked_mha.attach_plan(self, metadata, common_attn_metadata)
            except fallback.CAUGHT as exc:  # after start-up, never raise: vLLM's own choice runs the prefills
                setattr(metadata.prefill, masked_mha.PLAN_ATTRIBUTE, None)
                masked_mha.left_to_vllm(f"the step's masked-MHA groups could not be planned ({type(exc).__name__})",
                                        fallback.describe(exc))
        if not self.plans_steps:
            return metadata
        stats = self.engine.state.stats
        failure: tuple[str, str] | None = None
        try:
            self.attach_plan(metadata, common_attn_metadata)
        except fallback.CAUGHT as exc:  # after start-up, never raise: the step takes the bounded path
            failure = f"the step could not be planned ({type(exc).__name__})", fallback.describe(exc)
        if failure is not None:  # past the handler: the failed attempt's objects are gone
            metadata.planned = fallback.builder_fell_back(self.engine, *failure, common_attn_metadata.num_actual_tokens,
                                                          metadata.num_decode_tokens, metadata.num_prefills)
        elif isinstance(metadata.planned, PlannedStep):
            stats.planned_step(len(metadata.planned.launches), metadata.planned.reserved_peak)
        else:
            stats.stock_step()
        line = stats.maybe_say()
        if line is not None:
            logger.info(line)
        return metadata

    def sparse_requests(self, metadata: PlannedFlashMLASparseMetadata, num_reqs: int) -> int:
        """The requests, from the first, whose tokens vLLM hands the sparse kernels: all of them,
        or only the decodes where vLLM runs the step's prefills dense (every prefill within top-k
        tokens, a dense prefill backend, no forced MQA)."""
        if metadata.num_prefills == 0 or self.force_mqa or not release.prefills_run_dense(metadata):
            return num_reqs
        return int(metadata.num_decodes)

    def attach_plan(self, metadata: PlannedFlashMLASparseMetadata, common: CommonAttentionMetadata) -> None:
        """Plan the step's sparse tokens and attach the plan, with vLLM's FP8 metadata rebuilt for
        its route where that is not the route vLLM's rule took; nothing where stock's one call
        runs the step within the budget. Changes ``metadata`` only once everything succeeded."""
        sparse = self.sparse_requests(metadata, common.num_reqs)
        if sparse == metadata.num_decodes and metadata.num_decode_tokens <= self.engine.stock_decode_tokens:
            # Logged like a plan, so that a step log (tests/e2e/step_log.py) sees every FP8 step.
            logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, stock's code",
                         common.num_actual_tokens, metadata.num_decode_tokens, metadata.num_prefills)
            return
        # vLLM's int32 CPU copies as they are: the planner widens them itself.
        starts = common.query_start_loc_cpu.numpy()[: sparse + 1]
        query_lens = starts[1:] - starts[:-1]
        num_decodes = int(metadata.num_decodes)
        seq_lens = common.seq_lens_cpu_upper_bound
        if seq_lens is not None:
            context_lens = seq_lens.numpy()[:sparse] - query_lens
        elif sparse == num_decodes:
            # An MTP draft after a padded decode step under async scheduling may carry no CPU
            # sequence lengths (release.with_cpu_seq_lens). A decode's context shapes no plan.
            context_lens = np.zeros_like(query_lens)
        else:
            raise LookupError("vLLM's step metadata carries no CPU sequence lengths (seq_lens_cpu_upper_bound), "
                              "which a prefill's plan reads")
        padding = int(common.num_actual_tokens) - int(starts[-1])
        if padding > 0 and metadata.num_prefills == 0:
            query_lens, context_lens = with_padding_tokens(query_lens, context_lens, padding)
            num_decodes = len(query_lens)
        config = self.engine.config
        plan = routing.choose_plan(self.engine.cost_model, query_lens, context_lens, num_decodes, config)
        mixed = plan.mode == "mixed_batch"
        fp8 = metadata.fp8_extra_metadata
        if mixed != metadata.fp8_use_mixed_batch:
            fp8 = release.build_fp8_mixed(self, common) if mixed else release.build_fp8_separate(self, common, metadata)
        if not mixed and "sparse_prefill" in plan.launch_kernels:
            chunks = vllm_chunks(fp8, num_decodes)
            if plan.gather_chunks[:, :2].tolist() != chunks or (plan.gather_chunks[:, 2] >= 0).any():
                # vLLM gathers in its own chunks (its workspace, its rule): the launches follow them.
                native = plan.prefill_heads != config.prefill_padded_heads
                plan = mla_planner.plan_step(query_lens, context_lens, num_decodes,
                                             config.replace(mode=plan.mode, native_prefill_heads=native),
                                             gather_chunks=np.asarray(chunks, dtype=np.int64).reshape(-1, 2))
        vllm_route = None if mixed == metadata.fp8_use_mixed_batch else (metadata.fp8_use_mixed_batch,
                                                                          metadata.fp8_extra_metadata)
        planned = PlannedStep(plan, config, vllm_route, self.engine.workspace_heads)
        if logger.isEnabledFor(logging.DEBUG):  # the arguments are calls into the plan: none unless logged
            logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, %s, %d launches, peak %d B, "
                         "bound %s", plan.num_tokens, metadata.num_decode_tokens, metadata.num_prefills, plan.mode,
                         len(plan), plan.peak_bytes, plan.bound)
        # Last, so that nothing after it can leave the step on the plan's route without its plan.
        metadata.planned = planned
        metadata.fp8_use_mixed_batch, metadata.fp8_extra_metadata = mixed, fp8


def with_padding_tokens(query_lens: np.ndarray, context_lens: np.ndarray,
                        padding: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode-only step's lengths with its ``padding`` tokens past the requests' as decodes
    without context, uniform as the requests are: its trailing requests of length 0 take as many
    each as its longest request has, and what is left comes as further requests of that many.
    Where the padding is no whole number of such requests, every token of the step is a decode of
    one token: any token may run apart from its request on the sparse kernels, since each attends
    to its own top-k rows, and a decode batch must be uniform. vLLM's full-CUDA-graph
    metadata counts the padded batch's tokens in ``num_actual_tokens`` and its padding requests at
    length 0 (``v1/worker/gpu_model_runner.py``). It is mostly replayed, but a layer runs it eagerly,
    with q of every padded token, where dual-batch overlap gives up its micro-batches for a
    captured size (``v1/worker/gpu_ubatch_wrapper.py``)."""
    nonzero = np.flatnonzero(query_lens)
    first_pad = int(nonzero[-1]) + 1 if nonzero.size else 0
    per_request = int(query_lens.max()) if nonzero.size else 1
    uniform = bool(np.isin(query_lens, (0, per_request)).all())
    if padding % per_request or not uniform:
        tokens = int(query_lens.sum()) + padding
        return np.ones(tokens, dtype=np.int64), np.zeros(tokens, dtype=np.int64)
    pads = len(query_lens) - first_pad
    filled = min(pads, padding // per_request)
    extra = [per_request] * (padding // per_request - filled)
    query_lens = np.concatenate([query_lens[:first_pad], [per_request] * filled, extra])
    context_lens = np.concatenate([context_lens[:first_pad], [0] * (len(query_lens) - first_pad)])
    return query_lens.astype(np.int64), context_lens.astype(np.int64)


def translate_indices(
    md: FlashMLASparseMetadata,
    topk_indices: torch.Tensor,
    rows: slice,
    block_stride_rows: int | None,
    prefill: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's Triton translation of ``rows`` of request-relative top-k positions, into a fresh
    tensor for those rows only: cache slots; with ``prefill`` (the separate route's metadata),
    prefill rows become rows of their chunk's workspace (the builder made the workspace starts
    chunk-local), decode rows (request id -1) stay cache slots, and the valid counts come too."""
    if prefill is None:
        slots = release.convert_indices(md.req_id_per_token[rows], md.block_table, topk_indices[rows],
                                         block_size=md.block_size, block_stride_rows=block_stride_rows)
        return cast(torch.Tensor, slots), None
    return cast(tuple[torch.Tensor, torch.Tensor], release.convert_indices(
        md.req_id_per_token[rows], md.block_table, topk_indices[rows], block_size=md.block_size,
        block_stride_rows=block_stride_rows, HAS_PREFILL_WORKSPACE=True,
        prefill_workspace_request_ids=prefill.request_ids[rows], prefill_workspace_starts=prefill.workspace_starts,
        return_valid_counts=True,
    ))


class PlannedFlashMLASparseImpl(FlashMLASparseImpl):
    engine: engine.EngineSetup | None = None
    """The engine's setup on an FP8 cache; ``None`` (and stock's code) otherwise."""

    mla_layer: Any = None
    """Masked MHA: the ``MLAAttention`` layer of this impl, linked by the builder before
    it plans prefill rows on sparse MQA (``link_sparse_mqa_layers`` of the release's masked MHA)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FlashMLASparseImpl.__init__(self, *args, **kwargs)
        # Where each workspace view sits, checked now rather than trusted per step.
        self.workspace_layout = release.workspace_layout(self)
        if self.kv_cache_dtype != FP8_KV:
            return
        vllm_config = vllm_api.current_vllm_config()
        device = torch.device(vllm_config.device_config.device or "cuda")  # resolved from "auto" by now
        setup = engine.setup(vllm_config, self.num_heads, device)
        if not setup.plans_fp8:  # vLLM keeps its own route: stock's code, nothing reserved
            return
        self.engine = setup
        draft = vllm_api.give_mtp_draft_the_target_backend(vllm_config)
        if draft is not None and draft[1]:
            log.once(logging.INFO, "mla-planner: the MTP draft model's attention runs this backend too (the speculative "
                                   "config names none; vLLM's V1 model runner would give it stock FLASHMLA_SPARSE)")
        elif draft is not None and draft[0] != vllm_config.attention_config.backend:
            log.once(logging.WARNING, "mla-planner: --speculative-config names attention_backend %s for the MTP draft "
                                      "model: its layer runs that backend's code, outside the budget (leave it out, and "
                                      "the draft runs this backend)", getattr(draft[0], "name", draft[0]))
        provider = kernel_provider()
        self.mixed = MixedBatchExecutor(provider, self.engine.config)
        self.separate = SeparateExecutor(provider, self.engine.config)
        # Model construction: vLLM counts this as model memory, so the KV cache leaves room. Not
        # the profile run: vLLM's DeepSeek-V3.2 layer returns there before any impl hook.
        if setup.state.reservation.reserve(setup.reserved_bytes, device):  # once per engine
            settings = self.engine.settings
            logger.info("mla-planner: sparse MLA scratch budget %d MiB (%s); %d MiB reserved from the KV cache for "
                        "the largest launch beyond vLLM's workspace%s; %d heads per rank", settings.scratch_mb,
                        settings.source, self.engine.reserved_bytes >> 20,
                        "" if release.stock_workspace else " and the step's output", self.num_heads)

    @staticmethod
    def masked_mha_workspace_fits(prefill: Any) -> bool:
        """Where the release has masked MHA (else never called): ``MLAAttention._use_sparse_mha``
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
        # A step whose prefills the builder planned in masked-MHA groups runs them
        # group by group; any other (and every step of a release without masked MHA) is stock's.
        prefill = getattr(attn_metadata, "prefill", None)
        partial = masked_mha.plan_of(prefill) if release.masked_mha is not None and prefill is not None else None
        if partial is None or output_scale is not None:
            FlashMLASparseImpl.forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                                           output, output_scale)
            return
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
        # A release may pass kernel_metadata= (PCP+DCP decode rows, or its separate route's decode
        # rows: stock's own calls, never a plan); release.forward_result shapes what is returned.
        if not args and kwargs.get("kernel_metadata") is None:
            result = run_plan(self, "mixed_batch", q, kv_c_and_k_pe_cache, topk_indices, attn_metadata)
            if result is not None:
                return result
        return FlashMLASparseImpl._forward_fp8_kv_mixed_batch(
            self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata, *args, **kwargs
        )

    def _run_mixed(self, step: PlannedStep | fallback.BoundedStep, launches: Launches, q: torch.Tensor, kv_cache: torch.Tensor,
                   topk_indices: torch.Tensor, md: FlashMLASparseMetadata) -> Any:
        pages, block_stride_rows = release.fp8_kv_pages(kv_cache, md.block_size)
        views = release.workspace_views(self, step.workspace)

        def slots(rows: slice) -> torch.Tensor:
            return translate_indices(md, topk_indices, rows, block_stride_rows)[0]

        # Where the release reserves a workspace, the padded q and kernel output go in stock's BF16-prefill workspace views, which
        # this route never otherwise uses: the reservation counts them as served. One launch of
        # padded heads returns the kernel's output as it stands, as stock's call does; otherwise
        # the launches write the step's output (its workspace view where there is one, as stock's separate
        # route writes it).
        mixed, longest = self.mixed, launches.longest
        q_buffer = out_buffer = out = None
        if mixed.pads_heads:
            q_buffer, out_buffer = views.q_padded(longest), views.padded_out(longest)
        if mixed.writes_out(launches):
            out = step_output(views, q, self.kv_lora_rank)
        out = mixed.run(launches, q, pages.view(torch.uint8).unsqueeze(-2), slots, out, schedules=step.schedules,
                        buffers=Buffers(q_buffer, out_buffer), softmax_scale=self.softmax_scale)
        return release.forward_result(out)

    def _forward_fp8_kv_separate_prefill_decode(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        attn_metadata: FlashMLASparseMetadata,
    ) -> Any:
        result = run_plan(self, "separate_prefill_decode", q, kv_c_and_k_pe_cache, topk_indices, attn_metadata)
        if result is not None:
            return result
        return FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode(
            self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata
        )

    def _run_separate(self, step: PlannedStep, launches: SeparateLaunches, q: torch.Tensor, kv_cache: torch.Tensor,
                      topk_indices: torch.Tensor, md: FlashMLASparseMetadata) -> Any:
        fp8 = md.fp8_extra_metadata
        if not isinstance(fp8, FlashMLASparseMetadata.FP8SeparatePrefillDecode):
            raise TypeError(f"a separate-route plan with {type(fp8).__name__} metadata")
        pages, block_stride_rows = release.fp8_kv_pages(kv_cache, md.block_size)
        # Views of the workspace manager's buffer where the release reserves one, shared by the step's layers once vLLM serves.
        views = release.workspace_views(self, step.workspace)
        gather = views.gather()
        if gather is None:
            raise LookupError("the separate route's gather workspace")
        # Stock writes the step's output into its workspace where it has one: so does this route.
        out = step_output(views, q, self.kv_lora_rank)

        def translate(rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
            return translate_indices(md, topk_indices, rows, block_stride_rows, fp8.prefill)

        chunks = [] if fp8.prefill is None else fp8.prefill.chunks
        # The kernels read 64-row pages; the gather, as stock's, the cache as allocated, since the
        # chunks' block tables hold ids of blocks of md.block_size rows.
        self.separate.run(launches, q, pages.view(torch.uint8).unsqueeze(-2), translate, chunks, gather, out,
                          schedules=step.schedules, buffers=Buffers(views.q_padded(), views.padded_out()),
                          softmax_scale=self.softmax_scale, gather_cache=kv_cache)
        return release.forward_result(out)


def run_plan(impl: Any, route: str, q: torch.Tensor, kv_cache: torch.Tensor, topk_indices: torch.Tensor,
             md: FlashMLASparseMetadata) -> Any:
    """The layer call as its step's plan on ``route`` says; ``None`` where stock's code runs it as
    it stands (no plan and stock's one call, which fits the reservation); where the plan cannot
    run, the bounded path, decided once for the step's later layers. A function, not a method:
    vLLM's tests call the forwards with a stand-in ``impl``."""
    setup = getattr(impl, "engine", None)
    if setup is None:  # a BF16 cache, or vLLM's tests' stand-in `self`
        return None
    prepare(setup, md, kv_cache, topk_indices)
    step = getattr(md, "planned", None)
    if step is None:
        return None
    if isinstance(step, fallback.BoundedStep):  # the builder could not plan it
        return step.run(impl, q, kv_cache, topk_indices, md)
    if step.bounded is None:
        try:
            return run_planned(impl, step, route, q, kv_cache, topk_indices, md)
        except fallback.CAUGHT as exc:  # after start-up, never raise
            reason, detail = fallback.layer_reason(exc), fallback.describe(exc)
        # Past the handler, the exception and the failed launches' frames (their buffers) are gone.
        step.bounded = fallback.layer_fell_back(setup, reason, detail, step.vllm_route)
    return step.bounded.run(impl, q, kv_cache, topk_indices, md)


def run_planned(impl: Any, step: PlannedStep, route: str, q: torch.Tensor, kv_cache: torch.Tensor,
                topk_indices: torch.Tensor, md: FlashMLASparseMetadata) -> Any:
    """The plan's launches for this layer call; ``None`` where the plan is stock's one call within
    the allowance (stock's code runs it); :class:`.fallback.PlanMismatch` for a call whose tokens
    or route are not the plan's."""
    if q.shape[0] != step.sparse_tokens:
        raise fallback.PlanMismatch(f"{q.shape[0]} tokens where the plan has {step.sparse_tokens}")
    if step.plan.mode != route:
        raise fallback.PlanMismatch(f"vLLM called the {route} forward for a {step.plan.mode} plan")
    if step.stock_call_bytes is not None and step.stock_call_bytes <= impl.engine.stock_call_allowance:
        return None
    release.fill_group_topk(impl, topk_indices, md, kv_cache)
    if step.mixed_launches is not None:
        return impl._run_mixed(step, step.mixed_launches, q, kv_cache, topk_indices, md)
    assert step.separate_launches is not None
    return impl._run_separate(step, step.separate_launches, q, kv_cache, topk_indices, md)


def prepare(setup: engine.EngineSetup, md: FlashMLASparseMetadata, kv_cache: torch.Tensor,
            topk_indices: torch.Tensor) -> None:
    """Before the engine's layer calls run anything, once each: the reservation handed over once
    vLLM serves, the index translation warmed. A warm-up that fails is said once and not tried
    again: the translation then compiles where first used, as stock's does."""
    state = setup.state
    if state.reservation.held() and state.reservation.serving(kv_cache.shape[0], setup.profiling_kv_blocks):
        hand_over_reservation(state.reservation)
    if state.warm_up.pending:
        try:
            _pages, block_stride_rows = release.fp8_kv_pages(kv_cache, md.block_size)
            state.warm_up.maybe(setup.routes if setup.plans_fp8 else (), md.block_table, md.block_size,
                                block_stride_rows, topk_indices.shape[1])
        except fallback.CAUGHT as exc:
            state.warm_up.pending = False
            log.once(logging.WARNING, "mla-planner: warming up vLLM's Triton index translation failed (%s): its "
                                      "variants compile where first used", fallback.describe(exc))


def hand_over_reservation(reservation: Reservation) -> None:
    """Give the reserved bytes to the kernels: back to the driver, and, under sleep mode, out of
    vLLM's pool for the model (which keeps a freed segment mapped); said in one line."""
    elsewhere = reservation.made_on_another_stream()
    reservation.release()
    try:
        unmapped = release.release_from_sleep_mode_pool(reservation.address)
    except fallback.CAUGHT as exc:  # vLLM's unmap failed (a CUDA error): the step goes on, once said
        unmapped = False
        log.once(logging.WARNING, "mla-planner: unmapping the scratch reservation from vLLM's sleep-mode memory "
                                  "pool failed (%s): its bytes stay mapped there", exc)
    logger.info("mla-planner: scratch reservation of %d MiB handed to the kernels%s%s",
                reservation.reserved_bytes >> 20,
                " (made on another CUDA stream than this one)" if elsewhere else "",
                " (unmapped from vLLM's sleep-mode memory pool)" if unmapped else "")


def step_output(views: WorkspaceViews, q: torch.Tensor, rank: int) -> torch.Tensor:
    """The step's output ``(tokens, heads, rank)``: its workspace view where the release reserves
    one (the layout was checked at construction), a new tensor where there is none (the
    reservation counts it) or q is not of its dtype."""
    out = views.compact_out(q.shape[0])
    if out is None or out.dtype != q.dtype:
        return q.new_empty((q.shape[0], q.shape[1], rank))
    return out


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
