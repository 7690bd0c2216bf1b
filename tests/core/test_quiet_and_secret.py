"""The lock core's words to operators: no password in any error text, no wolf cried.

Issue 18, items 1 and 8, on real masters:

* masters given as a URL, a dict and a Sentinel spec, each with a password, whose error
  texts quote it (redis-py < 7.4 printed a Sentinel's ``sentinel_kwargs`` password;
  simulated by turning off this redis-py's redaction): the password is in no log line,
  no ``QuorumUnavailable`` (message, args, ``errors``), no ``Master.last_error`` and no
  ``check_masters`` status;
* one master of three stopped (the quorum is fine): 50 releases log a handful of
  WARNINGs, not one each, and a ``wait=False`` release never says "0 of 3".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock import QuorumUnavailable
from celery_redlock.testing import Masters

from ..secret_masters import SECRETS, print_passwords_in_reprs, unreachable_masters
from . import helpers
from .helpers import make_redlock

pytestmark = pytest.mark.timeout(60)

NODE_TIMEOUT = 0.2


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("celery_redlock") and r.levelno >= level]


def test_no_password_in_errors_logs_or_status(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    print_passwords_in_reprs(monkeypatch)
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    rl = make_redlock(unreachable_masters(), node_timeout=NODE_TIMEOUT)
    with pytest.raises(QuorumUnavailable) as raised:
        rl.acquire("report:1", 5)
    exc = raised.value
    assert "No master found for 'mymaster'" in str(exc.errors), "sentinel error not exercised"
    texts = {
        "exception": f"{exc} {exc.args!r} {exc.errors!r} {QuorumUnavailable(*exc.args)!r}",
        "last_error": repr([m.last_error for m in rl.masters]),
        "status": repr(rl.check_masters() if hasattr(rl, "check_masters") else ""),
        "logs": caplog.text + "\n".join(r.getMessage() for r in caplog.records),
    }
    for where, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} in {where}: {text[:2000]}"


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "no-wait"])
def test_releases_with_one_master_down_log_a_handful_of_lines(
    masters: Masters, caplog: pytest.LogCaptureFixture, wait: bool
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock")
    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    rl.acquire("warm", 5).release()  # connected to all three
    masters[2].stop()
    confirmed = []
    for n in range(50):
        lease = rl.acquire(f"job:{n}", 5)
        confirmed.append(lease.release(wait=wait))
    if wait:
        assert all(confirmed), "the quorum of two confirmed every release"
    warnings = _records(caplog, logging.WARNING)
    texts = [r.getMessage() for r in _records(caplog, logging.INFO)]
    # The master going down: one line (plus one summary per 30 s): never one per release.
    assert len(warnings) <= 3, texts
    assert len(texts) <= 4, texts
    assert not any(re.search(r"\b0 of \d+ masters", t) for t in texts), texts
    assert any(masters[2].url.split("//")[1].split("/")[0] in t for t in texts), (
        "the stopped master was not named in any line"
    )


def test_a_lease_whose_owner_reports_the_loss_logs_it_at_debug(
    masters: Masters, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    reported: list[Any] = []
    lease = rl.acquire("lost:1", 5)
    lease.on_lost(reported.append, reports_loss=True)
    lease._lose("taken away")
    lost = [r for r in _records(caplog, logging.DEBUG) if "lost the lock" in r.getMessage()]
    assert [r.levelno for r in lost] == [logging.DEBUG]
    lease.release()
