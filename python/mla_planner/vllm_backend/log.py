"""The backend's logger: under vLLM's (``vllm.mla_planner``), so its lines come out in vLLM's format
and at ``VLLM_LOGGING_LEVEL``; and lines said once per process, since vLLM makes a builder per
attention group and an impl per layer."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.mla_planner")

_said: set[str] = set()


def once(level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` once per process."""
    text = message % args if args else message
    if text not in _said:
        _said.add(text)
        logger.log(level, text)
