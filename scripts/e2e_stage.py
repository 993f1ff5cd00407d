#!/usr/bin/env python3
"""Stage a vLLM release and the packages the H200 image lacks to run it -- engine, `vllm serve` and
`vllm bench serve` -- for the end-to-end runs (docs/e2e.md).

Downloads into .e2e/downloads/ (kept: a second run reuses them), packs into .e2e/build/VERSION/,
cuts the bundle into .e2e/parts/partK/ (one folder per device call, each under 60 MB; the parts of
the last staging, whichever version), checks the round trip the GPU machine will do (join, verify,
extract, required files present), and prints the device-call plan. Needs network for the first run
of a version only.

    .venv/bin/python scripts/e2e_stage.py [--vllm 0.26|0.33] [--rebuild] [--chunk-mb 55]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import e2e_bundle as eb  # noqa: E402  (lives with the device-side scripts, which share it)

E2E = ROOT / ".e2e"
DOWNLOADS = E2E / "downloads"
BUILD = E2E / "build"
PARTS = E2E / "parts"
CALL_LIMIT = 64 << 20  # the device tool's limit per call: working tree + carried paths
# pip matches manylinux tags exactly; these cover every wheel of the list (llguidance is 2_31).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_31_x86_64", "manylinux1_x86_64")
MIN_FREE = 3 << 30  # downloads 0.3 GB, build 0.3 GB, round-trip check 0.9 GB


def wheel_for(requirement: str, folder: Path) -> Path | None:
    """The downloaded wheel of ``name==version`` in ``folder``, if any."""
    name, version = requirement.split("==")
    prefix = f"{name.replace('-', '_').lower()}-{version}-"
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix)]
    return found[0] if found else None


def download(requirements: list[str], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    todo = [r for r in requirements if wheel_for(r, folder) is None]
    if todo:
        print(f"==> downloading {len(todo)} wheel(s) into {folder.relative_to(ROOT)}")
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *todo],
            check=True,
        )
    wheels = []
    for r in requirements:
        w = wheel_for(r, folder)
        if w is None:
            raise SystemExit(f"pip reported success but no wheel for {r} is in {folder}")
        wheels.append(w)
    return wheels


def tracked_bytes() -> int:
    """What of the repo travels anyway: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def round_trip(parts: list[Path], target: eb.Target) -> None:
    """What the GPU machine does, here: stash each part, join, verify, extract, check the tree."""
    with tempfile.TemporaryDirectory(dir=E2E) as tmp:
        stash, site = Path(tmp) / "stash", Path(tmp) / "site"
        stash.mkdir()
        for part in parts:
            for f in part.iterdir():
                shutil.copy2(f, stash / f.name)
        eb.join_parts(stash, stash / eb.BUNDLE)
        unpacked = eb.unpack_bundle(stash / eb.BUNDLE, Path(tmp) / "unpacked")
        if eb.install_vllm_tree(unpacked, site) != target:
            raise SystemExit(f"round trip: the bundle does not carry vLLM {target.vllm}")
        missing = eb.missing_in_site(site)
        if missing:
            raise SystemExit(f"round trip: the extracted tree lacks {missing}")
        wheels = sorted((unpacked / eb.WHEELS_DIR).glob("*.whl"))
        if len(wheels) != len(target.dependencies):
            raise SystemExit(f"round trip: {len(wheels)} wheels, expected {len(target.dependencies)}")
        # pip resolves the wheels for the device's Python without installing anything.
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index", "--no-deps",
             "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
             "--target", str(Path(tmp) / "pip-target"), *map(str, wheels)],
            check=True,
        )
        print(f"==> round trip ok: {', '.join(target.required_in_site)} present; {len(wheels)} wheels accepted by pip")


def print_plan(parts: list[Path]) -> None:
    whl = ROOT / ".whl"
    ours = sorted(whl.glob("mla_planner-*.whl"))
    extra = sum(f.stat().st_size for f in whl.glob("*.whl")) if whl.is_dir() else 0
    tree = tracked_bytes()
    print("\n==> parts (one device call each):")
    for p in parts:
        size = sum(f.stat().st_size for f in p.iterdir())
        print(f"  {p.relative_to(ROOT)}  {size / 1e6:.1f} MB")
    if not ours:
        print("  NOTE: no .whl/mla_planner-*.whl yet: build it (maturin build --release -o .whl) before the last call")
    n = len(parts)
    print("\n==> device calls (make them back to back: the machine keeps /tmp only while warm):")
    for k, p in enumerate(parts, start=1):
        carry = [str(p.relative_to(ROOT))]
        cmd = f"bash tests/e2e/device_install.sh stash {k}"
        size = tree + sum(f.stat().st_size for f in p.iterdir())
        if k == n:
            carry.append(".whl")
            cmd += " && bash tests/e2e/device_install.sh install"
            size += extra
        flag = "" if size < CALL_LIMIT else "   <-- OVER the 64 MiB limit: lower --chunk-mb"
        print(f"  call {k}: carry {carry}  ({size / (1 << 20):.1f} MiB)\n          command: {cmd}{flag}")
    print(f"  call {n + 1} ...: carry []  command: a serving phase or in-process runs (docs/e2e.md)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default=eb.DEFAULT_TARGET, choices=sorted(eb.TARGETS),
                    help=f"the vLLM release to stage (default {eb.DEFAULT_TARGET})")
    ap.add_argument("--rebuild", action="store_true", help="repack vLLM even if .e2e/build/VERSION/ holds a packing")
    ap.add_argument("--chunk-mb", type=float, default=eb.CHUNK_BYTES / 1e6, help="part size in MB (< 60)")
    args = ap.parse_args()
    if not 0 < args.chunk_mb < 60:
        ap.error("--chunk-mb must be in (0, 60)")
    E2E.mkdir(exist_ok=True)
    free = shutil.disk_usage(E2E).free
    if free < MIN_FREE:
        raise SystemExit(f"only {free / (1 << 30):.1f} GiB free under {E2E}; staging needs about 3 GiB")

    target = eb.target_for(args.vllm)
    build = BUILD / target.vllm
    (vllm_wheel,) = download([f"vllm=={target.vllm}"], DOWNLOADS)
    dep_wheels = download(list(target.dependencies), DOWNLOADS / "deps")
    core, fa3 = build / eb.CORE_TAR, build / eb.FA3_TAR
    fresh = core.exists() and fa3.exists() and core.stat().st_mtime > vllm_wheel.stat().st_mtime
    if args.rebuild or not fresh:
        print(f"==> packing {vllm_wheel.name} (xz; a few minutes)")
        eb.pack_vllm_wheel(vllm_wheel, build)
    else:
        print(f"==> reusing {core.relative_to(ROOT)} and {fa3.relative_to(ROOT)}")
    print(f"  {eb.CORE_TAR} {core.stat().st_size / 1e6:.1f} MB, {eb.FA3_TAR} {fa3.stat().st_size / 1e6:.1f} MB, "
          f"{len(dep_wheels)} wheels {sum(w.stat().st_size for w in dep_wheels) / 1e6:.1f} MB")
    files = [(eb.CORE_TAR, core), (eb.FA3_TAR, fa3)] + [(f"{eb.WHEELS_DIR}/{w.name}", w) for w in dep_wheels]
    bundle = eb.make_bundle(target, files, build / eb.BUNDLE)
    manifest = eb.split_into_parts(bundle, PARTS, int(args.chunk_mb * 1e6))
    parts = [PARTS / f"part{c['part']}" for c in manifest["chunks"]]
    round_trip(parts, target)
    print_plan(parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
