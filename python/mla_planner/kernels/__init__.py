"""Attention kernels of our own (Triton and Gluon), outside the FlashMLA providers.

:mod:`.fp8_direct` -- sparse MLA that reads the ``fp8_ds_mla`` cache directly at the native head
count (docs/fp8-direct.md); its ``KernelConfig`` also reaches the Gluon kernels, :mod:`.fp8_wgmma`
(with :mod:`.fp8_wgmma_ws`) and :mod:`.fp8_mma`. Importing this package imports nothing; import the
submodule, which needs torch and triton (never vLLM, never CUDA at import time).
"""
