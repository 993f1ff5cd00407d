"""What one step costs under each policy.

*stock*: vLLM's FLASHMLA_SPARSE backend as shipped, as the release
`vllm_releases.SIMULATED` describes runs it. Mixed batch: one decode-kernel
call over every sparse token of the step. Separate: one decode call for the
decodes, one prefill call per `split_prefill_chunks` chunk. Both let the
kernel allocate `out` (vLLM passes none). Prefills are routed all-or-nothing
per step (vLLM's rule for masked MHA, where the release has it).

*planned*: `mla_planner.plan_step` under the byte budget.

All bytes come from the planner's scratch models; this module only decides
which kernel calls a policy makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from mla_planner import (
    Scratch,
    StepPlan,
    decode_scratch,
    max_tokens_per_launch,
    plan_prefill_groups,
    plan_step,
    prefill_scratch,
    split_prefill_chunks,
)

from .config import CliError, PlannerConfig, in_flags
from .steps import Step

PATHS = ("dense_mha", "masked_mha", "sparse_mqa")
FAILURES = ("int32_stride", "grid", "workspace_assert")


@dataclass(frozen=True)
class LaunchRow:
    """One sparse-attention kernel call as a policy reports it, with the buffers live while it runs."""

    kernel: str  # "sparse_decode" or "sparse_prefill"
    tokens: tuple[int, int]  # [start, end) query tokens of the step
    requests: tuple[int, int]  # [start, end) requests of the step
    batch: int
    s_q: int  # query tokens per batch entry
    scratch: Scratch  # stock: the call's buffers; planned: the plan's (`Launch.scratch`)

    @property
    def bytes(self) -> int:
        return self.scratch.total_bytes


@dataclass(frozen=True)
class Outcome:
    """A policy's verdict on one step."""

    launches: list[LaunchRow]
    num_launches: int
    peak_bytes: int
    failure: str | None  # a hard failure of the step (see FAILURES), None if it runs
    path_tokens: dict[str, int] = field(default_factory=dict)  # prefill tokens per path
    plan: StepPlan | None = None  # the planned policy's full plan


class Scratches:
    """Memoised scratch models for one config: steps repeat a handful of
    launch shapes, and the planner's Python call is the cost here."""

    def __init__(self, cfg: PlannerConfig) -> None:
        try:
            self._setup(cfg)
        except ValueError as e:  # the core refuses the config (heads, topk, SMs...)
            raise CliError(in_flags(str(e))) from None

    def _setup(self, cfg: PlannerConfig) -> None:
        self.cfg = cfg
        self.decode = lru_cache(maxsize=8192)(self._decode)
        self.prefill = lru_cache(maxsize=8192)(self._prefill)
        self.decode_limit = max_tokens_per_launch(cfg.step.num_heads)
        # The prefill kernel pads heads its own way (64 on sm90, 128 on
        # sm100); its lse buffer (s_q * padded heads * 4 bytes) says how many.
        padded = self._prefill(1, False).buffers["lse"] // 4
        self.prefill_limit = max_tokens_per_launch(padded)

    def _decode(self, batch: int, s_q: int, out_preallocated: bool) -> Scratch:
        c = self.cfg.step
        return decode_scratch(
            batch, s_q, c.num_heads, arch=c.arch, num_sms=c.num_sms, topk=c.topk, out_preallocated=out_preallocated
        )

    def _prefill(self, s_q: int, out_preallocated: bool) -> Scratch:
        c = self.cfg.step
        return prefill_scratch(s_q, c.num_heads, arch=c.arch, topk=c.topk, out_preallocated=out_preallocated,
                               padding=c.prefill_padding)

    def failure(self, launch: LaunchRow) -> str | None:
        """The hard limit a launch crosses, if any (docs/kernels.md, "Hard limits": b = 1 strides)."""
        limit, name = self.decode_limit if launch.kernel == "sparse_decode" else self.prefill_limit
        if launch.batch == 1 and launch.s_q > limit:
            return name
        return None


def _path_tokens(step: Step, groups_req: npt.NDArray[np.int64], paths: Sequence[str], offset: int) -> dict[str, int]:
    starts = [0, *accumulate(step.query_lens)]
    tokens = dict.fromkeys(PATHS, 0)
    for (r0, r1), path in zip(groups_req.tolist(), paths):
        tokens[path] += starts[r1 + offset] - starts[r0 + offset]
    return tokens


def stock(step: Step, s: Scratches) -> Outcome:
    """The kernel calls vLLM makes for this step as shipped (module docstring)."""
    cfg, d = s.cfg, step.num_decodes
    q, c = step.query_lens, step.context_lens
    starts = [0, *accumulate(q)]
    sparse = [(0, d)] if d else []  # request ranges through the sparse kernels
    path_tokens = dict.fromkeys(PATHS, 0)
    if len(q) > d:
        groups = plan_prefill_groups(q[d:], c[d:], topk=cfg.step.topk, available=cfg.step.masked_mha, stock=True)
        path_tokens = _path_tokens(step, groups.requests, groups.paths, d)
        for (r0, r1), path in zip(groups.requests.tolist(), groups.paths):
            if path == "sparse_mqa":
                sparse.append((r0 + d, r1 + d))
    launches: list[LaunchRow] = []
    failure = None
    if cfg.mode == "mixed_batch" or cfg.mode == "bf16":
        # One call over every sparse token (stock routing is all-or-nothing,
        # so they are contiguous).
        if sparse:
            r0, r1 = sparse[0][0], sparse[-1][1]
            t0, t1 = starts[r0], starts[r1]
            if cfg.mode == "mixed_batch":
                launches.append(LaunchRow("sparse_decode", (t0, t1), (r0, r1), 1, t1 - t0, s.decode(1, t1 - t0, False)))
            else:
                launches.append(LaunchRow("sparse_prefill", (t0, t1), (r0, r1), 1, t1 - t0, s.prefill(t1 - t0, False)))
    else:
        if d:
            s_q = max(q[:d])
            launches.append(LaunchRow("sparse_decode", (0, starts[d]), (0, d), d, s_q, s.decode(d, s_q, False)))
        rows = cfg.step.gather_workspace_rows
        for r0, r1 in (r for r in sparse if r[0] >= d):
            seq_lens = [q[i] + c[i] for i in range(r0, r1)]
            if max(seq_lens) > rows:  # vLLM asserts every request fits the gather workspace
                failure = "workspace_assert"
                continue
            for a, b in split_prefill_chunks(seq_lens, rows, request_offset=r0).tolist():
                t0, t1 = starts[a], starts[b]
                launches.append(LaunchRow("sparse_prefill", (t0, t1), (a, b), 1, t1 - t0, s.prefill(t1 - t0, False)))
    failure = failure or next((f for f in map(s.failure, launches) if f), None)
    peak = max((launch.bytes for launch in launches), default=0)
    return Outcome(launches, len(launches), peak, failure, path_tokens)


def plan(step: Step, s: Scratches) -> StepPlan:
    return plan_step(step.query_lens, step.context_lens, step.num_decodes, s.cfg.planned)


def planned(step: Step, s: Scratches, *, detail: bool = False) -> Outcome:
    """The planned policy. `detail` builds per-launch breakdowns (for `plan`);
    `simulate` reads only the totals."""
    p = plan(step, s)
    groups = p.prefill_groups
    path_tokens = _path_tokens(step, groups.requests, groups.paths, 0) if len(groups) else dict.fromkeys(PATHS, 0)
    launches = planned_launches(step, p) if detail or s.cfg.mode == "bf16" else []
    # The planner cuts mixed and separate steps under the hard limits; its
    # bf16 mode runs each run of sparse tokens in one call, as stock does.
    failure = next((f for f in map(s.failure, launches) if f), None)
    return Outcome(launches, len(p.launch_kernels), p.peak_bytes, failure, path_tokens, p)


def planned_launches(step: Step, p: StepPlan) -> list[LaunchRow]:
    """The plan's launches, each with the buffers the plan holds while it runs (its own, and
    those the step shares across launches, sized for the longest)."""
    mixed = p.mode == "mixed_batch"
    launches = []
    for launch in p:
        tokens, requests = launch.tokens, launch.requests
        if launch.kernel == "sparse_decode" and not mixed:  # a batch of decode requests
            batch, s_q = requests.stop - requests.start, max(step.query_lens[: step.num_decodes])
        else:  # one run of tokens
            batch, s_q = 1, tokens.stop - tokens.start
        launches.append(LaunchRow(launch.kernel, (tokens.start, tokens.stop), (requests.start, requests.stop), batch,
                                  s_q, launch.scratch))
    return launches


class CachedPolicies:
    """Both policies for a stream of steps, memoised per step shape.

    Neither policy reads a decode's context length (the decode kernel
    attends to top-k slots, whatever the context; gathers, the indexer and
    prefill paths see prefills only), so steps that differ only there cost
    the same, and decode-only steps repeat a handful of shapes.
    """

    MAX_ENTRIES = 4096

    def __init__(self, scratches: Scratches) -> None:
        self.scratches = scratches
        self._cache: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[Outcome, Outcome]] = {}

    def __call__(self, step: Step) -> tuple[Outcome, Outcome]:
        d = step.num_decodes
        key = (d, tuple(step.query_lens), tuple(step.context_lens[d:]))
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            hit = self._cache[key] = (stock(step, self.scratches), planned(step, self.scratches))
        return hit
