"""The tests' and benchmarks' harness, kept out of the wheel: a stand-alone executor of the FP8
separate path's gather chunks with the log-sum-exp merge of split requests that the GPU tests
check the kernels' accuracy with (:mod:`.separate_prefill`, :mod:`.lse_merge`), and the
allocator's peak of a call (:mod:`.measure`). Synthetic inputs live in the package, which
`mla-planner calibrate` draws from: ``mla_planner.calibration.synthetic``. Importing it needs torch, never
CUDA; pytest puts ``tests/`` on ``sys.path`` (pyproject.toml), a script adds it itself.
"""
