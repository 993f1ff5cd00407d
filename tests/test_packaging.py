"""The package holds what runs at run time; the test harness lives in tests/harness, not in the wheel."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_test_harness_in_the_package() -> None:
    assert importlib.util.find_spec("mla_planner.testing") is None
    assert not (ROOT / "python" / "mla_planner" / "testing").exists()


def test_maturin_includes_nothing_from_tests() -> None:
    """maturin packs python/mla_planner plus its ``include`` list: nothing of the harness may come back that way."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.maturin\]\n(.*?)(?=^\[)", text, re.S | re.M)
    assert section is not None
    assert not re.search(r"testing|tests|harness", section.group(1)), section.group(1)
