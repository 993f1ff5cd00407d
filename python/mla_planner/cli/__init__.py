"""The `mla-planner` command line: `plan`, `simulate`, `trace gen`, `presets`,
`calibrate`, `doctor`.

Errors in what the user gave (files, options) print one line and exit 2;
Ctrl-C exits 130 with nothing half-written. Anything else is a bug: one
line saying so, exit 1; MLA_PLANNER_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mla_planner import __version__

from . import calibrate, doctor, plan, presets, simulate, trace
from .config import CliError

EXIT_BUG = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
DEBUG_VARIABLE = "MLA_PLANNER_DEBUG"


class OneLineParser(argparse.ArgumentParser):
    """Option errors as one line (argparse prints the whole usage first); a value that starts with
    a minus and a digit (``--budget -1GiB``) is a value, which the option's own check refuses by
    name, not an unknown option ("expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mla-planner",
        description="Keep sparse-MLA attention (DeepSeek-V3.2, FlashMLA) inside a memory budget in vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"mla-planner {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (plan, simulate, trace, presets, calibrate, doctor):
        module.add_parser(commands)
    return parser


def _input_error(e: BaseException) -> str:
    """One line for an error from reading an input the checks let through
    (a device, a file that changed, a gzip stream cut short...)."""
    if isinstance(e, MemoryError):
        return "out of memory reading the input: is it the kind of file the command expects?"
    if isinstance(e, RecursionError):
        return "the input is nested too deeply to read"
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name = " ".join(["mla-planner", args.command, *filter(None, [getattr(args, "trace_command", None)])])
    debug = os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    try:
        status: int = args.run(args)
        return status
    except CliError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{name}: interrupted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `mla-planner plan | head`
        sys.stderr.close()
        return 0
    except (OSError, MemoryError, RecursionError, ValueError, OverflowError) as e:
        if debug:
            raise
        print(f"{name}: error: {_input_error(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if debug:
            raise
        print(
            f"{name}: internal error (a bug in mla-planner {__version__}): {type(e).__name__}: {e}; "
            f"run again with {DEBUG_VARIABLE}=1 for the traceback and report it with the command line",
            file=sys.stderr,
        )
        return EXIT_BUG
