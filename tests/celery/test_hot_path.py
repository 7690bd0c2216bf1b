"""Issue 17: what a job costs SingletonTask when nobody listens, and the shortcuts it takes.

The per-job work left out must change nothing a user sees: a connected receiver still
gets every argument, claim and companion names are the ones :func:`redis_key` builds, and
bad values are refused with the same messages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from celery_redlock import SingletonTask, signals
from celery_redlock import task as task_module
from celery_redlock.client import redlock_for, reset_clients
from celery_redlock.keys import redis_key
from celery_redlock.lock import Redlock, limits, waiting
from celery_redlock.memory import MemoryRedlock
from celery_redlock.settings import reset_settings

pytestmark = pytest.mark.timeout(60)


def _memory_app(name: str, **conf: Any) -> Iterator[Celery]:
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        redlock_redis_urls=["redis://127.0.0.1:1/0"],  # nothing listens: memory backend
        redlock_backend="memory",
        **conf,
    )
    yield app
    reset_clients()
    reset_settings()
    app.close()


@pytest.fixture
def eager_app() -> Iterator[Celery]:
    yield from _memory_app("hotpath", task_always_eager=True)


def test_signal_arguments_are_built_only_for_a_receiver(
    eager_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a receiver, a run neither reads its reschedule header nor the clocks for
    lock_acquired and lock_released; with one, both signals carry every argument."""
    reads: list[Any] = []
    original = task_module._rescheduled_since

    def counted(request: Any) -> float | None:
        reads.append(request.id)
        return original(request)

    monkeypatch.setattr(task_module, "_rescheduled_since", counted)

    @eager_app.task(base=SingletonTask, lock_key="hot:{n}", shared=False)
    def work(n: int) -> int:
        return n

    assert not signals.lock_acquired.receivers
    assert not signals.lock_released.receivers
    assert work.delay(1).get() == 1
    assert reads == []

    got: dict[str, dict[str, Any]] = {}

    def on_acquired(sender: Any = None, **kw: Any) -> None:
        got["acquired"] = kw

    def on_released(sender: Any = None, **kw: Any) -> None:
        got["released"] = kw

    signals.lock_acquired.connect(on_acquired, weak=False)
    signals.lock_released.connect(on_released, weak=False)
    try:
        result = work.delay(2)
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        signals.lock_released.disconnect(on_released)
    assert result.get() == 2
    assert reads == [result.id]
    acquired, released = got["acquired"], got["released"]
    assert acquired["key"] == released["key"] == "hot:2"
    assert acquired["task_id"] == released["task_id"] == result.id
    assert acquired["rescheduled_for"] == 0.0
    assert acquired["waited"] >= 0.0
    assert released["held_for"] >= 0.0
    assert released["lease"] is acquired["lease"]


_suffix = st.text(
    st.characters(blacklist_characters="{}", blacklist_categories=("Cs",)), min_size=1
).filter(lambda s: s not in ("meta", "fence"))
_key = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(
    lambda k: not k.startswith("}")
)


@given(key=_key, suffix=_suffix)
def test_claim_names_are_what_redis_key_builds(key: str, suffix: str) -> None:
    """The cached lock name plus the suffix is exactly ``redis_key(prefix, key, suffix)``,
    for the network client and the in-process one."""
    for client in (
        Redlock(["redis://127.0.0.1:1/0"], key_prefix="pfx"),
        MemoryRedlock(key_prefix="pfx"),
    ):
        assert client._claim_name(key, suffix) == redis_key("pfx", key, suffix)
        assert client._claim_name(key, suffix) == redis_key("pfx", key, suffix)  # cached


@pytest.mark.parametrize("suffix", ["meta", "fence", "a{b", "", "x}"])
def test_refused_suffixes_stay_refused_after_others_were_cached(suffix: str) -> None:
    client = Redlock(["redis://127.0.0.1:1/0"])
    client._claim_name("k", "dedupe:ok")
    with pytest.raises(ValueError, match="suffix"):
        client._claim_name("k", suffix)
    with pytest.raises(ValueError, match="suffix"):
        client._claim_name("k", suffix)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, r"ttl must be a number in \(0, 10\] seconds \(int or float\), got True"),
        ("1", TypeError, r"ttl must be a number in \(0, 10\] seconds \(int or float\), got '1'"),
        (0, ValueError, r"ttl must be a finite number in \(0, 10\] seconds, got 0"),
        (float("nan"), ValueError, r"ttl must be a finite number in \(0, 10\] seconds, got nan"),
        (10.5, ValueError, r"ttl must be a finite number in \(0, 10\] seconds, got 10.5"),
    ],
)
def test_range_messages_are_unchanged(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        limits.seconds("ttl", value, 0.0, 10.0, low_open=True)


def test_range_accepts_int_subclasses_as_before() -> None:
    import enum

    class Seconds(enum.IntEnum):
        FIVE = 5

    assert limits.seconds("ttl", Seconds.FIVE, 0.0, 10.0) == 5.0
    assert type(limits.seconds("ttl", 5, 0.0, 10.0)) is float


@pytest.mark.parametrize(
    ("load", "cores", "busy"), [(0.5, 2, False), (1.99, 2, False), (2.0, 2, True), (7.0, 4, True)]
)
def test_cores_busy_follows_the_load_average(
    monkeypatch: pytest.MonkeyPatch, load: float, cores: int, busy: bool
) -> None:
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(waiting.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(waiting, "_load_checked_at", -float("inf"))
    assert waiting.cores_busy() is busy


def test_cores_busy_reads_the_load_once_per_period(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []

    def loadavg() -> tuple[float, float, float]:
        reads.append(time.monotonic())
        return (99.0, 0.0, 0.0)

    monkeypatch.setattr(waiting.os, "getloadavg", loadavg)
    monkeypatch.setattr(waiting, "_load_checked_at", -float("inf"))
    assert all(waiting.cores_busy() for _ in range(100))
    assert len(reads) == 1
    monkeypatch.setattr(
        waiting, "_load_checked_at", time.monotonic() - 2 * waiting.LOAD_CHECK_PERIOD
    )
    assert waiting.cores_busy()
    assert len(reads) == 2


def test_cores_busy_is_false_without_a_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(waiting.os, "getloadavg", unavailable)
    monkeypatch.setattr(waiting, "_load_checked_at", -float("inf"))
    assert waiting.cores_busy() is False


# -- found by the hostile review of the single settings lookup (each failed before its fix) -


@pytest.fixture
def queued_app() -> Iterator[Celery]:
    yield from _memory_app("hotpath-queued")


def test_a_subclass_redlock_options_decides_the_publish(queued_app: Celery) -> None:
    class NoDedupe(SingletonTask):
        abstract = True

        def redlock_options(self) -> Any:
            return dataclasses.replace(super().redlock_options(), dedupe=None)

    @queued_app.task(base=NoDedupe, lock_key="k:{n}", shared=False)
    def job(n: int) -> int:
        return n

    first, second = job.apply_async((1,)), job.apply_async((1,))
    assert first.id != second.id  # both published: the override turned dedupe off
    assert not redlock_for(queued_app)._values  # and no marker was claimed


def test_an_instance_redlock_options_decides_the_publish(queued_app: Celery) -> None:
    # Found by a hostile review: redlock_options replaced on the task instance itself (a
    # test's mock.patch.object(job, "redlock_options", ...)) was asked by no path, only a
    # class override was.
    @queued_app.task(base=SingletonTask, lock_key="k:{n}", shared=False)
    def job(n: int) -> int:
        return n

    base = job.redlock_options()
    with mock.patch.object(
        job, "redlock_options", return_value=dataclasses.replace(base, dedupe=None)
    ):
        first, second = job.apply_async((1,)), job.apply_async((1,))
    assert first.id != second.id  # both published: the override turned dedupe off
    assert not redlock_for(queued_app)._values  # and no marker was claimed


def test_an_instance_redlock_options_decides_the_run(queued_app: Celery) -> None:
    seen: dict[str, float] = {}

    @queued_app.task(base=SingletonTask, lock_key="k:{n}", shared=False, bind=True)
    def job(self: Any, n: int) -> int:
        seen["ttl"] = self.lease.ttl
        return n

    base = job.redlock_options()
    with mock.patch.object(
        job, "redlock_options", return_value=dataclasses.replace(base, lock_ttl=7.0)
    ):
        job.apply((1,))
    assert seen["ttl"] == 7.0


def test_a_subclass_redlock_options_decides_the_run(queued_app: Celery) -> None:
    class ShortLock(SingletonTask):
        abstract = True

        def redlock_options(self) -> Any:
            return dataclasses.replace(super().redlock_options(), lock_ttl=7.0)

    seen: dict[str, float] = {}

    @queued_app.task(base=ShortLock, lock_key="k:{n}", shared=False, bind=True)
    def job(self: Any, n: int) -> int:
        seen["ttl"] = self.lease.ttl
        return n

    job.apply((1,))
    assert seen["ttl"] == 7.0
