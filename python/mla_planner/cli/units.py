"""Byte sizes as people type and read them."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
GIB = UNITS["GiB"]
# Larger than any GPU; keeps sizes inside the planner core's 64-bit integers.
MAX_BYTES = 1 << 50
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?\s*$")


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"512 MiB"``, ``"1.5GiB"`` or ``"1073741824"`` -> bytes.

    Only binary units: ``GB`` is ambiguous (10**9 or 2**30), so it is refused
    rather than guessed.
    """
    shown = text if len(text) <= 24 else text[:21] + "..."
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"{shown!r} is not a size: use a number with B, KiB, MiB or GiB, e.g. 1GiB or 512MiB")
    # Fraction, not float: exact, and a 400-digit number is "too large", not inf.
    value = int(Fraction(m.group(1)) * UNITS[m.group(2) or "B"])
    if value > MAX_BYTES:
        raise ValueError(f"{shown!r} is larger than {MAX_BYTES >> 50} PiB")
    return value


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``1.00 GiB``, ``956.4 MiB``, ``12 B``."""
    for unit in ("GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit]:
            value = n / UNITS[unit]
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"
    return f"{n} B"


def size_arg(text: str) -> int:
    """``parse_bytes`` as an argparse ``type=``: a bad size is argparse's one-line error."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
