"""The vLLM backend: FlashMLA sparse attention that follows mla-planner's plan.

Enable it with the ``vllm.general_plugins`` entry point this package declares (see
docs/vllm.md): ``--attention-backend CUSTOM``, or ``MLA_PLANNER_REPLACE_FLASHMLA_SPARSE=1`` to
take the place of ``FLASHMLA_SPARSE``. Importing this package does not import vLLM; the
backend classes live in :mod:`.backend`.
"""

from mla_planner.vllm_backend.plugin import BACKEND_PATH, register
from mla_planner.engine_model.settings import DEFAULT_SCRATCH_MB, Settings, SettingsError, read_settings

__all__ = ["BACKEND_PATH", "DEFAULT_SCRATCH_MB", "Settings", "SettingsError", "read_settings", "register"]
