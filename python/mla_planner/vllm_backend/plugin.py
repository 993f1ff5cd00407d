"""The ``vllm.general_plugins`` entry point. vLLM calls :func:`register` in every process it
starts (engine and workers), possibly more than once: registering again is harmless."""

from __future__ import annotations

import logging

from mla_planner.engine_model.settings import read_settings

BACKEND_PATH = "mla_planner.vllm_backend.backend.PlannedFlashMLASparseBackend"

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the backend as ``CUSTOM`` (and as ``FLASHMLA_SPARSE`` when
    ``MLA_PLANNER_REPLACE_FLASHMLA_SPARSE=1``). Bad settings, a cost profile that cannot be read
    among them, fail here, at start-up: vLLM's ``load_general_plugins`` lets the error out of the
    process's start (it catches errors only in importing a plugin, not in running it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    settings = read_settings()
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if settings.replace_flashmla_sparse:
        register_backend(AttentionBackendEnum.FLASHMLA_SPARSE, BACKEND_PATH)
    logger.debug("mla-planner registered %s as %s", BACKEND_PATH,
                 "CUSTOM and FLASHMLA_SPARSE" if settings.replace_flashmla_sparse else "CUSTOM")
