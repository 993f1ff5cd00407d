"""The backend's knobs, read from the environment once per process and checked at start-up.

* ``MLA_PLANNER_SCRATCH_MB`` -- the scratch budget in MiB (default
  :data:`DEFAULT_SCRATCH_MB`). ``VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB``, the name the upstream
  proposal used, is honoured too; when both are set they must agree.
* ``MLA_PLANNER_REPLACE_FLASHMLA_SPARSE`` -- ``1`` registers the backend in place of
  ``FLASHMLA_SPARSE`` as well as ``CUSTOM``, so existing command lines pick it up unchanged.
* ``MLA_PLANNER_COST_PROFILE`` -- the cost profile that routes FP8 steps (``mla-planner
  calibrate``); unset: the packaged one of this machine, else one measured here at an earlier
  start, else one measured at this start (:mod:`mla_planner.profiles`); ``none``: no profile,
  vLLM's rule, nothing measured. When set to a path it must name a readable UTF-8 file that
  parses as a cost profile, or start-up fails; a valid profile that was measured on another
  machine means vLLM's rule, with a warning (docs/routing.md).
* ``MLA_PLANNER_NATIVE_PREFILL_HEADS`` -- ``1`` runs the BF16 sparse prefill kernel at the rank's
  own 16 or 32 heads on every separate-route step (SM90, where the release's FlashMLA runs them; refused elsewhere
  at start-up). Unset: vLLM's padding to 64, unless the cost profile prices native heads cheaper
  for a step (docs/routing.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from mla_planner import CostModel

DEFAULT_SCRATCH_MB = 1024
"""1 GiB: 3,641-token launches at 64 padded heads (the mixed-batch path of a 16-head rank), a
few percent slower than one unbounded call on the H200 (docs/benchmarks.md), against the 8-10 GiB
one 32K-token call would take."""

MIN_SCRATCH_MB = 64
"""Below this a launch shrinks to a few hundred tokens at most (one of 133 tokens at 64 padded
heads takes 33 MiB) and a long prompt becomes hundreds of launches."""

MAX_SCRATCH_MB = 1 << 20

SCRATCH_VARS = ("MLA_PLANNER_SCRATCH_MB", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB")
REPLACE_VAR = "MLA_PLANNER_REPLACE_FLASHMLA_SPARSE"
PROFILE_VAR = "MLA_PLANNER_COST_PROFILE"
NATIVE_VAR = "MLA_PLANNER_NATIVE_PREFILL_HEADS"
KNOBS = (*SCRATCH_VARS, REPLACE_VAR, PROFILE_VAR, NATIVE_VAR)
NO_PROFILE = "none"
"""``MLA_PLANNER_COST_PROFILE=none``: route by vLLM's rule on purpose, with no warning."""


class SettingsError(ValueError):
    """A knob has a value the backend cannot use; the message names it and says what to do."""


@dataclasses.dataclass(frozen=True)
class Settings:
    scratch_mb: int
    replace_flashmla_sparse: bool
    source: str
    """Where ``scratch_mb`` came from: an environment variable's name, or ``"default"``."""
    cost_profile: str | None = None
    """A cost profile's path, checked to parse; ``None``: the packaged one, or none at all when
    ``vllm_rule``."""
    vllm_rule: bool = False
    """``MLA_PLANNER_COST_PROFILE=none``: no cost profile; FP8 steps take vLLM's rule."""
    native_prefill_heads: bool = False
    """``MLA_PLANNER_NATIVE_PREFILL_HEADS=1``: the prefill kernel at the rank's own heads, every step
    (checked against the heads, GPU and vLLM when the engine's configuration is made)."""

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_mb << 20


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The knobs in ``environ`` (default: this process's environment), checked. The process's own
    are read once per distinct set of values: registration, the builder and every layer's impl ask,
    and the cost profile check parses a file."""
    if environ is None:
        return _process_settings(tuple(os.environ.get(name) for name in KNOBS))
    return _read(environ)



@functools.lru_cache(maxsize=8)
def _process_settings(values: tuple[str | None, ...]) -> Settings:
    return _read({name: value for name, value in zip(KNOBS, values) if value is not None})


def _read(env: Mapping[str, str]) -> Settings:
    values = {name: _scratch_mb(name, env[name]) for name in SCRATCH_VARS if env.get(name, "").strip()}
    if len(set(values.values())) > 1:
        shown = ", ".join(f"{name}={mb}" for name, mb in values.items())
        raise SettingsError(f"{shown} disagree: set one of them (MLA_PLANNER_SCRATCH_MB is the project's name)")
    source, scratch_mb = next(iter(values.items()), ("default", DEFAULT_SCRATCH_MB))
    profile = env.get(PROFILE_VAR, "").strip()
    vllm_rule = profile.lower() == NO_PROFILE
    replace = _flag(REPLACE_VAR, env.get(REPLACE_VAR, ""), "replace FLASHMLA_SPARSE", "keep it")
    native = _flag(NATIVE_VAR, env.get(NATIVE_VAR, ""), "run the prefill kernel at 16 or 32 native heads",
                   "pad as vLLM does")
    return Settings(scratch_mb, replace, source, None if vllm_rule else _cost_profile(profile), vllm_rule, native)


def _scratch_mb(name: str, raw: str) -> int:
    try:
        mb = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number of MiB (e.g. {name}={DEFAULT_SCRATCH_MB})") from None
    if not MIN_SCRATCH_MB <= mb <= MAX_SCRATCH_MB:
        raise SettingsError(
            f"{name}={mb} is outside {MIN_SCRATCH_MB}..{MAX_SCRATCH_MB} MiB; "
            f"the default is {DEFAULT_SCRATCH_MB} (unset {name} to use it)"
        )
    return mb


def _cost_profile(value: str) -> str | None:
    """``value`` if it names a cost profile this process can read, ``None`` if unset. A profile
    someone set on purpose and that cannot be used is a mistake to fix now, not a silent switch
    to vLLM's rule found in a log after the model has loaded."""
    if not value:
        return None
    path = Path(value)

    def unusable(reason: str) -> SettingsError:
        shown = value if path.is_absolute() else f"{value} ({Path.cwd() / path})"
        return SettingsError(
            f"{PROFILE_VAR}={shown}: {reason}; point it at a profile written by `mla-planner calibrate`, "
            f"unset it to use the packaged one, or set it to {NO_PROFILE} for vLLM's rule"
        )

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise unusable("no such file") from None
    except OSError as e:
        raise unusable(f"cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        # Reading a FIFO or a device would block or never end; a directory is a slip of the path.
        raise unusable("a directory, not a file" if stat.S_ISDIR(mode) else "not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise unusable(f"cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise unusable(f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    try:
        CostModel.from_json(text)
    except ValueError as e:
        raise unusable(" ".join(str(e).split())) from None  # one line, whatever the parser says
    return value


def _flag(name: str, raw: str, on: str, off: str) -> bool:
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SettingsError(f"{name}={raw!r}: use 1 to {on}, 0 (or unset) to {off}")
