#!/usr/bin/env bash
# The static checks CI runs before the tests: ruff (lint and format) and mypy, configured in pyproject.toml
# with the baseline they started from (issue 45). Needs the dev extra (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check
.venv/bin/ruff format --check  # `ruff format` fixes what it finds
.venv/bin/mypy
