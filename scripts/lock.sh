#!/usr/bin/env bash
# Regenerate requirements/lock.txt: resolve pyproject.toml's ranges afresh in a scratch venv (the
# newest versions the index holds), then freeze what was installed. scripts/setup.sh and CI install
# with the lock as pip constraints, so every run gets the set the tests last passed with. After
# regenerating, run `bash scripts/test.sh` before committing the new lock.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install --quiet ".[cpu,train,dev,bench]"
"$scratch/venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec dualvllm
mkdir -p requirements
{
    echo "# What scripts/setup.sh and CI install (pip constraints), resolved from pyproject.toml's ranges"
    echo "# by scripts/lock.sh on $(date -u +%Y-%m-%d), Python $("$scratch/venv/bin/python" -c 'import platform; print(platform.python_version())')."
    "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(pip|setuptools|wheel)=='
} > requirements/lock.txt
echo "lock: wrote requirements/lock.txt ($(grep -vc '^#' requirements/lock.txt) packages)"
