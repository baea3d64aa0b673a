#!/usr/bin/env bash
# The GPU check of issue 55 (benchmarks/gpu_check.py): the realistic-shape pairs built offline, the
# in-process engines' q* against float64 on the GPU, one learner update at Qwen3-0.6B's shape in bf16
# autocast (64 x 1,024 tokens); one JSON with peak GPU memory, tokens/s and each check's result.
# Needs torch, transformers, accelerate and peft, and no vLLM; under 8 minutes on one GPU.
#
#     bash scripts/gpu_check.sh                    # --device cuda: writes benchmarks/results/gpu_check.json
#     bash scripts/gpu_check.sh --device cpu       # the smoke test CI runs (about a minute on 2 cores)
#
# Extra arguments go to benchmarks/gpu_check.py (--output FILE, --q-prompts N, --q-tokens N).
# The repository's venv when there is one, else the python on PATH (a GPU machine's own).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
exec "$python" benchmarks/gpu_check.py "$@"
