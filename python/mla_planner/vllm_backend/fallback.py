"""The bounded path: where a step cannot run its plan, its layer calls run inside the engine's
reservation all the same.

A step leaves its plan for one reason, decided once: the builder could not plan it, or its first
layer call that could not run the plan (tokens other than the plan's, an allocation failure in a
launch, any other error) decided it for the step's later layers. Each reason is logged once per
process at warning level, each step that falls back is counted once (:mod:`.stats`) and logged at
debug level as the step log reads it (``mla-planner step: ..., bounded path (REASON)``;
tests/e2e/step_log.py).

The bounded path runs the layer call's tokens on the mixed-batch route -- every token through the
sparse decode kernel, which any subset of a step's tokens can take, since each token attends to
its own top-k rows -- in launches the byte model proves fit the reservation
(:meth:`mla_planner.StepConfig.bounded_configs`). Where those launches are one, and vLLM's own
route for the step is that same one call, vLLM's code runs it: its exact bytes are that launch's.

An allocation failure on the bounded path is met by launches of a quarter of the bytes, down to
launches of one token; the step's later layers start where the last one succeeded. Only a failure
no bounded path can avoid reaches vLLM, as one line naming the call's tokens and the bytes asked.

Whatever a failed attempt allocated is freed before the next runs: the exception, which holds the
failed launch's frames and through them its buffers, is dropped before the fallback starts.
"""

from __future__ import annotations

import copy
import logging
import traceback
from typing import Any

import torch

import mla_planner
from mla_planner.executor.mixed_batch import Launches
from mla_planner.vllm_backend import log
from mla_planner.vllm_backend.log import logger
from mla_planner.vllm_backend.releases import release

CAUGHT = (Exception, mla_planner.PanicException)
"""What a step or layer call that cannot run its plan may raise: a planner bug (a Rust panic)
arrives as pyo3's ``PanicException``, a ``BaseException``."""

OOM = torch.OutOfMemoryError


class PlanMismatch(ValueError):
    """A layer call whose sparse tokens (or route) are not its step's plan's."""


def describe(exc: BaseException) -> str:
    """``exc``'s message on one line; for one without (a bare ``assert``, in vLLM's code or this
    backend's), where it was raised, so that the one warning still says which check failed."""
    message = " ".join(str(exc).split())
    if message:
        return message
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "(no message)"
    where = frames[-1]
    path = where.filename.replace("\\", "/")
    for root in ("/site-packages/", "/python/"):  # vllm/..., mla_planner/...
        if root in path:
            path = path.rsplit(root, 1)[1]
    return f"(no message) raised at {path}:{where.lineno} in {where.name}"


def layer_reason(exc: BaseException) -> str:
    """The reason a layer call could not run its plan: a few words, the same for every such call."""
    if isinstance(exc, PlanMismatch):
        return "vLLM handed the layer call other tokens than its plan's"
    if isinstance(exc, OOM):
        return "an allocation failed in a planned launch"
    return f"the layer call could not run its plan ({type(exc).__name__})"


_said: set[str] = set()


def warn_once(reason: str, detail: str) -> None:
    """The warning for ``reason``, once per process, with the first such step's ``detail``."""
    if reason not in _said:
        _said.add(reason)
        logger.warning("mla-planner: a step falls back to the bounded path: %s: %s (said once per reason; the "
                       "summary line counts them)", reason, detail)


class BoundedStep:
    """A step that left its plan, and the launches its layer calls run instead.

    ``vllm_route``: ``(fp8_use_mixed_batch, fp8_extra_metadata)`` as vLLM's rule built them, where
    the builder had rebuilt the step's metadata for its plan's route; ``None`` where the metadata
    is vLLM's."""

    def __init__(self, setup: Any, reason: str, vllm_route: tuple[bool, Any] | None = None) -> None:
        self.setup = setup
        self.reason = reason
        self.vllm_route = vllm_route
        self.schedules: dict[Any, Any] = {}
        """FlashMLA schedules by launch length, shared by the step's layers (as a plan's)."""
        self.workspace: dict[Any, Any] = {}
        """The release's workspace views, shared by the step's layers once vLLM serves."""
        self.rung = 0
        """The ladder's rung the step's layer calls start at: the last that ran."""
        self.vllm_call = vllm_route[0] if vllm_route is not None else None
        """Whether vLLM's own call may run a one-launch layer call: its route for the step is the
        mixed one (``None``: as the layer call's metadata says); ``False`` once it failed."""
        self._plans: dict[tuple[int, int], tuple[Launches, int]] = {}
        setup.state.stats.fell_back(reason)

    def launches(self, tokens: int, rung: int) -> tuple[Launches, int]:
        """The bounded plan of ``tokens`` tokens at ``rung``: its launches and the largest one's
        bytes beyond vLLM's workspace (what the reservation holds of it)."""
        key = (tokens, rung)
        made = self._plans.get(key)
        if made is None:
            config = self.setup.bounded_configs[rung]
            requests = [tokens] if tokens else []  # a layer call of no tokens: no launch
            plan = mla_planner.plan_step(requests, [0] * len(requests), 0, config)
            peak = plan.peak_beyond_workspace(config.decode_heads, self.setup.workspace_heads)
            made = self._plans[key] = (Launches.of(plan), peak)
        return made

    def vllm_metadata(self, md: Any) -> Any:
        """The step's metadata on the route vLLM's rule built."""
        if self.vllm_route is None:
            return md
        md = copy.copy(md)
        md.fp8_use_mixed_batch, md.fp8_extra_metadata = self.vllm_route
        md.planned = None
        return md

    def run(self, impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_indices: torch.Tensor, md: Any) -> Any:
        """The layer call within the reservation: vLLM's own call where it is the one bounded
        launch, the bounded launches otherwise. Raises only where no rung fits the memory there
        is, or where the bounded launches fail as well."""
        tokens = int(q.shape[0])
        stats = self.setup.state.stats
        if self.vllm_call is None:
            self.vllm_call = bool(md.fp8_use_mixed_batch)
        while True:
            launches, peak = self.launches(tokens, self.rung)
            stock = self.vllm_call and self.rung == 0 and len(launches.rows) == 1
            try:
                if stock:
                    result = stock_forward(impl, q, kv_cache, topk_indices, self.vllm_metadata(md))
                else:
                    release.fill_group_topk(impl, topk_indices, md, kv_cache)
                    result = impl._run_mixed(self, launches, q, kv_cache, topk_indices, md)
            except OOM:
                pass  # the failed attempt's buffers die with the exception, here
            except CAUGHT as exc:
                if stock:  # vLLM's code failed otherwise than for memory: the bounded launches, from now on
                    self.vllm_call = False
                    continue
                stats.failed()
                raise RuntimeError(f"mla-planner: a layer call of {tokens:,} tokens failed on the bounded path too "
                                   f"({type(exc).__name__}: {describe(exc)}), after {self.reason}") from exc
            else:
                stats.bounded_launch(peak)
                return result
            if self.rung + 1 >= len(self.setup.bounded_configs):
                stats.failed()
                raise OOM(f"mla-planner: a layer call of {tokens:,} tokens could not allocate its attention scratch "
                          f"even in launches of {launches.longest:,} tokens ({peak:,} bytes asked, "
                          f"{self.setup.reserved_bytes:,} reserved), after {self.reason}")
            self.rung += 1
            log.once(logging.WARNING, "mla-planner: an allocation failed on the bounded path: its launches take a "
                                      "quarter of the bytes each time, down to one token (said once)")


def stock_forward(impl: Any, q: torch.Tensor, kv_cache: torch.Tensor, topk_indices: torch.Tensor, md: Any) -> Any:
    """vLLM's own FP8 forward for the route ``md`` names."""
    return release.stock_fp8_forward(impl, bool(md.fp8_use_mixed_batch), q, kv_cache, topk_indices, md)


def builder_fell_back(setup: Any, reason: str, detail: str, tokens: int, decode_tokens: int,
                      prefills: int) -> BoundedStep:
    """A step the builder could not plan, for ``reason`` (``detail``: this step's numbers): its
    layer calls take the bounded path on vLLM's metadata."""
    warn_once(reason, detail)
    logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, bounded path (%s)",
                 tokens, decode_tokens, prefills, reason)
    return BoundedStep(setup, reason)


def layer_fell_back(setup: Any, reason: str, detail: str, vllm_route: tuple[bool, Any] | None) -> BoundedStep:
    """A step whose first layer call could not run its plan: the step's layer calls take the
    bounded path from this one on."""
    warn_once(reason, detail)
    logger.debug("mla-planner layer: bounded path (%s)", reason)
    return BoundedStep(setup, reason, vllm_route)
