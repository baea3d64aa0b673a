#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks (scripts/check.sh), then the whole test suite,
# real vLLM servers included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check.sh
# One process by default: on two cores the suite is bound by CPU (server start-ups, mostly), and
# two pytest-xdist workers took as long while holding twice the servers in RAM (measured
# 2026-12-07). On a larger machine, DUALVLLM_TEST_WORKERS=N runs N workers; tests that share
# servers stay on one worker (tests/conftest.py, shared_group), so each pair starts once.
workers=${DUALVLLM_TEST_WORKERS:-0}
if [ "$workers" = 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" "$@"
