"""Harness for tests, benchmarks and calibration, apart from the runtime package: synthetic
inputs shaped like a real step (:mod:`.synthetic`), the allocator's peak of a call
(:mod:`.measure`), and a stand-alone executor of the FP8 separate path's gather chunks with its
torch gather and log-sum-exp merge of split requests (:mod:`.separate_prefill`, :mod:`.gather`,
:mod:`.lse_merge`) that the GPU tests check the kernels' accuracy with. The vLLM backend uses
none of it. Importing it needs torch, never CUDA.
"""
