"""Write a command's files as a set, all or nothing.

Each file goes to a temporary file in its destination folder; only when
every one is complete are they renamed into place. A file being replaced is
first moved aside, so a rename that fails half-way puts the old files back:
an error or Ctrl-C never leaves half a file, half a report or a temporary
file behind. `check_folder` and `check_file` refuse unusable destinations
before any work starts, naming the path and the option.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .config import CliError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_beside(dest: Path, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=suffix)
    os.close(fd)
    return Path(name)


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _nearest_existing(path: Path) -> Path:
    here = path.absolute()
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    return here


def _check_writable(folder: Path, target: Path, option: str) -> None:
    """Create and remove a file in `folder`: the one test that also catches
    /proc, read-only mounts and permissions `os.access` misjudges (root)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".mla-planner-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CliError(f"{option} {target}: cannot write in {folder} ({_reason(e)}); choose another {option}") from None


def check_folder(folder: Path, names: Iterable[str], option: str) -> None:
    """`folder` can be created (or exists as a folder) and take files `names`."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        what = "is a file" if existing == folder.absolute() else f"cannot be created: {existing} is a file"
        raise CliError(f"{option} {folder} {what}; give {option} a folder")
    for name in names:
        if (folder / name).is_dir():
            raise CliError(f"{option} {folder}: {folder / name} is a folder; move it away or choose another {option}")
    _check_writable(existing, folder, option)


def check_file(path: Path, option: str) -> None:
    """`path` can be written as a file."""
    if path.is_dir():
        raise CliError(f"{option} {path} is a folder; give {option} a file name")
    existing = _nearest_existing(path.parent)
    if not existing.is_dir():
        raise CliError(f"{option} {path} cannot be created: {existing} is a file; choose another {option}")
    _check_writable(existing, path, option)


class AtomicFiles:
    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, destination)
        self._created: list[Path] = []  # folders made for the files, parents first

    def _make_folder(self, folder: Path) -> None:
        missing = []
        here = folder.absolute()
        while not os.path.lexists(here) and here != here.parent:
            missing.append(here)
            here = here.parent
        folder.mkdir(parents=True, exist_ok=True)
        self._created += reversed(missing)

    def write(self, dest: Path, fill: Callable[[BinaryIO], None]) -> None:
        """Create a temporary file next to `dest` and let `fill` write it."""
        try:
            self._make_folder(dest.parent)
            tmp = _temp_beside(dest, ".tmp")
        except OSError as e:
            raise CliError(f"{dest}: cannot write ({_reason(e)})") from None
        self._pending.append((tmp, dest))
        try:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CliError(f"{dest}: cannot write ({_reason(e)})") from None

    def write_bytes(self, dest: Path, data: bytes) -> None:
        def fill(f: BinaryIO) -> None:
            f.write(data)

        self.write(dest, fill)

    def commit(self) -> None:
        """Rename every file into place, or, if one rename fails, none."""
        placed: list[tuple[Path, Path | None]] = []  # (destination, its previous file moved aside)
        try:
            for tmp, dest in self._pending:
                if dest.is_dir() and not dest.is_symlink():
                    raise CliError(f"{dest} is a folder; move it away and run again")
                backup = None
                if os.path.lexists(dest):
                    backup = _temp_beside(dest, ".old")
                    try:
                        os.replace(dest, backup)
                    except BaseException:
                        backup.unlink(missing_ok=True)
                        raise
                placed.append((dest, backup))
                os.replace(tmp, dest)
        except BaseException as e:
            self._undo(placed)
            self.discard()
            if isinstance(e, OSError):
                raise CliError(f"{e.filename or 'output'}: cannot write ({_reason(e)}); nothing was changed") from None
            raise
        for _, backup in placed:
            if backup is not None:
                backup.unlink(missing_ok=True)
        self._pending.clear()
        self._created.clear()

    @staticmethod
    def _undo(placed: list[tuple[Path, Path | None]]) -> None:
        for dest, backup in reversed(placed):
            if backup is not None:
                os.replace(backup, dest)
            # A new file with no predecessor is removed by discard() if its
            # rename did not happen, and here if it did.
            elif os.path.lexists(dest):
                dest.unlink()

    def discard(self) -> None:
        """Remove the temporary files, and the folders made for them: a
        failed run leaves no empty report folder either."""
        for tmp, _ in self._pending:
            tmp.unlink(missing_ok=True)
        self._pending.clear()
        for folder in reversed(self._created):
            try:
                folder.rmdir()
            except OSError:  # not empty: something else is in it now
                pass
        self._created.clear()


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
