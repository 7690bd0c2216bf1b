"""Bad celery-redlock settings stop `celery worker` and `celery beat` at start, with a message
naming the setting, never at the first task."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .redlock_testkit import ProjEnv

pytestmark = pytest.mark.timeout(90)

BAD_SETTINGS = [
    pytest.param(
        {"redlock_on_contention": "maybe"},
        ["redlock_on_contention", "'retry', 'skip', 'raise'", "'maybe'"],
        id="on_contention",
    ),
    pytest.param({"redlock_ttl": -1}, ["redlock_ttl", "-1"], id="ttl"),
    pytest.param({"redlock_tll": 30}, ["redlock_tll", "redlock_ttl"], id="misspelled"),
]


def _exit_code(process: Any) -> int:
    try:
        return int(process.proc.wait(timeout=60))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running with bad settings:\n{process.log[-3000:]}") from None


@pytest.mark.parametrize(("conf", "named"), BAD_SETTINGS)
def test_worker_exits_at_start(
    proj_env: ProjEnv, celery_cmd: Any, conf: dict[str, Any], named: list[str]
) -> None:
    worker = celery_cmd(
        {**proj_env.vars, "REDLOCK_TEST_CONF": json.dumps(conf)},
        "worker",
        "-P",
        "prefork",
        "-c",
        "1",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "info",
    )
    assert _exit_code(worker) != 0
    log = worker.log
    assert "ImproperlyConfigured" in log
    for text in named:
        assert text in log
    assert " ready." not in log


@pytest.mark.parametrize(("conf", "named"), BAD_SETTINGS)
def test_beat_exits_at_start(
    proj_env: ProjEnv, celery_cmd: Any, tmp_path: Path, conf: dict[str, Any], named: list[str]
) -> None:
    beat = celery_cmd(
        {**proj_env.vars, "REDLOCK_TEST_CONF": json.dumps(conf)},
        "beat",
        "-s",
        str(tmp_path / "schedule"),
        "-l",
        "info",
    )
    assert _exit_code(beat) != 0
    for text in named:
        assert text in beat.log
