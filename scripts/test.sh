#!/usr/bin/env bash
# Run every test this machine can: the Rust planner's tests once, then, for each vLLM version the
# backend supports, install mla-planner with its test dependencies into that version's virtual
# environment -- .venv: vLLM 0.26.0 and torch 2.11.0 (extra `test`); .venv33: vLLM 0.33.0 and
# torch 2.14.0 (extra `test-vllm033`) -- and run the Python tests (GPU tests skip, saying why) and
# the type check there; vLLM's own sparse-MLA tests read the release's sdist, fetched into .e2e/sdist
# (offline they skip, saying why). Exits non-zero on any failure.
#
# VLLM_VERSIONS picks a subset, e.g. VLLM_VERSIONS=0.26 ./scripts/test.sh (default: "0.26 0.33").
# REMOVE_ENVS=1 deletes each environment once its tests pass. The two hold ~18 GB between them
# (torch and its CUDA libraries, twice); CI sets it so that only one is ever on its disk.
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
[ -n "${versions// /}" ] || { echo "VLLM_VERSIONS is empty (supported: 0.26 0.33)" >&2; exit 2; }
for version in $versions; do venv_for "$version" >/dev/null; done  # a bad version fails before any work

echo "==> cargo test (Rust planner)"
cargo test --release --locked
if cargo fmt --version >/dev/null 2>&1; then
    echo "==> cargo fmt --check (rust/rustfmt.toml; \`cargo fmt\` fixes it)"
    cargo fmt --check
else
    echo "==> cargo fmt --check not run: rustfmt is not installed (rustup component add rustfmt)"
fi

# One environment at a time, install then test (CI has 2 cores; pip and a test run would compete).
for version in $versions; do
    read -r venv extra <<<"$(venv_for "$version")"
    if [ ! -x "$venv/bin/python" ]; then
        echo "==> creating $venv with $($python --version)"
        "$python" -m venv "$venv"
    fi
    echo "==> installing mla-planner[$extra] into $venv (the first run downloads vLLM $version and torch," \
        "~9 GB: minutes; $(df -h --output=avail . | tail -1 | tr -d ' ') free here)"
    # No pip cache: a wheel cache would keep a second copy of torch and its CUDA libraries on disk.
    "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip
    "$venv/bin/python" -m pip install -q --no-cache-dir ".[$extra]"
    # vLLM's own sparse-MLA tests (tests/test_vllm_own_tests.py) read the release's sdist: its wheel has none.
    if sdist=$("$venv/bin/python" scripts/fetch_vllm_sdist.py .e2e/sdist); then
        export MLA_PLANNER_VLLM_SDIST=$sdist
    else
        unset MLA_PLANNER_VLLM_SDIST  # the test skips and says why
    fi
    echo "==> pytest, vLLM $version ($venv)"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir=. -c pyproject.toml tests
    echo "==> mypy, vLLM $version ($venv)"
    "$venv/bin/python" -m mypy
    if [ "${REMOVE_ENVS:-0}" = 1 ]; then
        echo "==> removing $venv (REMOVE_ENVS=1)"
        rm -rf "$venv"
    fi
done
