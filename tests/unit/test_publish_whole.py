"""``_publish_whole``: the soft time limit's signal held back while SingletonTask publishes.

In the main thread with billiard's ``SIGUSR1`` handler installed (as in a prefork pool's
process), with real signals sent to this process. No Redis is needed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.pool import soft_timeout_sighandler
from celery.exceptions import SoftTimeLimitExceeded

from celery_redlock.task import _publish_whole

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def billiards_handler() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_the_publish_is_held_until_the_caller_delivers_it(
    billiards_handler: None,
) -> None:
    steps: list[str] = []

    def publish() -> str:
        _signal_self()
        steps.append("published")  # reached: the signal did not land in the publish
        return "sent"

    result, deliver = _publish_whole(publish)
    assert (result, steps) == ("sent", ["published"])
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_no_signal_nothing_to_deliver(billiards_handler: None) -> None:
    assert _publish_whole(lambda: 7) == (7, None)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_a_publish_that_fails_delivers_a_held_signal_from_its_exception(
    billiards_handler: None,
) -> None:
    def publish() -> None:
        _signal_self()
        raise ConnectionError("broker gone")

    with pytest.raises(SoftTimeLimitExceeded) as caught:
        _publish_whole(publish)
    assert isinstance(caught.value.__context__, ConnectionError)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_a_publish_that_fails_without_a_signal_raises_its_own_exception(
    billiards_handler: None,
) -> None:
    def publish() -> None:
        raise ConnectionError("broker gone")

    with pytest.raises(ConnectionError):
        _publish_whole(publish)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_nested_publishes_hold_it_once_and_deliver_it_once(billiards_handler: None) -> None:
    """A reschedule publishes through apply_async, which holds it again: the inner call
    sees the outer's handler, not billiard's, and leaves it alone."""
    inner: list[Any] = []

    def outer() -> None:
        inner.append(_publish_whole(_signal_self))

    _, deliver = _publish_whole(outer)
    assert inner == [(None, None)]
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_other_handlers_and_threads_are_left_alone() -> None:
    """Without billiard's handler (a web process: gunicorn's, or none), or off the main
    thread, the publish runs as it is: nothing is swapped."""
    seen: list[Any] = []

    def note(signum: int, frame: Any) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR1, note)
    try:
        assert _publish_whole(lambda: signal.getsignal(signal.SIGUSR1)) == (note, None)
        with_billiard = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        assert with_billiard is note
        found: list[Any] = []
        thread = threading.Thread(target=lambda: found.append(_publish_whole(lambda: 1)))
        thread.start()
        thread.join(10)
        assert found == [(1, None)]
    finally:
        signal.signal(signal.SIGUSR1, previous)
