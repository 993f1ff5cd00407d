"""What the command line accepts: numbers in a sane range.

Checked here so that a message names the option at fault, instead of the
planner core's parameter names or a Python traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from mla_planner import MAX_DECODE_QUERY_LEN

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
