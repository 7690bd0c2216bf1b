#!/usr/bin/env bash
# Run the whole test suite against real redis-server masters (and RabbitMQ when present):
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/test_harness.py -k pause -x    # any pytest arguments
# Sets up .venv first (see scripts/_env.sh).
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

status=0
"$VENV_PY" -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "[test.sh] error: pytest collected no tests; a run that tests nothing is a failure" >&2
    exit 1
fi
exit "$status"
