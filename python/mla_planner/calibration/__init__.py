"""Measuring the sparse-MLA kernels on this GPU into a cost profile (docs/routing.md).

* :mod:`.grid` -- what is timed: token sizes per head count, gather row counts, rounds;
  the full grid of `mla-planner calibrate` and the reduced one an engine's first start measures.
* :mod:`.measure` -- the timing loop and the profile it writes.
* :mod:`.kernel_timing` -- one measurement, on fresh inputs, by CUDA events.
* :mod:`.synthetic` -- seeded random kernel inputs (also the tests' and benchmarks').
"""
