"""Django system checks for CELERY_REDLOCK_* settings, run the way `manage.py check` runs them.

Django can be configured once per process, so each case runs in a fresh interpreter with
its own ``settings.configure(...)``: no other test's Django configuration leaks in or out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import django
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

settings.configure(INSTALLED_APPS=["celery_redlock.contrib.django"], **json.loads(sys.argv[1]))
django.setup()
messages = [
    {"id": m.id, "obj": m.obj, "msg": m.msg, "error": m.is_serious()} for m in run_checks()
]
try:
    call_command("check")
    command = "ok"
except SystemCheckError as exc:
    command = str(exc)
print(json.dumps({"messages": messages, "command": command}))
"""


def run_checks_with(**django_settings: Any) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "CELERY_BROKER_URL"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(django_settings)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def ids(report: dict[str, Any]) -> list[str]:
    return [message["id"] for message in report["messages"]]


def test_valid_settings_pass_the_checks() -> None:
    report = run_checks_with(
        CELERY_BROKER_URL="redis://broker:6379/0",
        CELERY_REDLOCK_REDIS_URLS=["redis://r1:6379/0", "redis://r2:6379/0", "redis://r3:6379/0"],
        CELERY_REDLOCK_TTL=60,
        CELERY_REDLOCK_ON_CONTENTION="skip",
        CELERY_REDLOCK_DEDUPE=None,
        CELERY_REDLOCK_CONTENTION_BACKOFF=[2, 30],
    )
    assert report == {"messages": [], "command": "ok"}


def test_no_settings_at_all_pass_the_checks() -> None:
    assert run_checks_with() == {"messages": [], "command": "ok"}


def test_an_invalid_value_is_e001_naming_the_setting_and_accepted_values() -> None:
    report = run_checks_with(CELERY_REDLOCK_ON_CONTENTION="wait")
    assert report["messages"] == [
        {
            "id": "celery_redlock.E001",
            "obj": "settings.CELERY_REDLOCK_ON_CONTENTION",
            "msg": "redlock_on_contention (Django: CELERY_REDLOCK_ON_CONTENTION) must be one of "
            "'retry', 'skip', 'raise'; got 'wait' (a str)",
            "error": True,
        }
    ]
    # `manage.py check` (and so migrate, runserver...) stops on it.
    assert "celery_redlock.E001" in report["command"]
    assert "CELERY_REDLOCK_ON_CONTENTION" in report["command"]


def test_settings_that_do_not_fit_together_are_e002() -> None:
    report = run_checks_with(CELERY_REDLOCK_TTL=3, CELERY_REDLOCK_NODE_TIMEOUT=2)
    assert ids(report) == ["celery_redlock.E002"]
    (message,) = report["messages"]
    assert message["obj"] == "settings.CELERY_REDLOCK_NODE_TIMEOUT"
    assert "CELERY_REDLOCK_TTL" in message["msg"]


def test_misspelled_names_are_e003_and_our_names_outside_the_namespace_w001() -> None:
    report = run_checks_with(CELERY_REDLOCK_DEDUP="queued", REDLOCK_TTL=10, REDLOCK_RETRY_COUNT=3)
    messages = {m["obj"]: m for m in report["messages"]}
    assert ids(report) == ["celery_redlock.E003", "celery_redlock.W001"]
    assert messages["settings.CELERY_REDLOCK_DEDUP"]["msg"] == (
        "unknown celery-redlock setting CELERY_REDLOCK_DEDUP; did you mean CELERY_REDLOCK_DEDUPE?"
    )
    assert messages["settings.REDLOCK_TTL"]["msg"] == (
        "setting REDLOCK_TTL is outside namespace 'CELERY' and never read by celery-redlock; "
        "write CELERY_REDLOCK_TTL if it is meant for celery-redlock"
    )
    assert not messages["settings.REDLOCK_TTL"]["error"]


def test_another_librarys_redlock_setting_passes_the_checks() -> None:
    # Issue 15 item 10: REDLOCK_RETRY_COUNT (outside Celery's namespace) is not ours.
    report = run_checks_with(REDLOCK_RETRY_COUNT=3, REDLOCK_RETRY_DELAY=200)
    assert report == {"messages": [], "command": "ok"}


def test_passwords_in_masters_never_reach_the_check_output() -> None:
    report = run_checks_with(
        CELERY_REDLOCK_REDIS_URLS=["redis://:s3cret@r1:6379/0", "redis://:s3cret@r1:6379/0"]
    )
    assert ids(report) == ["celery_redlock.E001"]
    assert "s3cret" not in json.dumps(report)
    assert "redis://:***@r1:6379/0" in report["messages"][0]["msg"]


def test_a_bad_broker_url_used_as_default_master_is_reported() -> None:
    report = run_checks_with(CELERY_BROKER_URL="redis://broker:notaport/0")
    assert ids(report) == ["celery_redlock.E001"]
    message = report["messages"][0]["msg"]
    assert "CELERY_REDLOCK_REDIS_URLS" in message
    assert "from the broker URL, used while the setting is not set" in message
