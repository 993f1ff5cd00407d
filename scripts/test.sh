#!/usr/bin/env bash
# Install mla-planner with its test dependencies into one virtual environment per vLLM version the
# backend supports -- .venv: vLLM 0.26.0 and torch 2.11.0 (extra `test`); .venv33: vLLM 0.33.0 and
# torch 2.14.0 (extra `test-vllm033`) -- then run every test this machine can: the Rust planner's
# tests once, and in each environment the Python tests (GPU tests skip, saying why) and the type
# check. Exits non-zero on any failure.
#
# VLLM_VERSIONS picks a subset, e.g. VLLM_VERSIONS=0.26 ./scripts/test.sh (default: "0.26 0.33").
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
versions=${VLLM_VERSIONS:-0.26 0.33}

venv_for() {  # vLLM minor version -> its environment and requirements extra
    case "$1" in
        0.26) echo ".venv test" ;;
        0.33) echo ".venv33 test-vllm033" ;;
        *) echo "unknown vLLM version '$1' in VLLM_VERSIONS (supported: 0.26 0.33)" >&2; exit 2 ;;
    esac
}

# Environments first, one after the other (CI has 2 cores; pip and the Rust build would compete).
for version in $versions; do
    read -r venv extra <<<"$(venv_for "$version")"
    if [ ! -x "$venv/bin/python" ]; then
        echo "==> creating $venv with $($python --version)"
        "$python" -m venv "$venv"
    fi
    echo "==> installing mla-planner[$extra] into $venv (the first run downloads vLLM $version and torch: minutes)"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q ".[$extra]"
done

echo "==> cargo test (Rust planner)"
cargo test --release --locked
if cargo fmt --version >/dev/null 2>&1; then
    echo "==> cargo fmt --check (rust/rustfmt.toml; \`cargo fmt\` fixes it)"
    cargo fmt --check
else
    echo "==> cargo fmt --check not run: rustfmt is not installed (rustup component add rustfmt)"
fi

for version in $versions; do
    read -r venv _extra <<<"$(venv_for "$version")"
    echo "==> pytest, vLLM $version ($venv)"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir=. -c pyproject.toml tests
    echo "==> mypy, vLLM $version ($venv)"
    "$venv/bin/python" -m mypy
done
