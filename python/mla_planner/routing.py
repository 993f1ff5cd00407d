"""Which FP8 route each step takes: the cost model's choice where a profile measured on this
GPU, driver, torch and kernel library exists; vLLM's rule (mixed batch below 32 heads per rank)
otherwise, with a warning. Never a guess: a profile measured elsewhere is not used.

The cost model itself (profile format, interpolation, route prices) is Rust,
``mla_planner.CostModel``; this module finds a profile, decides whether it applies here, and
gives the vLLM backend a one-call decision per step. See docs/routing.md.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import numpy.typing as npt

from mla_planner import CostModel, step_mode
from mla_planner._core import COST_PROFILE_ENVIRONMENT_KEYS

logger = logging.getLogger(__name__)

PROFILE_DIR = "profiles"  # under mla_planner/data: one profile per architecture, <arch>.json
VLLM_RULE = "vLLM's rule (mixed batch below 32 heads per rank)"
GATHER_OPS = {
    "vllm": "cp_gather_and_upconvert_fp8_kv_cache",
    "torch": "mla_planner.executor.gather.gather_upconvert",
}
KERNEL_PACKAGES = {"vllm": "vllm", "flash_mla": "sgl-flash-mla"}


def default_profile_path(arch: str = "sm90") -> Path:
    """Where the packaged profile for ``arch`` lives (it may not exist)."""
    return Path(str(resources.files("mla_planner.data") / PROFILE_DIR / f"{arch}.json"))


def load_profile(
    path: str | os.PathLike[str] | None = None,
    *,
    arch: str = "sm90",
    environment: Mapping[str, str] | None = None,
    num_heads: int | None = None,
    num_sms: int | None = None,
    topk: int | None = None,
) -> CostModel | None:
    """The cost model in ``path`` (default: the packaged profile for ``arch``), or ``None``
    with a warning when it cannot be used here, so the caller falls back to vLLM's rule:

    * the file does not exist;
    * ``environment`` (this machine, :func:`current_environment`) differs from the one the
      profile was measured in, in any of GPU, driver, CUDA, torch, kernel library or gather op;
    * ``num_heads`` is given and the profile cannot price it (another architecture, SM count,
      top-k, or no table at its padded head count).

    ``environment=None`` skips the machine check (planning offline for the profile's GPU). A file
    that exists but is not a valid profile raises ``ValueError``: that is a mistake to fix, not a
    reason to route differently.
    """
    where = Path(path) if path is not None else default_profile_path(arch)
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fall_back(where, "no such file")
        return None
    except OSError as e:
        raise ValueError(f"{where}: cannot read cost profile: {e.strerror or e}") from None
    try:
        model = CostModel.from_json(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if environment is not None:
        stale = stale_keys(model.environment, environment)
        if stale:
            _fall_back(where, "measured elsewhere: " + "; ".join(stale))
            return None
    if num_heads is not None:
        try:
            model.check(num_heads, arch=arch, num_sms=num_sms, topk=topk)
        except ValueError as e:
            _fall_back(where, str(e))
            return None
    return model


def stale_keys(measured: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    """``"key: here != measured"`` for every environment key that differs."""
    return [
        f"{key} {here.get(key, 'unknown')!r} here, {measured.get(key)!r} in the profile"
        for key in COST_PROFILE_ENVIRONMENT_KEYS
        if here.get(key, "unknown") != measured.get(key)
    ]


def _fall_back(where: Path, reason: str) -> None:
    logger.warning("mla-planner: cost profile %s: %s; routing steps by %s", where, reason, VLLM_RULE)


def current_environment(kernels: str = "vllm", gather: str = "vllm", device: int | None = None) -> dict[str, str]:
    """This machine as a profile names it (needs torch and a CUDA GPU). ``kernels``: the
    provider whose decode and prefill kernels run (``vllm`` or ``flash_mla``); ``gather``:
    ``vllm`` (its ``cp_gather_and_upconvert_fp8_kv_cache``) or ``torch`` (the executor's)."""
    import torch

    if kernels not in KERNEL_PACKAGES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_PACKAGES)}, got {kernels!r}")
    if gather not in GATHER_OPS:
        raise ValueError(f"gather must be one of {', '.join(GATHER_OPS)}, got {gather!r}")
    gather_op = GATHER_OPS[gather]
    if gather == "vllm":
        gather_op = f"{_package_version('vllm')} {gather_op}"
    return {
        "gpu": torch.cuda.get_device_name(device),
        "driver": driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "kernels": _package_version(KERNEL_PACKAGES[kernels]),
        "gather": gather_op,
    }


def _package_version(package: str) -> str:
    try:
        return f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        return f"{package} (not installed)"


def driver_version() -> str:
    """The NVIDIA kernel driver's version, e.g. ``570.86.15``; ``unknown`` if unreadable."""
    try:
        import pynvml

        nvml: Any = pynvml
        nvml.nvmlInit()
        try:
            version = nvml.nvmlSystemGetDriverVersion()
        finally:
            nvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML here: try the kernel module's own report
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"Kernel Module\s+(\S+)", text)
    return m.group(1) if m else "unknown"


def choose_mixed_batch(
    model: CostModel | None,
    query_lens: npt.ArrayLike,
    context_lens: npt.ArrayLike,
    num_decodes: int,
    *,
    num_heads: int,
    budget_bytes: int,
    gather_workspace_rows: int,
    indexer_workspace_rows: int,
    arch: str = "sm90",
    num_sms: int | None = None,
    topk: int | None = None,
    indexer_logits_bytes: int | None = None,
    force_mqa: bool = False,
) -> bool:
    """Whether an FP8 step runs as one mixed batch (``True``) or separately (``False``).

    Contract, for the vLLM backend's metadata builder, once per scheduler step:

    * the step as the builder sees it: requests ordered decodes first, ``query_lens`` and
      ``context_lens`` per request (1-D integer arrays or lists), the first ``num_decodes``
      requests decodes; the other arguments as :func:`mla_planner.plan_step` takes them
      (``force_mqa``: vLLM runs every prefill as sparse MQA, short ones too);
    * ``model`` from :func:`load_profile`, checked once at start-up; ``None`` means no usable
      profile, and the answer is vLLM's rule (``num_heads < 32``), whatever the step;
    * with a model: the route predicted faster for this step among those the planner fits in
      ``budget_bytes`` (decodes take the decode kernel either way; the choice is how the
      prefill tokens run); a decode-only step, where the routes cost the same, gets vLLM's
      rule;
    * pure and fast: no GPU work, no allocation on the device, tens of microseconds (both
      routes are planned in Rust without the GIL);
    * raises ``ValueError`` (the planner's message) only for an invalid step or when neither
      route fits the budget, where planning the step would fail anyway.

    A caller that plans the step next can call ``model.choose_route(...)`` instead: same
    decision, and ``.plan`` is the chosen route's plan.
    """
    if model is None:
        return step_mode(num_heads, kv_dtype="fp8") == "mixed_batch"
    return model.choose_route(
        query_lens,
        context_lens,
        num_decodes,
        num_heads=num_heads,
        budget_bytes=budget_bytes,
        arch=arch,
        num_sms=num_sms,
        topk=topk,
        gather_workspace_rows=gather_workspace_rows,
        indexer_workspace_rows=indexer_workspace_rows,
        indexer_logits_bytes=indexer_logits_bytes,
        force_mqa=force_mqa,
    ).mixed_batch
