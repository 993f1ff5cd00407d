"""What the command line accepts: numbers in a sane range, and steps that
the model they describe could run (each request within `--max-model-len`,
each decode one token, or 1 + `--spec-tokens` with speculative decoding).

Checked here so that a message names the option or trace line at fault,
instead of the planner core's parameter names or a Python traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from operator import add
from typing import TYPE_CHECKING

from mla_planner import MAX_DECODE_QUERY_LEN

if TYPE_CHECKING:  # steps imports config, and config imports this module
    from .steps import Step

# Beyond any real deployment, and small enough that nothing overflows the
# planner core's integers.
MAX_MODEL_LEN = 1 << 30
MAX_TOPK = 1 << 20
MAX_NUM_SMS = 4096
# The planner core's own limits.
MAX_SPEC_TOKENS = MAX_DECODE_QUERY_LEN - 1  # a decode is 1 + N speculative tokens


def shorten(text: str, limit: int = 24) -> str:
    """A value as an error message quotes it: a 400-digit number in full
    would bury the message."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shorten(text)!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:,} and {high:,}, got {shorten(text)}")
        return value

    return parse


def number_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number from `low` (excluded if `low_open`) to `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shorten(text)!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            side = ">" if low_open else ">="
            raise argparse.ArgumentTypeError(f"must be a number {side} {low:,g} and <= {high:,g}, got {shorten(text)}")
        return value

    return parse


def add_spec_tokens(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--spec-tokens",
        type=int_in(0, MAX_SPEC_TOKENS),
        default=0,
        metavar="N",
        help="speculative tokens per decode: a decode then has up to 1 + N query tokens (default 0)",
    )


def step_problem(step: Step, max_model_len: int, max_decode_len: int) -> str | None:
    """Why the model could not run `step`, or None. Messages use the trace's
    field names; callers add the file and line or the options."""
    q, c, d = step.query_lens, step.context_lens, step.num_decodes
    if not q:
        return None
    # The common case in two C-level passes: simulate checks every step.
    if max(map(add, q, c)) <= max_model_len and max(q[:d], default=1) <= max_decode_len:
        return None
    for i, (qi, ci) in enumerate(zip(q, c)):
        if i < d and qi > max_decode_len:
            allowed = "1 token" if max_decode_len == 1 else f"at most {max_decode_len} tokens (1 + --spec-tokens)"
            hint = "" if max_decode_len > 1 else "; mark it a prefill, or pass --spec-tokens for speculative decoding"
            return f"request {i} is a decode of {qi:,} query tokens, but a decode has {allowed}{hint}"
        if qi + ci > max_model_len:
            return (
                f"request {i}: context_len {ci:,} + query_len {qi:,} = {qi + ci:,} tokens, more than the model's "
                f"--max-model-len {max_model_len:,}"
            )
    return None
