"""Fork safety (Celery's prefork pool): a child owns none of its parent's leases and
renews its own; the parent's renewal goes on undisturbed."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_redlock.exceptions import LockContended
from celery_redlock.lock import Redlock, engine
from celery_redlock.lock import master as master_module
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import lock_name, make_redlock, value_on


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def run_in_fork(child: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Run ``child()`` in a forked process; return its JSON result or fail with its error.

    The child leaves through ``os._exit`` only (never through pytest), and is killed if it
    overruns ``timeout`` (a deadlock after fork shows up as that).
    """
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that fork() with threads may deadlock the child: that hazard
        # is exactly what these tests check.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            os.close(read_end)
            payload = json.dumps({"ok": True, "result": child()})
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            payload = json.dumps({"ok": False, "error": traceback.format_exc()})
            code = 1
        try:
            os.write(write_end, payload.encode())
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"forked child {pid} did not finish within {timeout}s")
            readable, _, _ = select.select([read_end], [], [], left)
            if readable:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, timeout=5)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_end)
    outcome = json.loads(b"".join(chunks) or b'{"ok": false, "error": "no output"}')
    assert outcome["ok"], outcome["error"]
    return outcome["result"]


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_child_renews_its_own_and_parent_keeps_renewing(masters: Masters) -> None:
    rl = make_redlock(masters)
    parent = rl.acquire("parent", 1, auto_renew=True)
    parent_engine = engine()

    def child() -> dict[str, Any]:
        out: dict[str, Any] = {
            "parent_held": parent.held,
            "parent_remaining": parent.remaining(),
            "parent_release": parent.release(),
            "new_engine": engine() is not parent_engine,
        }
        # The parent's key is untouched by that release.
        out["parent_key"] = value_on(masters[0], lock_name("parent")) == parent.token
        try:
            rl.acquire("parent", 1)
            out["parent_key_contended"] = False
        except LockContended:
            out["parent_key_contended"] = True
        mine = rl.acquire("child", 1, auto_renew=True)
        end = time.monotonic() + 2.5  # 2.5 TTLs: only renewal keeps it
        while time.monotonic() < end:
            if not mine.held:
                out["child_lost"] = mine.lost_reason
                break
            time.sleep(0.01)
        out["child_held"] = mine.held
        out["child_renewals"] = engine().renewals
        out["child_release"] = mine.release()
        return out

    result = run_in_fork(child)
    assert result == {
        "parent_held": False,
        "parent_remaining": 0.0,
        "parent_release": False,
        "new_engine": True,
        "parent_key": True,
        "parent_key_contended": True,
        "child_held": True,
        "child_renewals": result["child_renewals"],
        "child_release": True,
    }
    assert result["child_renewals"] >= 5
    # Meanwhile (2.5 s, more than twice the TTL) the parent's engine kept renewing.
    assert parent.held
    assert engine() is parent_engine
    for server in masters:
        assert value_on(server, lock_name("parent")) == parent.token
        assert value_on(server, lock_name("child")) is None
    assert parent.release() is True


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_fork_while_the_engine_is_busy(masters: Masters) -> None:
    """Fork at arbitrary moments of busy renewal: the child never deadlocks on a lock that
    a parent thread held at fork time (connections, lanes, engine, run_id registry)."""
    rl = make_redlock(masters)
    leases = [rl.acquire(f"busy-{i}", 2, auto_renew=True, renew_every=0.01) for i in range(100)]
    renewals = engine().renewals

    def child() -> bool:
        fresh = Redlock(masters.urls)  # new links: connects, reads run_ids
        with fresh.lock("forked", 2, auto_renew=True, renew_every=0.05) as lease:
            ok = lease.held and lease.fence > 0
        with rl.lock("forked-2", 2) as lease:  # the inherited client works too
            ok = ok and lease.held
        fresh.close()
        return ok and not any(lease.held for lease in leases)

    for _ in range(8):
        assert run_in_fork(child, timeout=10) is True
    assert engine().renewals > renewals
    assert all(lease.held for lease in leases)
    for lease in leases:
        lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_fork_while_parent_threads_hold_locks(masters: Masters) -> None:
    """Deterministic version of the above: other threads hold the run_id registry's lock
    and a lane of the shared client while the fork happens."""
    rl = make_redlock(masters)
    rl.acquire("warm", 2).release()
    holding = threading.Barrier(3, timeout=5)
    done = threading.Event()

    def hold(lock: threading.Lock) -> None:
        with lock:
            holding.wait()
            done.wait(timeout=30)

    holders = [
        threading.Thread(target=hold, args=(master_module._known_lock,)),
        threading.Thread(target=hold, args=(rl._lanes[0].lock,)),
    ]
    for thread in holders:
        thread.start()
    try:
        holding.wait()

        def child() -> bool:
            with rl.lock("inherited", 2) as lease:
                inherited = lease.held
            fresh = Redlock(masters.urls)
            with fresh.lock("fresh", 2) as lease:
                return inherited and lease.held

        assert run_in_fork(child, timeout=10) is True
    finally:
        done.set()
        for thread in holders:
            thread.join(timeout=5)


def test_tokens_and_pid_are_drawn_anew_in_a_forked_child() -> None:
    """Tokens come from random bytes drawn ahead: a child must not reuse the parent's."""
    from celery_redlock.lock import process

    process.token_hex()  # the parent now holds bytes for the next 255 tokens
    child = run_in_fork(lambda: [process.pid(), os.getpid(), process.token_hex()])
    assert child[0] == child[1] != os.getpid()
    parent_next = process.token_hex()
    assert len(child[2]) == len(parent_next) == 32
    assert child[2] != parent_next
    assert process.pid() == os.getpid()
    tokens = {process.token_hex() for _ in range(1000)}  # several draws of 256
    assert len(tokens) == 1000
