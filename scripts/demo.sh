#!/usr/bin/env bash
# Run the demo (example_project/demo.py): the example Django + Celery project on three real
# redis-server masters, with real workers and beats, started for the occasion.
# Sets up .venv first (see scripts/_env.sh); arguments go to example_project/demo.py.
set -euo pipefail
# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

exec "$VENV_PY" example_project/demo.py "$@"
