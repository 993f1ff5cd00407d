"""Data shipped with the package.

``default_trace.jsonl.gz``: the workload `mla-planner simulate` replays when
given no trace. Regenerate (byte-identical) with::

    mla-planner trace gen --steps 3000 --seed 0 -o python/mla_planner/data/default_trace.jsonl.gz
"""

DEFAULT_TRACE = "default_trace.jsonl.gz"
