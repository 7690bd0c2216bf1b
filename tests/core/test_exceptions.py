"""The exception tree: one root, context as attributes, rebuildable from ``args``.

Celery's result backends store an exception as its class and ``args`` (JSON or pickle)
and re-create it with ``cls(*args)``; every exception must survive that unchanged.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator

import pytest

from celery_redlock import exceptions
from celery_redlock.exceptions import (
    AlreadyQueued,
    ImproperlyConfigured,
    LockContended,
    LockLost,
    QuorumUnavailable,
    RedlockError,
    StaleFence,
)
from celery_redlock.testing import Masters

from . import helpers

MASTERS = ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", "unix:///run/r.sock"]
ERRORS = {"redis://10.0.0.2:6379/0": "connect failed: refused"}
ATTRIBUTES = ("message", "key", "masters", "errors")


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def samples() -> list[RedlockError]:
    return [
        RedlockError("root", "k", MASTERS, ERRORS),
        LockContended("'k' is held by another owner", "k", MASTERS),
        QuorumUnavailable("only 1 of 3 masters answered", "report:{42}", MASTERS, ERRORS),
        LockLost("lease on 'k' is lost", "k", MASTERS),
        StaleFence("stale", "k", MASTERS, {}, 7, 9),
        ImproperlyConfigured("redlock_ttl must be a number of seconds"),
        LockContended(),
        StaleFence("only a message"),
        AlreadyQueued("duplicate of queued job j-1", "acct:42", MASTERS, {}, "j-1"),
        AlreadyQueued(),
    ]


def test_one_root() -> None:
    for name in exceptions.__all__:
        cls = getattr(exceptions, name)
        assert issubclass(cls, RedlockError)
        assert issubclass(cls, Exception)
    # The two outcomes of a failed acquire are told apart by type.
    assert not issubclass(LockContended, QuorumUnavailable)
    assert not issubclass(QuorumUnavailable, LockContended)


def assert_same(a: RedlockError, b: RedlockError) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert a.args == b.args
    for name in ATTRIBUTES:
        assert getattr(a, name) == getattr(b, name), name
    if isinstance(a, StaleFence):
        assert isinstance(b, StaleFence)
        assert (a.fence, a.current) == (b.fence, b.current)
    if isinstance(a, AlreadyQueued):
        assert isinstance(b, AlreadyQueued)
        assert a.task_id == b.task_id


@pytest.mark.parametrize("exc", samples(), ids=lambda e: type(e).__name__)
def test_rebuilt_from_args(exc: RedlockError) -> None:
    assert_same(exc, type(exc)(*exc.args))


@pytest.mark.parametrize("exc", samples(), ids=lambda e: type(e).__name__)
def test_pickles(exc: RedlockError) -> None:
    assert_same(exc, pickle.loads(pickle.dumps(exc)))


@pytest.mark.parametrize("exc", samples(), ids=lambda e: type(e).__name__)
def test_args_survive_json(exc: RedlockError) -> None:
    # What a JSON result backend does: store the args, re-create from the decoded args.
    rebuilt = type(exc)(*json.loads(json.dumps(exc.args)))
    assert_same(exc, rebuilt)


def test_context_attributes() -> None:
    exc = QuorumUnavailable("msg", "k", MASTERS, ERRORS)
    assert exc.key == "k"
    assert exc.masters == MASTERS
    assert exc.errors == ERRORS
    assert str(exc) == "msg"
    fence = StaleFence("stale", "k", MASTERS, None, 7, 9)
    assert (fence.fence, fence.current, fence.errors) == (7, 9, {})


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_exceptions_raised_by_the_lock_rebuild(masters: Masters) -> None:
    """The exceptions a real Redlock raises carry context and survive the round trip."""
    rl = helpers.make_redlock(masters, node_timeout=0.1)
    lease = rl.acquire("exc", 5)
    with pytest.raises(LockContended) as contended:
        rl.acquire("exc", 5)
    lease.release()
    with pytest.raises(LockLost) as lost:
        lease.ensure_held()
    masters[0].kill()
    masters[1].kill()
    with pytest.raises(QuorumUnavailable) as unavailable:
        rl.acquire("exc", 5)
    assert set(unavailable.value.errors) == {masters[0].url, masters[1].url}
    for exc in (contended.value, lost.value, unavailable.value):
        assert exc.key == "exc"
        assert exc.masters == [m.url for m in masters]
        assert_same(exc, type(exc)(*exc.args))
        assert_same(exc, pickle.loads(pickle.dumps(exc)))
        assert_same(exc, type(exc)(*json.loads(json.dumps(exc.args))))
