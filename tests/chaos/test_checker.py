"""The history checker on synthetic histories: each property passes a good history and
catches the bad one built to break it (a checker that cannot fail proves nothing)."""

from __future__ import annotations

from typing import Any

import pytest

from .checker import ANY, NONE, SOME, check

pytestmark = pytest.mark.chaos

MS = 1_000_000


class H:
    """Builds a history: ``h.at(ms, proc, ev, **fields)``; times in ms, stored in ns."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}

    def at(self, ms: float, proc: str, ev: str, **fields: Any) -> H:
        pid = self.pids.setdefault(proc, 100 + len(self.pids))
        self.events.append({"t": int(ms * MS), "ev": ev, "proc": proc, "pid": pid, **fields})
        return self

    def hold(
        self,
        proc: str,
        lease: str,
        start: float,
        end: float,
        *,
        ttl: float | None = 1000,
        key: str = "k",
        fence: int | None = None,
        exit_ev: str = "cs_exit",
    ) -> H:
        """``proc`` acquires at ``start`` (valid ``ttl`` ms, None = forever), is inside its
        critical section until ``end`` and releases then."""
        self.at(
            start,
            proc,
            "acq_ok",
            key=key,
            lease=lease,
            start_ns=int(start * MS),
            deadline_ns=None if ttl is None else int((start + ttl) * MS),
        )
        if fence is not None:
            self.at(start + 0.1, proc, "fence", key=key, lease=lease, fence=fence)
        self.at(start + 0.2, proc, "cs_enter", key=key, lease=lease, fence=fence)
        if exit_ev:
            self.at(end, proc, exit_ev, key=key, lease=lease)
            self.at(end + 0.1, proc, "rel_start", key=key, lease=lease)
        return self

    def store(
        self,
        seq: int,
        op: str,
        fence: int,
        *,
        max_before: int,
        accepted: bool,
        current: int = 0,
        based_on: int | None = None,
        value: int | None = None,
        key: str = "k",
        writer: str = "a",
        lease: str = "x",
    ) -> H:
        stale = fence < max_before
        entry: dict[str, Any] = {
            "seq": seq,
            "op": op,
            "key": key,
            "fence": str(fence),
            "max_before": str(max_before),
            "stale": stale,
            "accepted": accepted,
            "current": str(current),
            "writer": writer,
            "lease": lease,
        }
        if op == "write" and accepted:
            entry.update(value=str(value), based_on=str(based_on))
        self.events.append({"t": 10**15 + seq, "ev": "store", "proc": "store", "pid": 1, **entry})
        return self


def verdict(h: H, name: str, **kwargs: Any) -> Any:
    return check(h.events, **kwargs).verdicts[name]


# -- overlaps --------------------------------------------------------------------------------


def test_sequential_holders_pass() -> None:
    h = H().hold("a", "A", 0, 100).hold("b", "B", 200, 300).hold("a", "C", 400, 500)
    report = check(h.events)
    assert report.ok, report.format()
    assert report.verdicts["overlap"].violations == 0
    assert report.holders == 3


def test_overlap_within_validity_is_caught_with_a_timeline() -> None:
    h = H().hold("a", "A", 0, 500).hold("b", "B", 200, 300)
    report = check(h.events)
    assert report.verdicts["overlap"].violations == 1
    v = report.verdicts["overlap_in_validity"]
    assert v.violations == 1
    assert not v.ok
    assert v.label == "FAIL"
    assert "a/A and b/B" in v.detail
    assert "cs_enter" in v.timeline
    assert "b " in v.timeline
    assert "first violation of overlap_in_validity" in report.format()


def test_overlap_after_validity_ran_out_is_an_overlap_but_not_within_validity() -> None:
    # A's lease (ttl 100 ms) ran out at 100; B acquired at 150 while A was still inside
    # (a paused holder): shown, but Redlock's claim is not broken.
    h = H().hold("a", "A", 0, 500, ttl=100).hold("b", "B", 150, 300)
    report = check(h.events)
    assert report.verdicts["overlap"].violations == 1
    assert report.verdicts["overlap_in_validity"].violations == 0


def test_a_renewal_extends_validity() -> None:
    h = H().hold("a", "A", 0, 500, ttl=100)
    h.at(80, "a", "renew", key="k", lease="A", deadline_ns=400 * MS)
    h.hold("b", "B", 150, 300)
    assert verdict(h, "overlap_in_validity").violations == 1


def test_a_loss_ends_validity_before_its_deadline() -> None:
    h = H().hold("a", "A", 0, 500, ttl=1000)
    h.at(100, "a", "lost", key="k", lease="A", reason="gone")
    h.hold("b", "B", 150, 300)
    assert verdict(h, "overlap").violations == 1
    assert verdict(h, "overlap_in_validity").violations == 0


def test_a_lease_believed_forever_overlaps_within_validity() -> None:
    # The broken lock records no deadline: it believes it holds the lock until released.
    h = H().hold("a", "A", 0, 5000, ttl=None).hold("b", "B", 3000, 3100)
    assert verdict(h, "overlap_in_validity").violations == 1


def test_different_keys_never_overlap() -> None:
    h = H().hold("a", "A", 0, 500, key="k1").hold("b", "B", 100, 300, key="k2")
    assert verdict(h, "overlap").violations == 0


def test_a_killed_holder_leaves_its_critical_section_at_the_kill() -> None:
    h = H().hold("a", "A", 0, 0, exit_ev="")
    h.at(50, "injector", "kill", target="a", target_pid=h.pids["a"])
    h.hold("b", "B", 1100, 1200)
    assert check(h.events).verdicts["overlap"].violations == 0
    # Without the kill record, the critical section never ends: an overlap.
    h2 = H().hold("a", "A", 0, 0, exit_ev="").hold("b", "B", 1100, 1200)
    assert check(h2.events).verdicts["overlap"].violations == 1


def test_a_restarted_client_under_the_same_name_is_a_new_process() -> None:
    h = H().hold("a", "A", 0, 0, exit_ev="")
    h.at(50, "injector", "kill", target="a", target_pid=h.pids["a"])
    h.pids["a"] = 999  # started again: new pid, same name
    h.hold("a", "A2", 1100, 1200).hold("b", "B", 1300, 1400)
    assert check(h.events).verdicts["overlap"].violations == 0


def test_an_aborted_critical_section_ends_at_the_abort() -> None:
    h = H().hold("a", "A", 0, 120, ttl=100, exit_ev="cs_abort").hold("b", "B", 150, 300)
    assert verdict(h, "overlap").violations == 0


# -- the store's log ----------------------------------------------------------------------------


def test_fenced_writes_in_order_pass() -> None:
    h = H()
    h.store(1, "read", 10, max_before=0, accepted=True, current=0)
    h.store(2, "write", 10, max_before=10, accepted=True, current=0, based_on=0, value=1)
    h.store(3, "read", 11, max_before=10, accepted=True, current=1)
    h.store(4, "write", 11, max_before=11, accepted=True, current=1, based_on=1, value=2)
    h.store(5, "write", 10, max_before=11, accepted=False, current=2)  # refused: fine
    report = check(h.events)
    for name in ("stale_write_accepted", "fence_order", "lost_update_fenced"):
        assert report.verdicts[name].violations == 0, report.format()
    assert report.stats["store_refused"] == 1


def test_an_accepted_stale_write_is_caught_twice_independently() -> None:
    h = H()
    h.store(1, "read", 10, max_before=0, accepted=True, current=0)
    h.store(2, "read", 11, max_before=10, accepted=True, current=0)
    h.store(3, "write", 11, max_before=11, accepted=True, current=0, based_on=0, value=1)
    # fencing off: the stale holder's write goes in
    h.store(
        4, "write", 10, max_before=11, accepted=True, current=1, based_on=0, value=1, writer="old"
    )
    report = check(h.events)
    assert report.verdicts["stale_write_accepted"].violations == 1
    assert report.verdicts["fence_order"].violations == 1
    assert report.verdicts["lost_update_fenced"].violations == 1
    assert "seq 4 old" in report.verdicts["stale_write_accepted"].detail
    assert "ACCEPTED STALE" in report.verdicts["stale_write_accepted"].timeline


def test_fence_order_does_not_trust_the_stores_stale_flag() -> None:
    h = H()
    h.store(1, "write", 11, max_before=0, accepted=True, current=0, based_on=0, value=1)
    entry = h.store(2, "write", 10, max_before=0, accepted=True, current=1, based_on=1, value=2)
    assert entry.events[-1]["stale"] is False  # the store (wrongly) saw nothing newer
    assert verdict(h, "fence_order").violations == 1
    assert verdict(h, "stale_write_accepted").violations == 0


# -- tokens -------------------------------------------------------------------------------------


def test_token_order_across_holders() -> None:
    good = H().hold("a", "A", 0, 100, fence=5).hold("b", "B", 200, 300, fence=7)
    assert verdict(good, "token_order").violations == 0
    bad = H().hold("a", "A", 0, 100, fence=9).hold("b", "B", 200, 300, fence=7)
    v = verdict(bad, "token_order")
    assert v.violations == 1
    assert "fence 9" in v.detail
    assert "fence 7" in v.detail
    same = H().hold("a", "A", 0, 100, fence=7).hold("b", "B", 200, 300, fence=7)
    assert verdict(same, "token_order").violations == 1


def test_token_order_ignores_holders_acquiring_at_the_same_time() -> None:
    # B started its successful attempt before A's acquire returned: no order between them.
    h = H().hold("a", "A", 100, 200, fence=9)
    h.at(50, "b", "acq_ok", key="k", lease="B", start_ns=50 * MS, deadline_ns=10**12)
    h.at(300, "b", "fence", key="k", lease="B", fence=3)
    assert verdict(h, "token_order").violations == 0


# -- lost updates on the unfenced counter ----------------------------------------------------


def test_unfenced_lost_update() -> None:
    h = H()
    h.at(1, "a", "ctr_write", key="k", based_on=0, overwrote=0, value=1)
    h.at(2, "b", "ctr_write", key="k", based_on=0, overwrote=1, value=1)
    h.at(3, "store", "counter_final", key="k", value=1)
    v = verdict(h, "lost_update_unfenced")
    assert v.violations == 1
    assert "b " in v.timeline


def test_unfenced_shortfall_counts_every_update_lost_to_one_write() -> None:
    h = H()
    h.at(1, "b", "ctr_write", key="k", based_on=0, overwrote=0, value=1)
    h.at(2, "c", "ctr_write", key="k", based_on=1, overwrote=1, value=2)
    h.at(3, "a", "ctr_write", key="k", based_on=0, overwrote=2, value=1)  # read 0 long ago
    h.at(4, "store", "counter_final", key="k", value=1)
    assert verdict(h, "lost_update_unfenced").violations == 2


def test_unfenced_counter_intact() -> None:
    h = H()
    for i in range(3):
        h.at(i, "a", "ctr_write", key="k", based_on=i, overwrote=i, value=i + 1)
    h.at(9, "store", "counter_final", key="k", value=3)
    assert verdict(h, "lost_update_unfenced").violations == 0


# -- takeover, call timing, quorum, liveness ----------------------------------------------------


def _killed_holder(next_at: float) -> H:
    h = H().hold("a", "A", 0, 0, exit_ev="")
    h.at(100, "injector", "kill", target="a", target_pid=h.pids["a"])
    h.hold("b", "B", next_at, next_at + 10)
    return h


def test_takeover_within_the_bound() -> None:
    v = verdict(_killed_holder(1100), "takeover", takeover_bound_ms={"*": 1500})
    assert v.violations == 0
    assert v.applicable
    assert v.measure == pytest.approx(1000, abs=1)


def test_takeover_too_slow() -> None:
    v = verdict(_killed_holder(3100), "takeover", takeover_bound_ms={"*": 1500})
    assert v.violations == 1
    assert "3000 ms > 1500 ms" in v.detail


def test_takeover_that_never_happens_is_a_violation() -> None:
    h = H().hold("a", "A", 0, 0, exit_ev="")
    h.at(100, "injector", "kill", target="a", target_pid=h.pids["a"])
    assert verdict(h, "takeover", takeover_bound_ms={"*": 1500}).violations == 1


def test_call_timing() -> None:
    h = H()
    h.at(100, "a", "rpc", op="acquire", dur_ns=90 * MS, bound_ns=100 * MS, connects=0, codes="111")
    assert verdict(h, "call_timing", call_slack_ms=50).violations == 0
    h.at(900, "a", "rpc", op="renew", dur_ns=400 * MS, bound_ns=100 * MS, connects=0, codes="1EE")
    v = verdict(h, "call_timing", call_slack_ms=50)
    assert v.violations == 1
    assert "renew 400 ms > 100 ms" in v.detail


def test_acquiring_without_a_quorum() -> None:
    h = H().at(100, "injector", "quorum_lost").at(900, "injector", "quorum_back")
    h.hold("a", "A", 50, 80).hold("b", "B", 1000, 1100)
    assert verdict(h, "no_quorum_run").violations == 0
    h.hold("c", "C", 400, 450)
    v = verdict(h, "no_quorum_run")
    assert v.violations == 1
    assert "c/C" in v.detail


def test_every_submitted_item_finishes() -> None:
    h = H().at(0, "t", "submit", item="i1").at(0, "t", "submit", item="i2")
    h.at(5, "w", "done", item="i1")
    v = verdict(h, "finished")
    assert v.violations == 1
    assert "i2" in v.detail
    h.at(6, "w", "done", item="i2").at(7, "w", "done", item="i2")  # twice is fine
    assert verdict(h, "finished").violations == 0


def test_a_message_the_broker_lost_is_told_from_a_dropped_job() -> None:
    """``i1``'s last message was published, never received, and is gone from the broker
    after a worker was SIGKILLed: the broker lost it (broker_lost, not finished). ``i2``'s
    was received and then nothing: the library dropped it (finished)."""
    h = H().at(0, "t", "submit", item="i1", msg="m1").at(0, "t", "submit", item="i2", msg="m2")
    h.at(1, "w0", "received", msg="m1").at(1, "w0", "received", msg="m2")
    h.at(2, "w0", "publish", item="i1", msg="m1b").at(2, "w0", "publish", item="i2", msg="m2b")
    h.at(3, "w1", "received", msg="m2b")
    h.at(4, "t", "kill", target="w0")
    h.at(9, "t", "broker_state", queued=[], unacked=[], mutex_pttl_ms=-2)
    lost, finished = verdict(h, "broker_lost"), verdict(h, "finished")
    assert (lost.violations, finished.violations) == (1, 1)
    assert "['i1']" in lost.detail
    assert "first missing i2" in finished.detail
    assert "1 lost by the broker" in finished.detail


def test_a_message_still_in_the_broker_is_not_lost_by_it() -> None:
    """Queued, or unacked behind a killed worker's restore mutex: the broker still holds
    it, so the item counts as unfinished (the settle wait was too short), named in the
    broker_lost detail; and without a broker_state event broker_lost does not apply."""
    h = H().at(0, "t", "submit", item="i1", msg="m1").at(0, "t", "submit", item="i2", msg="m2")
    h.at(1, "w0", "received", msg="m2").at(4, "t", "kill", target="w0")
    assert not verdict(h, "broker_lost").applicable
    assert verdict(h, "finished").violations == 2
    h.at(9, "t", "broker_state", queued=["m1"], unacked=["m2"], mutex_pttl_ms=200_000)
    lost, finished = verdict(h, "broker_lost"), verdict(h, "finished")
    assert (lost.violations, finished.violations) == (0, 2)
    assert "['i2'] still unacked behind a held restore mutex" in lost.detail


def test_recovered_after_the_faults() -> None:
    h = H().at(0, "a", "agent_start").hold("a", "A", 10, 20)
    h.at(30, "injector", "fault_start", fault="x").at(40, "injector", "fault_end", fault="x")
    assert verdict(h, "recovered").violations == 1
    h.hold("a", "B", 50, 60)
    assert verdict(h, "recovered").violations == 0
    h.at(70, "injector", "hung", target="a")
    assert verdict(h, "recovered").violations == 1


def test_beat_occurrences() -> None:
    h = H()
    for i in range(4):
        h.at(i * 1000, "w", "beat_run", entry="e", occurrence=f"e#{i}")
    assert verdict(h, "beat_once").violations == 0
    h.at(5000, "w", "beat_run", entry="e", occurrence="e#2")  # twice
    h.at(7000, "w", "beat_run", entry="e", occurrence="e#6")  # 4, 5 skipped
    v = verdict(h, "beat_once")
    assert v.violations == 3
    assert "1 duplicated, 2 skipped" in v.detail
    # a coalesced late send of e#9 standing for 3 (e#7, e#8, e#9): nothing more skipped
    h.at(9000, "w", "beat_run", entry="e", occurrence="e#9", catch_up=3)
    assert verdict(h, "beat_once").violations == 3
    h.at(11000, "w", "beat_run", entry="e", occurrence="e#12", catch_up=2)  # e#10 skipped
    assert "1 duplicated, 3 skipped" in verdict(h, "beat_once").detail


def test_beat_coalesced_sends_account_for_each_occurrence_once() -> None:
    """The documented rule: each occurrence is run, or stood for by one coalesced late
    send (the ``redlock_catch_up_of`` list the worker left), exactly once."""
    h = H()
    h.at(0, "w", "beat_run", entry="e", occurrence="e#0")
    # e#1 was claimed by a beat that died before publishing it: the late send lists it.
    h.at(1000, "w", "beat_run", entry="e", occurrence="e#3", catch_up=3, covers=["e#2", "e#1"])
    assert verdict(h, "beat_once").violations == 0
    # A count alone (no list) stands for the n - 1 before it.
    h.at(2000, "w", "beat_run", entry="e", occurrence="e#5", catch_up=2)
    assert verdict(h, "beat_once").violations == 0
    # A list need not be contiguous (e#6 ran under its own message first).
    h.at(3000, "w", "beat_run", entry="e", occurrence="e#6")
    h.at(4000, "w", "beat_run", entry="e", occurrence="e#8", catch_up=2, covers=["e#7"])
    assert verdict(h, "beat_once").violations == 0
    # Stood for by a late send *and* run on its own: twice.
    h.at(5000, "w", "beat_run", entry="e", occurrence="e#7")
    v = verdict(h, "beat_once")
    assert v.violations == 1
    assert "1 duplicated, 0 skipped" in v.detail
    assert "first duplicate e#7" in v.detail


def test_beat_a_late_send_that_does_not_list_a_claimed_occurrence_skips_it() -> None:
    """The s15 failure: e#11 was claimed by the killed leader, the late send of e#13 stood
    for e#12 and e#13 only."""
    h = H()
    h.at(0, "w", "beat_run", entry="e1", occurrence="e1#10")
    h.at(3000, "w", "beat_run", entry="e1", occurrence="e1#13", catch_up=2, covers=["e1#12"])
    v = verdict(h, "beat_once")
    assert v.violations == 1
    assert "first skipped e1#11" in v.detail


# -- expectations --------------------------------------------------------------------------------


def test_expected_violations_must_be_shown() -> None:
    clean = H().hold("a", "A", 0, 100).hold("b", "B", 200, 300)
    report = check(clean.events, expect={"overlap": SOME})
    assert not report.ok
    assert report.verdicts["overlap"].label == "MISSED"
    dirty = H().hold("a", "A", 0, 500).hold("b", "B", 200, 300)
    report = check(dirty.events, expect={"overlap": SOME, "overlap_in_validity": ANY})
    assert report.ok, report.format()
    assert report.verdicts["overlap"].label == "SHOWN"
    assert report.verdicts["overlap_in_validity"].label == "info"
    assert report.verdicts["stale_write_accepted"].expect == NONE


def test_unknown_property_is_an_error() -> None:
    with pytest.raises(KeyError, match="unknown property"):
        check([], expect={"nope": NONE})


def test_a_torn_last_line_is_skipped(tmp_path: Any) -> None:
    from .history import History, load

    path = tmp_path / "h.jsonl"
    hist = History(path, "a")
    hist.write("x", n=1)
    hist.close()
    with path.open("ab") as f:
        f.write(b'{"t": 5, "ev": "y", "pro')  # a writer killed mid-line
    events = load(path)
    assert [e["ev"] for e in events] == ["x"]
    assert events[0]["proc"] == "a"
    assert isinstance(events[0]["t"], int)


def test_takeover_by_the_killed_client_started_again() -> None:
    h = H().hold("a", "A", 0, 0, exit_ev="")
    h.at(100, "injector", "kill", target="a", target_pid=h.pids["a"])
    h.pids["a"] = 999  # same name, new process
    h.hold("a", "A2", 1200, 1300)
    v = verdict(h, "takeover", takeover_bound_ms={"*": 1500})
    assert v.violations == 0
    assert v.measure == pytest.approx(1100, abs=1)
