"""Per-rank facts from the log of a tensor-parallel vLLM run, so the ranks can be compared:

* the KV cache each worker got (vLLM's "Current kv cache memory in use is X GiB", one line per worker);
* the scratch reservation mla-planner made in each worker ("scratch budget N MiB ... reserved");
* the plan each worker logged for every step (``mla-planner step: ...`` at VLLM_LOGGING_LEVEL=DEBUG).

vLLM prefixes a worker's lines with ``(Worker_TP<rank> pid=<pid>)``. Every rank plans the same
step from the same scheduler output, so their step lines must be the same sequence.

    python3 tests/e2e/rank_log.py /tmp/e2e/planned-tp2-0.95-32k.log [/tmp/e2e/stock-tp2-0.95-32k.log]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK = re.compile(r"\(Worker(?:_[A-Z]+\d+)*_TP(\d+) pid=\d+\)")
# vLLM 0.26 logs "Available KV cache memory" on rank 0 only; every rank logs the KV cache it holds.
KV = re.compile(r"(?:Current kv cache memory in use is|Available KV cache memory:) ([0-9.]+) ?GiB")
# The plugin's line names what it reserves ("... 1024 MiB (default); 676 MiB reserved from the KV
# cache ..."); logs of its earlier builds: "... 1024 MiB (default), reserved ..." (the budget) or
# "... 1024 MiB (default), 648 MiB of it reserved ...".
RESERVED = re.compile(r"mla-planner: sparse MLA scratch budget (\d+) MiB \([^)]*\)(?:; (\d+) MiB |, (?:(\d+) MiB of it )?)"
                      r"reserved")
STEP = re.compile(r"mla-planner step: (.*)$")


@dataclass
class Rank:
    kv_gib: float | None = None
    reserved_mib: int | None = None
    steps: list[str] = field(default_factory=list)


def parse(text: str) -> dict[int, Rank]:
    ranks: dict[int, Rank] = {}
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        m = RANK.search(line)
        if m is None:
            continue
        rank = ranks.setdefault(int(m.group(1)), Rank())
        if (kv := KV.search(line)) is not None:
            rank.kv_gib = float(kv.group(1))
        elif (res := RESERVED.search(line)) is not None:
            rank.reserved_mib = int(res.group(2) or res.group(3) or res.group(1))
        elif (step := STEP.search(line)) is not None:
            rank.steps.append(step.group(1).strip())
    return ranks


def problems(ranks: dict[int, Rank], *, planned: bool) -> list[str]:
    """What is wrong with a run's ranks: a rank without its KV line, and for the planned backend a
    rank that reserved nothing or planned a different sequence of steps than rank 0."""
    out = [f"rank {r}: no KV cache line" for r, rank in sorted(ranks.items()) if rank.kv_gib is None]
    if not ranks:
        return ["no worker lines (Worker_TP<rank>) in the log"]
    if planned:
        out += [f"rank {r}: no scratch reservation" for r, rank in sorted(ranks.items()) if rank.reserved_mib is None]
        first = ranks[min(ranks)].steps
        out += [f"rank {r}: {len(rank.steps)} step plans differ from rank {min(ranks)}'s {len(first)}"
                for r, rank in sorted(ranks.items()) if rank.steps != first]
    return out


def report(path: Path) -> tuple[list[str], list[str]]:
    ranks = parse(path.read_text(errors="replace"))
    planned = any(rank.reserved_mib is not None or rank.steps for rank in ranks.values())
    lines = [f"{path.name}: {len(ranks)} rank(s), {'planned' if planned else 'stock'}"]
    for r, rank in sorted(ranks.items()):
        kv = "–" if rank.kv_gib is None else f"{rank.kv_gib:.2f} GiB"
        reserved = "" if rank.reserved_mib is None else f", reserved {rank.reserved_mib} MiB"
        lines.append(f"  rank {r}: KV cache {kv}{reserved}, {len(rank.steps)} step plans logged")
    found = problems(ranks, planned=planned)
    if planned and not found:
        lines.append(f"  every rank logged the same {len(ranks[min(ranks)].steps)} step plans")
    return lines, found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    failed = False
    for path in args.logs:
        lines, found = report(path)
        print("\n".join(lines + [f"  PROBLEM: {p}" for p in found]))
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
