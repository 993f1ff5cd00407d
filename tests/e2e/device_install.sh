#!/usr/bin/env bash
# On the GPU machine, from the repo root (docs/e2e.md, "Device calls"):
#   bash tests/e2e/device_install.sh stash K      copy the carried .e2e/parts/partK into $E2E_STASH (/tmp/stash)
#   bash tests/e2e/device_install.sh install      join and verify the parts, install their wheels and vLLM into
#                                                 $E2E_SITE (/tmp/site) (skipped if it holds this bundle), then
#                                                 .whl/mla_planner-*.whl (always), and check the imports
#   bash tests/e2e/device_install.sh check        only the import and entry-point check
#   bash tests/e2e/device_install.sh pythonpath   $E2E_SITE and the paths its .pth files add (export PYTHONPATH=...)
set -euo pipefail
cd "$(dirname "$0")/../.."

STASH=${E2E_STASH:-/tmp/stash}
SITE=${E2E_SITE:-/tmp/site}
PY=${PYTHON:-python3}
BUNDLE_PY=tests/e2e/e2e_bundle.py
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")

pythonpath() {
    # vLLM 0.33's CUTLASS DSL reaches its packages through a .pth file, which Python reads only in a
    # site directory, never on PYTHONPATH: name what the site's .pth files add.
    "$PY" -c 'import site, sys
before = set(sys.path)
site.addsitedir(sys.argv[1])
print(":".join([sys.argv[1]] + [p for p in sys.path if p not in before and p != sys.argv[1]]))' "$SITE"
}

check() {
    PYTHONPATH="$(pythonpath)${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import importlib.metadata as md
import sys

import mla_planner
import vllm

plugins = sorted(f"{ep.name} = {ep.value}" for ep in md.entry_points(group="vllm.general_plugins"))
print(f"import ok: vllm {vllm.__version__} from {vllm.__file__}; mla_planner {mla_planner.__version__}")
print(f"vllm.general_plugins: {plugins}")
if not any(p.startswith("mla_planner =") for p in plugins):
    sys.exit("the mla_planner entry point is missing from vllm.general_plugins: rebuild the wheel")
EOF
}

case "${1:-}" in
stash)
    k=${2:?usage: device_install.sh stash K}
    src=.e2e/parts/part$k
    [ -d "$src" ] || { echo "no $src here: carry [\".e2e/parts/part$k\"] in this call" >&2; exit 2; }
    mkdir -p "$STASH"
    if [ -f "$STASH/manifest.json" ] && ! cmp -s "$src/manifest.json" "$STASH/manifest.json"; then
        echo "the stash holds parts of another staging: clearing $STASH"
        rm -rf "$STASH"; mkdir -p "$STASH"
    fi
    cp "$src"/* "$STASH"/
    echo "stashed part $k: $(cd "$src" && ls | tr '\n' ' ')"
    "$PY" "$BUNDLE_PY" status --stash "$STASH"
    ;;
install)
    "$PY" "$BUNDLE_PY" status --stash "$STASH"
    sha=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["sha256"])' "$STASH/manifest.json")
    if [ "$(cat "$SITE/.e2e-bundle" 2>/dev/null || true)" = "$sha" ] && "$PY" "$BUNDLE_PY" check --site "$SITE"; then
        echo "vLLM and its dependencies already installed from this bundle: skipped"
    else
        if [ -e "$SITE" ]; then  # another staging's (or a broken) install: none of it may linger
            echo "$SITE holds another staging: clearing it"
            rm -rf "$SITE"
        fi
        t0=$SECONDS
        "$PY" "$BUNDLE_PY" join --stash "$STASH" --dest "$STASH/unpacked"
        "${PIP[@]}" "$STASH"/unpacked/wheels/*.whl
        echo "installed $(ls "$STASH"/unpacked/wheels | wc -l) dependency wheels into $SITE"
        "$PY" "$BUNDLE_PY" install-vllm --src "$STASH/unpacked" --site "$SITE"
        "$PY" "$BUNDLE_PY" check --site "$SITE"
        rm -rf "$STASH/unpacked"
        echo "$sha" >"$SITE/.e2e-bundle"
        echo "vLLM install took $((SECONDS - t0)) s"
    fi
    shopt -s nullglob
    ours=(.whl/mla_planner-*.whl)
    if [ ${#ours[@]} -ne 1 ]; then
        echo "expected exactly one .whl/mla_planner-*.whl (carry .whl in this call), found ${#ours[@]}" >&2
        exit 2
    fi
    # A wheel of another version leaves its own dist-info behind: remove every earlier copy first.
    rm -rf "$SITE"/mla_planner "$SITE"/mla_planner-*.dist-info
    "${PIP[@]}" .whl/*.whl
    echo "installed into $SITE: $(cd .whl && ls *.whl | tr '\n' ' ')"
    check
    ;;
check)
    "$PY" "$BUNDLE_PY" check --site "$SITE"
    check
    ;;
pythonpath)
    pythonpath
    ;;
*)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
