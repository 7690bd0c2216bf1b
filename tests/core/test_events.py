"""The lock core's events (celery_redlock.lock.events): what operators' metrics are made of.

Masters going down and up are reported once per transition, renewals with their round
time and their margin (the validity left when the renewal was sent).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock.exceptions import QuorumUnavailable
from celery_redlock.lock import events
from celery_redlock.testing import Masters, wait_for

from .helpers import make_redlock


class Seen:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **arguments: Any) -> None:
        self.calls.append(arguments)


@pytest.fixture
def seen() -> Iterator[dict[str, Seen]]:
    observers = {name: Seen() for name in events.EVENTS}
    for name, observer in observers.items():
        events.subscribe(name, observer)
    yield observers
    for name, observer in observers.items():
        events.unsubscribe(name, observer)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_master_down_and_up_are_reported_once_per_transition(
    masters: Masters, seen: dict[str, Seen]
) -> None:
    rl = make_redlock(masters)
    rl.acquire("ev-1", 5).release()
    assert seen["master_state"].calls == []
    masters[0].stop()
    for i in range(20):  # 20 rounds with the master down: one "down"
        rl.acquire(f"ev-down-{i}", 5).release()
    downs = [c for c in seen["master_state"].calls if not c["up"]]
    assert len(downs) == 1, seen["master_state"].calls
    assert downs[0]["master"] == rl.masters[0].name
    assert downs[0]["error"]
    assert "@" not in downs[0]["master"]
    masters[0].start()

    def back_up() -> bool:
        try:
            rl.acquire("ev-up", 5).release()
        except QuorumUnavailable:
            return False
        return any(c["up"] for c in seen["master_state"].calls)

    wait_for(back_up, timeout=15, interval=0.05, message="the master reported up again")
    ups = [c for c in seen["master_state"].calls if c["up"]]
    assert len(ups) == 1
    assert ups[0] == {"master": rl.masters[0].name, "up": True, "error": ""}


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_renewals_report_round_time_and_margin(masters: Masters, seen: dict[str, Seen]) -> None:
    rl = make_redlock(masters)
    with rl.lock("ev-renew", 0.6, auto_renew=True) as lease:
        wait_for(lambda: len(seen["lock_renewed"].calls) >= 2, timeout=10, message="renewals")
        assert lease.held
    for call in seen["lock_renewed"].calls[:2]:
        assert call["key"] == "ev-renew"
        assert call["lease"] is lease
        assert 0 <= call["took"] < 0.6
        # Renewed every ttl/3: about 2/3 of the validity is left when the round goes out.
        assert 0 < call["margin"] <= 0.6


def test_an_observer_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken(**_: Any) -> None:
        raise RuntimeError("observer bug")

    events.subscribe("master_state", broken)
    try:
        events.emit("master_state", master="m", up=True, error="")
    finally:
        events.unsubscribe("master_state", broken)
    assert "observer bug" in caplog.text


def test_unknown_events_are_refused() -> None:
    with pytest.raises(ValueError, match="event must be one of master_state, lock_renewed"):
        events.subscribe("master_down", print)
