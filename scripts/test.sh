#!/usr/bin/env bash
# Install mla-planner with its test dependencies (vLLM 0.26.0, torch 2.11.0,
# pytest, hypothesis, mypy) into .venv, then run every test this machine can:
# the Rust planner's tests, the Python tests (GPU tests skip, saying why),
# and the type check. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
echo "==> installing mla-planner[test] (first run downloads vLLM 0.26.0 and torch: a few minutes)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q ".[test]"

echo "==> cargo test (Rust planner)"
cargo test --release --locked

echo "==> pytest"
# Run from tests/ so `import mla_planner` resolves to the installed wheel, not python/.
.venv/bin/python -m pytest -q -p no:cacheprovider --rootdir=. -c pyproject.toml tests

echo "==> mypy"
.venv/bin/python -m mypy
