#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks (scripts/check.sh), then the whole test suite,
# real vLLM servers included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
# Two workers (pytest-xdist) by default: alone, the suite leaves a third of the machine's two cores
# idle while tests wait on their servers. Tests that share servers stay on one worker
# (tests/conftest.py, shared_group), so each pair starts once. DUALVLLM_TEST_WORKERS=0: one process.
exec .venv/bin/python -m pytest -n "${DUALVLLM_TEST_WORKERS:-2}" "$@"
