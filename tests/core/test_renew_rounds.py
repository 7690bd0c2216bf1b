"""The renewal engine's rounds: at most ``RENEW_ROUND`` leases each, and every lease's
outcome counted right whether its masters extended all leases or only some.

A round waits ``node_timeout`` for its replies whatever it carries: one round of 10,000
extensions kept each master busy past 0.25 s on a slow 2-core host (the renewal
benchmark logged its masters as not answering, and the renewals they made were not
counted). The rounds are now cut at ``RENEW_ROUND`` leases.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redlock.lock import redlock as redlock_module
from celery_redlock.testing import Masters

from . import helpers
from .helpers import make_redlock


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def test_a_renewal_of_many_leases_is_sent_in_rounds_of_renew_round(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redlock_module, "RENEW_ROUND", 3)
    rl = make_redlock(masters)
    leases = [rl.acquire(f"many:{i}", 30) for i in range(7)]
    rounds: list[int] = []
    real_round = rl._round

    def counting(lane: Any, payloads: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("valid") is redlock_module._renew_replies:
            rounds.append(payloads[0][0].count(b"EVALSHA"))
        return real_round(lane, payloads, *args, **kwargs)

    monkeypatch.setattr(rl, "_round", counting)
    assert rl._renew_many(leases, [30.0] * 7) == ["ok"] * 7
    assert len(rounds) == 3  # 3 + 3 + 1 leases
    assert all(lease.held for lease in leases)
    for lease in leases:
        lease.release()


@given(st.lists(st.sets(st.integers(0, 2)), min_size=1, max_size=6))
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_each_lease_is_counted_by_the_masters_that_still_know_it(
    masters: Masters, deleted_on: list[set[int]]
) -> None:
    # Lease j's keys are deleted on the masters in deleted_on[j] before its renewal: it is
    # renewed where a quorum still has it, "gone" where a quorum no longer does. Masters
    # that extended every lease take the shortcut; the others are counted lease by lease.
    helpers.forget_masters()
    rl = make_redlock(masters)
    leases = [rl.acquire(f"mixed:{j}", 30) for j in range(len(deleted_on))]
    try:
        for lease, where in zip(leases, deleted_on, strict=True):
            for i in where:
                with masters[i].client() as conn:
                    conn.delete(rl.lock_key(lease.key))
        outcomes = rl._renew_many(leases, [30.0] * len(leases))
        for where, outcome in zip(deleted_on, outcomes, strict=True):
            if len(where) <= 1:  # still on a quorum of 3
                assert outcome == "ok", (deleted_on, outcomes)
            else:
                assert outcome == "gone", (deleted_on, outcomes)
    finally:
        for lease in leases:
            lease.release()
