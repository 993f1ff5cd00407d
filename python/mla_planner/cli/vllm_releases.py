"""What the doctor models of each supported vLLM release: one frozen description per release.

Everything the doctor's figures depend on that differs between releases is a field here, and
nothing else in ``cli`` tests a version. The plugin's own view of a release (what it calls in vLLM)
is ``vllm_backend.releases``, which imports vLLM; the doctor runs where vLLM is not installed, so it
reads these instead, and sizes the plugin's reservation with the same functions as the plugin's
engine setup (``engine_model.sizing``), given these facts.

The memory constants (``fixed_bytes``, ``activation_per_token``, ``cuda_graph_bytes``) are fitted
to KV-cache figures measured on one H200 (tests/data/doctor_kv_lines.json, each line with its
results page and run label); ``tests/test_doctor.py`` refits them from the lines named in
``fitted_on`` and checks every other line against the model.

Start-up warm-up. Both releases, once the KV cache is allocated (``EngineCore`` initialises it, then
``compile_or_warm_up_model``), run FlashInfer's autotune (``kernel_warmup``: on by default, also
under ``--enforce-eager``, on SM90 and newer with FlashInfer, a dependency of both) with a dummy
step of ``max_num_batched_tokens`` tokens. Whether that step reaches the sparse-MLA kernels is the
model runner's: V2 builds attention metadata for it, V1 builds none unless told to, so its attention
layers skip their kernels (``v2_runner_by_default``, ``parallel_drafting_needs_v1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mla_planner import decode_scratch
from mla_planner.engine_model import minor_of, sizing

from .gpus import H100_TOTAL_BYTES, H200_TOTAL_BYTES
from .units import GIB

MIB = 1 << 20


class StepReserve(NamedTuple):
    bytes: int
    source: str
    """Where the figure comes from, as the doctor prints it."""


@dataclass(frozen=True)
class StepReserves:
    """What a step holds outside the attention scratch and outside what vLLM set aside before the
    KV cache, as measured on the 2-layer test model (16 heads per rank) at TP 1 and TP 2: what stock's
    scratch cannot have of the memory beyond ``util x total``."""

    tp1: StepReserve
    tp2: StepReserve
    beyond_tp2: str
    """The source of TP 2's figure where it stands in for a larger tensor parallel size."""
    provenance: str
    """The measurement as a whole, for the doctor's list of sources."""

    def at(self, tp: int) -> StepReserve:
        """The figure at tensor parallel ``tp``: TP 1's at 1, TP 2's from 2 up."""
        if tp == 1:
            return self.tp1
        return self.tp2 if tp == 2 else StepReserve(self.tp2.bytes, self.beyond_tp2)


@dataclass(frozen=True)
class VllmRelease:
    version: str
    """The release modelled, as the doctor names it (``0.26.0``)."""
    workspace_holds_padded_views: bool
    """vLLM's workspace manager holds the sparse-MLA impl's padded q, padded output and output
    views (``max_num_batched_tokens`` rows at the padded heads) in the model's memory, so the plugin's
    reservation leaves them out (``sizing.reservation(..., workspace_heads=padded heads)``) and the
    non-KV memory holds them per token."""
    prefill_padding: int | None
    """The head multiple vLLM pads the prefill kernel's q to (``None``: the planner's default, 64 on
    Hopper and 128 on Blackwell)."""
    native_prefill_kernels: bool
    """FlashMLA runs the SM90 sparse prefill kernel at 16 and 32 heads unpadded, which a cost profile
    may choose: the reservation then covers that variant too."""
    masked_mha: bool
    """vLLM runs masked-MHA prefill (SM100, a BF16 cache) rather than sparse MQA."""
    parallel_drafting_doubles: bool
    """Parallel drafting appends a mask slot per draft token to a verification, so the decode
    threshold under speculative decoding is ``1 + 2k`` rather than ``1 + k``."""
    counts_discarded_draft_topk: bool
    """The MTP draft's own top-k index buffer (``max_num_batched_tokens`` x ``index_topk`` int32,
    which vLLM frees once the draft shares the target's) counts in the non-KV memory."""
    large_gpu_batched_tokens: int
    """``vllm serve``'s default ``max_num_batched_tokens`` on GPUs of 160 GiB or more."""
    long_context_gather_factor: int
    """The gather workspace's rows per ``max_model_len`` token above 256K tokens (5 up to there in
    both releases; vLLM 0.33 drops its default factor to 2 beyond)."""
    fixed_bytes: int
    """Non-KV memory that neither the weights, the workspaces nor the step size account for: CUDA
    context, libraries' workspaces, vLLM's own buffers, the activation peak at no tokens (fitted)."""
    activation_per_token: float
    """The profiled activation peak per token of ``max_num_batched_tokens`` beyond the workspaces and
    top-k buffer, eager, on a model of hidden size ``ACTIVATION_HIDDEN`` (fitted)."""
    cuda_graph_bytes: int
    """With CUDA graphs (no ``--enforce-eager``): vLLM's CUDA-graph memory estimate, less what the
    compiled model saves on its activation peak against eager (fitted on the 2-layer test model)."""
    fitted_on: tuple[str, ...]
    """The measured lines (tests/data/doctor_kv_lines.json) the constants were fitted on."""
    v2_runner_by_default: bool
    """vLLM runs model runner V2 for the sparse-MLA models (DeepSeek-V3.2's and GLM-5's MoE
    architectures) unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise, so its start-up autotune
    step runs their attention; 0.26 runs V2 by default only for the architectures it lists and for
    dense models, neither of which these are."""
    parallel_drafting_needs_v1: bool
    """Parallel drafting (other than DFlash's and DSpark's) sends an engine that would run V2 back to
    model runner V1 (where ``VLLM_USE_V2_MODEL_RUNNER`` is unset)."""
    dummy_remainder_spread: bool
    """V2's dummy step of ``t`` tokens over ``n`` requests gives the last ``t mod n`` requests one
    token more each; otherwise the last request takes the whole remainder."""
    per_rank_autotune_files: bool
    """FlashInfer's start-up autotune keeps its results in a file per rank, so at tensor parallel
    above 1 a start whose every rank loads the file an earlier start of the same configuration saved
    skips the dummy step; otherwise every start runs it."""
    step_reserve: StepReserves
    """What a step holds beyond what vLLM set aside, with where each figure was measured."""
    sampler_excess: str
    """A measured case of what the doctor leaves out: the profile run's sampler over
    ``max_num_seqs`` x vocabulary exceeding the step's peak (cited in its sources)."""

    @property
    def minor(self) -> str:
        return minor_of(self.version)

    def dummy_query_lens(self, num_tokens: int, num_reqs: int) -> list[int]:
        """The query lengths of model runner V2's dummy step of ``num_tokens`` over ``num_reqs``
        requests, in its order (the longer last)."""
        base, extra = divmod(num_tokens, num_reqs)
        if self.dummy_remainder_spread:
            return [base] * (num_reqs - extra) + [base + 1] * extra
        return [base] * (num_reqs - 1) + [base + extra]

    def gather_workspace_rows(self, max_model_len: int) -> int:
        """Rows of the BF16 gather workspace vLLM's sparse-MLA impl reserves: 5 x max_model_len, and
        :attr:`long_context_gather_factor` x max_model_len above 256K tokens."""
        return (5 if max_model_len <= 256 * 1024 else self.long_context_gather_factor) * max_model_len

    def padded_view_heads(self, heads: int) -> int | None:
        """Heads of the padded-q and output views vLLM's workspace holds at ``heads`` heads per rank
        on an FP8 cache (``None``: the release has no such views), as the release module's
        ``workspace_padded_heads`` gives the plugin's engine setup."""
        if not self.workspace_holds_padded_views:
            return None
        assert self.prefill_padding is not None
        return sizing.padded_heads(heads, self.prefill_padding)

    def default_batch(self, gpu_total_bytes: int) -> tuple[int, int]:
        """``vllm serve``'s default ``(max_num_batched_tokens, max_num_seqs)`` on a GPU of this much
        memory (``EngineArgs.get_batch_defaults``; neither release's A100 or GB10 exceptions)."""
        if gpu_total_bytes >= 160 * GIB:
            return self.large_gpu_batched_tokens, 1024
        if gpu_total_bytes >= 70 * GIB:
            return 8192, 1024
        return 2048, 256


ACTIVATION_HIDDEN = 1024
"""The hidden size of the test models the per-token activation was fitted on; another model's is
assumed to scale with its hidden size."""

# step_reserve, measured on the H200 under vLLM 0.26 with the 2-layer test model at 16 heads per rank.
# A stock 32K step of it: one decode call, `out` allocated by the kernel.
_STOCK_32K = decode_scratch(1, 32_768, 16)
_BEFORE_O_ACCUM = sum(v for k, v in _STOCK_32K.buffers.items() if k in ("q_padded", "out", "lse"))
STEP_RESERVE_0_26 = StepReserves(
    # TP 1: at 0.90 the 32K step ran with 0.87 GiB left free (scratch + reserve = 10% - 0.87 GiB).
    # Cross-check at 0.95: it failed asking for o_accum with 1.89 GiB free, q_padded, out and lse held.
    tp1=StepReserve(int(0.10 * H200_TOTAL_BYTES - 0.87 * GIB) - _STOCK_32K.total_bytes,
                    "measured on the test model under vLLM 0.26, TP 1"),
    # TP 2 (each rank 16 heads): at 0.95 o_accum failed with 429 MiB free; at 0.90 with 7.41 GiB free
    # (where TP 1 ran): the multi-GPU engine holds more. Assumed the same at larger TP.
    tp2=StepReserve(int(0.05 * H200_TOTAL_BYTES) - (_BEFORE_O_ACCUM + 429 * MIB),
                    "measured on the test model under vLLM 0.26, TP 2"),
    beyond_tp2="assumed: the test model's under vLLM 0.26 at TP 2",
    provenance="measured on the H200 under vLLM 0.26 (tiny e2e model): TP 1 at 0.90 and 0.95; TP 2 at 0.95 and"
               " 0.90; assumed the same for other models, TP > 2 and other releases",
)  # fmt: skip
# step_reserve's TP 1 figure under 0.33, measured on the H100 (docs/results-vllm-0.33.md, 33.35): stock's
# 32K step of the same model ran at 0.80 with 2,959,278,080 B left free, at 0.82 with 1,258,487,808 B
# (the two give the same reserve within 0.5 MiB). No TP 2 engine has run under 0.33: 0.26's figure.
STEP_RESERVE_0_33 = StepReserves(
    tp1=StepReserve(H100_TOTAL_BYTES - int(0.80 * H100_TOTAL_BYTES) - 2_959_278_080 - _STOCK_32K.total_bytes,
                    "measured on the test model under vLLM 0.33, TP 1"),
    tp2=STEP_RESERVE_0_26.tp2,
    beyond_tp2=STEP_RESERVE_0_26.beyond_tp2,
    provenance="TP 1 measured on an H100 under vLLM 0.33 (tiny e2e model) at 0.80 and 0.82; TP 2 measured on the"
               " H200 under vLLM 0.26 at 0.95 and 0.90; assumed the same for other models, GPUs and TP > 2",
)  # fmt: skip
SAMPLER_EXCESS_0_26 = "the tiny GLM-5 at 1,024 sequences with MTP, vLLM 0.26: 2.1 GiB more than this model"

# The constants: tests/test_doctor.py's fit (exact: three lines, three unknowns per release) of
# `fitted_on`'s lines, over what the model computes from geometry (weights, workspaces, top-k
# buffers). Refit with `cd tests && PYTHONPATH=../python python -m harness.doctor_kv` after a line changes.
V0_26 = VllmRelease(
    version="0.26.0",
    workspace_holds_padded_views=False,
    prefill_padding=None,
    native_prefill_kernels=False,
    masked_mha=False,
    parallel_drafting_doubles=True,
    counts_discarded_draft_topk=True,
    large_gpu_batched_tokens=8192,
    long_context_gather_factor=5,
    fixed_bytes=896_682_967,  # 0.84 GiB
    activation_per_token=40_550.4,
    cuda_graph_bytes=398_665_974,  # 0.37 GiB
    # in-process stock at 0.95, 32,768 and 65,536 tokens a step (eager): fixed and per token; the
    # flag matrix's s1 stock twin (run E: MTP 1, CUDA graphs): the CUDA-graph term.
    fitted_on=("0.26 in-process stock 0.95 32k (26.11)", "0.26 in-process stock 0.95 64k (26.11)",
               "0.26 matrix s1 stock twin (run E)"),
    v2_runner_by_default=False,
    parallel_drafting_needs_v1=True,
    dummy_remainder_spread=False,
    # kernel_warmup.flashinfer_autotune: above one rank no persistent cache (every rank tunes); at
    # one rank the leader tunes into its cache file, and the dummy step runs either way.
    per_rank_autotune_files=False,
    step_reserve=STEP_RESERVE_0_26,
    sampler_excess=SAMPLER_EXCESS_0_26,
)
V0_33 = VllmRelease(
    version="0.33.0",
    workspace_holds_padded_views=True,
    prefill_padding=64,
    native_prefill_kernels=True,
    masked_mha=True,
    # 0.33 runs model runner V2 where it can, which appends no mask slots (``max_decode_query_len``).
    parallel_drafting_doubles=False,
    counts_discarded_draft_topk=False,
    large_gpu_batched_tokens=16384,
    long_context_gather_factor=2,
    fixed_bytes=757_557_658,  # 0.71 GiB
    activation_per_token=62_489.7,
    cuda_graph_bytes=1_385_165_619,  # 1.29 GiB
    # in-process stock at 0.90 (eager, 32,768): fixed; in-process plugin at 0.95, 65,536 tokens a
    # step (plus its reservation): per token; `vllm serve` stock at 0.95 (CUDA graphs): graphs.
    fitted_on=("0.33 in-process stock 0.90 (33.12)", "0.33 in-process plugin 0.95 64k (33.21)",
               "0.33 serve stock 0.95 (33.4)"),
    v2_runner_by_default=True,
    parallel_drafting_needs_v1=True,
    dummy_remainder_spread=True,
    per_rank_autotune_files=True,
    step_reserve=STEP_RESERVE_0_33,
    sampler_excess=SAMPLER_EXCESS_0_26,
)

RELEASES: dict[str, VllmRelease] = {r.minor: r for r in (V0_26, V0_33)}
NEWEST = V0_33
SIMULATED = V0_26
"""The release whose stock calls ``simulate`` and ``plan`` replay (``policies.stock``): no workspace
holds a call's padded q or output, so each call's buffers are all its scratch, and the prefill
padding is the planner's default by architecture. Masked MHA, where asked for, is the behaviour of
the releases that have it (:func:`with_masked_mha`)."""


def names(releases: list[VllmRelease]) -> str:
    """``0.26 and 0.33``: the releases' minor versions, for help texts."""
    minors = [r.minor for r in releases]
    return ", ".join(minors[:-1]) + " and " + minors[-1] if len(minors) > 1 else "".join(minors)


def with_masked_mha() -> list[VllmRelease]:
    """The releases whose vLLM runs masked-MHA prefill."""
    return [r for r in RELEASES.values() if r.masked_mha]


def release_for(installed: str | None) -> VllmRelease:
    """The release a serve line runs on by default: the installed vLLM's where it is one of these,
    else the newest."""
    found = None if installed is None else RELEASES.get(minor_of(installed))
    return NEWEST if found is None else found
