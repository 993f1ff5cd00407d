"""Which FP8 route each step takes: the cost model's choice where a profile measured on this
GPU, driver, torch and kernel library exists; vLLM's rule (mixed batch below 32 heads per rank)
otherwise. Never a guess: a profile measured elsewhere is not used.

The cost model itself (profile format, interpolation, route prices) is Rust,
``mla_planner.CostModel``; this module names the machine a profile was measured on, decides
whether a profile applies here, and gives the vLLM backend a one-call decision per step. Which
profile an engine takes (packaged, cached, measured at its first start) is
:mod:`mla_planner.profiles`. See docs/routing.md.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy.typing as npt

from mla_planner import CostModel, StepConfig, StepPlan
from mla_planner import plan_step as mla_planner_plan_step
from mla_planner._core import COST_PROFILE_ENVIRONMENT_KEYS

logger = logging.getLogger(__name__)

PROFILE_DIR = "profiles"  # under mla_planner/data: <arch>-<kernels>-<gpu>.json (mla_planner.profiles)
VLLM_RULE = "vLLM's rule (mixed batch below 32 heads per rank)"
GATHER_OPS = {
    "vllm": "cp_gather_and_upconvert_fp8_kv_cache",
    "torch": "mla_planner.executor.reference.gather_upconvert",
}
KERNEL_PACKAGES = {"vllm": "vllm", "flash_mla": "sgl-flash-mla"}


def load_profile(
    path: str | os.PathLike[str],
    *,
    environment: Mapping[str, str] | None = None,
    config: StepConfig | None = None,
) -> CostModel | None:
    """The cost model in ``path``, or ``None`` with a warning when it cannot be used here, so the
    caller falls back to vLLM's rule:

    * the file does not exist;
    * ``environment`` (this machine, :func:`current_environment`) differs from the one the
      profile was measured in, in any of GPU, driver, CUDA, torch, kernel library or gather op;
    * ``config`` is given and the profile cannot price its steps (another architecture, SM
      count, top-k, or no table at its padded head counts).

    ``environment=None`` skips the machine check (planning offline for the profile's GPU). A file
    that exists but is not a valid profile raises ``ValueError``: that is a mistake to fix, not a
    reason to route differently.
    """
    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fall_back(where, "no such file")
        return None
    except OSError as e:
        raise ValueError(f"{where}: cannot read cost profile: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: cost profile is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    try:
        model = CostModel.from_json(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if environment is not None:
        stale = stale_keys(model.environment, environment)
        if stale:
            _fall_back(where, "measured elsewhere: " + "; ".join(stale)
                       + " (`mla-planner calibrate` writes one for this machine)")
            return None
    if config is not None:
        try:
            model.check(config)
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


_WARNED: set[tuple[str, str]] = set()


def _fall_back(where: Path, reason: str) -> None:
    # Once per profile and reason: vLLM makes a metadata builder per attention group, and each
    # loads the profile.
    if (str(where), reason) not in _WARNED:
        _WARNED.add((str(where), reason))
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
        gather_op = f"{package_version('vllm')} {gather_op}"
    return {
        "gpu": torch.cuda.get_device_name(device),
        "driver": driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "kernels": package_version(KERNEL_PACKAGES[kernels]),
        "gather": gather_op,
    }


def package_version(package: str) -> str:
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


def choose_plan(
    model: CostModel | None,
    query_lens: npt.ArrayLike,
    context_lens: npt.ArrayLike,
    num_decodes: int,
    config: StepConfig,
) -> StepPlan:
    """The plan a step runs by: with a cost model (from :func:`load_profile`, checked once at
    start-up), the plan of the FP8 route predicted faster among those that fit the budget --
    decodes take the decode kernel either way, the choice is how the prefill tokens run, and a
    decode-only step, where the routes cost the same, gets vLLM's rule; without one, the plan of
    ``config``'s own mode (vLLM's rule unless fixed).

    Pure and fast: no GPU work, tens of microseconds (planned in Rust without the GIL). Raises
    ``ValueError`` (the planner's message) for an invalid step or when no route fits the budget.
    """
    if model is None or config.kv_dtype != "fp8" or config.mode_fixed:
        return mla_planner_plan_step(query_lens, context_lens, num_decodes, config)
    return model.choose_route(query_lens, context_lens, num_decodes, config).plan
