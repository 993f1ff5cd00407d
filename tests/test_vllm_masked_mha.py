"""vLLM's masked-MHA prefill (in the releases that have it) through the backend, on the CPU: the real
``MLAAttention`` layer (its ``forward_impl`` and its ``_use_sparse_mha`` decision), the real
builders and impls (the backend's and stock's), the real dense prefill backend for the CPU, with
fakes for what needs an SM100 GPU: FA4's masked attention (``flash_attn_varlen_func`` with a top-k
mask, a float32 reference that records each call), FlashMLA's sparse kernel (the float32 reference
of tests/vllm_cpu.py, recording each call), and the Triton and CUDA helpers around them (mask
building, q concatenation, the context gather, the merge), each a torch version of what vLLM's code
says it does. No GPU here runs FA4: what these tests show is which calls the layer makes,
on which rows, with which masks, and that the rows hold the attention the top-k indices define.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from releases import NEEDS_VLLM, only_where

pytest.importorskip("vllm", reason=NEEDS_VLLM)

import mla_planner  # noqa: E402
from mla_planner.executor.reference import sparse_attention  # noqa: E402
from mla_planner.vllm_backend.releases import release  # noqa: E402
from mla_planner.vllm_backend.reservation import Reservation  # noqa: E402
from fixtures import gen  # noqa: E402, F401  (a pytest fixture)
from vllm_cpu import (  # noqa: E402
    KernelRecorder,
    RecordingProvider,
    common_metadata,
    cpu_vllm,
    model_dir,
    request_slots,
    shuffled_block_table,
    vllm_config,
)

# Any-typed: their masked-MHA members are the releases' that have it (mypy may read one without).
mla: Any = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
sparse_mla: Any = importlib.import_module("vllm.model_executor.layers.attention.sparse_mla_attention")
merge: Any = importlib.import_module("vllm.v1.attention.ops.merge_attn_states")

pytestmark = only_where(lambda f: f.masked_mha, "no masked-MHA prefill (SM100, FA4)")

HEADS, TOPK = 16, 128
NOPE, ROPE, V, LATENT = 128, 64, 128, 512
SCALE = (NOPE + ROPE) ** -0.5
PAGE = 64

# Two decodes, then four prefills: P0 short (dense MHA: sequence within top-k) with context,
# P1 long, P2 with context, P3. The step's longest query (1,536) and sequence (1,536) make vLLM's
# speed table take masked MHA at TP 1 (sequences up to 2,048 from queries of 1,536).
QUERY_LENS = [1, 1, 60, 1536, 200, 150]
CONTEXT_LENS = [40, 300, 40, 0, 250, 0]
DECODES = 2

# Mask workspaces (vLLM's is 128 MiB): P1's mask alone is 288 KiB (1,536 rows x 48 words x 4 B).
MIB = 1 << 20
P1_OUT = 256 << 10   # P1 fits no mask: P0 dense, P1 sparse MQA, P2+P3 masked MHA
P1_IN = 320 << 10    # P1 fits alone: P0 dense, P1 masked, P2+P3 masked


# -- fakes for the SM100 pieces -------------------------------------------------------------------


DENSE_MASK_MOD = object()
OFFSET_MASK_MOD = object()


class FakeFA4:
    """``flash_attn_varlen_func`` with FA4's top-k ``mask_mod`` as vLLM calls it
    (sparse_mla_attention.py:1029-1057): per batch entry, query row ``i`` may attend key ``j``
    where bit ``j`` (``j + key_start`` with the offset variant, the key start in the last word of
    the entry's row 0) of mask row ``i`` is set, and, causal, ``j <= i`` (bottom-right aligned).
    Float32; a row that may attend nothing gives 0 with an LSE of -inf."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                 return_softmax_lse: bool, fa_version: int, mask_mod: object, aux_tensors: list[torch.Tensor],
                 aux_tensor_leading_dims: list[int], causal: bool) -> Any:
        assert fa_version == 4 and mask_mod in (DENSE_MASK_MOD, OFFSET_MASK_MOD)
        mask = aux_tensors[0]
        offset = mask_mod is OFFSET_MASK_MOD
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        self.calls.append(dict(batch=len(cu_q) - 1, tokens=q.shape[0], causal=causal, offset=offset,
                               mask_shape=tuple(mask.shape), q_ptr=q.data_ptr()))
        heads = q.shape[1]
        out = torch.zeros((q.shape[0], heads, v.shape[-1]), dtype=torch.float32)
        lse = torch.full((heads, q.shape[0]), float("-inf"))
        for b in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            nq, nk = q1 - q0, k1 - k0
            if nq == 0 or nk == 0:
                continue
            key = torch.arange(nk) + (int(mask[b, 0, -1]) if offset else 0)
            words = mask[b, :nq][:, key >> 5].long()
            allowed = ((words >> (key & 31)) & 1).bool()
            if causal:
                allowed &= torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
            scores = torch.einsum("ihd,jhd->hij", q[q0:q1].float(), k[k0:k1].float()) * softmax_scale
            scores.masked_fill_(~allowed[None], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.nan_to_num(torch.exp(scores - row_lse[..., None]))
            out[q0:q1] = torch.einsum("hij,jhd->ihd", probs, v[k0:k1].float())
            lse[:, q0:q1] = row_lse
        result = out.to(q.dtype)
        return (result, lse) if return_softmax_lse else result


def build_topk_mask(topk_indices_per_req: list[torch.Tensor], q_lens: list[int], max_q_len: int, max_seq_len: int,
                    out: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_build_topk_mask`` (two Triton kernels): every row of ``out[b, :max_q_len]``
    has its first ``ceil(max_seq_len / 32)`` words cleared, and row ``i < q_lens[b]`` gets bit
    ``p`` set for each of its top-k positions ``p >= 0`` (the entries' rows packed in order)."""
    num_words = -(-max_seq_len // 32)
    out[: len(q_lens), :max_q_len, :num_words] = 0
    for b, (topk, q_len) in enumerate(zip(topk_indices_per_req, q_lens)):
        idx = topk[:q_len].long()
        hits = torch.zeros((q_len, num_words * 32), dtype=torch.int64)
        hits.scatter_add_(1, idx.clamp(min=0), (idx >= 0).long())
        bits = (hits > 0).view(q_len, num_words, 32).long() << torch.arange(32)
        words = bits.sum(-1)
        out[b, :q_len, :num_words] = (words - (words >= 2**31).long() * 2**32).to(torch.int32)
    return out[: len(q_lens), :max_q_len]


def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor) -> None:
    """vLLM's ``concat_mla_q``: each head's nope and rope parts side by side."""
    heads, nope = ql_nope.shape[1], ql_nope.shape[2]
    q_out[:, :heads, :nope] = ql_nope
    q_out[:, :heads, nope:] = q_pe


def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str, scale: torch.Tensor, seq_starts: torch.Tensor | None = None) -> None:
    """vLLM's context gather for a non-quantized cache: token ``t`` of request ``token_to_seq[t]``
    is its position ``seq_starts + t - cu_seq_lens``, copied from its page."""
    assert kv_cache_dtype == "auto"
    seq = token_to_seq[:num_tokens].long()
    pos = torch.arange(num_tokens) - cu_seq_lens.long()[seq]
    if seq_starts is not None:
        pos = pos + seq_starts.long()[seq]
    page = block_table.long()[seq, pos // PAGE]
    dst[:num_tokens] = src_cache[page, pos % PAGE]


# -- the layer, builders and a step ---------------------------------------------------------------


class KvBProj(torch.nn.Module):
    """``kv_b_proj`` as the MLA code calls it: latent -> (per head nope keys and values,)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.reshape(-1, LATENT), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x @ self.weight.T,)


class Engine:
    """Two attention layers of one engine on the CPU, with one step's inputs: ``layers.0.attn`` on
    the backend (``PlannedFlashMLASparseBackend``) and ``layers.1.attn`` on stock's
    ``FlashMLASparseBackend``, each with its builder; a BF16 KV cache."""

    def __init__(self, tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator,
                 mask_workspace_bytes: int) -> None:
        import vllm._custom_ops as custom_ops
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        from mla_planner.vllm_backend.backend import PlannedFlashMLASparseBackend

        monkeypatch.setenv("MLA_PLANNER_COST_PROFILE", "none")
        monkeypatch.setattr(Reservation, "reserve", lambda self, num_bytes, device: False)
        self.kernels = KernelRecorder()
        self._cpu = cpu_vllm(monkeypatch, RecordingProvider(), self.kernels)
        self._cpu.__enter__()
        # SM100 with FA4 (the dimension check is the model's; no GPU here has either).
        monkeypatch.setattr(sparse_mla, "_is_masked_mha_available", lambda *args, **kwargs: True)
        monkeypatch.setattr(sparse_mla, "GLOBAL_TOPK_MASK_MAX_BYTES", mask_workspace_bytes)
        monkeypatch.setattr(sparse_mla, "_build_topk_mask", build_topk_mask)
        self.fa4 = FakeFA4()
        flash_attn = types.ModuleType("vllm.vllm_flash_attn")
        flash_attn.flash_attn_varlen_func = self.fa4  # type: ignore[attr-defined]
        mask_mods = types.ModuleType("vllm.model_executor.layers.attention.sparse_mla_mask")
        mask_mods.dense_mask_mod = DENSE_MASK_MOD  # type: ignore[attr-defined]
        mask_mods.offset_dense_mask_mod = OFFSET_MASK_MOD  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", flash_attn)
        monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.attention.sparse_mla_mask", mask_mods)
        monkeypatch.setattr(custom_ops, "concat_mla_q", concat_mla_q)
        monkeypatch.setattr(custom_ops, "gather_and_maybe_dequant_cache", gather_and_maybe_dequant_cache)
        for module in (mla, sparse_mla):  # no Triton on the CPU: vLLM's own torch merge
            monkeypatch.setattr(module, "merge_attn_states", merge._merge_attn_states_torch)
        monkeypatch.setattr(mla, "PIN_MEMORY", False)  # the chunked-context metadata's (no GPU)
        self.dense_calls: list[int] = []
        dense_run = CPUSDPAMLAPrefillBackend.run_prefill_new_tokens

        def recording_dense_run(backend: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.dense_calls.append(q.shape[0])
            return dense_run(backend, q, *args, **kwargs)

        monkeypatch.setattr(CPUSDPAMLAPrefillBackend, "run_prefill_new_tokens", recording_dense_run)

        self.config = vllm_config(model_dir(tmp, num_heads=HEADS, topk=TOPK), kv_cache_dtype="auto")
        self.config.compilation_config.static_forward_context.clear()  # the real layers register here
        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
        self.weight = (torch.randn((HEADS, NOPE + V, LATENT), generator=gen) * 0.05).to(torch.bfloat16)
        self.topk_buffer = torch.full((self.config.scheduler_config.max_num_batched_tokens, TOPK), -1, dtype=torch.int32)
        spec = MLAAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=LATENT + ROPE, dtype=torch.bfloat16)
        self.layers, self.builders = [], []
        with set_current_vllm_config(self.config):
            for index, backend in enumerate((PlannedFlashMLASparseBackend, FlashMLASparseBackend)):
                name = f"layers.{index}.attn"
                layer = MLAAttention(
                    num_heads=HEADS, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                    q_lora_rank=None, kv_lora_rank=LATENT, kv_b_proj=KvBProj(self.weight),  # type: ignore[arg-type]
                    cache_config=self.config.cache_config, prefix=name, attn_backend=backend, use_sparse=True,
                    topk_indices_buffer=self.topk_buffer, prefill_backend_cls=CPUSDPAMLAPrefillBackend,
                )
                # What process_weights_after_loading derives from kv_b_proj (mla_attention.py:1347-1349).
                layer.W_UK_T = self.weight[:, :NOPE, :]
                layer.W_UV = self.weight[:, NOPE:, :].transpose(1, 2)
                self.layers.append(layer)
                self.builders.append(backend.get_builder_cls()(spec, [name], self.config, torch.device("cpu")))

    def close(self) -> None:
        self._cpu.__exit__(None, None, None)

    @property
    def ours(self) -> Any:
        return self.layers[0]

    def step(self, gen: torch.Generator, query_lens: list[int] = QUERY_LENS,
             context_lens: list[int] = CONTEXT_LENS) -> dict[str, Any]:
        """One step's metadata from each builder, its inputs (the cache already holds the new
        tokens' latents, as after vLLM's cache update) and the float32 reference output."""
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        block_table, num_pages = shuffled_block_table(seq_lens, gen)
        kv_cache = torch.randn((num_pages, PAGE, LATENT + ROPE), generator=gen).to(torch.bfloat16)
        common = common_metadata(query_lens, context_lens, block_table)
        positions = top_k_positions(query_lens, context_lens, gen)
        self.topk_buffer.fill_(-1)
        self.topk_buffer[: positions.shape[0]] = positions
        slots = request_slots(positions, query_lens, block_table)
        own = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
        req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        rows = kv_cache.view(-1, LATENT + ROPE)[block_table[req, own // PAGE].long() * PAGE + own % PAGE]
        q = torch.randn((len(own), HEADS, NOPE + ROPE), generator=gen).to(torch.bfloat16)
        return dict(
            metadata=[builder.build(0, common) for builder in self.builders], common=common, kv_cache=kv_cache, q=q,
            kv_c_normed=rows[:, :LATENT].contiguous(), k_pe=rows[:, LATENT:].unsqueeze(1).contiguous(),
            expected=reference(q, kv_cache, slots, self.weight),
        )

    def forward(self, layer: Any, case: dict[str, Any], metadata: Any) -> torch.Tensor:
        """The layer's ``forward_impl`` on the step, in a forward context as vLLM runs it."""
        from vllm.forward_context import set_forward_context

        q = case["q"]
        output = torch.empty((q.shape[0], HEADS * V), dtype=q.dtype)
        with set_forward_context({layer.layer_name: metadata}, self.config):
            layer.forward_impl(q, case["kv_c_normed"], case["k_pe"], case["kv_cache"], metadata, output)
        return output


def top_k_positions(query_lens: list[int], context_lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Each token's top-k positions as vLLM's indexer gives them: distinct, causal (at most the
    token's own position), every position while there are no more than top-k; ``-1`` padded."""
    rows = []
    for n, c in zip(query_lens, context_lens):
        for pos in range(c, c + n):
            take = torch.randperm(pos + 1, generator=gen)[:TOPK].to(torch.int32)
            rows.append(torch.cat([take, torch.full((TOPK - take.numel(),), -1, dtype=torch.int32)]))
    return torch.stack(rows)


def reference(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each token's attention over its top-k cache rows in float32, in the absorbed form (equal to
    MHA over the same keys): q's nope part through ``W_UK``, the latent output through ``W_UV``."""
    w = weight.float()
    q_latent = torch.einsum("tnp,npl->tnl", q[..., :NOPE].float(), w[:, :NOPE])
    out, _lse = sparse_attention(torch.cat([q_latent, q[..., NOPE:].float()], -1),
                                 kv_cache.view(-1, LATENT + ROPE).float(), slots, SCALE)
    return torch.einsum("tnl,nvl->tnv", out, w[:, NOPE:]).reshape(q.shape[0], HEADS * V)


@pytest.fixture
def engine_factory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(mask_workspace_bytes: int) -> Engine:
        engines.append(Engine(tmp_path, monkeypatch, gen, mask_workspace_bytes))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def close_to(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """BF16 inputs and outputs, float32 inside: within a few BF16 steps of the output's scale."""
    torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


# -- tests ----------------------------------------------------------------------------------------


def assert_stocks_all_sparse_mqa_step(engine: Any, layer: Any, case: dict[str, Any], metadata: Any) -> None:
    """The layer runs the step as stock does when the masks do not fit: every prefill token in one
    sparse-MQA call, no MHA call, the reference's output."""
    out = engine.forward(layer, case, metadata)
    assert engine.fa4.calls == [] and engine.dense_calls == []
    assert engine.kernels.prefill_calls == [(sum(QUERY_LENS), 64, 576)], "every prefill token in one sparse MQA call"
    close_to(out, case["expected"])


def test_one_mask_too_many_runs_the_rest_in_the_planners_groups(engine_factory: Any, gen: torch.Generator) -> None:
    """P1's mask fits no workspace: stock runs the whole step on sparse MQA; the backend runs P0
    as dense MHA, P2 and P3 as one masked-MHA group, and only P1 on sparse MQA."""
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(P1_OUT)
    case = engine.step(gen)
    ours_md, stock_md = case["metadata"]
    ours_layer, stock_layer = engine.layers
    # The layer's own decision: masked MHA but for the fit; the fit is where the two differ.
    assert not stock_layer._use_sparse_mha(stock_md)
    assert ours_layer._use_sparse_mha(ours_md)
    assert not stock_layer.impl.masked_mha_workspace_fits(ours_md.prefill)
    planned = mla_planner.plan_prefill_groups(QUERY_LENS[DECODES:], CONTEXT_LENS[DECODES:], topk=TOPK, workspace_bytes=P1_OUT,
                                              context_chunk_rows=engine.builders[0].chunked_prefill_workspace_size)
    partial = masked_mha.plan_of(ours_md.prefill)
    assert partial is not None
    assert partial.groups.requests.tolist() == planned.requests.tolist() == [[0, 1], [1, 2], [2, 4]]
    assert partial.groups.paths == planned.paths == ["dense_mha", "sparse_mqa", "masked_mha"]

    assert_stocks_all_sparse_mqa_step(engine, stock_layer, case, stock_md)

    engine.kernels.prefill_calls.clear()
    out = engine.forward(ours_layer, case, ours_md)
    # P0: the dense prefill backend, on its 60 tokens (its context through the same backend).
    assert engine.dense_calls == [60]
    # P1: one sparse MQA call of its 1,536 tokens; then the layer's own decode call.
    assert engine.kernels.prefill_calls == [(1536, 64, 576), (DECODES, 64, 576)]
    # P2 and P3: one masked-MHA group -- the suffix (causal, both requests) under one global mask
    # over whole sequences, then P2's context chunk under the same mask, keys offset.
    calls = [(c["batch"], c["tokens"], c["causal"], c["offset"], c["mask_shape"]) for c in engine.fa4.calls]
    global_mask = mla_planner.topk_mask_shape(2, 200, 450, reserve_key_starts_word=True)
    assert calls == [(2, 350, True, True, global_mask), (1, 200, False, True, (1, *global_mask[1:]))]
    assert math.prod(global_mask) * 4 == int(partial.groups.mask_bytes[2]) <= P1_OUT
    close_to(out, case["expected"])
    # Each group's rows, and the decodes', hold their own tokens' attention.
    offset = sum(QUERY_LENS[:DECODES])
    for run in partial.runs:
        rows = slice(offset + run.rows.start, offset + run.rows.stop)
        close_to(out[rows], case["expected"][rows])
    close_to(out[:offset], case["expected"][:offset])


def test_when_the_long_prompt_fits_alone_nothing_is_left_on_sparse_mqa(engine_factory: Any, gen: torch.Generator) -> None:
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(P1_IN)
    case = engine.step(gen)
    ours_md, stock_md = case["metadata"]
    partial = masked_mha.plan_of(ours_md.prefill)
    assert partial is not None and partial.groups.paths == ["dense_mha", "masked_mha", "masked_mha"]
    out = engine.forward(engine.ours, case, ours_md)
    assert engine.kernels.prefill_calls == [(DECODES, 64, 576)], "only the decodes on sparse MQA"
    assert engine.dense_calls == [60]
    # P1 alone: one causal call under its own mask (no context: no global mask); P2+P3 as above.
    p1_mask = mla_planner.topk_mask_shape(1, 1536, 1536)
    assert [(c["batch"], c["tokens"], c["causal"], c["mask_shape"]) for c in engine.fa4.calls][0] == (1, 1536, True, p1_mask)
    assert math.prod(p1_mask) * 4 == int(partial.groups.mask_bytes[1]) == 288 << 10
    assert len(engine.fa4.calls) == 3
    close_to(out, case["expected"])
    # Every masked group passes vLLM's own fit test on the metadata the builder made for it.
    for run in partial.runs:
        if run.path == "masked_mha":
            assert release.masked_mha is not None and release.masked_mha.masked_mha_set_fits(run.metadata.prefill)


def test_a_step_whose_masks_fit_runs_as_stock(engine_factory: Any, gen: torch.Generator) -> None:
    """vLLM's 128 MiB workspace holds the whole step's masks: no plan, and the backend's layer makes
    exactly stock's calls and writes exactly stock's output."""
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(mla_planner.GLOBAL_TOPK_MASK_MAX_BYTES)
    case = engine.step(gen)
    ours_md, stock_md = case["metadata"]
    assert masked_mha.plan_of(ours_md.prefill) is None
    assert engine.ours.impl.masked_mha_workspace_fits(ours_md.prefill)
    stock_out = engine.forward(engine.layers[1], case, stock_md)
    stock_calls, engine.fa4.calls = engine.fa4.calls, []
    stock_kernels, engine.kernels.prefill_calls = engine.kernels.prefill_calls, []
    out = engine.forward(engine.ours, case, ours_md)
    strip = [{k: v for k, v in c.items() if k != "q_ptr"} for c in stock_calls]
    assert [{k: v for k, v in c.items() if k != "q_ptr"} for c in engine.fa4.calls] == strip
    assert strip[0]["batch"] == 4, "all four prefills in one masked-MHA set"
    assert engine.kernels.prefill_calls == stock_kernels == [(DECODES, 64, 576)]
    assert torch.equal(out, stock_out)
    close_to(out, case["expected"])


@pytest.mark.parametrize("error", [RuntimeError, mla_planner.PanicException])
def test_a_step_the_groups_cannot_plan_runs_as_stock(engine_factory: Any, gen: torch.Generator,
                                                     monkeypatch: pytest.MonkeyPatch, error: type[BaseException]) -> None:
    """Planning the groups fails (here: made to; a planner bug arrives as pyo3's PanicException,
    a BaseException): the build does not raise, the step carries no plan, the reason is counted
    once, and the layer runs stock's all-sparse-MQA step."""
    from mla_planner.vllm_backend import masked_mha

    def fail(*_args: Any) -> None:
        raise error("a shape the planner did not expect")

    monkeypatch.setattr(masked_mha, "partial_prefill", fail)
    reason = f"the step's masked-MHA groups could not be planned ({error.__name__})"
    before = masked_mha.left[reason]
    engine = engine_factory(P1_OUT)
    case = engine.step(gen)
    ours_md, _stock = case["metadata"]
    assert masked_mha.left[reason] == before + 1
    assert masked_mha.plan_of(ours_md.prefill) is None
    assert_stocks_all_sparse_mqa_step(engine, engine.ours, case, ours_md)


def test_a_layer_call_whose_groups_cannot_run_runs_every_prefill_on_sparse_mqa(
        engine_factory: Any, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last group's masked-MHA call fails (here: made to) after the first two groups wrote
    their rows: nothing raises; every prefill token runs in one sparse-MQA call, as stock runs the
    step, the decodes in the layer's own call; the reference's output; the reason counted once."""
    from mla_planner.vllm_backend import masked_mha
    from mla_planner.vllm_backend.vllm_api import FlashMLASparseImpl

    engine = engine_factory(P1_OUT)
    case = engine.step(gen)
    ours_md, _stock = case["metadata"]
    partial = masked_mha.plan_of(ours_md.prefill)
    assert partial is not None and partial.runs[-1].path == "masked_mha"
    original = FlashMLASparseImpl.forward_mha

    def fail_on_the_masked_group(impl: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                                 kv_cache: torch.Tensor, metadata: Any, *rest: Any) -> None:
        if metadata is partial.runs[-1].metadata:
            raise RuntimeError("the masked-MHA call failed")
        original(impl, q, kv_c_normed, k_pe, kv_cache, metadata, *rest)

    monkeypatch.setattr(FlashMLASparseImpl, "forward_mha", fail_on_the_masked_group)
    reason = "the layer's masked-MHA groups could not run (RuntimeError)"
    before = masked_mha.left[reason]
    out = engine.forward(engine.ours, case, ours_md)
    prefill_tokens = sum(QUERY_LENS) - DECODES
    assert engine.dense_calls == [60], "the dense group ran before the failure"
    assert engine.kernels.prefill_calls == [(1536, 64, 576), (prefill_tokens, 64, 576), (DECODES, 64, 576)], \
        "P1's group, then every prefill token in one sparse-MQA call, then the decodes"
    assert engine.fa4.calls == [], "the failed group's call made none"
    close_to(out, case["expected"])
    assert masked_mha.left[reason] == before + 1


def test_the_builder_links_each_impl_to_its_layer_before_planning_groups(engine_factory: Any,
                                                                         gen: torch.Generator) -> None:
    """Groups on sparse MQA, and the fallback of every group, run the layer's absorbed weights: the
    builder links the impl to its layer when it plans a step's groups, so no layer call has to find
    it (a lookup that failed there would fail the fallback too)."""
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(P1_OUT)
    impl = engine.ours.impl
    assert impl.mla_layer is None
    ours_md, _stock = engine.step(gen)["metadata"]
    assert masked_mha.plan_of(ours_md.prefill) is not None and impl.mla_layer is engine.ours


def test_a_layer_whose_sparse_mqa_path_differs_keeps_stocks_step(engine_factory: Any, gen: torch.Generator) -> None:
    """The layer pads its heads (a weight path the sparse-MQA rows do not take): the builder plans
    no group for it, counted once, and the layer runs stock's all-sparse-MQA step; nothing raises
    in the forward."""
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(P1_OUT)
    engine.ours.q_pad_num_heads = 64
    reason = "the step's masked-MHA groups could not be planned (ValueError)"
    before = masked_mha.left[reason]
    case = engine.step(gen)
    ours_md, _stock = case["metadata"]
    assert masked_mha.left[reason] == before + 1
    assert masked_mha.plan_of(ours_md.prefill) is None
    engine.ours.q_pad_num_heads = None  # the CPU stand-ins run the unpadded path only
    assert_stocks_all_sparse_mqa_step(engine, engine.ours, case, ours_md)


def test_no_prefill_fits_any_mask_is_stocks_step(engine_factory: Any, gen: torch.Generator) -> None:
    """Every prefill too large alone: the planner's one sparse-MQA group is stock's route, so no plan."""
    from mla_planner.vllm_backend import masked_mha

    engine = engine_factory(16 << 10)
    case = engine.step(gen, [1, 1536, 300], [40, 0, 0])
    ours_md, _stock = case["metadata"]
    assert masked_mha.plan_of(ours_md.prefill) is None
    assert not engine.ours._use_sparse_mha(ours_md)


# -- the planner's mask bytes are vLLM's --------------------------------------------------------------


def test_planner_mask_bytes_follow_vllms_rule() -> None:
    assert mla_planner.GLOBAL_TOPK_MASK_MAX_BYTES == sparse_mla.GLOBAL_TOPK_MASK_MAX_BYTES == 128 * MIB
    words = sparse_mla.GLOBAL_TOPK_MASK_MAX_BYTES // 4
    rng = np.random.default_rng(0)
    lengths = [1, 31, 32, 33, 127, 128, 129, 255, 256, 257, 4095, 16384, 24576, 32768, 33024, 65536]
    for _ in range(400):
        batch = int(rng.integers(1, 9))
        q, k = (int(rng.choice(lengths)) + int(rng.integers(0, 3)) for _ in range(2))
        for reserve in (False, True):
            shape = sparse_mla._topk_mask_shape(batch, q, max(q, k), reserve)
            assert mla_planner.topk_mask_shape(batch, q, max(q, k), reserve_key_starts_word=reserve) == shape
            assert mla_planner.topk_mask_bytes(batch, q, max(q, k), reserve_key_starts_word=reserve) == math.prod(shape) * 4
        assert mla_planner.masked_mha_workspace_fits(batch, q, k) == sparse_mla._masked_mha_workspace_fits(batch, q, k, words)
    # A group the planner calls masked passes vLLM's test: its mask bytes are vLLM's for its set.
    for _ in range(200):
        n = int(rng.integers(1, 7))
        query_lens = rng.integers(1, 40000, n)
        groups = mla_planner.plan_prefill_groups(query_lens, np.zeros(n, dtype=np.int64))
        for (r0, r1), path, mask_bytes in zip(groups.requests.tolist(), groups.paths, groups.mask_bytes.tolist()):
            longest = int(query_lens[r0:r1].max())
            fits = sparse_mla._masked_mha_workspace_fits(r1 - r0, longest, 0, words)
            assert (path == "masked_mha") == (fits and longest > 2048)
            if path == "masked_mha":
                assert mask_bytes == math.prod(sparse_mla._topk_mask_shape(r1 - r0, longest, longest)) * 4
