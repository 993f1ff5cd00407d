"""The version seam: every difference between vLLM 0.26 and 0.33 that the backend touches, chosen
once, by the installed vLLM's version, at import.

The rest of the backend calls these and never branches on vLLM's version or reaches a vLLM
internal that differs between the two. Calls whose signature is one version's only go through
``Any``-typed module handles, so mypy (run against one installed vLLM) checks both branches
without version-specific ignores.

What differs (0.33.0 wheel, ``F`` = ``vllm/v1/attention/backends/mla/flashmla_sparse.py``):

* the FP8 forwards return ``(out, lse | None)`` (F:972, F:1190) where 0.26 returned ``out``;
* ``_build_fp8_mixed_decode_prefill()`` takes no argument (F:488; 0.26 took the step's metadata);
* the separate path's BF16 gather workspace is the impl's second ``workspace_specs`` entry, served
  by the workspace manager per call (F:793-832), not ``impl.prefill_bf16_workspace``;
* ``triton_convert_req_index_to_global_index`` takes ``BLOCK_STRIDE_ROWS`` (sparse_utils.py:493),
  the cache's rows per block from ``_fp8_kv_pages`` (F:136), which views a cache whose blocks are
  not 64 rows as the kernel's 64-row pages (0.26 only had 64-row blocks: the cache itself);
* ``get_prefill_workspace_size`` takes the ``VllmConfig`` (F:337: a configurable factor, 5 up to
  256K tokens, else 2) where 0.26 took ``max_model_len`` (factor 5); the indexer's prefill buffer
  (indexer.py:916) follows the same factor;
* the builder's FP8 path (``use_fp8_kv_cache``) also covers ``nvfp4_ds_mla`` (F:391);
* the builder keeps vLLM's route under HiSparse, PCP+DCP and DCP (F:442-486);
* the impl reserves a workspace at construction, from vLLM's workspace manager (F:793-832), whose
  padded q and output views the backend's launches use; 0.26 has none;
* FlashMLA's SM90 BF16 sparse prefill kernel (``flash_mla_sparse_fwd``) runs 16 and 32 heads
  unpadded in 0.33's build (:data:`NATIVE_PREFILL_KERNELS`); 0.26's runs 64 and 128 only;
* ``CommonAttentionMetadata.unpadded`` (what the MTP draft is given after a target step padded
  for a full CUDA graph: gpu_model_runner.py:2578-2586) keeps ``seq_lens_cpu_upper_bound`` on
  0.33; 0.26's drops it (v1/attention/backend.py:563-594) and keeps ``_seq_lens_cpu``, the same
  CPU array (gpu_model_runner.py:2343-2344, 2405-2407), which :func:`with_cpu_seq_lens` puts back.
  Under async scheduling with speculative decoding 0.26 keeps no ``_seq_lens_cpu``
  (gpu_model_runner.py:2354-2356): such a draft step, all decodes, has no CPU sequence lengths;
* masked-MHA prefill (SM100, FA4, a non-quantized KV cache): the layer asks the impl's
  ``masked_mha_workspace_fits`` and runs the prefills through its ``forward_mha``
  (mla_attention.py:990-1000, 1215-1240); 0.26 has none. The backend plans and runs it in
  :mod:`.masked_mha`, called on 0.33 only (:data:`MASKED_MHA`); what that asks of vLLM's layer
  and metadata is at the end of this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import vllm.v1.attention.backends.mla.flashmla_sparse as _stock_module
import vllm.v1.attention.backends.mla.sparse_utils as _utils_module
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata as CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as FlashMLASparseBackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl as FlashMLASparseImpl
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata as FlashMLASparseMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseMetadataBuilder as FlashMLASparseMetadataBuilder,
)

from mla_planner.engine_model import sizing

# Any-typed: the members called through these differ in signature between the versions.
stock: Any = _stock_module
utils: Any = _utils_module

SUPPORTED = ("0.26", "0.33")
T = TypeVar("T")


def _minor(version: str) -> str:
    parts = version.split(".")
    return ".".join(parts[:2])


VLLM_VERSION = importlib.metadata.version("vllm")
MINOR = _minor(VLLM_VERSION)
if MINOR not in SUPPORTED:
    # A third version's internals are unknown: refusing beats running a plan through methods
    # whose shapes may have changed under it.
    raise ImportError(
        f"mla-planner's vLLM backend supports vLLM {' and '.join(s + '.x' for s in SUPPORTED)}; "
        f"vLLM {VLLM_VERSION} is installed"
    )
V033 = MINOR == "0.33"

PLANNED_KV = "fp8_ds_mla"
"""The one KV-cache dtype whose steps are planned: the planner models fp8_ds_mla's 656-byte rows
and its gather. 0.33's nvfp4_ds_mla takes vLLM's FP8 path too, and runs stock's code."""

FORWARD_RETURNS_LSE = V033
"""0.33's FP8 forwards return ``(out, lse | None)``; 0.26's return ``out``."""

STOCK_WORKSPACE = V033
"""0.33's impl reserves its workspace at construction (model memory, so the KV cache leaves it):
the backend's reservation (:mod:`.reservation`) holds only what a launch needs beyond it. 0.26's
has none: the reservation holds the whole budget."""

PREFILL_PADDING: int | None = 64 if V033 else None
"""The head multiple vLLM pads the sparse prefill kernel's q to (its impl's ``prefill_padding``, set
in ``__init__``, so not readable before an impl exists): 0.33 pads to 64 on Hopper and Blackwell
alike; ``None`` leaves the planner's default, 0.26's rule (64 on Hopper, 128 on Blackwell)."""

NATIVE_PREFILL_KERNELS = V033
"""0.33's FlashMLA runs the SM90 sparse prefill kernel at 16 and 32 heads unpadded, so a plan made
for native prefill heads can run; 0.26's has 64- and 128-head kernels only."""

MASKED_MHA = V033
"""0.33 has masked-MHA prefill (0.26 none): the builder plans the prefills that fit in groups and
the impl runs them (:mod:`.masked_mha`, which only 0.33 imports)."""

# 0.33's modules a layer call reads, imported once (stock's module imports them already): an
# import statement in a layer call costs the host on every call. Any-typed, as ``stock``.
_workspace: Any = importlib.import_module("vllm.v1.worker.workspace") if V033 else None
_ubatching: Any = importlib.import_module("vllm.v1.worker.ubatching") if V033 else None
_index_group: Any = importlib.import_module("vllm.v1.attention.backends.mla.index_group") if V033 else None
_workspace_lane: Any = getattr(_workspace, "_workspace_lane", None)
"""0.33's context variable of the current workspace lane (private): without it a step's layers
make their workspace views each call (:func:`workspace_views`), never another lane's."""


def device_arch() -> str:
    """The GPU's architecture as the planner names it."""
    from vllm.platforms import current_platform

    return "sm100" if current_platform.is_device_capability_family(100) else "sm90"


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors, as vLLM counts them."""
    from vllm.utils.platform_utils import num_compute_units

    return int(num_compute_units(device.index))


def current_vllm_config() -> VllmConfig:
    """The configuration of the engine being built (vLLM sets it around model construction)."""
    return get_current_vllm_config()


def stats_interval_s() -> float:
    """vLLM's stats-logging interval (``VLLM_LOG_STATS_INTERVAL``, 10 s by default; envs.py:829-833
    on 0.26, :875-879 on 0.33), as the API server reads it: workers inherit its environment."""
    import vllm.envs as envs

    return float(envs.VLLM_LOG_STATS_INTERVAL)


def from_first_tp_rank(make: Callable[[], T]) -> T:
    """``make()`` on the first rank of the engine's tensor-parallel group, its result on every
    rank, by vLLM's ``GroupCoordinator.broadcast_object`` (0.26 distributed/parallel_state.py:760,
    0.33 :856); ``make()`` here where there is no group of more than one rank (one GPU, the CPU
    tests). Every rank must call it at the same point: each does while it builds the model."""
    from vllm.distributed import parallel_state

    state: Any = parallel_state
    if not state.model_parallel_is_initialized():
        return make()
    group = state.get_tp_group()
    if group.world_size == 1:
        return make()
    made = make() if group.rank_in_group == 0 else None
    return cast(T, group.broadcast_object(made, src=0))


def sleep_mode(vllm_config: VllmConfig) -> bool:
    """``--enable-sleep-mode``: vLLM builds the model in a memory pool of its own, which keeps
    what a start-up measurement frees mapped (:func:`release_from_sleep_mode_pool`)."""
    return bool(getattr(vllm_config.model_config, "enable_sleep_mode", False))


def forward_result(out: torch.Tensor) -> Any:
    """What the FP8 forwards return for an output of this backend (which needs no LSE: the
    backend runs no plan where vLLM wants one, see :func:`stock_route_reason`)."""
    return (out, None) if FORWARD_RETURNS_LSE else out


def stock_route_reason(vllm_config: Any) -> str | None:
    """Why this engine's steps must keep vLLM's own route and code, or ``None``. On 0.33 the
    builder fixes the route under HiSparse (host-backed cache, gathered by the index group) and
    context parallelism (PCP+DCP gathers KV shards; DCP needs the LSE of every token), none of
    which the plan's launches do (F:442-486: the builder's ``use_hisparse``, ``pcp_dcp_kv_gather``
    and ``dcp_world_size``, from these settings)."""
    if not V033:
        return None
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return "HiSparse"
    parallel = vllm_config.parallel_config
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if dcp > 1 and getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        return "PCP+DCP"
    if dcp > 1:
        return "DCP"
    return None


def prefills_run_dense(metadata: Any) -> bool:
    """vLLM's own verdict, from a step's metadata, that its prefills run dense MHA (every prefill
    sequence within top-k tokens), so that only its decodes reach the sparse kernels. Whether a
    dense prefill backend exists, or ``sparse_mla_force_mqa`` overrides it, is the caller's
    (``StepConfig.force_mqa``). 0.33's builder records it (``prefill.use_dense_mha``,
    sparse_mla_attention.py:408-413); 0.26's layer decides from the metadata's longest prefill
    sequence and top-k (mla_attention.py:756-765)."""
    if V033:
        return metadata.prefill is not None and bool(metadata.prefill.use_dense_mha)
    return bool(metadata.num_prefills > 0 and metadata.prefill_max_seq_len <= metadata.topk_tokens)


def build_fp8_mixed(builder: Any, common: Any) -> Any:
    """vLLM's mixed-batch FP8 metadata for a step (0.33 builds it from nothing: its scheduler
    initialises lazily from the query shape)."""
    return builder._build_fp8_mixed_decode_prefill() if V033 else builder._build_fp8_mixed_decode_prefill(common)


def model_topk(vllm_config: VllmConfig) -> int:
    """The model's top-k, read where this release's sparse-MLA layer reads it
    (sparse_mla_attention.py): ``hf_config.index_topk`` on 0.26, ``hf_text_config.index_topk`` on
    0.33. They name the same value for a served model; vLLM 0.26's own sparse-MLA tests replace
    ``hf_text_config`` with a namespace that has no ``index_topk``."""
    model = vllm_config.model_config
    return int((model.hf_text_config if V033 else model.hf_config).index_topk)


def prefill_workspace_rows(vllm_config: VllmConfig) -> int:
    """Rows of vLLM's BF16 gather workspace (its ``split_prefill_chunks`` limit)."""
    if V033:
        return int(stock.get_prefill_workspace_size(vllm_config))
    return int(stock.get_prefill_workspace_size(vllm_config.model_config.max_model_len))


def indexer_workspace_rows(vllm_config: VllmConfig) -> int:
    """Rows of the sparse indexer's prefill K buffer (indexer.py:916): 40 x max_model_len on 0.26,
    8 x the gather factor x max_model_len on 0.33 (the same at its default factor of 5; 16 x at the
    factor of 2 it takes above 256K tokens)."""
    from vllm.v1.attention.backends.mla import indexer

    return int(indexer.get_max_prefill_buffer_size(vllm_config))


def split_indexer_prefill_chunks() -> Any:
    """vLLM's indexer prefill chunking (a module function on 0.26, a static method of the indexer's
    metadata builder on 0.33), for the planner's equivalence tests."""
    from vllm.v1.attention.backends.mla import indexer as indexer_module

    indexer: Any = indexer_module
    return indexer.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks if V033 \
        else indexer.split_indexer_prefill_chunks


def fp8_kv_pages(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int | None]:
    """The cache as the FP8 kernels' 64-token pages, and the rows per block when a block spans
    several pages (``None``: blocks are the pages)."""
    if V033:
        pages, stride = stock._fp8_kv_pages(kv_cache, block_size)
        return pages, stride
    return kv_cache, None


def convert_indices(
    req_id: torch.Tensor, block_table: torch.Tensor, topk: torch.Tensor, *, block_size: int,
    block_stride_rows: int | None, **workspace: Any,
) -> Any:
    """vLLM's Triton translation of request-relative top-k positions (``workspace``: its
    prefill-workspace arguments, the same in both versions)."""
    stride = {"BLOCK_STRIDE_ROWS": block_stride_rows} if V033 else {}
    assert V033 or block_stride_rows is None, "vLLM 0.26 has 64-row blocks only"
    return utils.triton_convert_req_index_to_global_index(
        req_id, block_table, topk, BLOCK_SIZE=block_size, NUM_TOPK_TOKENS=topk.shape[1], **stride, **workspace,
    )


def fill_group_topk(impl: Any, topk_indices: torch.Tensor, metadata: Any, kv_cache: torch.Tensor) -> None:
    """Before a plan runs a decode-only layer call of the first layer of an index group that other
    layers share (0.33, models whose layers share one indexer's result): convert the step's top-k
    positions into the group's buffer of slots, as stock's first layer does
    (``SparseMLAIndexGroup._convert_once``, index_group.py:114). The plan translates per launch
    and converts nothing there, while a later layer of the group that runs vLLM's code (a layer
    whose plan could not run, or one on a BF16 cache) reads that buffer. With the valid counts
    and the valid slots first, as the separate route's and the BF16 readers take them; the mixed
    route's reader masks the ``-1`` slots wherever they are. On the current stream, so that it is
    ordered before the group's later layers."""
    if not V033:
        return
    group: Any = getattr(impl, "index_group", None)
    if type(group) is not _index_group.SparseMLAIndexGroup:  # none, or a HiSparse group (never planned)
        return
    rows = topk_indices.shape[0]
    if (impl.index_group_index != 0 or group.num_layers < 2 or rows != metadata.num_decode_tokens
            or rows > group.physical_topk_indices.shape[0]):
        return  # no later layer reads it; other steps' readers convert for themselves
    _, block_stride_rows = fp8_kv_pages(kv_cache, metadata.block_size)
    convert_indices(metadata.req_id_per_token[:rows], metadata.block_table, topk_indices,
                    block_size=metadata.block_size, block_stride_rows=block_stride_rows, return_valid_counts=True,
                    out=group.physical_topk_indices[:rows], valid_counts_out=group.valid_topk_counts[:rows])


def decode_threshold(vllm_config: VllmConfig, num_heads: int, arch: str) -> int:
    """The longest request the FlashMLA sparse builder counts as a decode: its table by heads per
    rank and architecture (F:366-372 on 0.33; the same table on 0.26), raised to a speculative
    verification's length (``_init_reorder_batch_threshold``, v1/attention/backend.py:658 on 0.33,
    651 on 0.26). tests/test_vllm_backend.py holds it against the builder's own."""
    threshold = sizing.builder_decode_threshold(num_heads, arch)
    spec = vllm_config.speculative_config
    if spec is None or spec.num_speculative_tokens is None:
        return threshold
    if V033:
        from vllm.v1.attention import backend as attention_backend

        api: Any = attention_backend
        return max(threshold, int(api.max_decode_query_len(vllm_config)))
    return max(threshold, 1 + (2 if spec.parallel_drafting else 1) * spec.num_speculative_tokens)


def give_mtp_draft_the_target_backend(vllm_config: VllmConfig) -> tuple[Any, bool] | None:
    """Name the target's attention backend (this one) as the MTP draft model's where the
    speculative config names none, before the draft is built. ``None`` where there is no MTP draft
    (or the target's backend was autoselected); else the backend the draft runs and whether this
    named it. vLLM's V1 model runner (0.26's; 0.33's where its V2 runner is off) never lets the
    draft inherit ``--attention-backend`` (``SpecDecodeBaseProposer._create_draft_vllm_config``,
    "Never inherit the attention backend from base"): the draft's MTP layer autoselects stock
    FLASHMLA_SPARSE and runs every prompt token of a step through the sparse decode kernel
    unplanned. 0.33's V2 runner keeps the target's backend unless one is named
    (``SpeculativeConfig.apply_draft_overrides``): there, naming it changes nothing. A backend the
    operator named is kept. Other speculative methods' drafts are not this model: left to vLLM."""
    spec = vllm_config.speculative_config
    target = vllm_config.attention_config.backend
    if spec is None or spec.method != "mtp" or target is None:
        return None
    if spec.attention_backend is not None:
        return spec.attention_backend, False
    spec.attention_backend = target
    return target, True


def with_cpu_seq_lens(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """``common`` with its CPU sequence lengths (``seq_lens_cpu_upper_bound``: exact for prefills,
    an upper bound for speculative decodes), which planning and vLLM's own separate-route build
    read. On 0.26 the MTP draft's metadata after a padded target step lacks them (``unpadded``
    drops the field) but, without async scheduling, keeps ``_seq_lens_cpu``, the runner's same
    array: a copy with it filled in. ``common`` itself where it has them, or has neither."""
    exact = getattr(common, "_seq_lens_cpu", None)
    if common.seq_lens_cpu_upper_bound is not None or exact is None:
        return common
    return dataclasses.replace(common, seq_lens_cpu_upper_bound=exact)


def uniform_decode_len(vllm_config: VllmConfig) -> int:
    """The query tokens of each request of a decode step: 1 + the speculative tokens."""
    spec = vllm_config.speculative_config
    return 1 + (spec.num_speculative_tokens or 0) if spec is not None else 1


def profiling_kv_blocks(vllm_config: VllmConfig) -> int:
    """Blocks of the minimal KV cache vLLM captures CUDA graphs against while it profiles memory,
    before it sizes the real one (``_init_minimal_kv_cache_for_profiling``: 0.33
    v1/worker/gpu/cudagraph_utils.py:1042, 0.26 v1/worker/gpu_model_runner.py:6439)."""
    compilation = vllm_config.compilation_config
    captures = compilation.max_cudagraph_capture_size or 0
    return min(vllm_config.scheduler_config.max_num_seqs, captures) or 1


def kv_cache_sized(vllm_config: VllmConfig) -> bool:
    """Whether the attention backends now being built serve the KV cache vLLM sized: vLLM sets
    ``cache_config.num_gpu_blocks`` before it builds the sized cache's backends (0.33
    v1/worker/gpu_worker.py:870, 0.26 :722) and only after it built the minimal profiling cache's
    (0.33 v1/worker/gpu_model_runner.py:6166-6167 and v1/worker/gpu/cudagraph_utils.py:1061-1062,
    0.26 v1/worker/gpu_model_runner.py:6462-6463), clearing it when that cache goes (0.33 :6207 and
    gpu/cudagraph_utils.py:1098, 0.26 :6518). The one sign left where both caches have the same blocks
    (``--num-gpu-blocks-override`` at or below :func:`profiling_kv_blocks`)."""
    return vllm_config.cache_config.num_gpu_blocks is not None


def release_from_sleep_mode_pool(address: int) -> bool:
    """Unmap the free segment at ``address`` from vLLM's CuMem allocator, where one holds it.

    Under sleep mode (``--enable-sleep-mode``, ``enable_cumem_allocator``) vLLM builds the model in
    a memory pool of its own (``use_memory_pool(tag="weights")``: 0.26 v1/worker/gpu_worker.py:424-431,
    0.33 :594-601), and so the reservation. Freed, its segment stays mapped there: PyTorch's
    ``empty_cache()`` leaves a pluggable allocator's live pool alone, and vLLM releases a pool's
    free segments only when its context exits or the tag is entered again (0.33
    device_allocator/cumem.py:399-402 and ``_trim``, 424-429; 0.26 inline at the end of
    ``use_memory_pool``). This does what ``_trim`` does, for the one segment: nothing allocates
    from the model's pool after loading. Returns whether it unmapped one; never imports the
    allocator (vLLM has, where it runs)."""
    cumem: Any = sys.modules.get("vllm.device_allocator.cumem")
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if allocator is None:
        return False
    for entry in list(allocator.allocator_and_pools.values()):
        for pool, _ in entry if isinstance(entry, list) else [entry]:  # 0.33 keeps a list per tag
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


def workspace_padded_heads(vllm_config: VllmConfig, num_heads: int) -> int | None:
    """Heads of the impl's padded-q and kernel-output workspace views: 0.33's prefill padding of
    its heads (F:815-831); ``None`` on 0.26, which has no such views."""
    if not STOCK_WORKSPACE or vllm_config.cache_config.cache_dtype != PLANNED_KV:
        return None
    assert PREFILL_PADDING is not None
    return -(-num_heads // PREFILL_PADDING) * PREFILL_PADDING


@dataclasses.dataclass(frozen=True)
class Slot:
    """One of the impl's ``workspace_specs`` (0.33): where vLLM's ``get_simultaneous`` puts it in
    the workspace manager's buffer (bytes from the buffer's start), its shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def of(self, buffer: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """This spec's view of ``buffer`` (the manager's, as bytes): its first ``rows`` rows, all
        of them by default."""
        if rows is None:
            rows = self.shape[0]
        elif not 0 <= rows <= self.shape[0]:  # past the spec is the next spec's memory
            raise ValueError(f"{rows} rows of a workspace view of {self.shape[0]}")
        row_bytes = self.dtype.itemsize * math.prod(self.shape[1:])
        return buffer[self.offset : self.offset + rows * row_bytes].view(self.dtype).view((rows, *self.shape[1:]))


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    """The impl's workspace on 0.33, read at construction from where vLLM's ``get_simultaneous``
    put each of its ``workspace_specs`` and checked: a layout this backend does not know is a
    start-up error, never a silent allocation per step. Stock's specs (F:793-832): ``q_concat``
    ``(max_tokens, heads padded to 64, 576)``, the sparse-MQA query stock's ``forward_mqa``
    concatenates; on an FP8 cache then the separate path's BF16 ``gather`` workspace (after it,
    PCP+DCP only, the all-gathered one), ``q_padded`` ``(max_tokens, padded heads, 576)`` and
    ``padded_out`` ``(max_tokens, padded heads, 512)`` -- the BF16 prefill kernel's padded q and
    output, which the backend's launches of either kernel take theirs from -- and ``compact_out``
    ``(max_tokens, heads, 512)``, the step's output. ``span``: the bytes they take together."""

    q_concat: Slot
    gather: Slot | None
    q_padded: Slot | None
    padded_out: Slot | None
    compact_out: Slot | None
    span: int


@dataclasses.dataclass(frozen=True)
class WorkspaceViews:
    """The impl's workspace for one layer call: on 0.33 views of the workspace manager's buffer
    (``buffer``, as bytes), each made when first asked for and exactly the rows asked for; on 0.26
    the impl's own gather workspace alone (the rest are ``None``)."""

    buffer: torch.Tensor | None
    layout: WorkspaceLayout | None
    legacy_gather: torch.Tensor | None = None
    _made: dict[tuple[int, int | None], torch.Tensor] = dataclasses.field(default_factory=dict, compare=False)

    def _view(self, slot: Slot | None, rows: int | None) -> torch.Tensor | None:
        if slot is None or self.buffer is None:
            return None
        key = (id(slot), rows)
        view = self._made.get(key)
        if view is None:
            view = self._made[key] = slot.of(self.buffer, rows)
        return view

    def gather(self) -> torch.Tensor | None:
        return self.legacy_gather if self.layout is None else self._view(self.layout.gather, None)

    def q_concat(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.q_concat, rows)

    def q_padded(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.q_padded, rows)

    def padded_out(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.padded_out, rows)

    def compact_out(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.compact_out, rows)


_LAYOUTS: dict[WorkspaceLayout, WorkspaceLayout] = {}
"""One instance per distinct layout, so that every layer of a model shares its layer's views."""


def workspace_layout(impl: Any) -> WorkspaceLayout | None:
    """The impl's workspace layout on 0.33 (``None`` on 0.26). Only ``q_concat`` where no plan
    runs (a BF16 or ``nvfp4_ds_mla`` cache, PCP+DCP: stock's code runs those steps)."""
    if not V033:
        return None
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
            raise RuntimeError(f"mla-planner: vLLM {VLLM_VERSION}'s workspace manager placed {slot.shape} {slot.dtype} "
                               f"elsewhere than this backend reads it; install a supported vLLM ({', '.join(SUPPORTED)})")
    if impl.kv_cache_dtype != PLANNED_KV or getattr(impl, "pcp_dcp_kv_gather", False):
        q_concat_only = WorkspaceLayout(slots[0], None, None, None, None, span)
        return _LAYOUTS.setdefault(q_concat_only, q_concat_only)
    heads, width, rank = impl.num_heads, impl.q_head_size, impl.kv_lora_rank
    padded = -(-heads // impl.prefill_padding) * impl.prefill_padding
    expected = [((padded, width), torch.bfloat16), ((padded, rank), torch.bfloat16), ((heads, rank), torch.bfloat16)]
    gather = tuple(impl.prefill_workspace_shape)
    if len(slots) != 5 or slots[1].shape != gather or [(s.shape[1:], s.dtype) for s in slots[-3:]] != expected:
        raise RuntimeError(
            f"mla-planner: vLLM {VLLM_VERSION}'s FlashMLA sparse workspace is {impl.workspace_specs}, not the layout this "
            f"backend knows (q_concat, the gather workspace {gather}, then {expected}); install a supported vLLM "
            f"({', '.join(SUPPORTED)})"
        )
    q_concat, gather_slot, q_padded, padded_out, compact_out = slots
    layout = WorkspaceLayout(q_concat, gather_slot, q_padded, padded_out, compact_out, span)
    return _LAYOUTS.setdefault(layout, layout)


def _byte_offset(view: torch.Tensor) -> int:
    return int(view.storage_offset()) * view.element_size()


def _span_of(manager: Any, span: int) -> torch.Tensor:
    """The manager's buffer for this micro-batch and lane, its first ``span`` bytes: one request,
    which sizes the buffer as stock's request of every spec does."""
    buffer: torch.Tensor = manager.get_simultaneous(((span,), torch.uint8))[0]
    return buffer


def workspace_views(impl: Any, memo: dict[Any, WorkspaceViews] | None = None) -> WorkspaceViews:
    """This call's workspace. On 0.33 one view of the manager's buffer, in bytes, as long as all of
    the impl's specs together, makes sure the buffer holds them all as stock's own request does;
    the call then makes only the views it uses from it: five views of vLLM's request cost the
    host more than a launch. These views may not outlive the layer call while the manager may
    still grow its buffer (another layer may grow it before vLLM locks it). Once vLLM has locked
    it (it serves), its buffers stay put, and ``memo`` (a step's, shared by its layers) keeps the
    first layer's views for the rest, by micro-batch and lane: each has a buffer of its own."""
    if not V033:
        return WorkspaceViews(None, None, getattr(impl, "prefill_bf16_workspace", None))
    layout: WorkspaceLayout | None = getattr(impl, "workspace_layout", None)
    if layout is None:  # vLLM's tests' stand-in ``self``
        layout = workspace_layout(impl)
    assert layout is not None
    manager = _workspace.current_workspace_manager()
    if memo is None or _workspace_lane is None or not manager.is_locked():
        return WorkspaceViews(_span_of(manager, layout.span), layout)
    key = (id(layout), _ubatching.dbo_current_ubatch_id(), _workspace_lane.get())
    views = memo.get(key)
    if views is None:
        views = memo[key] = WorkspaceViews(_span_of(manager, layout.span), layout)
    return views


# -- masked-MHA prefill (0.33 only; see .masked_mha) ----------------------------------------------
# ``L`` = vllm/model_executor/layers/attention/mla_attention.py, ``S`` =
# vllm/model_executor/layers/attention/sparse_mla_attention.py (0.33.0). Neither has these members
# on 0.26, which never calls what follows (``MASKED_MHA``).


def _layer_modules() -> tuple[Any, Any]:
    """0.33's MLA layer module and its sparse-MLA part, Any-typed (mypy also reads 0.26)."""
    import importlib

    return (importlib.import_module("vllm.model_executor.layers.attention.mla_attention"),
            importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention"))


def layer_takes_masked_mha(builder: Any, metadata: Any) -> bool:
    """``MLAAttention._use_sparse_mha``'s masked-MHA clause for this step (L:1215-1240), all but its
    last test (the workspace fit), from the builder's side: masked MHA available (the builder's
    mask workspace exists), no HiSparse, no DCP, not forced to MQA, not dense MHA already, and
    vLLM's speed table (``_use_masked_mha``, L:1872) choosing it for the step's longest query and
    sequence. The backend reports ``FLASHMLA_SPARSE``'s name, as the layer asks it."""
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
        backend_name=FlashMLASparseBackend.get_name(),
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        qk_head_dim=dims.qk_nope_head_dim + dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        query_len=prefill.max_query_len,
        seq_len=metadata.prefill_max_seq_len,
        has_context=prefill.chunked_context is not None,
    ))


def masked_mha_set_fits(prefill: Any) -> bool:
    """vLLM's whole-set fit test (``masked_mha_workspace_fits``, S:896-919) without its warning that
    the step falls back to sparse MQA (the backend may not)."""
    _mla, sparse = _layer_modules()
    chunked = prefill.chunked_context
    return bool(sparse._masked_mha_workspace_fits(
        batch_size=len(prefill.query_lens_cpu),
        max_query_len=prefill.max_query_len,
        max_context_chunk_seq_len=0 if chunked is None else max(chunk.max_seq_len for chunk in chunked.chunks),
        workspace_numel=prefill.topk_mask_workspace.numel(),
    ))


def stock_masked_mha_workspace_fits(prefill: Any) -> bool:
    """Stock's impl's answer to the layer's fit question, warning included."""
    return bool(stock.FlashMLASparseImpl.masked_mha_workspace_fits(prefill))


def topk_mask_workspace_bytes(prefill: Any) -> int:
    """Bytes of the builder's top-k mask workspace (128 MiB: ``GLOBAL_TOPK_MASK_MAX_BYTES``, S:67)."""
    workspace = prefill.topk_mask_workspace
    return int(workspace.numel() * workspace.element_size())


def clone_prefill_backend(builder: Any) -> Any:
    """A fresh dense prefill backend like the builder's (vLLM's own ``clone()``): one holds one
    prepared set of prefills."""
    return builder._prefill_backend.clone()


def prefill_metadata_of(builder: Any, metadata: Any, common: Any, r0: int, r1: int, backend: Any) -> Any:
    """Prefill metadata for the step's prefills ``[r0, r1)`` alone, as stock's ``build`` makes it
    for a step whose prefills they are (S:398-418): their block table and query starts, their
    chunked context by the builder's own method, and for a dense group ``backend``, prepared for
    them (``None``: masked MHA, which uses none)."""
    _mla, sparse = _layer_modules()
    prefill = metadata.prefill
    query_lens = prefill.query_lens_cpu[r0:r1]
    group = sparse.SparseMLAPrefillMetadata(
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


SPARSE_MQA_UNSUPPORTED = ("q_pad_num_heads", "is_aiter_triton_fp4_bmm_enabled", "is_aiter_triton_fp8_bmm_enabled",
                          "is_amx_bmm_enabled")
"""Layer settings whose weight paths :func:`sparse_mqa_rows` does not take: it runs the layer's decode
path for a BF16 cache on CUDA (no head padding, no ROCm or CPU weight kernels; masked MHA runs on
SM100 only)."""


def link_sparse_mqa_layers(builder: Any) -> str | None:
    """Ready the builder's layers for :func:`sparse_mqa_rows` before it plans a step's groups (a
    sparse-MQA group, and the fallback of every plan, run there): give each impl its
    ``MLAAttention`` layer (``impl.mla_layer``), so that the impl's forward needs no lookup of its
    own; or say why some layer could not run those rows. Each layer is found by name in vLLM's
    ``static_forward_context`` (where every layer registers itself, and the forward context's layers
    come from), with its impl, and none of :data:`SPARSE_MQA_UNSUPPORTED` set."""
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


def attention_layer(impl: Any) -> Any:
    """The ``MLAAttention`` layer whose impl ``impl`` is (:func:`link_sparse_mqa_layers`): its absorbed
    weights run sparse-MQA rows, as they do in the layer's own decode path."""
    if impl.mla_layer is None:
        raise LookupError("no MLAAttention layer linked to this impl (the builder links them before planning "
                          "sparse-MQA rows)")
    return impl.mla_layer


def sparse_mqa_rows(impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_rows: slice, metadata: Any,
                    out: torch.Tensor) -> None:
    """Prefill rows on sparse MQA, as the layer runs every token of a step whose masks do not fit:
    q absorbed by ``W_UK_T`` (L:1104-1105), concatenated with its rope part in the impl's
    ``q_concat`` workspace (``FlashMLASparseImpl.forward_mqa``'s BF16 branch), stock's BF16 sparse
    kernel call on the rows' ``topk_rows`` of the top-k buffer under ``metadata``, and the ``W_UV``
    up-projection into ``out`` (``_v_up_proj``)."""
    from vllm import _custom_ops as ops

    layer = attention_layer(impl)
    n, heads = q.shape[0], impl.num_heads
    q_nope, q_pe = torch.split(q, [impl.qk_nope_head_dim, impl.qk_rope_head_dim], dim=-1)
    ql_nope = q_nope.new_empty((n, heads, impl.kv_lora_rank))
    torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T, out=ql_nope.transpose(0, 1))
    q_mqa = workspace_views(impl).q_concat(n)
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
