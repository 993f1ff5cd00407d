"""The `mla-planner` command line: `plan`, `simulate`, `trace gen`, `presets`,
`calibrate`.

Errors in what the user gave (files, options) print one line and exit 2;
Ctrl-C exits 130 with nothing half-written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mla_planner import __version__

from . import calibrate, plan, presets, simulate, trace
from .config import CliError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla-planner",
        description="Keep sparse-MLA attention (DeepSeek-V3.2, FlashMLA) inside a memory budget in vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"mla-planner {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (plan, simulate, trace, presets, calibrate):
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
        return status
    except CliError as e:
        print(f"mla-planner {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"mla-planner {args.command}: interrupted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `mla-planner plan | head`
        sys.stderr.close()
        return 0
