"""Run mla-planner's plans on the FlashMLA sparse kernels (or on a float32 reference).

Importing this package needs torch, never CUDA or FlashMLA: kernels load when a provider is
built (:func:`get_provider`).
"""

from mla_planner._core import ALLOCATOR_RESERVE_BYTES
from mla_planner.executor.buffers import Buffers
from mla_planner.executor.mixed_batch import Launches, MixedBatchExecutor
from mla_planner.executor.providers import (
    PROVIDER_NAMES,
    FlashMLAProvider,
    KernelProvider,
    ProviderUnavailable,
    ReferenceProvider,
    VllmProvider,
    get_provider,
)
from mla_planner.executor.quant import quantize_fp8_ds_mla
from mla_planner.executor.reference import dequantize_fp8_ds_mla, sparse_attention

__all__ = [
    "ALLOCATOR_RESERVE_BYTES",
    "Buffers",
    "PROVIDER_NAMES",
    "FlashMLAProvider",
    "KernelProvider",
    "Launches",
    "MixedBatchExecutor",
    "ProviderUnavailable",
    "ReferenceProvider",
    "VllmProvider",
    "dequantize_fp8_ds_mla",
    "get_provider",
    "quantize_fp8_ds_mla",
    "sparse_attention",
]
