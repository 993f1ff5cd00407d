#!/usr/bin/env python3
"""Fetch the installed vLLM release's source distribution, for tests/test_vllm_own_tests.py: vLLM's
wheel carries no tests, its sdist does. PyPI's simple index (its JSON form, PEP 691) names the
file and its sha256; the file is downloaded and checked, nothing is built (`pip download
--no-binary` would build vLLM's metadata first, installing torch to do it). Prints the tarball's
path; exits 1, saying why, where it cannot be had (no network): the test then skips and says so.

    python3 scripts/fetch_vllm_sdist.py DIR     # DIR/vllm-X.Y.Z.tar.gz, kept for the next run
"""

from __future__ import annotations

import json
import sys
import urllib.request
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))

from e2e_bundle import sha256_of as sha256  # noqa: E402  (the staging's own checksum)

INDEX = "https://pypi.org/simple/vllm/"
TIMEOUT_S = 120


def fetch(folder: Path) -> Path:
    name = f"vllm-{version('vllm')}.tar.gz"
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        files = {f["filename"]: f for f in json.load(answer)["files"]}
    if name not in files:
        raise LookupError(f"{INDEX} lists no {name}")
    entry, target = files[name], folder / name
    if target.is_file() and sha256(target) == entry["hashes"]["sha256"]:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")  # nothing half-written under the final name
    with urllib.request.urlopen(entry["url"], timeout=TIMEOUT_S) as answer, partial.open("wb") as out:
        while block := answer.read(1 << 20):
            out.write(block)
    if sha256(partial) != entry["hashes"]["sha256"]:
        partial.unlink()
        raise ValueError(f"{name}: sha256 differs from the index's")
    partial.replace(target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(fetch(Path(argv[0])))
    except (OSError, LookupError, ValueError, KeyError, PackageNotFoundError) as exc:
        print(f"vLLM's sdist not fetched: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
