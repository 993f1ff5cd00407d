"""Planning time through the Python API next to vLLM's own split_prefill_chunks.

    python benchmarks/planning_bench.py

Prints, for 256 to 4,096 prefill requests: microseconds per call of
mla_planner.split_prefill_chunks (numpy in, numpy out) and of the installed
vLLM's split_prefill_chunks (a torch tensor in, a list out) on the same input,
their ratio (target >= 50x), and our time per request (flat when cost grows
linearly with requests).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch

import mla_planner as mp


def best_of(fn: object, repeat: int) -> float:
    """Seconds per call: the best of `repeat` timing rounds (least noise)."""
    timer = timeit.Timer(fn)  # type: ignore[arg-type]
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from vllm.v1.attention.backends.utils import split_prefill_chunks as vllm_split  # after --help: it logs on import

    rng = np.random.default_rng(args.seed)
    workspace = 163_840 * 5  # vLLM: max_model_len * 5 for DeepSeek-V3.2
    print(f"{'requests':>8} {'ours us':>10} {'vLLM us':>10} {'speed-up':>9} {'ours ns/request':>16}")
    for n in (256, 512, 1024, 2048, 4096):
        seq = rng.integers(1, 8192, size=n, dtype=np.int64)
        seq_t = torch.from_numpy(seq.copy())
        ours = mp.split_prefill_chunks(seq, workspace)
        assert ours.tolist() == [list(t) for t in vllm_split(seq_t, workspace)]
        t_ours = best_of(lambda: mp.split_prefill_chunks(seq, workspace), args.repeat)
        t_vllm = best_of(lambda: vllm_split(seq_t, workspace), args.repeat)
        print(f"{n:>8} {t_ours * 1e6:>10.1f} {t_vllm * 1e6:>10.1f} {t_vllm / t_ours:>8.0f}x {t_ours / n * 1e9:>16.1f}")


if __name__ == "__main__":
    main()
