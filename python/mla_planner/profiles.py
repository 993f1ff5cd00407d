"""Which cost profile routes an engine's FP8 steps, and where it comes from (docs/routing.md,
"Where an engine's profile comes from"). In order:

1. ``MLA_PLANNER_COST_PROFILE=none``: no profile. vLLM's rule routes every step; a step whose
   one vLLM call fits the budget runs as that call, only a larger one is cut.
2. ``MLA_PLANNER_COST_PROFILE=PATH``: that file (measured elsewhere: vLLM's rule, with a warning).
3. A packaged profile measured in this environment (GPU, driver, CUDA, torch, kernels, gather):
   ``mla_planner/data/profiles/<arch>-<kernels>-<gpu>.json``.
4. A profile this machine measured at an earlier start, from the cache (:func:`cache_dir`),
   when it was measured in this environment, prices this engine's kernels and reaches its largest
   step.
5. Otherwise one is measured now, on the reduced grid (:func:`.calibration.grid.first_start_grid`),
   written to the cache and used.

The result crosses between processes as a :class:`Found` (plain data, the profile's text), so
one tensor-parallel rank can find or measure it and every rank route by the same one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from mla_planner import CostModel, StepConfig
from mla_planner.routing import PROFILE_DIR, package_version, stale_keys

CACHE_VAR = "MLA_PLANNER_CACHE_DIR"
REFERENCE_GPU = "NVIDIA H200"
"""The GPU whose packaged profile prices steps where no GPU is visible (planning offline, the
CPU tests): the docs' figures were measured on it."""

@dataclasses.dataclass(frozen=True)
class Found:
    """An engine's cost profile and where it came from."""

    source: str
    """``file``, ``packaged``, ``cached``, ``measured``; or ``none``, with ``text`` ``None``, when
    no profile routes."""
    text: str | None = None
    """The profile's JSON."""
    where: str = ""
    """The file it was read from or written to (``measured``: the cache file, or ``""`` where
    the cache could not be written)."""
    seconds: float = 0.0
    """``measured``: how long the measurement took."""
    why: str = ""
    """What made it this source: why the cache was refused, why nothing was measured."""

    def model(self) -> CostModel | None:
        return None if self.text is None else CostModel.from_json(self.text)

    def describe(self) -> str:
        """One line for the start-up log."""
        skip = "MLA_PLANNER_COST_PROFILE=none routes by vLLM's rule instead"
        if self.source == "packaged":
            whose = f"{self.why}" if self.why else "this GPU and software"
            return f"cost profile packaged for {whose} ({Path(self.where).name}) routes FP8 steps"
        if self.source == "cached":
            return f"cost profile measured on this machine at an earlier start ({self.where}) routes FP8 steps; {skip}"
        if self.source == "measured":
            kept = f"cached at {self.where}" if self.where else "not cached (the cache folder is not writable)"
            why = f" ({self.why})" if self.why else ""
            return (f"no cost profile for this GPU and software{why}: measured one in {self.seconds:.1f} s on a reduced grid, "
                    f"{kept}, and it routes FP8 steps; set {CACHE_VAR} to move the cache, "
                    "MLA_PLANNER_COST_PROFILE=PATH (`mla-planner calibrate`) to use another, or none to skip it")
        if self.source == "file":
            return f"cost profile {self.where} routes FP8 steps"
        return f"no cost profile ({self.why or 'MLA_PLANNER_COST_PROFILE=none'})"


# --- packaged profiles -------------------------------------------------------------------


def gpu_slug(gpu: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``: the GPU part of a packaged profile's name."""
    words = gpu.lower().split()
    if words and words[0] == "nvidia":
        words = words[1:]
    return "-".join("".join(c for c in w if c.isalnum()) for w in words) or "gpu"


def packaged_name(arch: str, kernels: str, gpu: str) -> str:
    return f"{arch}-{kernels.replace(' ', '-')}-{gpu_slug(gpu)}.json"


def packaged_profiles(arch: str = "sm90", kernels: str | None = None) -> list[Path]:
    """The packaged profiles of ``arch`` for ``kernels`` (as a profile's environment names them,
    ``"vllm X.Y.Z"``; default: the installed vLLM's), one per GPU they were measured on."""
    kernels = package_version("vllm") if kernels is None else kernels
    folder = resources.files("mla_planner.data") / PROFILE_DIR
    prefix = f"{arch}-{kernels.replace(' ', '-')}-"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.startswith(prefix) and p.name.endswith(".json"))


def environment_of(profile: Path) -> dict[str, str]:
    """The environment a profile's file names (GPU, driver, CUDA, torch, kernels, gather)."""
    return CostModel.from_json(profile.read_text(encoding="utf-8")).environment


def packaged_for(arch: str, environment: Mapping[str, str], kernels: str | None = None) -> Path | None:
    """The packaged profile measured in ``environment``, if any."""
    for path in packaged_profiles(arch, kernels):
        if not stale_keys(environment_of(path), environment):
            return path
    return None


def packaged_for_gpu(arch: str, gpu: str, kernels: str | None = None) -> Path | None:
    """The packaged profile measured on ``gpu`` (its name as torch reports it, or a part of it:
    ``H100``), whatever the driver or torch; ``None`` if there is none."""
    for path in packaged_profiles(arch, kernels):
        measured_on = environment_of(path).get("gpu", "")
        if gpu.lower() == measured_on.lower() or gpu_slug(gpu) in gpu_slug(measured_on).split("-"):
            return path
    return None


# --- the cache ---------------------------------------------------------------------------


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where measured profiles are kept: ``$MLA_PLANNER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mla-planner``, else ``~/.cache/mla-planner``."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_VAR):
        return Path(env[CACHE_VAR])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "mla-planner"


def cache_path(config: StepConfig, environment: Mapping[str, str], native: bool,
               environ: Mapping[str, str] | None = None) -> Path:
    """The cache file of profiles measured in ``environment`` for ``config``'s kernels: its
    architecture, SMs, top-k, padded heads and (``native``) unpadded prefill heads. Engines
    that run the same kernels here share it."""
    key = {
        "environment": dict(sorted(environment.items())),
        "arch": config.arch,
        "num_sms": config.num_sms,
        "topk": config.topk,
        "padded_heads": sorted({config.decode_heads, config.prefill_padded_heads}),
        "native_heads": [config.num_heads] if native else [],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = f"{config.arch}-{environment.get('kernels', 'kernels').replace(' ', '-')}-{gpu_slug(environment.get('gpu', ''))}-{digest}.json"
    return cache_dir(environ) / "profiles" / name


def refusal(text: str, config: StepConfig, environment: Mapping[str, str] | None, *, native: bool = False,
            max_step_tokens: int | None = None) -> str | None:
    """Why a profile cannot route an engine of ``config`` here (``None``: it can): not a valid
    profile, measured elsewhere (``environment`` ``None``: not checked), not pricing its kernels
    (``native``: at its own heads too), or (``max_step_tokens``) not reaching its largest step."""
    try:
        model = CostModel.from_json(text)
    except ValueError as e:
        return f"not a valid profile ({' '.join(str(e).split())})"
    stale = stale_keys(model.environment, environment) if environment is not None else []
    if stale:
        return "measured elsewhere: " + "; ".join(stale)
    try:
        model.check(config)
    except ValueError as e:
        return " ".join(str(e).split())
    if native and not model.prices_native_prefill(config):
        return f"no prefill table at {config.num_heads} native heads"
    if max_step_tokens is None:
        return None
    reached = max((int(size) for size, _ in json.loads(text)["sparse_decode"][str(config.decode_heads)]), default=0)
    needed = min(max_step_tokens, _launch_limit(config.decode_heads))
    if reached < needed:
        return f"measured up to {reached:,} tokens a launch, this engine's steps reach {needed:,}"
    return None


def _launch_limit(heads: int) -> int:
    from mla_planner.calibration.grid import launch_limit

    return launch_limit(heads, False)


def write_cache(path: Path, text: str) -> str | None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed into place, so
    engines starting together never read half a file); the reason where it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


# --- an engine's profile -----------------------------------------------------------------


def find(config: StepConfig, *, path: str | None, environment: Mapping[str, str] | None, native: bool,
         max_step_tokens: int, measure: Callable[[], dict[str, Any]] | None,
         measure_off: str = "measuring is off here", environ: Mapping[str, str] | None = None) -> Found:
    """The profile that routes an engine of ``config`` (FP8), by the order in the module's
    docstring. ``path``: ``MLA_PLANNER_COST_PROFILE``'s file (already checked to parse);
    ``environment``: this machine (:func:`.routing.current_environment`), ``None`` where no GPU
    is visible (then the reference GPU's packaged profile, unchecked, and no measuring);
    ``native``: the installed kernels run the prefill kernel at ``config``'s own heads;
    ``measure``: makes a profile on the reduced grid (``None``: measuring is refused here, for
    the reason ``measure_off``)."""
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        refused = refusal(text, config, environment)
        if refused is not None:
            return Found("none", why=f"MLA_PLANNER_COST_PROFILE={path}: {refused} (`mla-planner calibrate` writes one here)")
        return Found("file", text, path)
    if environment is None:
        reference = packaged_for_gpu(config.arch, REFERENCE_GPU)
        if reference is None:
            return Found("none", why=f"no GPU visible, and no {REFERENCE_GPU} profile packaged for this vLLM")
        reference_text = reference.read_text(encoding="utf-8")
        refused = refusal(reference_text, config, None)
        if refused is not None:
            return Found("none", why=f"no GPU visible, and the {REFERENCE_GPU}'s profile: {refused}")
        return Found("packaged", reference_text, str(reference), why=f"the {REFERENCE_GPU}, no GPU being visible")
    packaged = packaged_for(config.arch, environment, environment.get("kernels"))
    if packaged is not None:
        text = packaged.read_text(encoding="utf-8")
        if refusal(text, config, None) is None:  # measured here (packaged_for); else its kernels at other heads or top-k
            return Found("packaged", text, str(packaged))
    cached = cache_path(config, environment, native, environ)
    why = "none packaged or cached"
    try:
        text = cached.read_text(encoding="utf-8")
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        why = f"the cached {cached} is unreadable ({getattr(e, 'strerror', None) or e}); measuring anew"
    else:
        refused = refusal(text, config, environment, native=native, max_step_tokens=max_step_tokens)
        if refused is None:
            return Found("cached", text, str(cached))
        why = f"the cached {cached.name} was refused: {refused}"
    if measure is None:
        return Found("none", why=f"{why}, and {measure_off}")
    started = time.monotonic()
    from mla_planner.calibration.measure import CalibrationError, json_text

    try:
        text = json_text(measure())
    except (CalibrationError, RuntimeError, ValueError) as e:
        return Found("none", why=f"{why}; measuring one failed: {' '.join(str(e).split())}")
    seconds = time.monotonic() - started
    not_written = write_cache(cached, text)
    return Found("measured", text, "" if not_written else str(cached), seconds, why)
