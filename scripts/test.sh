#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks (scripts/check.sh), then the whole test suite,
# real vLLM servers included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
exec .venv/bin/python -m pytest "$@"
