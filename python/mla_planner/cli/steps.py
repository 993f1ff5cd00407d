"""A scheduler step as the planner sees it, and the trace file format:
JSON Lines, one step per line (see docs/cli.md)."""

from __future__ import annotations

import gzip
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import add, itemgetter
from pathlib import Path
from typing import IO, Any

from .config import CliError

REQUEST_KEYS = frozenset({"query_len", "context_len", "decode"})


@dataclass(frozen=True)
class Step:
    """Requests of one step, decodes first (as vLLM's batch reorder puts them)."""

    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.query_lens[self.num_decodes :])

    def problem(self, max_model_len: int, max_decode_len: int) -> str | None:
        """Why the model could not run this step, or None: each request within `--max-model-len`,
        each decode one token, or 1 + `--spec-tokens` with speculative decoding. Messages use the
        trace's field names; callers add the file and line or the options."""
        q, c, d = self.query_lens, self.context_lens, self.num_decodes
        if not q:
            return None
        # The common case in two C-level passes: simulate checks every step.
        if max(map(add, q, c)) <= max_model_len and max(q[:d], default=1) <= max_decode_len:
            return None
        for i, (qi, ci) in enumerate(zip(q, c)):
            if i < d and qi > max_decode_len:
                allowed = "1 token" if max_decode_len == 1 else f"at most {max_decode_len} tokens (1 + --spec-tokens)"
                hint = "" if max_decode_len > 1 else "; mark it a prefill, or pass --spec-tokens for speculative decoding"
                return f"request {i} is a decode of {qi:,} query tokens, but a decode has {allowed}{hint}"
            if qi + ci > max_model_len:
                return (
                    f"request {i}: context_len {ci:,} + query_len {qi:,} = {qi + ci:,} tokens, more than the model's "
                    f"--max-model-len {max_model_len:,}"
                )
        return None

    @classmethod
    def from_requests(cls, requests: list[tuple[int, int, bool]]) -> Step:
        decodes = [r for r in requests if r[2]]
        prefills = [r for r in requests if not r[2]]
        ordered = decodes + prefills
        return cls([r[0] for r in ordered], [r[1] for r in ordered], len(decodes))

    def to_json(self) -> str:
        d = self.num_decodes
        reqs = [
            {"query_len": q, "context_len": c, "decode": i < d}
            for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens))
        ]
        return json.dumps({"requests": reqs}, separators=(",", ":"))


def _is_count(x: object) -> bool:
    return type(x) is int  # bool is an int subclass; true/false are not lengths


_INT, _BOOL = {int}, {bool}
_MISSING = object()
_QUERY_LEN, _CONTEXT_LEN = itemgetter("query_len"), itemgetter("context_len")


def _parse_fast(obj: Any) -> Step | None:
    """The common, valid case, checked with C-level set operations; None if
    anything is off, and `_diagnose` then says what."""
    try:
        reqs = obj["requests"]
        q = list(map(_QUERY_LEN, reqs))
        c = list(map(_CONTEXT_LEN, reqs))
        flags = list(map(dict.get, reqs, repeat("decode"), repeat(_MISSING)))
        missing = flags.count(_MISSING)
        if sum(map(len, reqs)) != 3 * len(reqs) - missing:  # a key beyond the three
            return None
        if missing:  # "decode" left out: a one-token query is a decode
            flags = [qi == 1 if f is _MISSING else f for qi, f in zip(q, flags)]
    except (TypeError, KeyError, AttributeError):
        return None
    if not q:
        return Step([], [], 0) if isinstance(reqs, list) else None
    if not (set(map(type, q)) == _INT and set(map(type, c)) == _INT and set(map(type, flags)) == _BOOL):
        return None
    if min(q) < 1 or min(c) < 0:
        return None
    num_decodes = flags.count(True)
    if flags[:num_decodes].count(True) == num_decodes:  # decodes already first
        return Step(q, c, num_decodes)
    return Step.from_requests(list(zip(q, c, flags)))


def _diagnose(obj: Any) -> str:
    """What is wrong with a step that `_parse_fast` refused."""
    if not isinstance(obj, dict):
        return f"a step must be a JSON object, got {type(obj).__name__}"
    if "requests" not in obj:
        return 'a step needs a "requests" list'
    reqs = obj["requests"]
    if not isinstance(reqs, list):
        return '"requests" must be a list'
    for i, r in enumerate(reqs):
        where = f"request {i}"
        if not isinstance(r, dict):
            return f"{where}: must be an object with query_len and context_len"
        unknown = set(r) - REQUEST_KEYS
        if unknown:
            return f"{where}: unknown field {sorted(unknown)[0]!r} (fields: query_len, context_len, decode)"
        for key, least in (("query_len", 1), ("context_len", 0)):
            if key not in r:
                return f"{where}: missing {key}"
            v = r[key]
            if not _is_count(v):
                return f"{where}: {key} must be an integer, got {json.dumps(v)}"
            if v < least:
                return f"{where}: {key} must be >= {least}, got {v}"
        if "decode" in r and type(r["decode"]) is not bool:
            return f"{where}: decode must be true or false, got {json.dumps(r['decode'])}"
    return "invalid step"


def parse_step(line: str) -> Step:
    """One trace line -> Step; ValueError says what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:  # e.g. a line of 100,000 "["
        raise ValueError("JSON nested too deeply: a step is an object holding a list of objects") from None
    step = _parse_fast(obj)
    if step is None:
        raise ValueError(_diagnose(obj))
    return step


STDIN = "-"
# Far longer than any real step (a 1,000-request step is ~60 KB) and small
# enough to read: a line past it is not a trace (e.g. /dev/zero).
MAX_LINE_CHARS = 16 << 20


def open_text(path: Path) -> IO[str]:
    """Read a trace: `-` is stdin; a name ending in .gz is gzip-compressed."""
    if str(path) == STDIN:
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(path: Path, label: str | None = None) -> Iterator[tuple[int, Step]]:
    """(line number, step) of a trace file, blank lines skipped. Errors
    name the file and line."""
    name = label or ("stdin" if str(path) == STDIN else str(path))
    try:
        f = open_text(path)
    except OSError as e:
        raise CliError(f"{name}: cannot read trace: {e.strerror or e}") from None
    with f:
        try:
            # readline with a limit: an endless line stops at the limit instead of filling memory.
            for number, line in enumerate(iter(partial(f.readline, MAX_LINE_CHARS + 1), ""), 1):
                if len(line) > MAX_LINE_CHARS:
                    raise CliError(f"{name}:{number}: line longer than {MAX_LINE_CHARS >> 20} MiB: not a trace")
                if not line.strip():
                    continue
                try:
                    yield number, parse_step(line)
                except ValueError as e:
                    raise CliError(f"{name}:{number}: {e}") from None
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise CliError(f"{name}: cannot read trace: {e}") from None
