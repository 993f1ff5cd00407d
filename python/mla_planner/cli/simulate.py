"""`mla-planner simulate`: replay a trace under stock vLLM and the planner."""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mla_planner import data

from . import checks, config, policies, report, vllm_releases
from .atomic import atomic_files, check_folder
from .config import CliError, PlannerConfig
from .records import POLICIES, Records, summarise
from .steps import STDIN, Step, read_trace
from .units import GIB

DEFAULT_OUT = Path("mla-planner-report")
# An assumption, not a measurement: what a deployment leaves free after
# weights, KV cache and activations. Pass your own.
DEFAULT_HEADROOM_GIB = 4.0
MAX_HEADROOM_GIB = 1 << 20  # 1 PiB: beyond any GPU
MAX_COUNTED_BYTES = 4 << 30  # counting lines for the progress bar stops here


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "simulate",
        help="replay a workload trace under stock vLLM and under the planner",
        description=(
            "Replay a JSON Lines trace (one scheduler step per line; format in docs/cli.md) under stock "
            f"vLLM {vllm_releases.SIMULATED.minor} and under mla-planner. With no TRACE: the built-in default workload."
        ),
    )
    p.add_argument(
        "trace", nargs="?", type=Path, help="trace file (.jsonl, or .jsonl.gz; - reads stdin); default: built-in workload"
    )
    config.add_options(p)
    checks.add_spec_tokens(p)
    p.add_argument(
        "--headroom-gib",
        type=checks.number_in(0, MAX_HEADROOM_GIB, low_open=True),
        default=DEFAULT_HEADROOM_GIB,
        help="GPU memory free for attention scratch; steps needing more are OOMs (default %(default)s)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the report, plot and data (default ./%(default)s)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (faster for huge traces)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def replay(
    steps: Iterable[tuple[int, Step]],
    cfg: PlannerConfig,
    label: str,
    progress: tqdm[Any] | None = None,
    *,
    max_decode_len: int = 1,
) -> Records:
    """Both policies over every (line number, step). A step the model could
    not run, and the planner's errors (e.g. a budget below one token's
    launch), name the trace line."""
    both = policies.CachedPolicies(policies.Scratches(cfg))
    rec = Records()
    stock_rec, planned_rec = rec.policies["stock"], rec.policies["planned"]
    for line, step in steps:
        problem = step.problem(cfg.max_model_len, max_decode_len)
        if problem is not None:
            raise CliError(f"{label}:{line}: {problem}")
        try:
            stock, planned = both(step)
            stock_rec.add(stock)
            planned_rec.add(planned)
        except ValueError as e:
            raise CliError(f"{label}:{line}: {e}") from None
        rec.tokens.append(step.num_tokens)
        rec.prefill_tokens.append(step.prefill_tokens)
        if progress is not None:
            progress.update()
    return rec


def _count_lines(path: Path) -> int | None:
    """Lines of a trace file, for the progress bar's total and ETA; None
    for stdin, pipes and devices, or a file too big to count quickly."""
    if str(path) == STDIN or not path.is_file():
        return None
    opener = gzip.open if path.suffix == ".gz" else open
    count, seen = 0, 0
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
                seen += len(chunk)
                if seen > MAX_COUNTED_BYTES:
                    return None
    except (OSError, EOFError):
        return None  # the replay reports it, with the line
    return count


def run(args: argparse.Namespace) -> int:
    cfg = PlannerConfig.from_args(args)
    headroom = int(args.headroom_gib * GIB)
    names = [name for key, name in report.FILES.items() if key != "plot" or not args.no_plot]
    check_folder(args.out, names, "--out")  # before the replay: a bad --out fails in a second, not a minute
    with ExitStack() as stack:
        if args.trace is None:
            path = stack.enter_context(resources.as_file(resources.files(data) / data.DEFAULT_TRACE))
            label = f"built-in default workload (mla_planner/data/{data.DEFAULT_TRACE})"
            trace_name = "built-in default workload"
        else:
            path = args.trace
            label = trace_name = "stdin" if str(path) == STDIN else str(path)
        show_bar = not args.quiet and sys.stderr.isatty()
        bar = stack.enter_context(
            tqdm(desc="simulating", unit=" steps", total=_count_lines(path) if show_bar else None, file=sys.stderr,
                 disable=not show_bar, dynamic_ncols=True)
        )  # fmt: skip
        rec = replay(read_trace(path, label), cfg, label, bar, max_decode_len=1 + args.spec_tokens)
    if not len(rec):
        raise CliError(f"{label}: no steps")
    summary = {
        "trace": label,
        "steps": len(rec),
        "headroom_bytes": headroom,
        "budget_bytes": cfg.step.scratch_budget_bytes,
        "config": {"num_heads": cfg.step.num_heads, "heads_from": cfg.heads_from, "mode": cfg.mode, "vllm_path": cfg.vllm_path,
                   "kv_dtype": cfg.step.kv_dtype, "arch": cfg.step.arch, "num_sms": cfg.step.num_sms, "topk": cfg.step.topk,
                   "masked_mha": cfg.step.masked_mha, "max_model_len": cfg.max_model_len},
        **{p: summarise(rec.policies[p], budget_bytes=cfg.step.scratch_budget_bytes, headroom_bytes=headroom) for p in POLICIES},
    }
    with atomic_files() as files:
        written = report.write_all(files, args.out, rec, summary, cfg, plot=not args.no_plot, trace_name=trace_name)
    print(report.terminal_summary(summary))
    print()
    print(report.where_written(written))
    print(report.verdict(summary))
    return 0
