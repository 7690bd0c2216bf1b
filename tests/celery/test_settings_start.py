"""Bad celery-redlock settings stop `celery worker` and `celery beat` at start, with a message
naming the setting, never at the first task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .redlock_testkit import FAILING_WORKER_ARGS, ProjEnv, exit_code

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


@pytest.mark.parametrize(("conf", "named"), BAD_SETTINGS)
def test_worker_exits_at_start(
    proj_env: ProjEnv, celery_cmd: Any, conf: dict[str, Any], named: list[str]
) -> None:
    worker = celery_cmd(
        {**proj_env.vars, "REDLOCK_TEST_CONF": json.dumps(conf)}, *FAILING_WORKER_ARGS
    )
    assert exit_code(worker) != 0
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
    assert exit_code(beat) != 0
    for text in named:
        assert text in beat.log
