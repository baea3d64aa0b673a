#!/usr/bin/env bash
# Run a pytest selection N times in a row and count the runs that pass: how a flaky test
# is measured (issue 23: a lockstep training run that could hang after its last update).
#
#   bash scripts/repeat_tests.sh 20 "tests/integration/test_cli.py::test_train_pushes_verified_weights_and_resumes_after_a_kill[0---lockstep]" \
#       tests/integration/test_replica_pools_vllm.py::test_training_goes_on_pushing_verified_weights_when_a_base_replica_dies
#
# BURN=1 runs a CPU burner at the lowest priority beside the tests, as the hang was first
# seen on a machine with one such job. Each run's pytest output goes to
# $OUT/run-I.log (OUT defaults to repeat-tests/, git-ignored); the tally to $OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/repeat_tests.sh N PYTEST_ARGS..." >&2
    exit 2
fi
runs=$1
shift
out=${OUT:-repeat-tests}
mkdir -p "$out"
bash scripts/setup.sh >/dev/null
burner=
if [ "${BURN:-0}" = 1 ]; then
    nice -n 19 .venv/bin/python -c "while True: pass" &
    burner=$!
fi
trap '[ -n "$burner" ] && kill "$burner" 2>/dev/null || true' EXIT
passed=0
for i in $(seq 1 "$runs"); do
    started=$(date +%s)
    if .venv/bin/python -m pytest -p no:cacheprovider -q "$@" >"$out/run-$i.log" 2>&1; then
        result=pass
        passed=$((passed + 1))
    else
        result=FAIL
    fi
    echo "run $i/$runs: $result in $(($(date +%s) - started)) s ($(tail -1 "$out/run-$i.log"))" | tee -a "$out/summary.txt"
done
echo "passed $passed of $runs: $*" | tee -a "$out/summary.txt"
[ "$passed" = "$runs" ]
