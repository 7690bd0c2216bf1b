"""Reads and releases for a process that does not hold the lock: the worker's main process
freeing a dead pool child's lock (``holder`` then ``release_token``), and a redelivered job
recognising its own earlier run (``owned_by``)."""

from __future__ import annotations

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import Masters

pytestmark = pytest.mark.timeout(30)


def test_holder_reads_the_token_and_metadata_a_quorum_agree_on(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        assert rl.holder("job:1", ("task_id",)) is None
        lease = rl.acquire("job:1", 10, meta={"task_id": "t1", "pid": "42"})
        found = rl.holder("job:1", ("task_id", "pid", "host"))
        assert found == (lease.token, {"task_id": "t1", "pid": "42", "host": ""})
        with pytest.raises(ValueError, match="at least one metadata field"):
            rl.holder("job:1", ())
    finally:
        rl.close()


def test_release_token_frees_only_the_lock_holding_that_token(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        first = rl.acquire("job:2", 10, meta={"task_id": "t2"})
        token = first.token
        assert rl.release_token("job:2", token) is True
        assert not rl.locked("job:2")
        # A later holder of the key (the same task id, redelivered) is never freed by the
        # earlier holder's token.
        second = rl.acquire("job:2", 10, meta={"task_id": "t2"})
        assert rl.release_token("job:2", token) is False
        assert second.owned()
        second.release()
    finally:
        rl.close()


def test_owned_by_tells_the_holders_task_id(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        assert rl.owned_by("job:3", "task_id", "t3") is False
        lease = rl.acquire("job:3", 10, meta={"task_id": "t3"})
        assert rl.owned_by("job:3", "task_id", "t3") is True
        assert rl.owned_by("job:3", "task_id", "other") is False
        lease.release()
        assert rl.owned_by("job:3", "task_id", "t3") is False
    finally:
        rl.close()
