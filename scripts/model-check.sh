#!/usr/bin/env bash
# The lock's model checker (tests/core/test_model.py): a Hypothesis state machine over 3 real
# masters behind the fault proxy. Writes a summary to docs/model-check-results.txt.
#
#   scripts/model-check.sh            # the CI profile: fixed seeds, a few minutes
#   scripts/model-check.sh long       # random seeds for REDLOCK_MODEL_MINUTES (default 30)
#   REDLOCK_MODEL_DISABLE=extend,huge,garbage scripts/model-check.sh long
#                                     # leave rules out, to hunt a bug behind an easier one
#   MODEL_RESULTS=/tmp/r.txt scripts/model-check.sh   # write the summary elsewhere
#
# The summary replaces the "last run" part of the file and keeps everything from the line
# "negative control" on (the recorded counterexamples).
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

profile=${1:-ci}
case $profile in
    ci) selector=test_lock_model_ci ;;
    long)
        selector=test_lock_model_long
        export REDLOCK_MODEL_CHECK=long
        ;;
    *)
        echo "usage: $0 [ci|long]" >&2
        exit 2
        ;;
esac
results=${MODEL_RESULTS:-$REPO_ROOT/docs/model-check-results.txt}
log=$(mktemp "${TMPDIR:-/tmp}/model-check.XXXXXX.log")
trap 'rm -f "$log"' EXIT

status=0
started=$(date +%s)
start_text=$(date '+%Y-%m-%d %H:%M:%S')
"$VENV_PY" -m pytest tests/core/test_model.py -k "$selector" -p no:cacheprovider -s --show-capture=no \
    2>&1 | tee "$log" || status=${PIPESTATUS[0]}
elapsed=$(( $(date +%s) - started ))
if [ "$status" -eq 0 ]; then outcome="PASSED"; else outcome="FAILED (pytest exit status $status)"; fi

kept=$(mktemp "${TMPDIR:-/tmp}/model-kept.XXXXXX")
trap 'rm -f "$log" "$kept"' EXIT
if [ -f "$results" ]; then
    sed -n '/^negative control/,$p' "$results" >"$kept"
fi
{
    echo "celery-redlock model checker: last run (scripts/model-check.sh $profile)"
    echo "run at $start_text for ${elapsed} s on $(uname -n) ($(uname -sr)), $("$VENV_PY" -V 2>&1)," \
        "commit $(git -C "$REPO_ROOT" rev-parse --short HEAD)"
    echo "profile: $profile; disabled rules: ${REDLOCK_MODEL_DISABLE:-none}"
    echo "outcome: $outcome"
    grep -E "model-check long: run|passed|failed" "$log" | tail -n 3 || true
    if [ "$status" -ne 0 ]; then
        echo
        echo "failure (shrunk; the timeline is the checker's own record):"
        sed -n '/^Falsifying example/,/^=\+ short test summary/p' "$log" | head -n 200
    fi
    echo
    cat "$kept"
} >"$results"
echo "[model-check.sh] $outcome after ${elapsed} s; summary in $results" >&2
exit "$status"
