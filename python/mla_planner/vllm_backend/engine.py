"""One engine's setup, made once per engine from vLLM's configuration and read by the metadata
builder and by every layer's impl: the settings, the step configuration, the rule that routes FP8
steps, the engine's limits, the smallest budget those limits need (checked here, at start-up), the
bytes the reservation holds, what vLLM's own calls may allocate within it, and the bounded path's
configurations; and the engine's state as it runs (:class:`EngineState`: its reservation, its
warm-up, its counters), one per engine whatever the number of engines in the process.

Nothing downstream derives a kernel, workspace or budget fact again: the builder plans with
:attr:`EngineSetup.config`, the impl reserves :attr:`EngineSetup.reserved_bytes`, and both ask
:attr:`EngineSetup.stock_call_allowance` whether a step may run vLLM's own call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

import mla_planner
from mla_planner import profiles, routing
from mla_planner.calibration.grid import Grid, first_start_grid
from mla_planner.engine_model import sizing
from mla_planner.vllm_backend import log, vllm_api
from mla_planner.vllm_backend.log import logger
from mla_planner.vllm_backend.releases import release
from mla_planner.vllm_backend.reservation import Reservation
from mla_planner.vllm_backend.stats import StepStats
from mla_planner.vllm_backend.warmup import WarmUp
from mla_planner.engine_model.settings import NATIVE_VAR, Settings, SettingsError, read_settings



@dataclasses.dataclass
class EngineState:
    """What one engine changes as it runs, shared by its builders and every layer's impl (its MTP
    draft's too, which vLLM builds with a copy of the engine's configuration)."""

    reservation: Reservation = dataclasses.field(default_factory=Reservation)
    warm_up: WarmUp = dataclasses.field(default_factory=WarmUp)
    stats: StepStats = dataclasses.field(default_factory=lambda: StepStats(vllm_api.stats_interval_s()))


_states: list[tuple[Any, EngineState]] = []


def state_of(vllm_config: Any) -> EngineState:
    """The state of the engine ``vllm_config`` configures: one per compilation configuration, the
    object whose forward context holds every attention layer of one engine. The draft model's
    copy of the configuration shares it (vLLM finds the draft's layers there), a second engine's
    does not."""
    engine = vllm_config.compilation_config
    for made_for, state in _states:
        if made_for is engine:
            return state
    state = EngineState()
    _states[:] = [*_states[-7:], (engine, state)]
    return state


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    settings: Settings
    config: mla_planner.StepConfig
    """The step configuration. Every token handed to the planner runs the sparse kernels
    (``force_mqa``): which prefills vLLM runs dense is vLLM's decision, read from each step's
    metadata, and those never reach the planner."""
    cost_model: mla_planner.CostModel | None
    """Routes FP8 steps where a profile measured on this machine exists; ``None``: vLLM's rule."""
    routes: tuple[str, ...]
    """The FP8 routes steps may take: both with a cost model, vLLM's rule's one otherwise."""
    max_step_tokens: int
    """vLLM's ``max_num_batched_tokens``: no step carries more."""
    max_decode_query_len: int
    """vLLM's decode threshold: requests of up to this many query tokens count as decodes."""
    workspace_heads: int | None
    """Heads of the release's padded-q and kernel-output workspace views (``None``: it has none)."""
    stock_call_allowance: int
    """The most one launch allocates beyond vLLM's workspace, over every plan the limits admit:
    what the reservation holds for the kernels, and so the most one vLLM call of a step may
    allocate (its padded q and output included) and still run as vLLM's own code."""
    reserved_bytes: int
    """What the reservation holds: the allowance, and where the release has no workspace view for it
    the step's output too."""
    stock_decode_tokens: int
    """Decode-only steps of at most this many tokens run vLLM's own call unplanned: every decode
    batch of that many tokens is one launch within the allowance."""
    profiling_kv_blocks: int
    """Blocks of the minimal KV cache vLLM captures CUDA graphs against while it profiles memory:
    a forward over a cache of no more blocks runs before the KV cache is sized."""
    stock_reason: str | None = None
    """Why vLLM keeps its own route and code for every step (HiSparse, context parallelism), if it
    does: then nothing is planned, checked or reserved."""
    bounded_configs: tuple[mla_planner.StepConfig, ...] = ()
    """The bounded path's rungs (:meth:`mla_planner.StepConfig.bounded_configs`): mixed-batch
    launches within the allowance, then each a quarter of the one before, down to one token."""
    state: EngineState = dataclasses.field(default_factory=EngineState, compare=False)
    """The engine's state as it runs (:func:`state_of`)."""

    @property
    def plans_fp8(self) -> bool:
        return self.config.kv_dtype == "fp8" and self.stock_reason is None

    def route_configs(self) -> list[mla_planner.StepConfig]:
        """The configuration of every route (and prefill-head variant) a step may take
        (:func:`.sizing.route_configs`)."""
        return sizing.route_configs(self.config, profiled=self.cost_model is not None,
                                    native_kernels=release.native_prefill_kernels)


_made: list[tuple[Any, tuple[Any, ...], EngineSetup]] = []


def setup(vllm_config: Any, num_heads: int, device: torch.device) -> EngineSetup:
    """This process's setup for ``vllm_config`` at ``num_heads`` heads per rank, made once: the
    builder and every layer's impl ask. A budget below what the engine needs is a
    :class:`.SettingsError`, raised here, at start-up."""
    settings = read_settings()
    key = (num_heads, torch.device(device), settings)
    for config, made_key, made in _made:
        if config is vllm_config and made_key == key:
            return made
    made = make_setup(vllm_config, num_heads, torch.device(device), settings, state_of(vllm_config))
    _made[:] = [*_made[-3:], (vllm_config, key, made)]
    return made


def make_setup(vllm_config: Any, num_heads: int, device: torch.device, settings: Settings,
               state: EngineState | None = None) -> EngineSetup:
    config = step_config(vllm_config, num_heads, device, settings)
    stock_reason = release.stock_route_reason(vllm_config)
    # Where vLLM keeps its own route for every step, no profile routes anything: none is measured.
    cost_model = cost_model_for(config, settings, vllm_config, device) if stock_reason is None else None
    routes = sizing.ROUTES if cost_model is not None else (config.mode,)
    scheduler = vllm_config.scheduler_config
    max_step_tokens = int(scheduler.max_num_batched_tokens)
    max_decode = min(release.decode_threshold(vllm_config, num_heads, config.arch), max_step_tokens)
    partial = EngineSetup(settings, config, cost_model, routes, max_step_tokens, max_decode,
                          release.workspace_padded_heads(vllm_config, num_heads), 0, 0, 0,
                          vllm_api.profiling_kv_blocks(vllm_config), stock_reason, state=state or EngineState())
    if not partial.plans_fp8:
        return partial
    check_budget(partial)
    # Without a workspace view for the step's output the executors allocate it, in the reservation.
    allowance, reserved = sizing.reservation(partial.route_configs(), max_step_tokens, max_decode, num_heads,
                                             partial.workspace_heads)
    # The bounded path's launches, padded q and output included, fit the allowance: checked here,
    # at start-up, where a budget that leaves not even one token for it is refused.
    try:
        bounded = tuple(config.bounded_configs(allowance))
    except ValueError as exc:
        raise SettingsError(f"{exc}; set MLA_PLANNER_SCRATCH_MB higher") from None
    with_allowance = dataclasses.replace(partial, stock_call_allowance=allowance, reserved_bytes=reserved,
                                         bounded_configs=bounded)
    with_allowance.state.stats.reserved_bytes = with_allowance.reserved_bytes
    stock_decodes = stock_decode_tokens(with_allowance, int(scheduler.max_num_seqs),
                                        vllm_api.uniform_decode_len(vllm_config))
    return dataclasses.replace(with_allowance, stock_decode_tokens=stock_decodes)


def step_config(vllm_config: Any, num_heads: int, device: torch.device, settings: Settings) -> mla_planner.StepConfig:
    """The engine's step configuration: this GPU, the rank's heads, the model's top-k, the KV cache
    dtype, vLLM's workspaces and prefill padding, the budget; native prefill heads where asked
    for (a :class:`.SettingsError` where this vLLM, GPU or head count has no such kernel)."""
    if settings.native_prefill_heads and not release.native_prefill_kernels:
        raise SettingsError(
            f"{NATIVE_VAR}=1: vLLM {vllm_api.installed_version()}'s FlashMLA runs the prefill kernel at 64 or 128 heads only "
            f"(later releases' also at 16 and 32); unset {NATIVE_VAR}"
        )
    fp8 = vllm_config.cache_config.cache_dtype == vllm_api.PLANNED_KV
    config = mla_planner.StepConfig(
        num_heads,
        arch=vllm_api.device_arch(),
        num_sms=vllm_api.num_sms(device),
        topk=release.model_topk(vllm_config),
        kv_dtype="fp8" if fp8 else "bf16",
        scratch_budget_bytes=settings.scratch_bytes,
        max_model_len=vllm_config.model_config.max_model_len,
        gather_workspace_rows=release.prefill_workspace_rows(vllm_config),
        indexer_workspace_rows=vllm_api.indexer_workspace_rows(vllm_config),
        force_mqa=True,
        execution="vllm",
        prefill_padding=release.prefill_padding,
    )
    if not settings.native_prefill_heads:
        return config
    if not config.native_prefill_heads_possible:
        raise SettingsError(
            f"{NATIVE_VAR}=1: the prefill kernel runs 16 or 32 heads per rank unpadded, on sm90 only; this engine "
            f"has {config.num_heads} heads per rank on {config.arch}; unset {NATIVE_VAR}"
        )
    return config.replace(native_prefill_heads=True)


def cost_model_for(config: mla_planner.StepConfig, settings: Settings, vllm_config: Any,
                   device: torch.device) -> mla_planner.CostModel | None:
    """The cost model that routes the engine's FP8 steps (:mod:`mla_planner.profiles`: the one
    set, packaged, cached or measured now), found or measured on the first tensor-parallel rank
    and shared, so every rank routes each step alike; ``None``: vLLM's rule. Said once."""
    if settings.vllm_rule or config.kv_dtype != "fp8":
        return None
    found = vllm_api.from_first_tp_rank(functools.partial(find_profile, config, settings, vllm_config, device))
    model = found.model()
    if model is not None and not release.native_prefill_kernels and model.prices_native_prefill(config):
        # It could choose a prefill kernel this vLLM's FlashMLA does not have.
        found = profiles.Found("none", why=f"{found.where} prices the prefill kernel at {config.num_heads} native heads, "
                                           f"which vLLM {vllm_api.installed_version()}'s FlashMLA does not run (calibrate under this vLLM)")
        model = None
    if found.source == "none":
        log.once(logging.WARNING if found.why else logging.INFO, "mla-planner: %s; routing FP8 steps by %s",
                 found.describe(), routing.VLLM_RULE)
    else:
        log.once(logging.INFO, "mla-planner: %s", found.describe())
    return model


_found: dict[tuple[Any, ...], profiles.Found] = {}


def find_profile(config: mla_planner.StepConfig, settings: Settings, vllm_config: Any,
                 device: torch.device) -> profiles.Found:
    """:func:`.profiles.find` for this engine, once per process for the same kernels, setting and
    largest step (vLLM hands its builders and layers copies of one configuration: the first
    finds, the rest are told the same); never raises (the other ranks wait for its answer)."""
    native = release.native_prefill_kernels and config.native_prefill_heads_possible
    max_step_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    key = (settings.cost_profile, config.arch, config.num_sms, config.topk, config.decode_heads,
           config.prefill_padded_heads, config.num_heads if native else 0, max_step_tokens, str(device))
    if key not in _found:
        _found[key] = _find_profile(config, settings, vllm_config, device, native, max_step_tokens)
    return _found[key]


def _find_profile(config: mla_planner.StepConfig, settings: Settings, vllm_config: Any, device: torch.device,
                  native: bool, max_step_tokens: int) -> profiles.Found:
    grid = first_start_grid(config, max_step_tokens, int(vllm_config.model_config.max_model_len), native)
    measure = None if vllm_api.sleep_mode(vllm_config) else functools.partial(measure_first_start, grid, device)
    try:
        environment = routing.current_environment("vllm", "vllm") if torch.cuda.is_available() else None
        return profiles.find(config, path=settings.cost_profile, environment=environment, native=native,
                             max_step_tokens=max_step_tokens, measure=measure,
                             measure_off="vLLM's sleep mode keeps what a measurement at start-up frees (run `mla-planner "
                                         "calibrate` once and set MLA_PLANNER_COST_PROFILE to its file)")
    except Exception as e:  # a profile's file read or parsed differently since the settings checked it
        return profiles.Found("none", why=f"finding a cost profile failed: {' '.join(str(e).split())}")


def measure_first_start(grid: Grid, device: torch.device) -> dict[str, Any]:
    """Time ``grid`` on ``device`` with vLLM's kernels, as `mla-planner calibrate` does, from inside
    vLLM's model construction: torch's default device and dtype set back to its own for the
    measurement (vLLM builds the model under its own)."""
    from mla_planner.calibration.measure import measure

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"), torch.cuda.device(device):
            return measure(grid, provider="vllm", gather="vllm", command="an engine's first start (reduced grid)",
                           progress=lambda message: logger.debug("mla-planner: measuring a cost profile: %s", message))
    finally:
        torch.set_default_dtype(dtype)


def check_budget(setup: EngineSetup) -> None:
    """Refuse, at start-up, a budget some step of this engine could not be planned in
    (:func:`.sizing.check_budget`)."""
    sizing.check_budget(setup.route_configs(), setup.settings, setup.max_step_tokens, setup.max_decode_query_len)


def stock_decode_tokens(setup: EngineSetup, max_num_seqs: int, uniform_decode_len: int) -> int:
    """The decode tokens a step may hand the sparse kernels and still run vLLM's call unplanned:
    the most a decode step of ``max_num_seqs`` requests carries (``uniform_decode_len`` tokens
    each: 1 + the speculative tokens; within ``max_num_batched_tokens``), where every uniform
    decode batch of that many tokens -- one-token decodes, or fewer requests of more tokens each,
    up to the decode threshold -- is one launch within the allowance; else the same for
    ``max_num_seqs`` tokens; else 0, and every decode-only step is planned. Planning such a step
    would cost the builder its time and change nothing; a longer one (a release's start-up
    warm-up sends 32,768 decode tokens through the kernel at once) is planned like any."""
    fits = functools.partial(_one_stock_launch, setup.config, setup.stock_call_allowance)
    for tokens in sorted({min(max_num_seqs * n, setup.max_step_tokens) for n in (uniform_decode_len, 1)}, reverse=True):
        longest = min(tokens, setup.max_decode_query_len, mla_planner.MAX_DECODE_QUERY_LEN)
        if all(fits(tokens // s_q, s_q) for s_q in range(1, longest + 1)):
            return tokens
    return 0


def _one_stock_launch(config: mla_planner.StepConfig, allowance: int, batch: int, s_q: int) -> bool:
    try:
        plan = mla_planner.plan_step([s_q] * batch, [config.topk] * batch, batch, config)
    except ValueError:  # not even one request of s_q tokens fits: planned, never stock's
        return False
    return len(plan) == 1 and plan.peak_bytes <= allowance
