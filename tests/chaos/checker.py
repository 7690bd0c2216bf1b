"""Check a chaos history: pure Python, no Redis, no Celery.

Input: the events of every process (see :mod:`tests.chaos.history`), ordered by ``t``
(``time.monotonic_ns()``), plus the fenced store's own log (``ev == "store"``, ordered by
its ``seq``) and the final values of the unfenced counters (``ev == "counter_final"``).

Properties (each gets a verdict):

``overlap``            two holders of one key inside their critical sections at once
``overlap_in_validity`` ... while *both* leases were valid by their own deadlines: a
                       violation of Redlock's safety claim (zero unless its assumptions
                       are broken, e.g. a master's clock jumps)
``stale_write_accepted`` the store accepted a write whose fence was below one it had seen
``fence_order``        accepted writes of a key whose fence went down (recomputed from the
                       store's sequence, not from its ``stale`` flag)
``token_order``        a holder that acquired after another finished acquiring got a
                       smaller or equal fence
``lost_update_fenced`` an accepted store write computed from a value that was not current
``lost_update_unfenced`` an unfenced ``SET`` that overwrote another client's increment
``takeover``           time from a holder's SIGKILL to the next acquisition of its key
``call_timing``        a round to the masters that took longer than its node-timeout bound
``no_quorum_run``      a critical section whose acquisition started while no quorum existed
``finished``           a submitted work item (task) that never finished, unless the broker
                       lost its last message (``broker_lost``)
``broker_lost``        a work item whose last message the broker lost: published, never
                       received by a worker, gone at the end, a worker SIGKILLed after its
                       publish (kombu's Redis transport pops a message with BRPOP before
                       it records it in ``unacked``: a worker killed in between loses it).
                       Needs the Celery scenarios' ``publish``/``received``/
                       ``broker_state`` events; the detail also names items still unacked
                       behind a killed worker's restore mutex (not excused)
``recovered``          no critical section completed after the last fault healed, or a
                       client that did not stop when asked (hung)
``beat_once``          a beat occurrence run (or stood for by a coalesced late send)
                       twice, or never

For every property that failed the report carries a timeline of its first violation:
the events of the processes involved (and the faults) around it, in ms from its start.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

__all__ = ["PROPERTIES", "Holder", "Report", "Verdict", "check"]

Event = dict[str, Any]
INF = float("inf")

PROPERTIES = (
    "overlap",
    "overlap_in_validity",
    "stale_write_accepted",
    "fence_order",
    "token_order",
    "lost_update_fenced",
    "lost_update_unfenced",
    "takeover",
    "call_timing",
    "no_quorum_run",
    "finished",
    "broker_lost",
    "recovered",
    "beat_once",
)

#: What a scenario expects of a property: zero violations, some (a negative control, or a
#: fault that breaks Redlock's assumptions: the checker must show it), or anything (info).
NONE, SOME, ANY = "none", "some", "any"


@dataclasses.dataclass
class Holder:
    """One lease: from the successful acquisition to its release, loss or the kill."""

    proc: str
    pid: int
    lease: str
    key: str
    acquired: int  # start of the successful attempt (validity is measured from here)
    acquired_ok: int  # when acquire() returned
    #: (from, deadline) pairs: valid on [from, deadline); deadline None = never expires
    validity: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    end: float = INF  # released, lost or killed: no validity after this
    fence: int | None = None
    cs: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    open_cs: int | None = None

    def valid_intervals(self) -> list[tuple[float, float]]:
        # Each record says "from here on, the deadline is this one" (an extension may set
        # it earlier as well as later): a record's deadline holds until the next record.
        out = []
        records = sorted(self.validity)
        for n, (start, deadline) in enumerate(records):
            until = records[n + 1][0] if n + 1 < len(records) else INF
            hi = min(deadline, self.end, until)
            if hi > start:
                out.append((float(start), hi))
        return _union(out)

    def cs_in_validity(self) -> list[tuple[float, float]]:
        return _intersect(_union([(float(a), b) for a, b in self.cs]), self.valid_intervals())


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersect(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _measure(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


@dataclasses.dataclass
class Verdict:
    name: str
    expect: str
    violations: int
    detail: str = ""
    timeline: str = ""
    #: a number worth reporting beside the count (e.g. the worst takeover, in ms)
    measure: float | None = None
    applicable: bool = True

    @property
    def ok(self) -> bool:
        if not self.applicable or self.expect == ANY:
            return True
        if self.expect == NONE:
            return self.violations == 0
        return self.violations > 0

    @property
    def label(self) -> str:
        if not self.applicable:
            return "n/a"
        if self.expect == ANY:
            return "info"
        if self.expect == NONE:
            return "PASS" if self.violations == 0 else "FAIL"
        return "SHOWN" if self.violations > 0 else "MISSED"


@dataclasses.dataclass
class Report:
    verdicts: dict[str, Verdict]
    holders: int
    events: int
    stats: dict[str, Any]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts.values())

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts.values() if not v.ok]

    def summary(self) -> str:
        """One short line per property (for the verdict table)."""
        parts = []
        for v in self.verdicts.values():
            if not v.applicable:
                continue
            text = f"{v.name}={v.violations}"
            if v.measure is not None:
                text += f"({v.measure:.0f}ms)"
            parts.append(f"{text}:{v.label}")
        return " ".join(parts)

    def format(self) -> str:
        lines = [f"{self.events} events, {self.holders} holders; stats: {self.stats}"]
        for v in self.verdicts.values():
            if not v.applicable:
                continue
            extra = f" [{v.measure:.0f} ms]" if v.measure is not None else ""
            lines.append(
                f"  {v.label:6} {v.name:22} {v.violations:5} (expect {v.expect}){extra} {v.detail}"
            )
        for v in self.verdicts.values():
            if v.applicable and v.timeline and (not v.ok or v.expect != NONE):
                lines.append(f"--- first violation of {v.name}:")
                lines.append(v.timeline)
        return "\n".join(lines)


# -- building holders ------------------------------------------------------------------------


def build_holders(events: Sequence[Event]) -> dict[tuple[str, str], Holder]:
    holders: dict[tuple[str, str], Holder] = {}
    # By pid: a killed client may be started again under the same name.
    kills: dict[int, int] = {}
    for e in events:
        if e["ev"] == "kill" and e.get("target_pid"):
            kills.setdefault(e["target_pid"], e["t"])
    last_t = events[-1]["t"] if events else 0
    for e in events:
        ev = e["ev"]
        if ev == "acq_ok":
            h = Holder(
                proc=e["proc"],
                pid=e["pid"],
                lease=e["lease"],
                key=e["key"],
                acquired=e["start_ns"],
                acquired_ok=e["t"],
            )
            h.validity.append((e["start_ns"], _deadline(e.get("deadline_ns"))))
            holders[(e["proc"], e["lease"])] = h
            continue
        ident = (e.get("proc", ""), e.get("lease", ""))
        h = holders.get(ident)  # type: ignore[assignment]
        if h is None:
            continue
        if ev == "renew":
            h.validity.append((e["t"], _deadline(e.get("deadline_ns"))))
        elif ev in ("lost", "rel_start"):
            h.end = min(h.end, e["t"])
        elif ev == "fence":
            h.fence = int(e["fence"])
        elif ev == "cs_enter":
            h.open_cs = e["t"]
            if e.get("fence") is not None and h.fence is None:
                h.fence = int(e["fence"])
        elif ev in ("cs_exit", "cs_abort") and h.open_cs is not None:
            h.cs.append((h.open_cs, e["t"]))
            h.open_cs = None
    for h in holders.values():
        killed = kills.get(h.pid)
        if killed is not None and killed >= h.acquired:
            h.end = min(h.end, killed)
        if h.open_cs is not None:
            # Never left: until the process was killed, else until the end of the history
            # (a stopped process that was never resumed is still "inside").
            close = killed if killed is not None and killed >= h.open_cs else last_t
            h.cs.append((h.open_cs, float(close)))
            h.open_cs = None
    return holders


def _deadline(value: Any) -> float:
    return INF if value is None else float(value)


# -- timelines -------------------------------------------------------------------------------

_FAULT_EVENTS = {"fault_start", "fault_end", "kill", "quorum_lost", "quorum_back", "spawn"}
_SKIP_FIELDS = {"t", "ev", "proc", "pid"}


def timeline(
    events: Sequence[Event],
    procs: Iterable[str],
    around: tuple[float, float],
    *,
    leases: Iterable[str] = (),
    limit: int = 60,
) -> str:
    """The events of ``procs`` (and every fault) within ``around`` (ns), as text."""
    procs, leases = set(procs), set(leases)
    lo, hi = around
    picked = [
        e
        for e in events
        if lo <= e["t"] <= hi
        and e["ev"] not in ("rpc", "op")
        and (
            e["ev"] in _FAULT_EVENTS
            or (e["ev"] == "store" and e.get("lease") in leases)
            or (
                e.get("proc") in procs
                and (not leases or e.get("lease") in leases or "lease" not in e)
            )
        )
    ]
    if len(picked) > limit:
        picked = picked[: limit // 2] + picked[-limit // 2 :]
    origin = picked[0]["t"] if picked else lo
    lines = []
    for e in picked:
        fields = " ".join(
            f"{k}={_short(v, k, origin)}" for k, v in e.items() if k not in _SKIP_FIELDS
        )
        lines.append(
            f"  {(e['t'] - origin) / 1e6:10.1f} ms  {e.get('proc', '?'):12} {e['ev']:12} {fields}"
        )
    return "\n".join(lines)


def _short(value: Any, key: str, origin: int) -> str:
    if key.endswith("_ns") and isinstance(value, int) and key not in ("dur_ns", "bound_ns"):
        return f"{(value - origin) / 1e6:+.1f}ms"
    if key in ("dur_ns", "bound_ns") and isinstance(value, int):
        return f"{value / 1e6:.1f}ms"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the properties --------------------------------------------------------------------------


def _overlaps(
    events: Sequence[Event], holders: Mapping[tuple[str, str], Holder]
) -> tuple[Verdict, Verdict]:
    by_key: dict[str, list[Holder]] = defaultdict(list)
    for h in holders.values():
        if h.cs:
            by_key[h.key].append(h)
    pairs, in_validity = [], []
    for group in by_key.values():
        spans = sorted(((lo, hi, h) for h in group for lo, hi in h.cs), key=lambda s: (s[0], s[1]))
        active: list[tuple[int, float, Holder]] = []
        for lo, hi, h in spans:
            active = [a for a in active if a[1] > lo]
            for alo, ahi, other in active:
                if other is h:
                    continue
                both = (max(lo, alo), min(hi, ahi))
                pairs.append((both, other, h))
                shared = _intersect(other.cs_in_validity(), h.cs_in_validity())
                if _measure(shared) > 0:
                    in_validity.append((shared[0], other, h))
            active.append((lo, hi, h))
    overlap = Verdict("overlap", NONE, len(pairs))
    valid = Verdict("overlap_in_validity", NONE, len(in_validity))
    for verdict, found in ((overlap, pairs), (valid, in_validity)):
        if found:
            found.sort(key=lambda p: p[0][0])
            (lo, hi), a, b = found[0]
            total = sum(p[0][1] - p[0][0] for p in found) / 1e6
            verdict.detail = (
                f"first on {a.key!r}: {a.proc}/{a.lease} and {b.proc}/{b.lease}, "
                f"{(hi - lo) / 1e6:.1f} ms; {total:.0f} ms in all"
            )
            start = min(a.acquired, b.acquired)
            verdict.timeline = timeline(
                events, (a.proc, b.proc), (start - 50e6, hi + 50e6), leases=(a.lease, b.lease)
            )
    return overlap, valid


def _store(events: Sequence[Event]) -> tuple[Verdict, Verdict, Verdict, Verdict]:
    log = sorted((e for e in events if e["ev"] == "store"), key=lambda e: e["seq"])
    stale = [e for e in log if e["op"] == "write" and e["accepted"] and e["stale"]]
    inversions, lost = [], []
    top: dict[str, int] = {}
    for e in log:
        if not e["accepted"]:
            continue
        fence = int(e["fence"])
        if e["op"] == "write":
            if fence < top.get(e["key"], 0):
                inversions.append(e)
            if str(e.get("based_on")) != str(e.get("current")):
                lost.append(e)
        top[e["key"]] = max(top.get(e["key"], 0), fence)
    applicable = bool(log)
    results = []
    for name, found in (
        ("stale_write_accepted", stale),
        ("fence_order", inversions),
        ("lost_update_fenced", lost),
    ):
        v = Verdict(name, NONE, len(found), applicable=applicable)
        if found:
            first = found[0]
            v.detail = (
                f"first: seq {first['seq']} {first['writer']}/{first['lease']} key "
                f"{first['key']!r} fence {first['fence']} (store had seen {first['max_before']}"
                f"; value {first.get('current')} -> {first.get('value')}, based on "
                f"{first.get('based_on')})"
            )
            window = [e for e in log if e["key"] == first["key"] and e["seq"] <= first["seq"]]
            v.timeline = "\n".join(
                f"  seq {e['seq']:6} {e['op']:5} {e['writer']:12} {e['lease']:14} fence "
                f"{e['fence']} max {e['max_before']} {'ACCEPTED' if e['accepted'] else 'refused'}"
                f"{' STALE' if e['stale'] else ''} cur={e.get('current')} val={e.get('value', '')}"
                for e in window[-12:]
            )
        results.append(v)
    refused = sum(1 for e in log if not e["accepted"])
    info = Verdict("store_refused", ANY, refused, applicable=applicable)
    return results[0], results[1], results[2], info


def _token_order(events: Sequence[Event], holders: Mapping[tuple[str, str], Holder]) -> Verdict:
    by_key: dict[str, list[Holder]] = defaultdict(list)
    for h in holders.values():
        if h.fence is not None and h.fence > 0:
            by_key[h.key].append(h)
    bad: list[tuple[Holder, Holder]] = []
    for group in by_key.values():
        done = sorted(group, key=lambda h: h.acquired_ok)
        ok_times = [h.acquired_ok for h in done]
        # prefix maximum of fences in acquired_ok order
        best: list[tuple[int, Holder]] = []
        for h in done:
            assert h.fence is not None
            if not best or h.fence > best[-1][0]:
                best.append((h.fence, h))
            else:
                best.append(best[-1])
        for h in group:
            n = bisect.bisect_left(ok_times, h.acquired)
            if n and best[n - 1][0] >= h.fence:  # type: ignore[operator]
                bad.append((best[n - 1][1], h))
    v = Verdict("token_order", NONE, len(bad), applicable=bool(by_key))
    if bad:
        bad.sort(key=lambda p: p[1].acquired)
        a, b = bad[0]
        v.detail = (
            f"{a.proc}/{a.lease} acquired {a.key!r} first with fence {a.fence}; "
            f"{b.proc}/{b.lease} acquired after it with fence {b.fence}"
        )
        v.timeline = timeline(
            events,
            (a.proc, b.proc),
            (a.acquired - 10e6, b.acquired_ok + 10e6),
            leases=(a.lease, b.lease),
        )
    return v


def _unfenced(events: Sequence[Event]) -> Verdict:
    writes = [e for e in events if e["ev"] == "ctr_write"]
    lost = [e for e in writes if e["overwrote"] != e["based_on"]]
    finals = {e["key"]: e["value"] for e in events if e["ev"] == "counter_final"}
    done: dict[str, int] = defaultdict(int)
    for e in writes:
        done[e["key"]] += 1
    # A holder killed between its SET and the record adds one more than recorded.
    shortfall = sum(max(0, n - finals.get(k, n)) for k, n in done.items())
    v = Verdict("lost_update_unfenced", NONE, max(len(lost), shortfall), applicable=bool(writes))
    if writes:
        v.detail = (
            f"{len(writes)} increments; {len(lost)} overwrote another's; "
            f"final shortfall {shortfall}"
        )
    if lost:
        first = lost[0]
        v.timeline = timeline(
            events,
            {first["proc"]}
            | {
                e["proc"]
                for e in writes
                if e["key"] == first["key"] and abs(e["t"] - first["t"]) < 5e9
            },
            (first["t"] - 3e9, first["t"] + 10e6),
            limit=40,
        )
    return v


def _takeover(
    events: Sequence[Event],
    holders: Mapping[tuple[str, str], Holder],
    bound_ms: Mapping[str, float] | None,
) -> Verdict:
    kills = [e for e in events if e["ev"] == "kill" and e.get("target")]
    if not kills or bound_ms is None:
        return Verdict("takeover", NONE, 0, applicable=False)
    acquisitions: dict[str, list[Holder]] = defaultdict(list)
    for h in holders.values():
        acquisitions[h.key].append(h)
    for group in acquisitions.values():
        group.sort(key=lambda h: h.acquired_ok)
    worst, slow, measured = 0.0, [], 0
    for kill in kills:
        for h in holders.values():
            if h.pid != kill.get("target_pid") or not (h.acquired_ok <= kill["t"] < h.end + 1):
                continue
            if not h.cs or h.cs[-1][1] < kill["t"]:
                continue  # not inside its critical section: nothing to take over
            bound = bound_ms.get(h.key, bound_ms.get("*", INF))
            later = [o for o in acquisitions[h.key] if o.acquired_ok > kill["t"] and o.pid != h.pid]
            latency = (later[0].acquired_ok - kill["t"]) / 1e6 if later else INF
            measured += 1
            worst = max(worst, latency)
            if latency > bound:
                slow.append((kill, h, latency, bound))
    v = Verdict(
        "takeover", NONE, len(slow), measure=worst if measured else None, applicable=measured > 0
    )
    v.detail = f"{measured} kills of a holder; worst {worst:.0f} ms"
    if slow:
        kill, h, latency, bound = slow[0]
        v.detail += f"; {h.key!r} after killing {h.proc}: {latency:.0f} ms > {bound:.0f} ms"
        v.timeline = timeline(
            events, (h.proc,), (kill["t"] - 1e9, kill["t"] + min(latency, 60e3) * 1e6 + 1e6)
        )
    return v


def _call_timing(events: Sequence[Event], slack_ms: float) -> Verdict:
    rpcs = [e for e in events if e["ev"] == "rpc"]
    slow = [e for e in rpcs if e["dur_ns"] > e["bound_ns"] + slack_ms * 1e6]
    worst = max((e["dur_ns"] / 1e6 for e in rpcs), default=0.0)
    v = Verdict("call_timing", NONE, len(slow), measure=worst, applicable=bool(rpcs))
    if rpcs:
        over = max((e["dur_ns"] - e["bound_ns"]) / 1e6 for e in rpcs)
        v.detail = (
            f"{len(rpcs)} rounds; worst {worst:.0f} ms; worst over its bound {over:+.0f} ms "
            f"(slack {slack_ms:.0f})"
        )
    if slow:
        first = slow[0]
        v.detail += (
            f"; first: {first['proc']} {first['op']} {first['dur_ns'] / 1e6:.0f} ms > "
            f"{first['bound_ns'] / 1e6:.0f} ms"
        )
        v.timeline = timeline(
            events, (first["proc"],), (first["t"] - first["dur_ns"] - 5e6, first["t"] + 5e6)
        )
    return v


def _no_quorum(events: Sequence[Event], holders: Mapping[tuple[str, str], Holder]) -> Verdict:
    windows, start = [], None
    for e in events:
        if e["ev"] == "quorum_lost" and start is None:
            start = e["t"]
        elif e["ev"] == "quorum_back" and start is not None:
            windows.append((start, e["t"]))
            start = None
    if start is not None:
        windows.append((start, INF))
    if not windows:
        return Verdict("no_quorum_run", NONE, 0, applicable=False)
    bad = [(h, w) for h in holders.values() for w in windows if h.cs and w[0] <= h.acquired <= w[1]]
    runs = [
        e
        for e in events
        if e["ev"] == "task_start"
        and any(w[0] <= e.get("acquired_ns", e["t"]) <= w[1] for w in windows)
    ]
    v = Verdict("no_quorum_run", NONE, len(bad) + len(runs))
    v.detail = f"{len(windows)} windows without a quorum"
    if bad:
        h, w = bad[0]
        v.detail += f"; {h.proc}/{h.lease} acquired {h.key!r} inside one"
        v.timeline = timeline(events, (h.proc,), (w[0] - 100e6, h.acquired_ok + 100e6))
    return v


def _missing(events: Sequence[Event]) -> tuple[dict[str, Event], dict[str, int], list[str]]:
    """Submitted items (in submission order), how often each finished, the unfinished."""
    submitted = {e["item"]: e for e in events if e["ev"] == "submit"}
    runs: dict[str, int] = defaultdict(int)
    for e in events:
        if e["ev"] == "done":
            runs[e["item"]] += 1
    return submitted, runs, [i for i in submitted if i not in runs]


def _broker_lost(events: Sequence[Event]) -> tuple[Verdict, set[str]]:
    """Unfinished items whose last message the broker lost or withholds (see the module
    docstring), and the verdict. Not applicable without a ``broker_state`` event."""
    states = [e for e in events if e["ev"] == "broker_state"]
    if not states:
        return Verdict("broker_lost", NONE, 0, applicable=False), set()
    state = states[-1]
    queued, unacked = set(state.get("queued") or ()), set(state.get("unacked") or ())
    mutex_held = (state.get("mutex_pttl_ms") or -2) > 0
    received = {e.get("msg") for e in events if e["ev"] == "received"}
    kills = [e["t"] for e in events if e["ev"] == "kill"]
    last: dict[str, Event] = {}
    gone: list[Event] = []  # published, never received, not in the broker: lost
    for e in events:
        if e["ev"] not in ("submit", "publish") or not e.get("msg"):
            continue
        last[e["item"]] = e
        m = e["msg"]
        lost_here = m not in received and m not in queued and m not in unacked
        if lost_here and any(k > e["t"] for k in kills):
            gone.append(e)
    gone_msgs = {e["msg"] for e in gone}
    _, _, missing = _missing(events)
    lost, withheld = [], []
    for item in missing:
        m = last[item]["msg"] if item in last else None
        if m in gone_msgs:
            lost.append(item)
        elif m in unacked and mutex_held:
            withheld.append(item)
    v = Verdict("broker_lost", NONE, len(lost))
    v.detail = f"{len(gone)} messages lost by the broker ({len(lost)} of them an item's last)"
    if lost:
        v.detail += f": items {sorted(lost)}"
    if withheld:
        # Not excused: the scenario keeps kombu's unacked_mutex_expire short, so this
        # means its settle wait was too short; ``finished`` counts them.
        v.detail += (
            f"; items {sorted(withheld)} still unacked behind a held restore mutex"
            f" ({state.get('mutex_pttl_ms')} ms left)"
        )
    return v, set(lost)


def _finished(events: Sequence[Event], broker_items: Set[str] = frozenset()) -> Verdict:
    submitted, runs, missing = _missing(events)
    unexplained = [i for i in missing if i not in broker_items]
    v = Verdict("finished", NONE, len(unexplained), applicable=bool(submitted))
    if submitted:
        again = sum(1 for i in submitted if runs.get(i, 0) > 1)
        v.detail = (
            f"{len(submitted)} submitted, {len(submitted) - len(missing)} finished"
            f" ({again} finished more than once: at-least-once delivery)"
        )
        if unexplained:
            v.detail += f"; first missing {unexplained[0]}"
        if len(unexplained) < len(missing):
            v.detail += f"; {len(missing) - len(unexplained)} lost by the broker (broker_lost)"
    return v


def _recovered(events: Sequence[Event]) -> Verdict:
    heals = [e["t"] for e in events if e["ev"] in ("fault_end", "quorum_back")]
    clients = {(e["proc"], e["pid"]) for e in events if e["ev"] == "agent_start"}
    if not heals or not clients:
        return Verdict("recovered", NONE, 0, applicable=False)
    healed = max(heals)
    done = [e for e in events if e["ev"] == "cs_exit" and e["t"] > healed]
    hung = [e["target"] for e in events if e["ev"] == "hung"]
    v = Verdict("recovered", NONE, (0 if done else 1) + len(hung))
    v.detail = (
        f"{len(done)} critical sections completed after the last heal; "
        f"clients that did not stop when asked: {hung}"
    )
    return v


_INDEX = re.compile(r"^(.*)#(-?\d+)$")


def _stands_for(e: Event) -> list[str]:
    """The occurrences one beat run accounts for: its own, and for a coalesced late send
    (header ``redlock_catch_up_of``, as the worker left it after the run claims) the
    others it lists. A run that carries only a count (``redlock_catch_up`` = n, no list)
    stands for its own occurrence and the n - 1 before it."""
    own = str(e["occurrence"])
    covers = e.get("covers")
    if covers:
        return [own, *(str(o) for o in covers)]
    n = int(e.get("catch_up") or 1)
    m = _INDEX.match(own)
    if n > 1 and m:
        index = int(m.group(2))
        return [f"{m.group(1)}#{i}" for i in range(index, index - n, -1)]
    return [own]


def _beat(events: Sequence[Event], window: tuple[int, int] | None) -> Verdict:
    """``beat_once``, the documented rule: every occurrence of an entry, from the first
    seen to the last, is accounted for by exactly one run, either its own or a coalesced
    late send that stands for it (``redlock_beat_catch_up = "one"``). Accounted for by
    two runs: duplicated; by none: skipped."""
    runs = [e for e in events if e["ev"] == "beat_run"]
    if not runs:
        return Verdict("beat_once", NONE, 0, applicable=False)
    by: dict[str, list[Event]] = defaultdict(list)
    for e in runs:
        for occurrence in _stands_for(e):
            by[occurrence].append(e)
    dups = {o: rs for o, rs in by.items() if len(rs) > 1}
    indices: dict[str, set[int]] = defaultdict(set)
    for occurrence in by:
        m = _INDEX.match(occurrence)
        if m:
            indices[m.group(1)].add(int(m.group(2)))
    gaps = []
    for entry, seen in sorted(indices.items()):
        gaps += [f"{entry}#{i}" for i in range(min(seen), max(seen) + 1) if i not in seen]
    v = Verdict("beat_once", NONE, sum(len(r) - 1 for r in dups.values()) + len(gaps))
    coalesced = sum(1 for e in runs if len(_stands_for(e)) > 1)
    v.detail = (
        f"{len(by)} occurrences, {len(runs)} runs ({coalesced} coalesced); "
        f"{len(dups)} duplicated, {len(gaps)} skipped"
    )
    if dups:
        first_o, first = min(dups.items(), key=lambda item: item[1][1]["t"])
        v.detail += f"; first duplicate {first_o} by {[e['proc'] for e in first]}"
        v.timeline = timeline(
            events, {e["proc"] for e in first}, (first[0]["t"] - 5e9, first[-1]["t"] + 1e6)
        )
    elif gaps:
        v.detail += f"; first skipped {gaps[0]}"
    return v


def check(
    events: Sequence[Event],
    *,
    expect: Mapping[str, str] | None = None,
    takeover_bound_ms: Mapping[str, float] | None = None,
    call_slack_ms: float = 150.0,
) -> Report:
    """Check ``events`` (any order; sorted here) and return a :class:`Report`.

    ``expect`` maps a property to ``"none"`` (default), ``"some"`` or ``"any"``;
    ``takeover_bound_ms`` maps a key (or ``"*"``) to the longest acceptable takeover.
    """
    events = sorted(events, key=lambda e: e["t"])
    holders = build_holders(events)
    overlap, valid = _overlaps(events, holders)
    stale, order, lost_fenced, refused = _store(events)
    broker, broker_items = _broker_lost(events)
    verdicts = [
        overlap,
        valid,
        stale,
        order,
        _token_order(events, holders),
        lost_fenced,
        _unfenced(events),
        _takeover(events, holders, takeover_bound_ms),
        _call_timing(events, call_slack_ms),
        _no_quorum(events, holders),
        _finished(events, broker_items),
        broker,
        _recovered(events),
        _beat(events, None),
    ]
    out = {v.name: v for v in verdicts}
    for name, wanted in (expect or {}).items():
        if name not in out:
            raise KeyError(f"unknown property {name!r}; known: {', '.join(PROPERTIES)}")
        out[name].expect = wanted
    stats = {
        "acquired": len(holders),
        "in_cs": sum(1 for h in holders.values() if h.cs),
        "store_refused": refused.violations,
        "lost": sum(1 for e in events if e["ev"] == "lost"),
        "contended": sum(
            1 for e in events if e["ev"] == "acq_fail" and e.get("error") == "contended"
        ),
        "unavailable": sum(
            1 for e in events if e["ev"] == "acq_fail" and e.get("error") == "unavailable"
        ),
    }
    return Report(out, holders=len(holders), events=len(events), stats=stats)
