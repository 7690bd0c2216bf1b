"""Master host names resolved within a deadline (``celery_redlock.lock.resolve``).

``socket.getaddrinfo`` has no timeout: before, a master whose name did not resolve (a
DNS outage, a dead first nameserver) held the acquire that had to connect to it for as
long as the system resolver tried, twice (once here, once in redis-py's connect): 6 s for
a name that took 3 s to fail, with a node_timeout of 0.25 s. Real masters, reached by
names that a stand-in resolver maps to 127.0.0.1; the stand-in hangs on an event the
test sets at its end, never on a sleep.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock.lock import probe, resolve
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import make_redlock

pytestmark = pytest.mark.timeout(60)

NODE_TIMEOUT = 0.25
#: what a hung lookup would cost, were it waited for: far beyond any deadline here
HANG = 20.0


class Resolver:
    """Stands in for the system resolver: names ending in ``.test`` map to 127.0.0.1,
    and hang while ``hung`` holds them (until :meth:`release`)."""

    def __init__(self) -> None:
        self.real = socket.getaddrinfo
        self.hung: set[str] = set()
        self.failing: set[str] = set()
        self.freed = threading.Event()
        self.lookups: list[str] = []
        #: names that resolve to other addresses than 127.0.0.1, in this order
        self.moved: dict[str, list[str]] = {}
        #: a name whose lookups after its first (failing) one hang
        self.hang_after_failure: str | None = None

    def __call__(
        self, host: Any, port: Any, family: int = 0, kind: int = 0, proto: int = 0, flags: int = 0
    ) -> Any:
        if isinstance(host, str) and host.endswith(".test") and not flags & socket.AI_NUMERICHOST:
            self.lookups.append(host)
            if host in self.hung or (
                host == self.hang_after_failure and self.lookups.count(host) > 1
            ):
                self.freed.wait(HANG)
            if host in self.failing:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            found: list[Any] = []
            for address in self.moved.get(host, ["127.0.0.1"]):
                found += self.real(address, port, family, kind, proto, flags)
            return found
        return self.real(host, port, family, kind, proto, flags)

    def release(self) -> None:
        self.freed.set()


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    resolve.forget()
    yield from helpers.clean_state()
    resolve.forget()


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    fake = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    yield fake
    fake.release()


def _named(masters: Masters, *hosts: str) -> list[str]:
    """The masters' URLs, the first ones by the given names instead of 127.0.0.1."""
    urls = list(masters.urls)
    for i, host in enumerate(hosts):
        urls[i] = urls[i].replace("127.0.0.1", host)
    return urls


def _drop_connections(rl: Any) -> None:
    """Close every connection of ``rl``: its next round connects again."""
    for lane in rl._lanes:
        for link in lane.links:
            link.close()


def _handed_back_and_used(rl: Any, masters: Masters, timeout: float) -> None:
    """The probe hands the first master back, and the next acquire lands on it."""
    wait_for(
        lambda: rl.masters[0] not in probe.watching(),
        timeout=timeout,
        message="the probe never handed the first master back",
    )
    lease = rl.acquire("job", 5)
    assert helpers.value_on(masters[0], helpers.lock_name("job")) == lease.token
    lease.release()


def _timed(call: Any) -> tuple[float, Any]:
    started = time.monotonic()
    result = call()
    return time.monotonic() - started, result


def test_a_name_that_does_not_resolve_costs_an_acquire_one_node_timeout(
    masters: Masters, resolver: Resolver
) -> None:
    resolver.hung.add("hung.test")
    rl = make_redlock(_named(masters, "hung.test"), node_timeout=NODE_TIMEOUT)
    took, lease = _timed(lambda: rl.acquire("job", 5))
    # The two others make the quorum; before, the acquire waited for the resolver (HANG).
    assert took < NODE_TIMEOUT + 2.0, took
    assert "did not resolve within" in (rl.masters[0].last_error or "")
    assert rl.masters[0] in probe.watching()  # tried again off the jobs' path
    lease.release()
    # The lookup goes on, one for the name whatever the number of connects.
    took, lease = _timed(lambda: rl.acquire("job", 5))
    assert took < NODE_TIMEOUT + 2.0, took
    lease.release()
    assert resolver.lookups.count("hung.test") == 1


def test_once_the_lookup_answers_the_master_is_back(masters: Masters, resolver: Resolver) -> None:
    resolver.hung.add("late.test")
    rl = make_redlock(_named(masters, "late.test"), node_timeout=NODE_TIMEOUT)
    rl.acquire("job", 5).release()
    assert rl.masters[0].down
    resolver.release()  # the resolver answers at last
    _handed_back_and_used(rl, masters, timeout=15)


def test_a_name_resolved_before_is_connected_to_while_the_resolver_hangs(
    masters: Masters, resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    rl = make_redlock(_named(masters, "a.test", "b.test"), node_timeout=NODE_TIMEOUT)
    rl.acquire("job", 5).release()  # resolved, connected
    monkeypatch.setattr(resolve, "FRESH", 0.0)  # every answer is old now
    resolver.hung |= {"a.test", "b.test"}
    _drop_connections(rl)  # the next acquire connects again
    took, lease = _timed(lambda: rl.acquire("job", 5))
    assert took < NODE_TIMEOUT + 2.0, took
    # Both named masters were reached at their last known address, not given up on.
    assert helpers.value_on(masters[0], helpers.lock_name("job")) == lease.token
    assert helpers.value_on(masters[1], helpers.lock_name("job")) == lease.token
    lease.release()


def test_a_failed_lookup_keeps_the_last_known_addresses(
    masters: Masters, resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve.resolve("a.test", 1, 0, socket.SOCK_STREAM, 1.0)[0][4][0] == "127.0.0.1"
    monkeypatch.setattr(resolve, "FRESH", 0.0)
    resolver.failing |= {"a.test", "b.test"}
    assert resolve.resolve("a.test", 1, 0, socket.SOCK_STREAM, 1.0)[0][4][0] == "127.0.0.1"
    with pytest.raises(socket.gaierror):
        resolve.resolve("b.test", 1, 0, socket.SOCK_STREAM, 1.0)  # never resolved: no address


def test_an_address_never_waits_for_the_resolver(resolver: Resolver) -> None:
    threads = threading.active_count()
    for host in ("127.0.0.1", "::1"):
        assert resolve.resolve(host, 6379, 0, socket.SOCK_STREAM, 0.0)
    assert resolver.lookups == []
    assert threading.active_count() == threads


def test_a_refused_connect_to_one_address_is_not_resolved_again(
    masters: Masters, resolver: Resolver
) -> None:
    rl = make_redlock(_named(masters, "a.test"), node_timeout=NODE_TIMEOUT)
    rl.acquire("job", 5).release()
    masters[0].stop()
    _drop_connections(rl)
    resolver.hung.add("a.test")  # were redis-py to connect it, it would wait HANG
    took, lease = _timed(lambda: rl.acquire("job", 5))
    assert took < NODE_TIMEOUT + 2.0, took
    assert "Connection refused" in (rl.masters[0].last_error or ""), rl.masters[0].last_error
    lease.release()


def test_a_forked_child_does_not_wait_for_its_parents_lookup(resolver: Resolver) -> None:
    resolver.hung.add("hung.test")
    with pytest.raises(TimeoutError):
        resolve.resolve("hung.test", 1, 0, socket.SOCK_STREAM, 0.05)
    assert resolve._under_way  # the parent's lookup goes on

    def child() -> bytes:
        resolver.hung.clear()
        found = resolve.resolve("hung.test", 1, 0, socket.SOCK_STREAM, 5.0)
        return found[0][4][0].encode()

    assert helpers.in_child(child) == b"127.0.0.1"


# -- hostile review of the first version -----------------------------------------------------


def test_a_master_that_moved_is_looked_up_again_after_a_failed_connect(
    masters: Masters, resolver: Resolver
) -> None:
    resolver.moved = {"moved.test": ["127.0.0.3"]}  # its old address: nothing listens there
    rl = make_redlock(_named(masters, "moved.test"), node_timeout=NODE_TIMEOUT)
    rl.acquire("job", 5).release()
    assert rl.masters[0].down
    del resolver.moved["moved.test"]  # the name answers its new address at once
    # Before, the cached old address served connects and probes for 30 s.
    _handed_back_and_used(rl, masters, timeout=10)


def test_a_lookup_thread_that_cannot_start_does_not_stick(
    resolver: Resolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(OSError, match="cannot start a lookup"):
        resolve.resolve("ok.test", 1, 0, socket.SOCK_STREAM, 1.0)
    monkeypatch.setattr(threading.Thread, "start", start)
    # Before, the lookup stayed "under way" for good: every call timed out.
    assert resolve.resolve("ok.test", 1, 0, socket.SOCK_STREAM, 1.0)[0][4][0] == "127.0.0.1"


def test_the_fallback_to_old_addresses_is_logged_once(
    resolver: Resolver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    resolve.resolve("a.test", 1, 0, socket.SOCK_STREAM, 1.0)
    monkeypatch.setattr(resolve, "FRESH", 0.0)
    monkeypatch.setattr(resolve, "FAILED_FOR", 0.0)  # every call asks the resolver
    resolver.failing.add("a.test")
    for _ in range(5):
        resolve.resolve("a.test", 1, 0, socket.SOCK_STREAM, 1.0)
    said = [r.getMessage() for r in caplog.records if "a.test" in r.getMessage()]
    assert len(said) == 1, said
    resolver.failing.clear()
    resolve.resolve("a.test", 1, 0, socket.SOCK_STREAM, 1.0)
    assert "resolves again" in caplog.records[-1].getMessage()


def test_a_name_that_fails_to_resolve_is_not_looked_up_again_by_redis_py(
    masters: Masters, resolver: Resolver
) -> None:
    resolver.failing.add("flap.test")
    resolver.hang_after_failure = "flap.test"  # its second lookup hangs
    rl = make_redlock(_named(masters, "flap.test"), node_timeout=NODE_TIMEOUT)
    took, lease = _timed(lambda: rl.acquire("job", 5))
    assert took < NODE_TIMEOUT + 2.0, took
    assert "Temporary failure in name resolution" in (rl.masters[0].last_error or "")
    lease.release()


def test_a_name_whose_first_address_refuses_is_connected_at_the_next_one(
    masters: Masters, resolver: Resolver
) -> None:
    # Nothing listens on 127.0.0.3: refused at once. Before, redis-py connected the
    # master, looking the name up again with no deadline (it hangs from then on here).
    resolver.moved = {"two.test": ["127.0.0.3", "127.0.0.1"]}
    resolver.hang_after_failure = "two.test"
    rl = make_redlock(_named(masters, "two.test"), node_timeout=NODE_TIMEOUT)
    took, lease = _timed(lambda: rl.acquire("job", 5))
    assert took < NODE_TIMEOUT + 2.0, took
    assert helpers.value_on(masters[0], helpers.lock_name("job")) == lease.token
    assert resolver.lookups.count("two.test") == 1
    lease.release()


@pytest.mark.parametrize("masters", [7], indirect=True)
def test_names_that_hang_cost_a_connect_one_node_timeout_in_all(
    masters: Masters, resolver: Resolver
) -> None:
    hung = ("h1.test", "h2.test", "h3.test")
    resolver.hung |= set(hung)
    rl = make_redlock(_named(masters, *hung), node_timeout=1.0)
    took, lease = _timed(lambda: rl.acquire("job", 5))
    # Before, one node_timeout per name: 3 s.
    assert took < 2.2, took
    lease.release()


def test_a_name_that_keeps_failing_is_asked_once_a_second_at_most(resolver: Resolver) -> None:
    resolver.failing.add("gone.test")
    for _ in range(20):
        with pytest.raises(socket.gaierror):
            resolve.resolve("gone.test", 1, 0, socket.SOCK_STREAM, 1.0)
    assert resolver.lookups.count("gone.test") == 1


# -- hostile review of the second version ----------------------------------------------------


def test_a_master_named_by_an_invalid_host_name_counts_as_failed(masters: Masters) -> None:
    # idna refuses a 64-character label (UnicodeError, not an OSError): before, the
    # lookups started ahead of the connects let it out of acquire.
    rl = make_redlock(_named(masters, "x" * 64 + ".example"), node_timeout=NODE_TIMEOUT)
    lease = rl.acquire("job", 5)
    assert "not a valid host name" in (rl.masters[0].last_error or ""), rl.masters[0].last_error
    lease.release()


def test_a_connect_interrupted_inside_redis_py_closes_its_socket(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_redlock.lock import master as master_module

    opened: list[Any] = []

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> None:
        opened.append(self)
        raise KeyboardInterrupt  # as a signal handler's, after redis-py took the socket

    monkeypatch.setattr(master_module._Preconnected, "on_connect_check_health", interrupted)
    rl = make_redlock(masters.urls, node_timeout=NODE_TIMEOUT)
    with pytest.raises(KeyboardInterrupt):
        rl.acquire("job", 5)
    assert opened
    # Closed at once, not when the exception and its frames are dropped.
    assert all(conn._sock is None for conn in opened)
