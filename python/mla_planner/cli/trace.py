"""`mla-planner trace gen`: write a seeded, reproducible workload trace."""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from . import checks, tracegen
from .atomic import atomic_files, check_file
from .config import CliError

# The generator draws arrivals by Knuth's method, which needs exp(-rate) > 0;
# a queue of 64 waiting requests makes higher rates pointless anyway.
MAX_ARRIVALS_PER_STEP = 100.0
MAX_STEPS = 1_000_000
"""A step is about 1.5 KB of JSON at the default mix (3,000 steps: 4.4 MB before gzip), so this
is about 1.5 GB uncompressed: more than a simulation needs to settle, and a typo's 10^11 steps is
refused at once instead of filling a disk."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("trace", help="make workload traces")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    gen = sub.add_parser(
        "gen",
        help="generate a trace: chat turns, long documents, steady decodes",
        description="Generate a JSON Lines trace (one scheduler step per line; format in docs/cli.md).",
    )
    gen.add_argument("-o", "--output", type=Path, help="file to write (.gz: gzip-compressed); default or -: stdout")
    gen.add_argument("--steps", type=int, default=3000, help=f"scheduler steps, at most {MAX_STEPS:,} (default 3000)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument(
        "--max-num-batched-tokens",
        default=",".join(map(str, tracegen.DEFAULT_BATCHED_TOKENS)),
        help="token budget per step; a list runs the values as equal phases in order (default %(default)s)",
    )
    gen.add_argument("--max-num-seqs", type=int, default=tracegen.Mix.max_num_seqs, help="most running requests (default %(default)s)")
    gen.add_argument("--chat-per-step", type=checks.number_in(0, MAX_ARRIVALS_PER_STEP), default=tracegen.Mix.chat_per_step, help="mean chat turns arriving per step (default %(default)s)")
    gen.add_argument("--docs-per-step", type=checks.number_in(0, MAX_ARRIVALS_PER_STEP), default=tracegen.Mix.doc_per_step, help="mean long documents arriving per step (default %(default)s)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(run=run_gen)


def _batched_tokens(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CliError(f"--max-num-batched-tokens: {checks.shorten(text)!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise CliError("--max-num-batched-tokens values must be >= 1")
    return values


def run_gen(args: argparse.Namespace) -> int:
    if not 1 <= args.steps <= MAX_STEPS:
        raise CliError(f"--steps must be from 1 to {MAX_STEPS:,} (about 1.5 KB a step before gzip), got {args.steps:,}")
    if args.max_num_seqs < 1:
        raise CliError("--max-num-seqs must be >= 1")
    to_stdout = args.output is None or str(args.output) == "-"
    if not to_stdout:
        check_file(args.output, "--output")
    mix = tracegen.Mix(chat_per_step=args.chat_per_step, doc_per_step=args.docs_per_step, max_num_seqs=args.max_num_seqs)
    steps = tracegen.generate(args.steps, args.seed, _batched_tokens(args.max_num_batched_tokens), mix)
    show_bar = not args.quiet and sys.stderr.isatty()
    with tqdm(steps, desc="generating", unit=" steps", total=args.steps, file=sys.stderr, disable=not show_bar,
              dynamic_ncols=True) as bar:
        return _write(args, (step.to_json() + "\n" for step in bar), to_stdout)


def _write(args: argparse.Namespace, lines: Iterator[str], to_stdout: bool) -> int:
    if to_stdout:
        sys.stdout.writelines(lines)
        return 0

    def fill(f: BinaryIO) -> None:
        if args.output.suffix == ".gz":
            # mtime 0 and no name: the same seed gives the same bytes.
            with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as z:
                z.writelines(line.encode() for line in lines)
        else:
            f.writelines(line.encode() for line in lines)

    with atomic_files() as files:
        files.write(args.output, fill)
    print(f"wrote {args.steps:,} step{'' if args.steps == 1 else 's'} to {args.output.absolute()}", file=sys.stderr)
    return 0
