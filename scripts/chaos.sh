#!/usr/bin/env bash
# The full chaos matrix (tests/chaos): every scenario with every negative control, the
# root-only network-namespace scenarios included; writes the verdict table to
# docs/chaos-results.txt. About 15 minutes on 2 cores.
#
#   sudo scripts/chaos.sh                  # everything
#   sudo scripts/chaos.sh -k s06           # any pytest arguments (the table then covers those)
#   CHAOS_TABLE=/tmp/t.txt scripts/chaos.sh   # write the table elsewhere
#
# Without root the namespace scenarios are skipped (with the reason shown). The default
# subset (no namespaces, fewer negative controls) runs with the normal test command,
# scripts/test.sh, marked `chaos`; this script adds everything marked `chaos_full`.
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

if [ "$(id -u)" != 0 ]; then
    echo "[chaos.sh] not root: the network-namespace scenarios will be skipped" >&2
fi
table=${CHAOS_TABLE:-$REPO_ROOT/docs/chaos-results.txt}
results=$(mktemp "${TMPDIR:-/tmp}/chaos-results.XXXXXX.jsonl")
trap 'rm -f "$results"' EXIT

status=0
started=$(date +%s)
CHAOS_RESULTS=$results "$VENV_PY" -m pytest tests/chaos -m "chaos or chaos_full" \
    --durations=0 "$@" || status=$?
echo "[chaos.sh] pytest exit status $status after $(( $(date +%s) - started )) s" >&2
if [ -s "$results" ]; then
    "$VENV_PY" -m tests.chaos.report "$results" "$table"
    echo "[chaos.sh] verdict table written to $table" >&2
else
    echo "[chaos.sh] no scenario ran: table not written" >&2
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
