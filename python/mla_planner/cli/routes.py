"""`mla-planner plan --profile`: which FP8 route the cost model takes for the step, and the
predicted time of each route. Planning is offline, for the profile's GPU, so the profile is
not checked against this machine; a missing one falls back to vLLM's rule with a warning."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_planner import RouteChoice, RouteTime
from mla_planner.routing import VLLM_RULE, load_profile

from .config import CliError, PlannerConfig, in_flags
from .steps import Step

ROUTE_NAMES = {"mixed_batch": "mixed batch", "separate_prefill_decode": "separate prefill/decode"}


@dataclass(frozen=True)
class Routes:
    profile: Path
    environment: dict[str, str] | None  # None: no usable profile, vLLM's rule decides
    choice: RouteChoice | None

    @property
    def mode(self) -> str | None:
        """The route for the planned policy; None leaves it to vLLM's rule."""
        return None if self.choice is None else self.choice.mode

    @property
    def native_prefill_heads(self) -> bool:
        """The planned policy runs the prefill kernel at native heads, as the cost model priced it."""
        return self.choice is not None and self.choice.config.native_prefill_heads


# A measured profile is tens of kilobytes; a bigger file is not one, and
# reading a device such as /dev/zero whole would never end.
MAX_PROFILE_BYTES = 16 << 20


def _check_profile_file(profile: Path) -> None:
    """Refuse what is not a regular file of a profile's size (a missing file
    is left to load_profile, which falls back to vLLM's rule)."""
    try:
        st = profile.stat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise CliError(f"--profile {profile}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CliError(f"--profile {profile} is not a regular file; give the JSON file mla-planner calibrate wrote")
    if st.st_size > MAX_PROFILE_BYTES:
        raise CliError(f"--profile {profile} is {st.st_size:,} bytes, too large for a cost profile")


def choose(profile: Path, step: Step, cfg: PlannerConfig) -> Routes:
    if cfg.step.kv_dtype != "fp8":
        raise CliError("--profile chooses between the FP8 routes; a BF16 KV cache has one (drop --profile)")
    _check_profile_file(profile)
    try:
        model = load_profile(profile)
    except ValueError as e:
        raise CliError(str(e)) from None
    except RecursionError:
        raise CliError(f"--profile {profile}: JSON nested too deeply: not a cost profile") from None
    if model is None:
        return Routes(profile, None, None)
    try:
        choice = model.choose_route(step.query_lens, step.context_lens, step.num_decodes, cfg.planned)
    except ValueError as e:  # another GPU or model than the profile's, or neither route fits
        raise CliError(f"{profile}: {in_flags(str(e))}") from None
    return Routes(profile, model.environment, choice)


def _ms(us: float) -> str:
    return f"{us / 1000:.3f} ms"


def _route_line(name: str, time: RouteTime | None, error: str | None) -> str:
    if time is None:
        return f"  {name:<24} does not fit the budget: {error}"
    parts = [
        f"{part} {_ms(us)} x{n}{at}"
        for part, us, n, at in (
            ("decode", time.decode_us, time.decode_launches, ""),
            ("gather", time.gather_us, time.gathers, ""),
            ("prefill", time.prefill_us, time.prefill_launches, f" at {time.prefill_heads} heads"),
        )
        if n
    ]
    return f"  {name:<24} {_ms(time.total_us):>11}  ({', '.join(parts) or 'no sparse launches'})"


def to_text(routes: Routes) -> list[str]:
    if routes.choice is None or routes.environment is None:
        return [f"route    {VLLM_RULE}: no usable cost profile at {routes.profile}", ""]
    env = routes.environment
    p = routes.choice.prediction
    taken = ROUTE_NAMES[routes.choice.mode]
    out = [
        f"routes   cost model measured on {env['gpu']} (driver {env['driver']}, torch {env['torch']}, {env['kernels']}), "
        f"{routes.profile}",
        _route_line("mixed batch", p.mixed, p.mixed_error),
        _route_line("separate prefill/decode", p.separate, p.separate_error),
    ]
    if p.mixed is not None and p.separate is not None:
        fast, slow = sorted((p.mixed.total_us, p.separate.total_us))
        ratio = f"predicted {slow / fast:.2f}x faster" if fast < slow else "predicted equal: vLLM's rule"
        out.append(f"  taken: {taken}, {ratio}")
    else:
        out.append(f"  taken: {taken}, the route that fits")
    return [*out, ""]


def _time_json(t: RouteTime | None) -> dict[str, Any] | None:
    if t is None:
        return None
    keys = ("total_us", "decode_us", "gather_us", "prefill_us", "decode_launches", "gathers", "prefill_launches",
            "prefill_heads")
    return {k: getattr(t, k) for k in keys}


def to_json(routes: Routes) -> dict[str, Any]:
    c = routes.choice
    return {
        "profile": str(routes.profile),
        "environment": routes.environment,
        "rule": "vllm" if c is None else "cost_model",
        "route": None if c is None else c.mode,
        "mixed": None if c is None else _time_json(c.prediction.mixed),
        "separate": None if c is None else _time_json(c.prediction.separate),
        "mixed_error": None if c is None else c.prediction.mixed_error,
        "separate_error": None if c is None else c.prediction.separate_error,
    }
