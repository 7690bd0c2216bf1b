"""The operator tools (``celery redlock ls|inspect|clear|check``, celery_redlock.admin) beside
a master that answers with the wrong reply types, or trickles a reply a byte at a time
(hostile review r12): each command reports that master and goes on with the others, within
a bound, never a traceback or a hang."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock, admin
from celery_redlock.testing import Masters
from tests.core.test_masters import FakeMaster

pytestmark = pytest.mark.timeout(90)


def _int_everything(command: list[bytes]) -> bytes:
    """Handshakes pass; every other command gets an integer (a wrong type for SCAN, INFO,
    TIME, DUMP, EVAL ...), as from a proxy or another server on the port."""
    if command[0].upper() == b"PING":
        return b"+PONG\r\n"
    return b":1\r\n"


@contextlib.contextmanager
def _beside(masters: Masters, fake: FakeMaster) -> Iterator[Redlock]:
    redlock = Redlock([*masters.urls[:2], fake.url])
    try:
        yield redlock
    finally:
        redlock.close()
        fake.close()


@pytest.mark.parametrize("trickle", [False, True], ids=["wrong-types", "trickle"])
def test_each_tool_reports_a_misbehaving_master_and_serves_the_others(
    masters: Masters, monkeypatch: pytest.MonkeyPatch, trickle: bool
) -> None:
    monkeypatch.setattr(admin, "MASTER_DEADLINE", 0.5)
    good = Redlock(masters.urls[:2])
    good.acquire("gone:1", 60)  # left held: clear deletes it
    good.close()
    fake = FakeMaster(_int_everything, trickle=trickle)
    expected = "no complete reply within 0.5s" if trickle else "unexpected reply"
    with _beside(masters, fake) as redlock:
        started = time.monotonic()
        records, errors = admin.list_keys(redlock)
        assert [r.key for r in records] == ["gone:1"]
        assert expected in errors[redlock.masters[2].name]

        rows = admin.inspect_key(redlock, "gone:1")
        assert "redlock:{gone:1}" in rows[0]
        assert expected in rows[2]["error"]

        reports, quorum = admin.check(redlock, max_ttl=60)
        assert quorum  # the two real masters
        assert expected in (reports[2].error or "")

        deleted, errors = admin.clear(redlock, "gone:1")
        assert "redlock:{gone:1}" in deleted  # on the masters that answer
        assert expected in errors[redlock.masters[2].name]
        for server in masters[:2]:
            with server.client() as conn:
                assert not conn.exists("redlock:{gone:1}")
        assert time.monotonic() - started < 10  # 5 tools, each bounded per master
