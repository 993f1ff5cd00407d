"""Running the installed vLLM's sparse-MLA builder and impl on the CPU, for the backend's tests.

vLLM needs a GPU for three things these tests do not: the SM count, the Triton index
translation and the CUDA gather op. Each is replaced here by a torch version of what its
docstring specifies; the FlashMLA kernels become the float32 reference, recording every call.
"""

from __future__ import annotations

import importlib
import json
import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from mla_planner.executor.layout import PAGE_SIZE, as_slots, page_of, slot_of
from mla_planner.executor.reference import (
    gather_upconvert_reference,
    sparse_attention,
    sparse_decode_reference,
    sparse_prefill_reference,
)
from mla_planner.executor.providers import ReferenceProvider, ReferenceSchedule

MODEL_CONFIG = pathlib.Path(__file__).parent / "e2e" / "tiny-deepseek-v32" / "config.json"
SHARED_MODEL_CONFIG = pathlib.Path(__file__).parents[2] / "shared" / "e2e" / "tiny-deepseek-v32" / "config.json"
NUM_SMS = 132


def model_dir(tmp: pathlib.Path, *, num_heads: int, topk: int) -> pathlib.Path:
    """The tiny DeepSeek-V3.2 config with ``num_heads`` heads and top-``topk`` indexing."""
    source = MODEL_CONFIG if MODEL_CONFIG.exists() else SHARED_MODEL_CONFIG
    config = json.loads(source.read_text())
    config.update(num_attention_heads=num_heads, num_key_value_heads=num_heads, index_topk=topk)
    out = tmp / f"model-h{num_heads}-k{topk}"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


class DensePrefillBackend:
    """Stands in for the layer's dense-MHA prefill backend (FlashAttention on the GPU) as far as
    the sparse builder uses it: with one, short prefills run dense MHA and only the decode tokens
    reach the sparse kernels, as in a GPU engine without ``sparse_mla_force_mqa``."""

    def clone(self) -> DensePrefillBackend:
        return self

    def prepare_metadata(self, prefill: Any) -> None: ...


def vllm_config(model: pathlib.Path, *, kv_cache_dtype: str = "fp8_ds_mla", max_model_len: int = 4096,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, dense_prefill: bool = False) -> Any:
    """A CPU engine's configuration. ``dense_prefill``: the layer has a dense prefill backend
    (:class:`DensePrefillBackend`); without one, as by default, every prefill token is sparse."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16",
        generation_config="vllm",
    )
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=PAGE_SIZE, cache_dtype=cast(Any, kv_cache_dtype)),  # a Literal in vLLM's types
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    # The builder reads the layer's dense-MHA prefill backend from here.
    prefill_backend = DensePrefillBackend() if dense_prefill else None
    config.compilation_config.static_forward_context["layers.0.attn"] = SimpleNamespace(prefill_backend=prefill_backend)
    return config


def common_metadata(query_lens: list[int], context_lens: list[int], block_table: torch.Tensor, *,
                    exact_seq_lens: bool = True) -> Any:
    """vLLM's metadata of a step. ``exact_seq_lens=False``: without the exact CPU sequence lengths a
    release may keep beside the upper bound, as its runner under async speculative decoding builds it."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor(query_lens, dtype=torch.int32)
    seq = q + torch.tensor(context_lens, dtype=torch.int32)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(q, 0)
    import dataclasses

    # A release's metadata keeps the exact CPU sequence lengths beside the upper bound, or the bound only.
    keeps_exact = exact_seq_lens and "_seq_lens_cpu" in {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    exact: dict[str, Any] = {"_seq_lens_cpu": seq} if keeps_exact else {}
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        seq_lens=seq.clone(),
        num_reqs=len(query_lens),
        num_actual_tokens=int(q.sum()),
        max_query_len=int(q.max()),
        max_seq_len=int(seq.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(int(q.sum()), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq,
        **exact,
    )


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    BLOCK_SIZE: int = 64,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    HAS_PREFILL_WORKSPACE: bool = False,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    BLOCK_STRIDE_ROWS: int | None = None,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    **context_parallel: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``triton_convert_req_index_to_global_index`` as its docstring defines it, with the
    ``BLOCK_STRIDE_ROWS`` (physical rows per block) and preallocated outputs of the releases that
    pass them. Context-parallel arguments are not modelled: one away from its default fails the test."""
    defaults = dict(prefill_workspace_rank_stride=None, dcp_size=1, dcp_rank=0, cp_kv_cache_interleave_size=1,
                    idx_mapping=None)
    assert all(defaults[k] == v for k, v in context_parallel.items()), context_parallel
    assert req_id.shape[0] == token_indices.shape[0]
    pos = token_indices.long()
    valid = pos >= 0
    page = block_table[req_id.long()].long().gather(1, page_of(pos, BLOCK_SIZE).clamp(max=block_table.shape[1] - 1))
    # Blocks BLOCK_STRIDE_ROWS physical rows apart where the release passes it; else (None) the page formula.
    out_slots = slot_of(page, pos, BLOCK_SIZE) if BLOCK_STRIDE_ROWS is None else page * BLOCK_STRIDE_ROWS + pos % BLOCK_SIZE
    if HAS_PREFILL_WORKSPACE:
        assert prefill_workspace_request_ids is not None and prefill_workspace_starts is not None
        prefill = prefill_workspace_request_ids.long()
        is_prefill = (prefill >= 0).unsqueeze(1)
        starts = prefill_workspace_starts.long()[prefill.clamp(min=0)].unsqueeze(1)
        out_slots = torch.where(is_prefill, starts + pos, out_slots)
    slots = torch.where(valid, out_slots, -1).to(torch.int32)
    counts = valid.sum(1).to(torch.int32)
    if return_valid_counts:
        # The prefill kernel reads each row's first `count` indices: the valid ones lead (as the
        # indexer's top-k puts them; attention does not depend on the keys' order).
        slots = slots.gather(1, torch.argsort((~valid).to(torch.int8), dim=1, stable=True))
    if out is not None:
        slots = out.copy_(slots)
    if valid_counts_out is not None:
        counts = valid_counts_out.copy_(counts)
    if return_valid_counts:
        return slots, counts
    return slots


class NullStream:
    """A CUDA stream or event where there is one stream: every wait and record is a no-op."""

    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def __enter__(self) -> NullStream:
        return self
    def __exit__(self, *exc: object) -> None: ...


def compute_token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int,
                                 num_tokens: int) -> torch.Tensor:
    """vLLM's ``compute_token_to_req_indices`` (a Triton kernel, in the releases that have it) as its docstring defines it:
    each of the first ``num_tokens`` tokens' request index, 0 at or past ``num_mapped_tokens``."""
    token = torch.arange(num_tokens)
    req = torch.searchsorted(query_start_loc[1:].long(), token, right=True).clamp(max=query_start_loc.shape[0] - 2)
    out[:num_tokens] = torch.where(token < num_mapped_tokens, req, 0).to(out.dtype)
    return out[:num_tokens]


class KernelRecorder:
    """The FlashMLA kernels as the float32 reference, recording each call's shapes."""

    def __init__(self) -> None:
        self.decode_calls: list[tuple[int, ...]] = []
        self.prefill_calls: list[tuple[int, ...]] = []
        self.prefill_q: list[torch.Tensor] = []
        self.prefill_out_ptrs: list[int] = []
        self.prefill_q_ptrs: list[int] = []
        from mla_planner import NATIVE_PREFILL_HEADS
        from mla_planner.vllm_backend.releases import release

        native = tuple(NATIVE_PREFILL_HEADS) if release.native_prefill_kernels else ()
        self.prefill_heads = (*native, 64, 128)

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: Any, cache_seqlens: Any,
                               head_dim_v: int, tile_scheduler_metadata: Any, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
                               indices: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert indices is not None and softmax_scale is not None and is_fp8_kvcache
        self.decode_calls.append(tuple(q.shape))
        return sparse_decode_reference(q, k_cache, indices, softmax_scale)

    def flash_mla_sparse_fwd(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, topk_length: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # As the real kernels: 64 and 128 heads, and 16 and 32 in a build with native prefill kernels.
        if q.shape[1] not in self.prefill_heads:
            raise RuntimeError(f"flash_mla_sparse_fwd: no kernel for {q.shape[1]} heads (this build runs {self.prefill_heads})")
        self.prefill_calls.append(tuple(q.shape))
        self.prefill_q.append(q.clone())
        self.prefill_q_ptrs.append(q.data_ptr())
        result, lse = sparse_prefill_reference(q, kv, indices, sm_scale, topk_length)
        if out is not None:
            assert out.shape == result.shape and out.stride(-1) == 1
            self.prefill_out_ptrs.append(out.data_ptr())
            result = out.copy_(result)
        return result, lse, lse


class RecordingProvider(ReferenceProvider):
    """The executors' provider: the reference kernels (the prefill kernel's heads as this vLLM's
    FlashMLA runs them), recording each launch's q and buffers."""

    def __init__(self) -> None:
        from mla_planner.vllm_backend.releases import release

        super().__init__(takes_out=True, native_prefill_heads=release.native_prefill_kernels)
        self.schedules_created = 0
        self.launch_q: list[torch.Tensor] = []
        self.launch_ptrs: list[tuple[int, int | None]] = []
        """Each decode launch's q and ``out=`` (``None``: none) data pointers."""
        self.prefill_calls: list[tuple[int, ...]] = []
        self.prefill_q: list[torch.Tensor] = []
        self.prefill_q_ptrs: list[int] = []
        self.prefill_out_ptrs: list[int] = []
        self.gathers = 0

    def new_decode_schedule(self) -> ReferenceSchedule:
        self.schedules_created += 1
        return super().new_decode_schedule()

    def sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, schedule: Any,
                      softmax_scale: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.launch_q.append(q.clone())
        self.launch_ptrs.append((q.data_ptr(), None if out is None else out.data_ptr()))
        return super().sparse_decode(q, kv_cache, indices, schedule, softmax_scale, out)

    def sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                       out: torch.Tensor | None = None,
                       topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.prefill_calls.append(tuple(q.shape))
        self.prefill_q.append(q.clone())
        self.prefill_q_ptrs.append(q.data_ptr())
        if out is not None:
            self.prefill_out_ptrs.append(out.data_ptr())
        return super().sparse_prefill(q, kv, indices, softmax_scale, out, topk_length)

    def gather_upconvert(self, kv_cache: torch.Tensor, workspace: torch.Tensor, block_table: torch.Tensor,
                         workspace_starts: torch.Tensor, num_requests: int) -> None:
        self.gathers += 1
        super().gather_upconvert(kv_cache, workspace, block_table, workspace_starts, num_requests)


def patch_if_present(monkeypatch: pytest.MonkeyPatch, module_name: str, attr: str, value: Any) -> None:
    """Replace ``module_name.attr`` where this vLLM has it (the GPU-only pieces differ by version)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    if hasattr(module, attr):
        monkeypatch.setattr(module, attr, value)


@contextmanager
def cpu_vllm(monkeypatch: pytest.MonkeyPatch, provider: RecordingProvider, kernels: KernelRecorder) -> Iterator[None]:
    """Swap vLLM's GPU-only pieces for the CPU versions above while the builder and impl run."""
    import vllm.v1.attention.backends.mla.flashmla_sparse as stock

    import mla_planner.vllm_backend.backend as backend
    import mla_planner.vllm_backend.vllm_api as vllm_api

    monkeypatch.setattr(stock, "num_compute_units", lambda device_id=None: NUM_SMS)
    monkeypatch.setattr(vllm_api, "num_sms", lambda device: NUM_SMS)
    # Every module that holds the Triton translation under its name: stock's, the one the
    # backend calls through (the release reads it from sparse_utils), and an index group's.
    for name in ("flashmla_sparse", "sparse_utils", "index_group"):
        patch_if_present(monkeypatch, f"vllm.v1.attention.backends.mla.{name}", "triton_convert_req_index_to_global_index",
                         convert_req_index_to_global_index)
    # Stock's separate route gathers its prefills' rows through vLLM's op: the reference the
    # backend's provider gathers with.
    patch_if_present(monkeypatch, "vllm._custom_ops", "cp_gather_and_upconvert_fp8_kv_cache", gather_upconvert_reference)
    monkeypatch.setattr(stock, "flash_mla_with_kvcache", kernels.flash_mla_with_kvcache)
    monkeypatch.setattr(stock, "flash_mla_sparse_fwd", kernels.flash_mla_sparse_fwd)
    monkeypatch.setattr(stock, "get_mla_metadata", lambda *a, **k: (object(), None))
    monkeypatch.setattr(backend, "kernel_provider", lambda: provider)
    # An index group (where the release has them) translates on a side stream, ordered by events: one stream here.
    index_group = "vllm.v1.attention.backends.mla.index_group"
    patch_if_present(monkeypatch, index_group, "current_stream", NullStream)
    patch_if_present(monkeypatch, index_group, "_create_side_stream", lambda device: NullStream())
    patch_if_present(monkeypatch, index_group, "_create_event", NullStream)
    # Where the release maps tokens to requests on the device.
    patch_if_present(monkeypatch, "vllm.v1.attention.ops.metadata", "compute_token_to_req_indices",
                     compute_token_to_req_indices)
    sparse_mla = "vllm.model_executor.layers.attention.sparse_mla_attention"
    # One rank, with no process groups: a release's sparse-MLA impl may ask the TP group's size.
    patch_if_present(monkeypatch, sparse_mla, "get_tensor_model_parallel_world_size", lambda: 1)
    # No pinned host memory without a GPU: a release's MLA builders import the flag or ask for it
    # outright (the chunked-context metadata of a dense prefill with context).
    for name in ("vllm.utils.torch_utils", sparse_mla, "vllm.model_executor.layers.attention.mla_attention"):
        patch_if_present(monkeypatch, name, "PIN_MEMORY", False)
    zeros, empty = torch.zeros, torch.empty
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    yield


def forward_out(result: Any) -> torch.Tensor:
    """An FP8 forward's output: ``(out, lse)`` where the release returns the LSE (its facts'
    ``forward_returns_lse``), with no LSE outside context parallelism; else ``out``."""
    if isinstance(result, tuple):
        out, lse = result
        assert lse is None
        return cast(torch.Tensor, out)
    return cast(torch.Tensor, result)


def request_slots(indices: torch.Tensor, query_lens: list[int], block_table: torch.Tensor,
                  block_size: int = PAGE_SIZE) -> torch.Tensor:
    """Request-relative top-k positions -> cache slots (rows of the cache as allocated), request by
    request (``-1`` stays)."""
    req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = convert_req_index_to_global_index(req.to(torch.int32), block_table, indices, BLOCK_SIZE=block_size)
    assert isinstance(slots, torch.Tensor)
    return slots


def reference_output(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    return sparse_attention(q, as_slots(kv_cache), slots, scale)[0]


def causal_positions(query_lens: list[int], context_lens: list[int], topk: int, gen: torch.Generator) -> torch.Tensor:
    """Each token's top-k request positions, drawn from ``[0, its position]``, some ``-1``."""
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(query_lens, context_lens)])
    draws = (torch.rand((len(pos), topk), generator=gen) * (pos.unsqueeze(1) + 1)).floor().to(torch.int32)
    return draws.masked_fill(torch.rand((len(pos), topk), generator=gen) < 0.1, -1)


def shuffled_block_table(seq_lens: list[int], gen: torch.Generator, block_size: int = PAGE_SIZE) -> tuple[torch.Tensor, int]:
    """Each request's blocks, drawn at random from one pool, and the pool's size."""
    pages = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    table = torch.full((len(seq_lens), max(pages)), 0, dtype=torch.int32)
    first = 0
    for r, n in enumerate(pages):
        table[r, :n] = order[first : first + n]
        first += n
    return table, sum(pages)


def numpy_lengths(values: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.asarray(values, dtype=np.int64)


def custom_backend_in_this_process(results: Any) -> None:
    """What a vLLM worker does at start-up (``WorkerWrapperBase.init_worker``: load the general
    plugins), then which class ``CUSTOM`` names here; run in a child process."""
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call]
    results.put(AttentionBackendEnum.CUSTOM.get_path())
