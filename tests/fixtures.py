"""Fixtures shared by the CPU test modules; a module imports the ones it uses
(``from fixtures import gen``). tests/gpu has its own ``gen``, on the GPU."""

from __future__ import annotations

import secrets

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded fresh for each test; the seed is printed, and pytest shows it when the
    test fails."""
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)
