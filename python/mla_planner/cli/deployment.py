"""Will a vLLM deployment of a sparse-MLA model survive its worst step? A pure model, of the vLLM
release the serve line runs on (:mod:`.vllm_releases`: one description per supported release).

What vLLM does, per GPU (docs/kernels.md, "Two vLLM facts about reservation";
``gpu_worker.determine_available_memory`` in every release modelled): it gives the KV cache
``util x total`` less the non-KV memory: model loading (weights and what loading allocates: the
workspaces, the top-k buffer), the profiled peak of a max-size dummy step, and with CUDA graphs
the CUDA-graph estimate (:func:`non_kv_parts`). The profile run never calls the sparse-MLA kernels,
so stock vLLM's attention scratch must come out of what lies outside ``util x total``, less what a
step holds that the profile did not set aside (``step_reserve``, measured on the H200). The plugin
reserves what its largest launch allocates (and the step's output, where the release's workspace
has no view for it) inside the model memory instead (:func:`plugin_reservation`), so its KV cache
is that much smaller and its scratch comes out of the reservation.

Every byte of scratch comes from the planner core (`policies.stock`, `plan_step`) and the engine's
own sizing (`engine_model.sizing`); this module only adds the memory model around them, and labels
each figure as measured, fitted or assumed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from mla_planner import (
    StepConfig,
    decode_scratch,
    indexer_logits_bytes,
    max_tokens_per_launch,
    plan_step,
    prefill_scratch,
    topk_mask_bytes,
)
from mla_planner.engine_model import sizing
from mla_planner.engine_model.settings import Settings

from . import policies, presets, vllm_releases
from .config import CliError, PlannerConfig, in_flags
from .gpus import GPUS as GPUS
from .gpus import H200_TOTAL_BYTES as H200_TOTAL_BYTES
from .gpus import Gpu
from .steps import Step
from .vllm_releases import ACTIVATION_HIDDEN, StepReserve, VllmRelease

MIB = 1 << 20
SERVE_NAMES = {"scratch_budget_bytes": "the budget (MLA_PLANNER_SCRATCH_MB)", "max_model_len": "--max-model-len"}
"""The planner's argument names as a serve line sets them, for the doctor's messages."""


def installed_vllm() -> str | None:
    """The vLLM release installed here, if any (read from its metadata: nothing is imported)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


# --- GPUs ---------------------------------------------------------------------


def gpu_present() -> Gpu:
    """The first CUDA GPU of this machine, as torch sees it."""
    try:
        import torch
    except ImportError:
        raise CliError("--gpu present needs torch with CUDA; name a GPU instead: " + ", ".join(GPUS)) from None
    if not torch.cuda.is_available():
        raise CliError("--gpu present: no CUDA GPU here; name one instead: " + ", ".join(GPUS))
    props = torch.cuda.get_device_properties(0)
    _free, total = torch.cuda.mem_get_info(0)
    arch = "sm100" if props.major >= 10 else "sm90"
    return Gpu(props.name, arch, props.multi_processor_count, int(total), "measured: this machine's GPU 0")


def lookup_gpu(name: str) -> Gpu:
    if name == "present":
        return gpu_present()
    for key, gpu in GPUS.items():
        if key.lower() == name.lower():
            return gpu
    raise CliError(f"--gpu {name!r}: known GPUs are {', '.join(GPUS)}, or 'present' for this machine's")


# --- the model ----------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """The config.json facts the doctor needs (DeepSeek-V3.2-style sparse MLA)."""

    name: str
    num_heads: int
    topk: int
    kv_lora_rank: int
    rope_dim: int
    num_layers: int
    hidden_size: int
    max_position_embeddings: int
    index_head_dim: int
    weight_bytes: int  # all ranks together
    weight_source: str
    draft_layer_bytes: int = 0  # one MTP layer (decoder layer and its input projection), all ranks together
    draft_source: str = "assumed: none"

    @property
    def q_head_size(self) -> int:
        """The width of a query head the sparse kernels read: the latent and the RoPE part."""
        return self.kv_lora_rank + self.rope_dim

    def kv_bytes_per_token(self, fp8: bool) -> int:
        """One token's KV-cache bytes on one rank (MLA caches the latent whole on every rank):
        the MLA entry (fp8_ds_mla: fp8 latent, one fp32 scale per 128 values, bf16 RoPE; else
        bf16) and the indexer's key (fp8 plus one fp32 scale per 128 values) in every layer."""
        mla = self.kv_lora_rank + self.kv_lora_rank // 128 * 4 + self.rope_dim * 2 if fp8 else (self.kv_lora_rank + self.rope_dim) * 2
        indexer = self.index_head_dim + self.index_head_dim // 128 * 4
        return self.num_layers * (mla + indexer)


REQUIRED_KEYS = ("num_attention_heads", "index_topk", "kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers", "hidden_size")


def _estimate_params(c: dict[str, Any]) -> int:
    """Parameters of a DeepSeek-V3-style model from its config.json: embeddings and head,
    MLA and indexer projections, dense and MoE MLPs (norms and biases are negligible)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    q_lora = c.get("q_lora_rank") or h
    nope, rope, v = c.get("qk_nope_head_dim", 128), c["qk_rope_head_dim"], c.get("v_head_dim", 128)
    kv_lora = c["kv_lora_rank"]
    attn = h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
    ih, idim = c.get("index_n_heads", 64), c.get("index_head_dim", 128)
    indexer = q_lora * ih * idim + h * idim + h * ih
    layers, dense_layers = c["num_hidden_layers"], min(c.get("first_k_dense_replace", 0), c["num_hidden_layers"])
    experts = c.get("n_routed_experts") or 0
    dense_mlp = 3 * h * c.get("intermediate_size", 4 * h)
    moe_mlp = (experts + (c.get("n_shared_experts") or 0)) * 3 * h * c.get("moe_intermediate_size", 0) + h * experts
    mlp = dense_layers * dense_mlp + (layers - dense_layers) * (moe_mlp if experts else dense_mlp)
    return int(2 * c.get("vocab_size", 0) * h + layers * (attn + indexer) + mlp)


def model_from_config(path: Path) -> Model:
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CliError(f"--config {path}: cannot read a config.json ({e})") from None
    if not isinstance(c, dict):
        raise CliError(f"--config {path}: not a JSON object")
    missing = [k for k in REQUIRED_KEYS if not isinstance(c.get(k), int)]
    if missing:
        raise CliError(f"--config {path}: no integer {', '.join(missing)}: is it a sparse-MLA (DeepSeek-V3.2-style) model?")
    quant = c.get("quantization_config") or {}
    fp8 = isinstance(quant, dict) and "fp8" in str(quant.get("quant_method", "")).lower()
    width = 1 if fp8 else 2
    params = _estimate_params(c)
    # An MTP layer: one more decoder layer (as the model's last) and its projection of [embedding;
    # hidden] to hidden; vLLM shares the target's embedding and head with it.
    draft = _estimate_params({**c, "num_hidden_layers": c["num_hidden_layers"] + 1}) - params + 2 * c["hidden_size"] ** 2
    return Model(
        name=str(path),
        num_heads=c["num_attention_heads"],
        topk=c["index_topk"],
        kv_lora_rank=c["kv_lora_rank"],
        rope_dim=c["qk_rope_head_dim"],
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        max_position_embeddings=int(c.get("max_position_embeddings", 163_840)),
        index_head_dim=int(c.get("index_head_dim", 128)),
        weight_bytes=params * width,
        weight_source=f"assumed: {params / 1e9:,.2f}B parameters counted from config.json x {width} B ({'fp8' if fp8 else 'bf16'})",
        draft_layer_bytes=draft * width,
        draft_source=f"counted from config.json: one MTP layer, {draft / 1e9:,.3f}B parameters x {width} B",
    )


# The presets' architecture facts; weights are the published parameter counts in FP8.
# An MTP layer is assumed one layer's share of the published count.
PRESET_MODELS: dict[str, Model] = {
    "deepseek-v3.2": Model("deepseek-v3.2", 128, 2048, 512, 64, 61, 7168, 163_840, 128, 671 * 10**9,
                           "assumed: 671B parameters (published) x 1 B (FP8 checkpoint)", 671 * 10**9 // 61,
                           "assumed: one layer's share of the published 671B, x 1 B"),
    "glm-5": Model("glm-5", 64, 2048, 512, 64, 78, 6144, 202_752, 128, 744 * 10**9,
                   "assumed: 744B parameters (published) x 1 B (FP8 checkpoint)", 744 * 10**9 // 78,
                   "assumed: one layer's share of the published 744B, x 1 B"),
}  # fmt: skip


def lookup_model(name_or_path: str) -> Model:
    if name_or_path in PRESET_MODELS:
        return PRESET_MODELS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        return model_from_config(path)
    raise CliError(f"--config {name_or_path!r}: neither a config.json (or a folder with one) nor a preset ({', '.join(PRESET_MODELS)})")


def model_for_serve_model(model: str | None) -> Model | None:
    """The model a serve line names, when the doctor can tell: a local folder with config.json,
    or a Hugging Face name of a preset."""
    if model is None:
        return None
    if (Path(model) / "config.json").exists():
        return model_from_config(Path(model) / "config.json")
    low = model.lower()
    if "deepseek-v3.2" in low:
        return PRESET_MODELS["deepseek-v3.2"]
    if "glm-5" in low:
        return PRESET_MODELS["glm-5"]
    return None


# --- the non-KV memory vLLM sizes the KV cache around ------------------------------------------


class MemoryPart(NamedTuple):
    bytes: int
    source: str
    """Where the figure comes from, as the doctor prints it: measured, fitted, counted or assumed."""


def sparse_mla_workspace_bytes(model: Model, release: VllmRelease, heads: int, max_num_batched_tokens: int,
                               max_model_len: int, kv_fp8: bool) -> int:
    """What vLLM's workspace manager holds for the sparse-MLA impl, in the model's memory: the
    concatenated q of a whole step and, on an FP8 cache, the BF16 gather workspace and (where the
    release has them) the padded q, padded output and output views of a whole step
    (flashmla_sparse.py's ``workspace_specs`` / ``get_simultaneous`` at impl construction)."""
    t, width, rank = max_num_batched_tokens, model.q_head_size, model.kv_lora_rank
    padded = release.padded_view_heads(heads)
    if not kv_fp8:
        # a BF16 cache pads the concatenated q to the prefill kernel's heads where the release has the views
        return t * (padded or heads) * width * 2
    total = t * heads * width * 2 + release.gather_workspace_rows(max_model_len) * width * 2
    if padded is not None:
        total += t * (padded * width + padded * rank + heads * rank) * 2
    return total


def topk_buffer_bytes(model: Model, max_num_batched_tokens: int) -> int:
    """The indexer's top-k index buffer of a whole step (int32), which the model allocates at load."""
    return max_num_batched_tokens * model.topk * 4


# --- the deployment and its diagnosis ------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    model: Model
    gpu: Gpu
    tp: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    max_model_len: int
    kv_fp8: bool
    plugin: bool  # --attention-backend CUSTOM
    budget_bytes: int
    max_num_seqs: int
    weights_override: int | None = None
    activation_override: int | None = None
    routes_by_profile: bool = True
    """A cost profile routes the plugin's FP8 steps (packaged, cached, or measured at its first
    start), so steps may take either route; ``False`` under ``MLA_PLANNER_COST_PROFILE=none``."""
    release: VllmRelease = vllm_releases.NEWEST
    enforce_eager: bool = False
    """``--enforce-eager``: no CUDA graphs, so no CUDA-graph estimate (and an uncompiled model)."""
    num_speculative_tokens: int = 0
    """``--speculative-config``'s ``num_speculative_tokens`` (0: no speculative decoding)."""
    mtp_draft: bool = False
    """The speculative method is MTP: the draft is the model's own MTP layer, loaded beside it."""
    parallel_drafting: bool = False
    speculative_method: str | None = None
    """``--speculative-config``'s method (DFlash and DSpark draft in parallel on model runner V2)."""
    flashinfer_autotune: bool = True
    """vLLM's start-up FlashInfer autotune runs (off: ``--no-enable-flashinfer-autotune``)."""
    v2_runner_env: bool | None = None
    """``VLLM_USE_V2_MODEL_RUNNER`` in the serve line's environment (``None``: unset)."""

    @property
    def heads_per_rank(self) -> int:
        return self.model.num_heads // self.tp

    @property
    def weights_per_rank(self) -> int:
        return self.weights_override if self.weights_override is not None else math.ceil(self.model.weight_bytes / self.tp)

    @property
    def activation(self) -> int:
        """vLLM's profiled activation peak per step beyond the workspaces and top-k buffer: the test
        models' fitted figure per token, scaled by hidden size (an assumption for any other model)."""
        if self.activation_override is not None:
            return self.activation_override
        scale = self.model.hidden_size / ACTIVATION_HIDDEN
        return int(self.release.activation_per_token * self.max_num_batched_tokens * scale)

    @property
    def verification_len(self) -> int | None:
        """The query tokens of a speculative verification (``None``: no speculative decoding)."""
        if self.num_speculative_tokens <= 0:
            return None
        return sizing.verification_len(self.num_speculative_tokens,
                                       self.parallel_drafting and self.release.parallel_drafting_doubles)

    def non_kv_parts(self) -> dict[str, MemoryPart]:
        """The non-KV memory vLLM sets aside before the KV cache, by part, each with its source."""
        r, t = self.release, self.max_num_batched_tokens
        test_model = "fitted on the 2-layer test models (H200, TP 1)"
        like_test_model = self.tp == 1 and self.model.hidden_size == ACTIVATION_HIDDEN
        draft = 0
        if self.mtp_draft:
            draft = math.ceil(self.model.draft_layer_bytes / self.tp)
            if r.counts_discarded_draft_topk:
                draft += topk_buffer_bytes(self.model, t)
        parts = {
            "weights": MemoryPart(self.weights_per_rank, "given" if self.weights_override is not None
                                  else self.model.weight_source + f", / TP {self.tp}"),
            "mtp_draft": MemoryPart(draft, (self.model.draft_source + (", and its discarded top-k buffer"
                                                                      if r.counts_discarded_draft_topk else ""))
                                    if self.mtp_draft else "no MTP draft"),
            "workspace": MemoryPart(sparse_mla_workspace_bytes(self.model, r, self.heads_per_rank, t,
                                                               self.max_model_len, self.kv_fp8),
                                    "counted: vLLM's sparse-MLA workspace at this step size and max_model_len"),
            "topk_buffer": MemoryPart(topk_buffer_bytes(self.model, t), "counted: the indexer's top-k buffer of a step"),
            "activation": MemoryPart(self.activation, "given" if self.activation_override is not None else
                                     f"{test_model}, per token" if like_test_model else
                                     f"assumed: {test_model}, per token, scaled by hidden size"),
            "fixed": MemoryPart(r.fixed_bytes, test_model if like_test_model else
                                f"assumed: {test_model}, for every model and TP"),
            "cuda_graphs": MemoryPart(0, "--enforce-eager: none") if self.enforce_eager else
                           MemoryPart(r.cuda_graph_bytes, f"assumed: the CUDA-graph estimate {test_model}"),
        }  # fmt: skip
        return parts

    def non_kv_bytes(self) -> int:
        return sum(part.bytes for part in self.non_kv_parts().values())

    def stock_kv_bytes(self, util: float | None = None) -> int:
        u = self.gpu_memory_utilization if util is None else util
        return int(u * self.gpu.total_bytes) - self.non_kv_bytes()

    def headroom(self, util: float | None = None) -> int:
        """Memory a step's unreserved scratch can take: what lies outside util x total, less the
        step's own unreserved memory."""
        u = self.gpu_memory_utilization if util is None else util
        return self.gpu.total_bytes - int(u * self.gpu.total_bytes) - self.step_reserve().bytes

    def step_reserve(self) -> StepReserve:
        """What a step holds outside the scratch and what vLLM set aside, at this tensor parallel
        size, as the release's description gives it."""
        return self.release.step_reserve.at(self.tp)

    def planner_config(self, *, fp8: bool) -> PlannerConfig:
        try:
            step = StepConfig(
                self.heads_per_rank, arch=self.gpu.arch, num_sms=self.gpu.num_sms, topk=self.model.topk,
                kv_dtype="fp8" if fp8 else "bf16", scratch_budget_bytes=self.budget_bytes,
                max_model_len=self.max_model_len, execution="vllm", prefill_padding=self.release.prefill_padding,
                gather_workspace_rows=self.release.gather_workspace_rows(self.max_model_len),
            )  # fmt: skip
        except ValueError as e:
            raise CliError(f"the planner refuses this deployment: {in_flags(str(e), SERVE_NAMES)}") from None
        return PlannerConfig(step, f"{self.model.name} at TP {self.tp}", None, self.tp)


@dataclass(frozen=True)
class StepVerdict:
    """One step under one policy."""

    peak_bytes: int
    launches: int
    limit: str | None  # a hard kernel limit the step crosses (int32_stride, grid, workspace_assert)
    fits: bool


PARALLEL_V2_DRAFTERS = ("dflash", "dspark")
"""Speculative methods whose parallel drafting model runner V2 runs itself."""


def runs_v2(d: Deployment) -> bool:
    """Whether vLLM runs model runner V2 for this line: ``VLLM_USE_V2_MODEL_RUNNER`` where set, else
    the release's default, less parallel drafting where the release sends it back to V1."""
    if d.v2_runner_env is not None:
        return d.v2_runner_env
    r = d.release
    if d.parallel_drafting and r.parallel_drafting_needs_v1 and (d.speculative_method or "").lower() not in PARALLEL_V2_DRAFTERS:
        return False
    return r.v2_runner_by_default


@dataclass(frozen=True)
class Warmup:
    """vLLM's start-up dummy step of ``max_num_batched_tokens`` tokens (FlashInfer's autotune, run
    once the KV cache is allocated), and stock's kernel calls in it where it reaches them."""

    step: Step
    """Its requests as model runner V2 makes them (context 0; decodes where short enough)."""
    why: str
    """Why it does or does not run the sparse-MLA kernels, as the doctor prints it."""
    stock: StepVerdict | None
    """Stock's calls in it (``None`` where it does not attend)."""

    @property
    def attends(self) -> bool:
        """It runs the sparse-MLA kernels: model runner V2 builds attention metadata for it."""
        return self.stock is not None


def warmup_step(d: Deployment) -> Step:
    """Model runner V2's dummy step: the tokens spread over ``min(tokens, max_num_seqs)`` requests
    of no context; those no longer than vLLM's decode threshold are decodes (first, the shorter)."""
    t = d.max_num_batched_tokens
    lens = d.release.dummy_query_lens(t, min(t, d.max_num_seqs))
    threshold = sizing.decode_threshold(d.heads_per_rank, d.gpu.arch, d.verification_len)
    return Step(lens, [0] * len(lens), sum(1 for q in lens if q <= threshold))


def warmup(d: Deployment) -> Warmup:
    step = warmup_step(d)
    if not d.flashinfer_autotune:
        return Warmup(step, "--no-enable-flashinfer-autotune", None)
    if not runs_v2(d):
        return Warmup(step, "model runner V1 builds no attention metadata for it, so the sparse-MLA kernels do "
                      "not run in it", None)  # fmt: skip
    return Warmup(step, "model runner V2 runs its attention", stock_step(d, step))


@dataclass(frozen=True)
class Diagnosis:
    deployment: Deployment
    worst_step: Step
    paths: dict[str, dict[str, Any]]
    stock: StepVerdict
    plugin: StepVerdict
    headroom: int
    stock_kv_bytes: int
    plugin_kv_bytes: int
    stock_kv_tokens: int
    plugin_kv_tokens: int
    reserved_bytes: int  # what the plugin holds back from the KV cache (plugin_reservation)
    reserved_kv_tokens: int  # the KV tokens those bytes would hold (fp8_ds_mla)
    max_stock_util: float | None
    budget_kv_tokens: int  # the KV tokens the plugin's budget would hold (fp8_ds_mla)
    stock_path: str  # the path stock vLLM takes for this cache and heads per rank (the same rule in every release modelled)
    stride_tokens: int  # the longest single mixed-batch / prefill call the kernels accept
    warmup: Warmup
    assumptions: dict[str, str] = field(default_factory=dict)

    @property
    def stock_fails_at(self) -> str | None:
        """Where stock vLLM fails: ``"start-up"`` (its warm-up step), ``"worst step"``, or ``None``."""
        w = self.warmup
        if w.stock is not None and not w.stock.fits:
            return "start-up"
        return None if self.stock.fits else "worst step"

    @property
    def stock_limit(self) -> str | None:
        """A hard kernel limit stock crosses at start-up or on its worst step."""
        w = self.warmup.stock
        return (w.limit if w is not None else None) or self.stock.limit


def kv_tokens(d: Deployment, kv_bytes: int, fp8: bool) -> int:
    per_token = d.model.kv_bytes_per_token(fp8)
    return max(0, kv_bytes) // per_token


PER_RANK_AUTOTUNE_FILES = " and ".join(f"vLLM {r.minor}'s per-rank files" for r in vllm_releases.RELEASES.values()
                                      if r.per_rank_autotune_files) or "per-rank files"
"""Where saved autotune results can skip the start-up step, as the doctor's sources say it."""


WORKSPACE_BUFFERS = ("q_padded", "out")
"""A sparse prefill call's buffers that live in vLLM's workspace where the release keeps its padded
views there (counted with the non-KV memory, not with the call's transient scratch). Only the
prefill kernel's: vLLM's FP8 decode-kernel call (the mixed batch, and the separate route's decodes)
pads q into a fresh ``new_zeros`` and lets the kernel allocate its output, in every release modelled."""


def stock_step(d: Deployment, step: Step) -> StepVerdict:
    """Stock vLLM's worst kernel call for `step`, from the CLI's stock policy (vLLM's calls): what
    each call allocates beyond what the release holds in its workspace."""
    cfg = d.planner_config(fp8=d.kv_fp8)
    outcome = policies.stock(step, policies.Scratches(cfg))
    peak = outcome.peak_bytes
    if d.kv_fp8 and d.release.workspace_holds_padded_views and outcome.launches:
        peak = max(row.bytes - in_workspace(row) for row in outcome.launches)
    fits = outcome.failure is None and peak <= d.headroom()
    return StepVerdict(peak, outcome.num_launches, outcome.failure, fits)


def in_workspace(row: policies.LaunchRow) -> int:
    """Bytes of a stock call's buffers that vLLM's workspace already holds (:data:`WORKSPACE_BUFFERS`)."""
    if row.kernel != "sparse_prefill":
        return 0
    return sum(row.scratch.buffers.get(name, 0) for name in WORKSPACE_BUFFERS)


def plugin_step(d: Deployment, step: Step) -> StepVerdict:
    """The plugin's plan for `step` (FP8 KV, the budget held back from the KV cache)."""
    cfg = d.planner_config(fp8=True)
    try:
        plan = plan_step(step.query_lens, step.context_lens, step.num_decodes, cfg.step)
    except ValueError as e:
        raise CliError(f"the planner cannot plan the worst step: {e}") from None
    fits = plan.peak_bytes <= d.budget_bytes + max(0, d.headroom())
    return StepVerdict(plan.peak_bytes, len(plan), None, fits)


def plugin_routes(d: Deployment) -> tuple[list[StepConfig], int]:
    """The configurations of the FP8 routes the plugin's steps may take (:func:`.sizing.route_configs`:
    both where a cost profile routes them, vLLM's rule's alone under ``MLA_PLANNER_COST_PROFILE=none``;
    the native-heads prefill variant where the release's FlashMLA has it), and vLLM's decode threshold
    (raised under speculative decoding): what the engine setup sizes and checks the budget with."""
    step = d.planner_config(fp8=True).step
    max_decode = min(sizing.decode_threshold(d.heads_per_rank, d.gpu.arch, d.verification_len), d.max_num_batched_tokens)
    routes = sizing.route_configs(step, profiled=d.routes_by_profile, native_kernels=d.release.native_prefill_kernels)
    return routes, max_decode


def plugin_reservation(d: Deployment) -> int:
    """What the plugin holds back from the KV cache, as its engine setup sizes it
    (:func:`.sizing.reservation`): the most one launch of any plan of the routes its steps may take
    allocates beyond vLLM's workspace at this step size, and where the release's workspace has no
    view for it the step's output. tests/test_doctor.py checks it against the reservations the H200
    logged under each release."""
    routes, max_decode = plugin_routes(d)
    return sizing.reservation(routes, d.max_num_batched_tokens, max_decode, d.heads_per_rank,
                              d.release.padded_view_heads(d.heads_per_rank))[1]


def check_plugin_budget(d: Deployment, settings: Settings) -> None:
    """:class:`.SettingsError` where the plugin's engine would refuse the budget at start-up."""
    routes, max_decode = plugin_routes(d)
    sizing.check_budget(routes, settings, d.max_num_batched_tokens, max_decode)


def worst_steps(d: Deployment) -> list[Step]:
    """Steps of max_num_batched_tokens: one prefill, and the same tokens shared with decodes."""
    t = d.max_num_batched_tokens
    steps = [Step([t], [0], 0)]
    decodes = min(d.max_num_seqs - 1, t - 1, 1024)
    if decodes > 0:
        steps.append(Step([1] * decodes + [t - decodes], [min(d.max_model_len - 1, 4096)] * decodes + [0], decodes))
    return steps


def max_stock_util(d: Deployment, stock_peak: int) -> float | None:
    """The highest util (two decimals) at which `stock_peak` fits the headroom, if any."""
    util = math.floor((1 - (stock_peak + d.step_reserve().bytes) / d.gpu.total_bytes) * 100) / 100
    return util if util > 0 else None


def _max_stock_util(d: Deployment, worst: StepVerdict, start: Warmup) -> float | None:
    """The highest util at which stock runs both its worst step and its warm-up (none past a limit)."""
    verdicts = [worst] if start.stock is None else [worst, start.stock]
    if any(v.limit for v in verdicts):
        return None
    return max_stock_util(d, max(v.peak_bytes for v in verdicts))


def _paths(d: Deployment, t: int) -> dict[str, dict[str, Any]]:
    """Each sparse-MLA path's transient scratch for one call of `t` tokens as vLLM makes it."""
    h, arch, topk = d.heads_per_rank, d.gpu.arch, d.model.topk
    mixed = decode_scratch(1, t, h, arch=arch, num_sms=d.gpu.num_sms, topk=topk)
    separate = prefill_scratch(t, h, arch=arch, topk=topk)
    taken = presets.vllm_path(h, "fp8" if d.kv_fp8 else "bf16", short=True)
    # A bf16 cache sends every token through one prefill-kernel call: the separate path's bytes.
    mask = topk_mask_bytes(1, t, t)
    return {
        "mixed_batch": {"bytes": mixed.total_bytes, "buffers": mixed.buffers, "stock_takes_it": taken == "mixed batch",
                        "limit": "int32_stride" if t > max_tokens_per_launch(h)[0] else None},
        "separate": {"bytes": separate.total_bytes, "buffers": separate.buffers, "stock_takes_it": taken != "mixed batch",
                     "limit": None},
        "indexer": {"bytes": min(indexer_logits_bytes(t, t), 512 * MIB), "reserved_by_vllm": True},
        "masked_mha_mask": {"bytes": mask, "applies": d.release.masked_mha and arch == "sm100" and not d.kv_fp8,
                            "release_has_it": d.release.masked_mha, "fits_128_mib": mask <= 128 * MIB},
    }  # fmt: skip


def diagnose(d: Deployment) -> Diagnosis:
    if d.heads_per_rank < 1 or d.model.num_heads % d.tp:
        raise CliError(f"{d.model.num_heads} attention heads do not split over tensor parallel {d.tp}")
    steps = worst_steps(d)
    stock = max((stock_step(d, s) for s in steps), key=lambda v: (v.limit is not None, v.peak_bytes))
    plugin = max((plugin_step(d, s) for s in steps), key=lambda v: v.peak_bytes)
    start = warmup(d)
    stock_kv = d.stock_kv_bytes()
    reserved = plugin_reservation(d)
    plugin_kv = stock_kv - reserved
    stride = max_tokens_per_launch(d.heads_per_rank)[0]
    return Diagnosis(
        deployment=d,
        worst_step=steps[0],
        paths=_paths(d, d.max_num_batched_tokens),
        stock=stock,
        plugin=plugin,
        headroom=d.headroom(),
        stock_kv_bytes=stock_kv,
        plugin_kv_bytes=plugin_kv,
        stock_kv_tokens=kv_tokens(d, stock_kv, d.kv_fp8),
        plugin_kv_tokens=kv_tokens(d, plugin_kv, True),
        reserved_bytes=reserved,
        reserved_kv_tokens=kv_tokens(d, reserved, True),
        max_stock_util=_max_stock_util(d, stock, start),
        stride_tokens=stride,
        warmup=start,
        budget_kv_tokens=d.budget_bytes // d.model.kv_bytes_per_token(True),
        stock_path=presets.vllm_path(d.heads_per_rank, "fp8" if d.kv_fp8 else "bf16", short=True),
        assumptions={
            "gpu_total": d.gpu.source,
            **{name: part.source for name, part in d.non_kv_parts().items()},
            "step_reserve": d.release.step_reserve.provenance,
            "sampler": "not modelled: the profile's sampler run over max_num_seqs x vocabulary (with MTP, its rejection"
                f" sampler), which can exceed the step's peak ({d.release.sampler_excess})",
            "scratch": "the planner's byte models (docs/kernels.md, checked against the H200's allocator)",
            "warmup": "counted: vLLM's start-up FlashInfer autotune step (kernel_warmup) as model runner V2 makes it;"
                " assumed: FlashInfer installed (a dependency of both releases) and a first start: where every rank"
                f" loads autotune results an earlier start of the same configuration saved ({PER_RANK_AUTOTUNE_FILES},"
                " TP > 1), the step is skipped",
        },
    )  # fmt: skip
