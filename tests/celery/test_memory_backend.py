"""``redlock_backend = "memory"``: SingletonTask without Redis, for users' unit tests.

Eager mode and an in-process worker keep their lock semantics (dedupe, contention, TTL,
no re-entry) with no master at all; a `celery worker` refuses the backend (it is not shared
between processes) unless forced.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import ImproperlyConfigured, LockContended, LockLost, SingletonTask, install
from celery_redlock.client import redlock_for, reset_clients
from celery_redlock.memory import MemoryRedlock
from celery_redlock.settings import reset_settings
from celery_redlock.testing import wait_for

pytestmark = pytest.mark.timeout(60)

#: Nothing listens here: any attempt to reach a master would fail loudly.
NO_MASTER = "redis://127.0.0.1:1/0"


def memory_app(**conf: Any) -> Celery:
    app = Celery("memapp", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        **{"redlock_redis_urls": [NO_MASTER], "redlock_backend": "memory", **conf},
    )
    return app


@contextlib.contextmanager
def _reset_after(app: Celery) -> Iterator[Celery]:
    try:
        yield app
    finally:
        reset_clients()
        reset_settings()
        app.close()


@pytest.fixture
def eager_app() -> Iterator[Celery]:
    with _reset_after(memory_app(task_always_eager=True)) as app:
        yield app


@pytest.fixture
def published_app() -> Iterator[Celery]:
    """A memory-backend app whose publishes go to its in-memory broker (not eager)."""
    with _reset_after(memory_app()) as app:
        yield app


def test_eager_delay_runs_without_any_master(eager_app: Celery) -> None:
    @eager_app.task(base=SingletonTask, lock_key="acct:{n}", shared=False)
    def double(n: int) -> int:
        return 2 * n

    assert double.delay(21).get() == 42
    assert isinstance(redlock_for(eager_app), MemoryRedlock)
    assert not redlock_for(eager_app).locked("acct:21")  # released after the run


def test_eager_contention_and_no_reentry(eager_app: Celery) -> None:
    seen: dict[str, Any] = {}

    @eager_app.task(bind=True, base=SingletonTask, lock_key="acct:{n}", shared=False)
    def nested(self: Any, n: int, again: bool) -> str:
        seen["held"] = self.lease.held
        if again:
            inner = nested.delay(n, False)  # same key while this run holds it
            seen["inner"] = inner.result
            return str(inner.state)
        return "ran"

    assert nested.delay(1, True).get() == "FAILURE"
    assert isinstance(seen["inner"], LockContended)
    assert seen["inner"].key == "acct:1"
    assert seen["held"] is True
    assert nested.delay(1, False).get() == "ran"  # free again after the first run


@pytest.fixture
def worker_app() -> Iterator[Celery]:
    app = memory_app()
    yield app
    reset_clients()
    reset_settings()
    app.close()


def test_in_process_worker_dedupes_and_skips_on_contention(worker_app: Celery) -> None:
    runs: list[int] = []
    gate = threading.Event()
    started = threading.Event()

    @worker_app.task(base=SingletonTask, lock_key="acct:{n}", shared=False)
    def sync(n: int) -> int:
        runs.append(n)
        return n

    @worker_app.task(base=SingletonTask, lock_key="acct:{n}", on_contention="skip", shared=False)
    def hold(n: int) -> str:
        started.set()
        gate.wait(20)
        return "held"

    # Published before any worker consumes: the duplicate coalesces into the queued job.
    first, second = sync.delay(7), sync.delay(7)
    assert first.id == second.id
    with start_worker(worker_app, pool="threads", concurrency=2, perform_ping_check=False):
        assert first.get(timeout=20) == 7
        assert runs == [7]
        holder = hold.delay(8)
        wait_for(started.is_set, timeout=20, message="the holder to start")
        skipped = hold.apply_async((8,), task_id="skipped-1")
        # Skipped: a ready FAILURE with LockContended (redlock_skip_result's default).
        with pytest.raises(LockContended):
            skipped.get(timeout=20)
        gate.set()
        assert holder.get(timeout=20) == "held"


def test_an_in_process_prefork_worker_refuses_the_memory_backend() -> None:
    """Each prefork child would keep its own lock table: two runs of one key overlapped in
    two children (found by review). Threads and solo pools share the process's table."""
    app = memory_app()
    install(app)
    try:
        with (
            pytest.raises(ImproperlyConfigured, match="prefork pool"),
            start_worker(app, pool="prefork", concurrency=2, perform_ping_check=False),
        ):
            pass
    finally:
        reset_clients()
        reset_settings()
        app.close()


def test_ttl_runs_on_the_monotonic_clock_and_fences_grow() -> None:
    now = [1000.0]
    redlock = MemoryRedlock(clock=lambda: now[0])
    lease = redlock.acquire("k", ttl=10)
    fence = lease.fence
    with pytest.raises(LockContended):
        redlock.acquire("k", ttl=10)  # not re-entrant, also for the same client
    now[0] += 9.9
    assert lease.held
    assert redlock.locked("k")
    now[0] += 0.2
    assert not lease.held
    assert not redlock.locked("k")
    other = redlock.acquire("k", ttl=10)
    assert other.fence > fence
    assert lease.release() is False  # expired: never deletes the next holder's lock
    assert redlock.locked("k")
    with pytest.raises(LockLost):
        lease.extend()
    other.extend(60)
    now[0] += 59
    assert other.held
    assert other.release() is True
    assert not redlock.locked("k")

    assert redlock.claim("k", "dedupe", "a", 5) == ("a", True)
    assert redlock.claim("k", "dedupe", "b", 5) == ("a", False)
    assert redlock.unclaim("k", "dedupe", "b") is False
    now[0] += 5
    assert redlock.claim("k", "dedupe", "b", 5) == ("b", True)


def test_release_owned_by_and_companions() -> None:
    redlock = MemoryRedlock()
    redlock.claim("k", "dedupe", "t1", 60)
    lease = redlock.acquire("k", ttl=30, meta={"task_id": "t1"}, clear_companion=("dedupe", "t1"))
    assert redlock.claim("k", "dedupe", "t2", 60) == ("t2", True)  # cleared with the acquire
    assert redlock.release_owned_by("k", "task_id", "other") is False
    assert redlock.release_owned_by("k", "task_id", "t1") is True
    assert not lease.owned()


WORKER_APP = """
import os
from celery import Celery
import celery_redlock

app = Celery("memworker", broker="memory://")
app.conf.redlock_backend = "memory"
app.conf.redlock_backend_force = os.environ.get("FORCE") == "1"
celery_redlock.install(app)
"""


def _worker(tmp_path: Path, force: bool) -> subprocess.Popen[bytes]:
    (tmp_path / "memworker.py").write_text(WORKER_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.update(PYTHONPATH=str(tmp_path), FORCE="1" if force else "0")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "memworker", "worker", "-P", "solo", "-l", "info"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_beat_refuses_the_memory_backend(tmp_path: Path) -> None:
    (tmp_path / "memworker.py").write_text(WORKER_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.update(PYTHONPATH=str(tmp_path), FORCE="0")
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "memworker", "beat", "-l", "info",
         "-s", str(tmp_path / "schedule")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "redlock_backend (Django: CELERY_REDLOCK_BACKEND) is 'memory'" in (
        result.stdout + result.stderr
    )


def test_a_celery_worker_refuses_the_memory_backend(tmp_path: Path) -> None:
    proc = _worker(tmp_path, force=False)
    try:
        out, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    text = out.decode()
    assert "redlock_backend (Django: CELERY_REDLOCK_BACKEND) is 'memory'" in text
    assert "redlock_backend_force=True" in text


def test_a_forced_celery_worker_starts_with_the_memory_backend(tmp_path: Path) -> None:
    proc = _worker(tmp_path, force=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(line.decode() for line in proc.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("ready." in line for line in lines), timeout=45, message="ready")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
    assert not any("ImproperlyConfigured" in line for line in lines)


def test_bad_backend_value_is_refused() -> None:
    app = memory_app(redlock_backend="fakeredis")
    with pytest.raises(ImproperlyConfigured, match=r"redlock_backend .* must be one of 'redis'"):
        redlock_for(app)
    reset_settings()
    app.close()


def test_clear_lock_and_clear_dedupe_delete_on_the_memory_backend(published_app: Celery) -> None:
    """Review r10: both returned ``[]`` and left the lock and the marker in place (they
    looped over the Redis masters, of which the memory backend has none): the next
    identical publish was folded into a job that would never run."""
    app = published_app

    @app.task(base=SingletonTask, lock_key="acct:{n}", shared=False)
    def job(n: int) -> int:
        return n

    rl = redlock_for(app)
    lease = rl.acquire("acct:1", 30, meta={"task_id": "running"})
    assert job.clear_lock(1) == ["redlock:{acct:1}", "redlock:{acct:1}:meta"]
    assert not rl.locked("acct:1")
    assert not lease.owned()
    rl.claim("acct:2", job.dedupe_suffix(), "queued-id", 3600)
    assert job.clear_dedupe(2) == [f"redlock:{{acct:2}}:{job.dedupe_suffix()}"]
    assert job.delay(2).id != "queued-id"  # published, not folded into the old marker
    assert job.clear_lock(3) == []  # nothing there


def test_the_holder_reads_of_revoke_and_killed_child_release_work_on_the_memory_backend(
    published_app: Celery,
) -> None:
    """Review r10: ``holder``, ``owned_by`` and ``release_token`` (revoke, a killed pool
    child's release, the acks_late own-run check) raised AttributeError here."""
    app = published_app
    rl = redlock_for(app)
    lease = rl.acquire("acct:1", 30, meta={"task_id": "t1", "host": "w1"})
    assert rl.holder("acct:1", ("task_id", "host")) == (
        lease.token,
        {"task_id": "t1", "host": "w1"},
    )
    assert rl.owned_by("acct:1", "task_id", "t1")
    assert not rl.owned_by("acct:1", "task_id", "t2")
    assert not rl.release_token("acct:1", "not-the-token")
    assert rl.release_token("acct:1", lease.token)
    assert rl.holder("acct:1", ("task_id",)) is None
    assert not rl.owned_by("acct:1", "task_id", "t1")


def test_a_runs_lease_follows_its_ttl_when_the_body_extends_it(eager_app: Celery) -> None:
    """Review r11: the task handed its lease ``renew_every = lock_ttl / 3`` as if given,
    so after ``self.lease.extend(1.04)`` it kept renewing every second, past the new
    validity, and lost the lease. With ``redlock_renew_every`` unset the lease's own
    default applies and follows the TTL."""

    @eager_app.task(bind=True, base=SingletonTask, lock_key="acct:{n}", lock_ttl=3, shared=False)
    def shrink(self: Any, n: int) -> float:
        before = self.lease.renew_every
        self.lease.extend(1.04)
        return before, self.lease.renew_every

    before, after = shrink.delay(1).get()
    assert before == pytest.approx(1.0)
    assert after == pytest.approx(1.04 / 3)


def test_a_lease_whose_lock_clear_lock_deleted_is_lost_on_the_memory_backend(
    published_app: Celery,
) -> None:
    """Review r11: on the memory backend a cleared lock's lease still read held, and
    ``lock_lost`` never came (its renewal never fails: there is no network), so a second
    holder and the first both read held."""
    app = published_app

    @app.task(base=SingletonTask, lock_key="acct:{n}", shared=False)
    def job(n: int) -> int:
        return n

    rl = redlock_for(app)
    first = rl.acquire("acct:1", 30, auto_renew=True)
    lost = threading.Event()
    first.on_lost(lambda lease: lost.set())
    assert job.clear_lock(1) == ["redlock:{acct:1}"]
    assert lost.wait(5)
    assert not first.held
    second = rl.acquire("acct:1", 30)
    assert second.held
    assert not first.held


def test_a_lease_released_by_another_process_is_lost_on_the_memory_backend(
    published_app: Celery,
) -> None:
    """Review r13: ``release_token`` and ``release_owned_by`` (revoke, a killed child's
    release) deleted the key but left its lease reading held, beside a second holder."""
    app = published_app
    rl = redlock_for(app)
    first = rl.acquire("acct:1", 30, auto_renew=True, meta={"task_id": "t1"})
    assert rl.release_token("acct:1", first.token)
    wait_for(lambda: not first.held, timeout=5, message="first lease lost")
    second = rl.acquire("acct:1", 30, auto_renew=True, meta={"task_id": "t2"})
    assert rl.release_owned_by("acct:1", "task_id", "t2")
    wait_for(lambda: not second.held, timeout=5, message="second lease lost")
