"""GPU tests (``python -m pytest -m gpu tests/gpu -q``): collected everywhere, run only where a
CUDA device and the FlashMLA kernels are present, and skipped with the reason otherwise.

``MLA_PLANNER_PROVIDER`` picks the kernels: ``flash_mla`` (sgl-flash-mla, the default) or
``vllm`` (vLLM's bundled FlashMLA).
"""

from __future__ import annotations

import secrets

import pytest
import torch

from mla_planner.executor import KernelProvider, ProviderUnavailable, get_provider

from gpu_helpers import PROVIDER


@pytest.fixture(scope="session")
def provider() -> KernelProvider:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")
    try:
        return get_provider(PROVIDER)
    except ProviderUnavailable as exc:
        pytest.skip(f"kernel provider {PROVIDER!r} unavailable: {exc}")


@pytest.fixture(autouse=True)
def _needs_gpu_kernels(provider: KernelProvider) -> None:
    """Every test here skips, with the provider fixture's reason, when the kernels are absent."""


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(32)
    print(f"random seed: {seed}")  # shown by pytest when the test fails
    return torch.Generator(device="cuda").manual_seed(seed)
