"""Packing vLLM 0.26.0 and its missing dependencies for the GPU machine, and unpacking them there.

The device tool carries at most 64 MiB per call, and vLLM's wheel is 304 MB. So: the wheel's tree,
less what the H200 run never loads (FA2, the SM100 FMHA sources, DeepGEMM builds for other Pythons),
goes into ``vllm-core.tar.xz``; FA3's 153 MB library into ``vllm-fa3.tar.xz``; both and the dependency
wheels into one plain ``bundle.tar``, cut into chunks of under 60 MB, one chunk per device call, each
with the same ``manifest.json`` (sizes and sha256 of every chunk and of the whole).

Standard library only: the device side runs this file with the GPU image's python3 (3.12).
CLI (used by ``device_install.sh``): ``status``, ``join``, ``install-vllm``, ``check`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

VLLM_VERSION = "0.26.0"
DIST_INFO = f"vllm-{VLLM_VERSION}.dist-info"
FA3_SO = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
CORE_TAR = "vllm-core.tar.xz"
FA3_TAR = "vllm-fa3.tar.xz"
BUNDLE = "bundle.tar"
MANIFEST = "manifest.json"
WHEELS_DIR = "wheels"
CHUNK_BYTES = 55_000_000  # < 60 MB, leaving room in a 64 MiB call for the repo and .whl/
REQUIRED_IN_SITE = (
    "vllm/__init__.py",
    "vllm/_flashmla_C.abi3.so",
    FA3_SO,
    f"{DIST_INFO}/METADATA",  # vLLM's platform detection reads its own distribution metadata
)

# What the GPU image lacks (docs/e2e.md, "Staging"): cp312 wheels, installed with --no-deps.
DEPENDENCIES = (
    "annotated-types==0.8.0", "apache-tvm-ffi==0.1.10", "astor==0.8.1", "blake3==1.0.11",
    "cachetools==8.0.2", "cbor2==6.3.0", "compressed-tensors==0.17.0", "depyf==0.20.0", "dill==0.4.1",
    "distro==1.9.0", "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "ijson==3.6.0",
    "jiter==0.19.0", "lark==1.2.2", "llguidance==1.7.6", "msgspec==0.23.0", "openai==3.57.0",
    "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "python-json-logger==4.2.0", "pyzmq==27.3.0", "setproctitle==1.3.8",
    "sniffio==1.3.1", "starlette==1.10.0", "torch-c-dlpack-ext==0.1.5", "truststore==0.10.5",
    "typing-inspection==0.4.5", "xgrammar==0.2.7",
)

_OTHER_PY_DEEPGEMM = re.compile(r"^vllm/third_party/deep_gemm/_C\.cpython-3(?!12-)\d+-.*\.so$")


def member_kind(name: str) -> str:
    """Where a file of the vLLM wheel goes: ``core``, ``fa3`` or ``drop``."""
    if name == FA3_SO:
        return "fa3"
    if name == "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so":
        return "drop"  # FA3 serves Hopper; vllm_flash_attn imports with either library
    if name.startswith("vllm/third_party/fmha_sm100/") or _OTHER_PY_DEEPGEMM.match(name):
        return "drop"  # Blackwell-only sources; DeepGEMM builds for other Pythons
    return "core"


class _XzWriter:
    """A stream that xz-compresses into a file: the xz tool on all cores if present, else lzma."""

    def __init__(self, out: Path) -> None:
        self._file: IO[bytes] = out.open("wb")
        self._proc: subprocess.Popen[bytes] | None = None
        if shutil.which("xz"):
            self._proc = subprocess.Popen(["xz", "-T0", "-6", "-c"], stdin=subprocess.PIPE, stdout=self._file)
            assert self._proc.stdin is not None
            self.stream: IO[bytes] = self._proc.stdin
        else:
            self.stream = lzma.open(self._file, "wb", preset=6)

    def close(self) -> None:
        self.stream.close()
        failed = self._proc is not None and self._proc.wait() != 0
        self._file.close()
        if failed:
            raise RuntimeError("xz failed")


def pack_vllm_wheel(wheel: Path, out_dir: Path) -> tuple[Path, Path]:
    """Writes ``vllm-core.tar.xz`` and ``vllm-fa3.tar.xz`` from the wheel, straight from the zip."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / CORE_TAR, out_dir / FA3_TAR)
    with zipfile.ZipFile(wheel) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        for path, kind in zip(paths, ("core", "fa3")):
            tmp = path.with_suffix(".part")
            writer = _XzWriter(tmp)
            with tarfile.open(fileobj=writer.stream, mode="w|") as tar:
                for info in infos:
                    if member_kind(info.filename) != kind:
                        continue
                    entry = tarfile.TarInfo(info.filename)
                    entry.size = info.file_size
                    mode = (info.external_attr >> 16) & 0o777
                    entry.mode = mode if mode else 0o644
                    with zf.open(info) as src:
                        tar.addfile(entry, src)
            writer.close()
            tmp.replace(path)
    return paths


def make_bundle(files: list[tuple[str, Path]], out: Path) -> Path:
    """One uncompressed tar of ``(name inside, file)`` pairs (the parts are already compressed)."""
    tmp = out.with_suffix(".part")
    with tarfile.open(tmp, "w") as tar:
        for arcname, path in files:
            tar.add(path, arcname=arcname)
    tmp.replace(out)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Chunk:
    part: int
    file: str
    bytes: int
    sha256: str


def split_into_parts(bundle: Path, parts_dir: Path, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Cuts ``bundle`` into ``parts_dir/partK/bundle.tar.KKK`` (K from 1), each part with the manifest.

    Earlier ``partK`` folders are removed first, so no stale chunk can travel.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    if parts_dir.exists():
        for old in parts_dir.glob("part*"):
            shutil.rmtree(old)
    chunks: list[Chunk] = []
    with bundle.open("rb") as src:
        while block := src.read(chunk_bytes):
            k = len(chunks) + 1
            name = f"{bundle.name}.{k:03d}"
            folder = parts_dir / f"part{k}"
            folder.mkdir(parents=True)
            (folder / name).write_bytes(block)
            chunks.append(Chunk(k, name, len(block), hashlib.sha256(block).hexdigest()))
    manifest = {
        "bundle": bundle.name,
        "bytes": bundle.stat().st_size,
        "sha256": sha256_of(bundle),
        "chunks": [c.__dict__ for c in chunks],
    }
    for c in chunks:
        (parts_dir / f"part{c.part}" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_manifest(stash: Path) -> dict[str, Any]:
    path = stash / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: stash a part first (device_install.sh stash K)")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def missing_chunks(stash: Path) -> list[int]:
    """Part numbers whose chunk is absent from ``stash`` or differs in size (a cheap check)."""
    manifest = load_manifest(stash)
    return [
        c["part"] for c in manifest["chunks"]
        if not (stash / c["file"]).is_file() or (stash / c["file"]).stat().st_size != c["bytes"]
    ]


def join_parts(stash: Path, out: Path) -> Path:
    """Reassembles the bundle from the chunks in ``stash``, checking every sha256."""
    manifest = load_manifest(stash)
    missing = missing_chunks(stash)
    if missing:
        raise FileNotFoundError(f"chunks of parts {missing} are not in {stash}: stash them first")
    whole = hashlib.sha256()
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as dst:
        for c in manifest["chunks"]:
            data = (stash / c["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != c["sha256"]:
                raise ValueError(f"{c['file']}: sha256 differs from the manifest (a part of another staging?)")
            whole.update(data)
            dst.write(data)
    if whole.hexdigest() != manifest["sha256"]:
        raise ValueError("the joined bundle's sha256 differs from the manifest")
    tmp.replace(out)
    return out


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    # Python >= 3.12 (and patched older ones) take a filter; "tar" keeps the archive's modes.
    if hasattr(tarfile, "tar_filter"):
        tar.extractall(dest, filter="tar")
    else:
        tar.extractall(dest)


def unpack_bundle(bundle: Path, dest: Path) -> Path:
    """Extracts the bundle (the two vLLM tars and ``wheels/``) into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(bundle, "r") as tar:
        _extract(tar, dest)
    return dest


def install_vllm_tree(unpacked: Path, site: Path) -> None:
    """Puts vLLM's tree and dist-info into ``site``, replacing any earlier copy."""
    site.mkdir(parents=True, exist_ok=True)
    for old in ("vllm", DIST_INFO):
        if (site / old).exists():
            shutil.rmtree(site / old)
    for name in (CORE_TAR, FA3_TAR):
        with tarfile.open(unpacked / name, "r:xz") as tar:
            _extract(tar, site)


def missing_in_site(site: Path) -> list[str]:
    return [p for p in REQUIRED_IN_SITE if not (site / p).is_file()]


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="which parts a stash holds and which it lacks")
    st.add_argument("--stash", type=Path, required=True)
    jn = sub.add_parser("join", help="reassemble and verify the bundle, then extract it into --dest")
    jn.add_argument("--stash", type=Path, required=True)
    jn.add_argument("--dest", type=Path, required=True)
    iv = sub.add_parser("install-vllm", help="extract the vLLM tars from --src into --site")
    iv.add_argument("--src", type=Path, required=True)
    iv.add_argument("--site", type=Path, required=True)
    ck = sub.add_parser("check", help="exit 1 unless vLLM's required files are in --site")
    ck.add_argument("--site", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "status":
            manifest = load_manifest(args.stash)
            missing = missing_chunks(args.stash)
            n = len(manifest["chunks"])
            have = [c["part"] for c in manifest["chunks"] if c["part"] not in missing]
            print(f"stash {args.stash}: parts {have} of {n} present; missing {missing or 'none'}")
        elif args.cmd == "join":
            bundle = join_parts(args.stash, args.stash / BUNDLE)
            unpack_bundle(bundle, args.dest)
            bundle.unlink()  # the chunks stay; the joined copy only doubles the disk use
            wheels = sorted(p.name for p in (args.dest / WHEELS_DIR).glob("*.whl"))
            print(f"bundle verified and extracted into {args.dest}: {len(wheels)} wheels, {CORE_TAR}, {FA3_TAR}")
        elif args.cmd == "install-vllm":
            install_vllm_tree(args.src, args.site)
            print(f"vLLM {VLLM_VERSION} tree extracted into {args.site}")
        elif args.cmd == "check":
            absent = missing_in_site(args.site)
            if absent:
                print(f"{args.site} lacks {absent}", file=sys.stderr)
                return 1
            print(f"{args.site} has vLLM's required files")
    except (OSError, ValueError, tarfile.TarError, KeyError) as exc:
        print(f"e2e_bundle {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
