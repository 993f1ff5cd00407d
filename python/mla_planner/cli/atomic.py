"""Write files all-or-nothing: each goes to a temporary file beside its
destination and is renamed into place only when every file is complete, so
an error or Ctrl-C never leaves half a file (or half a report) behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class AtomicFiles:
    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, destination)

    def write(self, dest: Path, fill: Callable[[BinaryIO], None]) -> None:
        """Create a temporary file next to `dest` and let `fill` write it."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        self._pending.append((Path(tmp), dest))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())

    def write_bytes(self, dest: Path, data: bytes) -> None:
        def fill(f: BinaryIO) -> None:
            f.write(data)

        self.write(dest, fill)

    def commit(self) -> None:
        for tmp, dest in self._pending:
            os.replace(tmp, dest)
        self._pending.clear()

    def discard(self) -> None:
        for tmp, _ in self._pending:
            tmp.unlink(missing_ok=True)
        self._pending.clear()


@contextmanager
def atomic_files() -> Iterator[AtomicFiles]:
    """Files written inside the block appear together at its end, or not at all."""
    files = AtomicFiles()
    try:
        yield files
    except BaseException:
        files.discard()
        raise
    files.commit()
