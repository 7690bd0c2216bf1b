"""Counterexamples the model checker found, kept as ordinary tests.

Each test replays one shrunk sequence of ``tests/core/test_model.py``'s state machine, step
by step, with every invariant checked after each step, as Hypothesis ran it. The
timelines they were found with are in ``docs/model-check-results.txt`` ("negative control
on afa3165").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .model import machine
from .model import world as world_module
from .model.machine import LockModel

pytestmark = pytest.mark.chaos

Step = Callable[[LockModel, dict[str, object]], object]


@pytest.fixture(scope="module")
def model_world() -> Iterator[world_module.World]:
    with world_module.world() as w:
        yield w


def replay(steps: list[Step]) -> None:
    """Run ``steps`` on a fresh model, checking the invariants after each, then tear down."""
    model = LockModel()
    names: dict[str, object] = {}
    try:
        model.start()
        check(model)
        for step in steps:
            step(model, names)
            check(model)
    except BaseException:
        model._cleanup()
        raise
    model.teardown()


def check(model: LockModel) -> None:
    model.one_holder_per_key()
    model.held_leases_are_backed_by_a_quorum()
    model.heartbeat_alive_while_renewing()


@pytest.mark.usefixtures("model_world")
def test_extend_to_a_shorter_ttl_sets_that_deadline() -> None:
    """(1) ``extend(shorter)`` kept the old local deadline while the masters' expiry shrank."""
    replay(
        [
            lambda m, n: n.update(l0=m.acquire(client="A", key="job", ttl=1.0)),
            lambda m, n: m.extend(ticket=n["l0"], ttl=0.5),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_extend_to_a_shorter_ttl_leaves_no_lease_without_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(1) as the masters see it (the extension's deadline check off): the lease reads held
    after its key expired on every master, so any client can take the key."""
    monkeypatch.setattr(machine, "DISABLED", frozenset({"extend_contract"}))
    replay(
        [
            lambda m, n: n.update(l0=m.acquire(client="A", key="job", ttl=1.0)),
            lambda m, n: m.extend(ticket=n["l0"], ttl=0.5),
            lambda m, n: m.idle(seconds=0.3),
            lambda m, n: m.idle(seconds=0.3),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_blocking_retry_on_another_lane_is_not_undone_by_its_own_late_release() -> None:
    """(2) One token for every attempt of a blocking acquire: the first attempt's undo,
    held on lane 1's connection, lands after the retry on lane 0 counted that master."""
    replay(
        [
            lambda m, n: m.path_fault(client="A", m=2, mode="refuse"),
            lambda m, n: m.hold_requests(client="A", lane=1, m=0),
            lambda m, n: n.update(l0=m.acquire_blocking_busy_lane(key="job", ttl=4.0, timeout=1.0)),
            lambda m, n: m.flow(),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_blocking_retry_as_the_search_found_it() -> None:
    """(2) as the long profile's search found it (its no-op steps removed): A's own
    expiring lease is the contention, a black hole and held requests the faults."""
    replay(
        [
            lambda m, n: n.update(l0=m.acquire(client="A", key="job", ttl=1.0)),
            lambda m, n: m.path_fault(client="A", m=0, mode="blackhole"),
            lambda m, n: m.hold_requests(client="A", lane=1, m=2),
            lambda m, n: m.acquire_blocking_busy_lane(key="job", ttl=1.0, timeout=0.5),
            lambda m, n: m.acquire(client="A", key="job", ttl=1.0),
            lambda m, n: m.acquire(client="A", key="job", ttl=1.0),
            lambda m, n: m.hold_requests(client="A", lane=0, m=0),
            lambda m, n: m.acquire_blocking_busy_lane(key="job", ttl=4.0, timeout=0.5),
            lambda m, n: m.flow(),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_a_renewal_capped_by_max_hold_sets_that_deadline() -> None:
    """(5, found by the CI profile with trial fixes for 1-4) The heartbeat's last renewals
    under ``max_hold`` send a shorter TTL (what is left of ``max_hold``); the masters' key
    expires with it, but the lease kept its longer deadline (``_set_deadline`` keeps the
    later one on this path too), so it reads held after every master dropped its key."""
    replay(
        [
            lambda m, n: n.update(
                l0=m.acquire_auto_renew(client="A", key="job", ttl=2.0, max_hold=1.5)
            ),
            lambda m, n: m.idle(seconds=1.2),
            lambda m, n: m.idle(seconds=0.3),
            lambda m, n: m.idle(seconds=0.3),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_a_master_answering_garbage_is_one_unreachable_master() -> None:
    """(3) ``HTTP/1.1 400`` from one master of three made the acquire raise ValueError."""
    replay(
        [
            lambda m, n: m.path_fault(client="A", m=0, mode="garbage"),
            lambda m, n: m.acquire_blocking(client="A", key="job", ttl=1.0, timeout=0.3),
        ]
    )


@pytest.mark.usefixtures("model_world")
def test_a_huge_ttl_does_not_stop_the_heartbeat() -> None:
    """(4) ``acquire(ttl=1e11, auto_renew=True)``: the engine's wait overflowed and its
    thread died; refusing the TTL (ValueError) passes too."""
    replay([lambda m, n: m.acquire_huge_ttl()])
