"""Packing a vLLM release (``TARGETS``) and the wheels the GPU image lacks into parts a device call can
carry (docs/e2e.md, "Staging"), and unpacking them there: standard library only, for the image's python3.
The CLI is device_install.sh's.
"""

from __future__ import annotations

import argparse
import hashlib
import io
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

FA3_SO = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
CORE_TAR = "vllm-core.tar.xz"
FA3_TAR = "vllm-fa3.tar.xz"
BUNDLE = "bundle.tar"
MANIFEST = "manifest.json"
WHEELS_DIR = "wheels"
TARGET_FILE = "target.json"  # in the bundle: which vLLM it carries
CHUNK_BYTES = 55_000_000  # < 60 MB, leaving room in a 64 MiB call for the repo and .whl/


@dataclass(frozen=True)
class Target:
    """A vLLM release and, in ``dependencies``, the closure of its requirements in a CPU install less
    what the H200 image has and the GPU-kernel packages this model never imports (cp312 wheels,
    installed with --no-deps; 0.33 imports flashinfer with its sparse-MLA backend, and CUTLASS's DSL
    for the fused q kernel)."""

    vllm: str
    dependencies: tuple[str, ...]

    @property
    def dist_info(self) -> str:
        return f"vllm-{self.vllm}.dist-info"

    @property
    def required_in_site(self) -> tuple[str, ...]:
        # vLLM's platform detection reads its own distribution metadata
        return "vllm/__init__.py", "vllm/_flashmla_C.abi3.so", FA3_SO, f"{self.dist_info}/METADATA"


_SHARED = (  # the same wheel in both releases' closures
    "annotated-types==0.8.0", "astor==0.8.1", "blake3==1.0.11", "cachetools==8.0.2", "cbor2==6.3.0", "cffi==2.1.1",
    "compressed-tensors==0.17.0", "cryptography==50.0.2", "depyf==0.20.0", "dill==0.4.1", "dnspython==2.9.2",
    "docstring-parser==0.18.0", "email-validator==2.4.0", "fastapi==0.136.3", "fastapi-cli==0.0.34",
    "fastar==0.12.0", "googleapis-common-protos==1.76.0", "httpcore2==2.16.2", "httptools==0.9.0", "httpx2==2.16.2",
    "ijson==3.6.0", "interegular==0.3.3", "jiter==0.19.0", "jmespath==1.1.0", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.7.6", "lm-format-enforcer==0.11.3",
    "loguru==0.7.3", "mcp==2.3.0", "mcp-types==2.3.0", "mistral-common==1.13.1",
    "model-hosting-container-standards==0.1.16", "msgspec==0.23.0", "openai==3.57.0", "opentelemetry-api==1.45.2",
    "opentelemetry-exporter-http-transport==0.66b2", "opentelemetry-exporter-otlp==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2", "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2", "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-proto==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-semantic-conventions-ai==0.5.1", "outlines-core==0.2.14", "partial-json-parser==0.2.1.1.post7",
    "prometheus-fastapi-instrumentator==8.1.0", "pybase64==1.5.1", "pycountry==26.2.16", "pycparser==3.12",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "pydantic-extra-types==2.11.1", "pydantic-settings==2.16.3",
    "pyjwt==2.15.1", "python-dotenv==1.2.4", "python-json-logger==4.2.0", "python-multipart==0.0.34",
    "pyzmq==27.3.0", "referencing==0.37.0", "rich-toolkit==0.20.6", "rpds-py==2026.9.1", "setproctitle==1.3.8",
    "sniffio==1.3.1", "sse-starlette==3.7.0", "starlette==1.10.0", "supervisor==4.3.0", "torch-c-dlpack-ext==0.1.5",
    "truststore==0.10.5", "typing-inspection==0.4.5", "uvicorn==0.54.0", "watchfiles==1.3.0", "websockets==17.4",
)

TARGETS = {
    "0.26": Target("0.26.0", _SHARED + (
        "anthropic==2.14.0", "apache-tvm-ffi==0.1.10", "flashinfer-python==0.6.14", "openai-harmony==0.0.8",
        "pyelftools==0.33", "xgrammar==0.2.7",
    )),
    "0.33": Target("0.33.0", _SHARED + (
        "anthropic==2.15.0", "apache-tvm-ffi==0.1.11", "flashinfer-python==0.7.2.post1", "orjson==3.13.0",
        "oss-harmony==0.0.11", "xgrammar==0.2.8",
        # DeepSeek-V3.2's fused q kernel is CuTe DSL on CUDA (models/deepseek_v32/common/kernels.py
        # imports it unconditionally there): the CUDA 13 build of CUTLASS's Python DSL travels.
        "nvidia-cutlass-dsl==4.8.0", "nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl-libs-core==4.8.0",
        "nvidia-cutlass-dsl-libs-cu13==4.8.0",
        # With CuTe DSL importable, vLLM's SM90 warm-up compiles its router GEMM, which builds on QuACK.
        "quack-kernels==0.6.5",
    )),
}
DEFAULT_TARGET = "0.26"


def target_for(version: str) -> Target:
    """The target of a vLLM minor version (``0.26``) or release (``0.26.0``)."""
    minor = ".".join(version.split(".")[:2])
    if minor not in TARGETS:
        raise ValueError(f"no staging target for vLLM {version}: one of {', '.join(sorted(TARGETS))}")
    return TARGETS[minor]


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


def make_bundle(target: Target, files: list[tuple[str, Path]], out: Path) -> Path:
    """One uncompressed tar of ``(name inside, file)`` pairs (the parts are already compressed) and
    ``target.json``, naming the vLLM release the bundle carries."""
    tmp = out.with_suffix(".part")
    with tarfile.open(tmp, "w") as tar:
        for arcname, path in files:
            tar.add(path, arcname=arcname)
        data = json.dumps({"vllm": target.vllm}).encode()
        info = tarfile.TarInfo(TARGET_FILE)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_into_parts(bundle: Path, parts_dir: Path, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Cuts ``bundle`` into ``parts_dir/partK/bundle.tar.KKK`` (K from 1), each part with the manifest;
    earlier ``partK`` folders are removed first, so no stale chunk can travel."""
    for old in parts_dir.glob("part*"):
        shutil.rmtree(old)
    chunks: list[dict[str, Any]] = []
    with bundle.open("rb") as src:
        while block := src.read(chunk_bytes):
            k, name = len(chunks) + 1, f"{bundle.name}.{len(chunks) + 1:03d}"
            (parts_dir / f"part{k}").mkdir(parents=True)
            (parts_dir / f"part{k}" / name).write_bytes(block)
            chunks.append({"part": k, "file": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"bundle": bundle.name, "bytes": bundle.stat().st_size, "sha256": sha256_of(bundle), "chunks": chunks}
    for c in chunks:
        (parts_dir / f"part{c['part']}" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_manifest(stash: Path) -> dict[str, Any]:
    path = stash / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: stash a part first (device_install.sh stash K)")
    return dict(json.loads(path.read_text()))


def missing_chunks(stash: Path) -> list[int]:
    """Part numbers whose chunk is absent from ``stash`` or differs in size (a cheap check)."""
    return [c["part"] for c in load_manifest(stash)["chunks"]
            if not (stash / c["file"]).is_file() or (stash / c["file"]).stat().st_size != c["bytes"]]


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
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(bundle, "r") as tar:
        _extract(tar, dest)
    return dest


def install_vllm_tree(unpacked: Path, site: Path) -> Target:
    """Puts the bundle's vLLM tree and dist-info into ``site``, replacing any earlier vLLM."""
    target = target_for(json.loads((unpacked / TARGET_FILE).read_text())["vllm"])  # the target the bundle carries
    site.mkdir(parents=True, exist_ok=True)
    for old in [site / "vllm", *site.glob("vllm-*.dist-info")]:
        shutil.rmtree(old, ignore_errors=True)
    for name in (CORE_TAR, FA3_TAR):
        with tarfile.open(unpacked / name, "r:xz") as tar:
            _extract(tar, site)
    return target


def site_target(site: Path) -> Target:
    """The target whose vLLM ``site`` holds (its one ``vllm-X.dist-info``)."""
    infos = sorted(p.name for p in site.glob("vllm-*.dist-info"))
    if len(infos) != 1:
        raise ValueError(f"{site} holds {len(infos)} vLLM dist-info folders ({infos}): expected one")
    return target_for(infos[0].removeprefix("vllm-").removesuffix(".dist-info"))


def missing_in_site(site: Path) -> list[str]:
    try:
        target = site_target(site)
    except ValueError as exc:
        return [str(exc)]
    return [p for p in target.required_in_site if not (site / p).is_file()]


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, options, text in (
            ("status", ("stash",), "which parts a stash holds and which it lacks"),
            ("join", ("stash", "dest"), "reassemble and verify the bundle, then extract it into --dest"),
            ("install-vllm", ("src", "site"), "extract the vLLM tars from --src into --site"),
            ("check", ("site",), "exit 1 unless vLLM's required files are in --site")):
        command = sub.add_parser(name, help=text)
        for option in options:
            command.add_argument(f"--{option}", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "status":
            chunks, missing = load_manifest(args.stash)["chunks"], missing_chunks(args.stash)
            have = [c["part"] for c in chunks if c["part"] not in missing]
            print(f"stash {args.stash}: parts {have} of {len(chunks)} present; missing {missing or 'none'}")
        elif args.cmd == "join":
            bundle = join_parts(args.stash, args.stash / BUNDLE)
            unpack_bundle(bundle, args.dest)
            bundle.unlink()  # the chunks stay; the joined copy only doubles the disk use
            wheels = sorted(p.name for p in (args.dest / WHEELS_DIR).glob("*.whl"))
            print(f"bundle verified and extracted into {args.dest}: {len(wheels)} wheels, {CORE_TAR}, {FA3_TAR}")
        elif args.cmd == "install-vllm":
            target = install_vllm_tree(args.src, args.site)
            print(f"vLLM {target.vllm} tree extracted into {args.site}")
        elif args.cmd == "check":
            absent = missing_in_site(args.site)
            if absent:
                print(f"{args.site} lacks {absent}", file=sys.stderr)
                return 1
            print(f"{args.site} has vLLM {site_target(args.site).vllm}'s required files")
    except (OSError, ValueError, tarfile.TarError, KeyError) as exc:
        print(f"e2e_bundle {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
