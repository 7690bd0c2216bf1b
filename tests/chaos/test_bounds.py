"""Direct checks of bounds the scenarios found broken (each fails without its fix)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_redlock.lock import Redlock, waiting
from celery_redlock.lock import master as master_module
from celery_redlock.testing import Masters

from .proxy import ProxyProcess

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]


@pytest.fixture
def slow_masters(masters: Masters) -> Iterator[ProxyProcess]:
    master_module._known_run_ids.clear()
    proxy = ProxyProcess([(m.host, m.port) for m in masters])
    try:
        yield proxy
    finally:
        proxy.close()
        master_module._known_run_ids.clear()


def test_a_connect_costs_one_round_trip(slow_masters: ProxyProcess) -> None:
    """Scenario s11: redis-py's CLIENT SETINFO (two extra round trips per connect, each
    bounded by the read timeout alone) made a connect to a slow master cost three round
    trips, and the connects of one round add up: a renewal round took longer than the
    TTL with every master answering within node_timeout."""
    rtt = 0.1
    slow_masters.set("*", "delay", rtt / 2, rtt / 2)
    rl = Redlock(slow_masters.urls(), node_timeout=0.3)
    try:
        started = time.monotonic()
        lease = rl.acquire("k", 5)
        took = time.monotonic() - started
        # 3 connects (one handshake round trip each) + the acquire round trip; with
        # SETINFO it was 3 x 3 + 1 round trips (about 1.0 s).
        assert took < 4 * rtt + 0.3, f"acquire through {rtt}s RTT took {took:.3f}s"
        assert lease.release()
    finally:
        rl.close()


@pytest.mark.parametrize("spin_wait", [0.002, 0.2], ids=["adaptive", "control: polls throughout"])
def test_slow_replies_stop_the_polling(
    slow_masters: ProxyProcess, spin_wait: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masters whose replies come later than ``spin_wait`` cost no polling CPU.

    The proxy holds every reply 10 ms. With ``spin_wait`` = 2 ms the client stops polling
    after a few rounds and sleeps through the waits: it is on a CPU a small share of the
    time. The control polls for up to 0.2 s, longer than any wait, so it keeps polling:
    on a CPU most of the time.
    """
    slow_masters.set("*", "delay", 0, 0.01)
    monkeypatch.setattr(waiting, "cores_busy", lambda: False)  # whatever else this host runs
    rl = Redlock(slow_masters.urls(), node_timeout=0.3, spin_wait=spin_wait)
    try:
        for i in range(12):  # long enough for the moving average to settle
            rl.acquire(f"settle-{i}", 5).release()
        cpu, wall = time.thread_time(), time.monotonic()
        for i in range(20):
            rl.acquire(f"slow-{i}", 5).release()
        busy = (time.thread_time() - cpu) / (time.monotonic() - wall)
    finally:
        rl.close()
    # The share of the time this thread was on a CPU: sleeping in select is not.
    if spin_wait < 0.01:
        assert busy < 0.1, f"on CPU {busy:.0%} of the time"
    else:
        assert busy > 0.5, f"on CPU {busy:.0%} of the time"


def test_busy_cores_stop_the_polling(
    slow_masters: ProxyProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every core busy (load average >= cores) a round sleeps instead of polling,
    even where polling would go on (the control above): it would take the CPU from the
    masters and task bodies."""
    slow_masters.set("*", "delay", 0, 0.01)
    # raising=False: before the fix there was nothing to patch, and the round polled
    monkeypatch.setattr(waiting, "cores_busy", lambda: True, raising=False)
    rl = Redlock(slow_masters.urls(), node_timeout=0.3, spin_wait=0.2)
    try:
        rl.acquire("settle", 5).release()
        cpu, wall = time.thread_time(), time.monotonic()
        for i in range(20):
            rl.acquire(f"busy-{i}", 5).release()
        busy = (time.thread_time() - cpu) / (time.monotonic() - wall)
    finally:
        rl.close()
    assert busy < 0.1, f"on CPU {busy:.0%} of the time"
