"""Steps the backend leaves to vLLM's own code because it cannot run them exactly as planned.

After start-up the backend never raises: a step whose plan cannot be made, or whose shapes in a
forward differ from its plan, runs vLLM's own code instead. Each reason is logged once, at warning
level, and every such step is counted (:data:`counts`) and logged at debug level as the step log
reads it (``mla-planner step: ..., vLLM's own code (REASON)``; tests/e2e/step_log.py).
"""

from __future__ import annotations

import collections
import traceback

import mla_planner
from mla_planner.vllm_backend.log import logger

CAUGHT = (Exception, mla_planner.PanicException)
"""What a step or layer call that cannot run its plan may raise, all left to vLLM's own code: a
planner bug (a Rust panic) arrives as pyo3's ``PanicException``, a ``BaseException``."""


counts: collections.Counter[str] = collections.Counter()
"""Steps (builder) and layer calls (impl) that ran vLLM's own code, by reason."""


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


def ran_stock(reason: str, detail: str, tokens: int, decode_tokens: int, prefills: int) -> None:
    """A step the builder could not plan, for ``reason`` (a few words, the same for every such
    step; ``detail`` says this step's numbers): vLLM's own code runs it."""
    counts[reason] += 1
    if counts[reason] == 1:
        logger.warning("mla-planner: a step runs vLLM's own code: %s: %s (said once per reason; the step log counts "
                       "them)", reason, detail)
    logger.debug("mla-planner step: %d tokens, %d decode tokens, %d prefills, vLLM's own code (%s)",
                 tokens, decode_tokens, prefills, reason)


def layer_ran_stock(reason: str, detail: str) -> None:
    """A layer call whose inputs are not its step's plan's: vLLM's own code runs it."""
    counts[reason] += 1
    if counts[reason] == 1:
        logger.warning("mla-planner: a layer call runs vLLM's own code: %s: %s (said once per reason; the step log "
                       "counts them)", reason, detail)
    logger.debug("mla-planner layer: vLLM's own code (%s)", reason)
