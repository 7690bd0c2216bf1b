"""The lock's model checker: a Hypothesis state machine over real masters and real faults.

Clients: ``A`` (one :class:`Redlock` shared by threads: a blocking acquire can run while
another thread keeps lane 0 busy), ``B`` (a separate client), ``C`` (a separate client on
an injectable clock, for pauses) and forked children of the test process (on ``A``).
Rules acquire, extend, release, read fences, renew, fork; fault rules stop and restart
masters and drive the fault proxy per (client, master) and per connection.

What is checked after every step (and, for mutual exclusion, every few milliseconds by a
monitor thread):

* **one holder**: no two leases of one key both report ``held`` at one instant. "At one
  instant" means: a pass reads ``held`` of every live lease, a second pass right after
  reads them again; two leases of one key held in both passes were both held at every
  instant between the passes (a lease once released or lost never reads held again, and
  its validity only moves by an extension a quorum confirmed);
* **backed by a quorum**: a lease held throughout a read of the masters (its deadline lies
  after the read) has its token on a quorum of them. A master that cannot be read (stopped)
  counts as backing it, and so does a master restarted since the lease was acquired (the
  client keeps it out of every quorum for the longest TTL: "delayed restart"). This is the
  state from which a second client *can* get in; finding it needs no second acquire;
* **extend**: after a confirmed ``extend(ttl)`` the deadline is that extension's validity,
  ``start + ttl - drift`` with ``start`` between the call and its return (never the later
  of the old and new deadlines);
* **fences**: each fence granted is larger than every fence granted before on that key;
* **release** never raises, and returns a bool;
* **bounded calls**: every call returns within its bound (a few ``node_timeout`` s;
  a blocking acquire within its timeout plus that);
* **only documented errors**: ``LockContended``, ``QuorumUnavailable``, ``LockLost``
  where the contract names them; anything else (a parser error from a garbage reply) fails;
* **heartbeat**: whenever a lease is auto-renewed the engine thread is alive, and a lease
  taken with a huge TTL is either refused (``ValueError``) or leaves the engine renewing;
* at the end of an example, once every lease is released and faults are healed, no lock
  key is left on any master after the longest TTL used (polled with a deadline).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from celery_redlock.exceptions import LockContended, LockLost, QuorumUnavailable
from celery_redlock.keys import redis_key
from celery_redlock.lock import Lease, Redlock, heartbeat

from .child import CHILD_BUDGET, run_child
from .world import CLIENTS, MASTERS, PREFIX, Held, Timeline, World, current_world

__all__ = ["NODE_TIMEOUT", "LockModel"]

T = TypeVar("T")

NODE_TIMEOUT = 0.2
#: What a loaded 2-core machine may add to one bounded call.
SLACK = 0.6
#: How long the lane-0 user of :meth:`LockModel.acquire_blocking_busy_lane` keeps it
#: after the acquire started: less than a round that waits for a master.
BUSY = NODE_TIMEOUT / 2
KEYS = ("job", "job", "job", "aux")
TTLS = (1.0, 2.0, 4.0)
QUORUM = MASTERS // 2 + 1

#: Rules and fault modes to leave out (``REDLOCK_MODEL_DISABLE=extend,huge,garbage``):
#: the search stops at the first broken promise, so hunting one bug behind an easier one
#: means switching the easier one off.
DISABLED = frozenset(filter(None, os.environ.get("REDLOCK_MODEL_DISABLE", "").split(",")))
PATH_MODES = [
    m for m in ("blackhole", "drop_replies", "garbage", "refuse", "delay") if m not in DISABLED
]


def enabled(name: str) -> Callable[[Any], bool]:
    """A precondition: the rule runs unless ``REDLOCK_MODEL_DISABLE`` names it."""
    return lambda self: name not in DISABLED


keys = st.sampled_from(KEYS)
ttls = st.sampled_from(TTLS)
clients = st.sampled_from(CLIENTS)
masters = st.integers(0, MASTERS - 1)


class Ticket:
    """What an acquire rule puts in the bundle, granted or not.

    Every acquire adds exactly one, so the bundle grows the same way whatever the masters
    answered: Hypothesis replays and shrinks a sequence by drawing from it again, and a
    bundle that depends on timing would make its draws differ between runs.
    """

    def __init__(self, label: str, held: Held | None) -> None:
        self.label = label
        self.held = held

    def __repr__(self) -> str:
        return self.label if self.held is None else repr(self.held)


class ModelFailure(AssertionError):
    """A broken promise; the message carries the timeline."""


class LockModel(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.world: World = current_world()
        self.world.reset()
        self.timeline = Timeline()
        self.skew = 0.0
        self.rls: dict[str, Redlock] = {}
        self.all: list[Held] = []
        self.fences: dict[str, list[tuple[float, int, str]]] = {}
        self.held_ports: set[int] = set()
        self.max_ttl = max(TTLS)
        self.used_auto = False
        self.labels = itertools.count(1)
        self.tickets = itertools.count(1)
        self.huge_tried = False
        #: a check failed: teardown then only cleans up (a second failure, chained to the
        #: first, would make Hypothesis's replays look inconsistent)
        self.failed = False
        self.violations: list[str] = []
        #: faults in force, by target (liveness checks are skipped while any is)
        self.faults: set[str] = set()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- set-up and tear-down -----------------------------------------------------------------

    def _clock_c(self) -> float:
        return time.monotonic() + self.skew

    @initialize()
    def start(self) -> None:
        for name in CLIENTS:
            clock: Callable[[], float] = self._clock_c if name == "C" else time.monotonic
            self.rls[name] = Redlock(self.world.urls(name), node_timeout=NODE_TIMEOUT, clock=clock)
            # Connected, and every master's run_id known, before any fault: a client that
            # first meets a master after it restarted cannot tell (documented).
            self.rls[name].acquire("warm", 1.0).release()
        a = self.rls["A"]
        with a._lanes[0].lock:  # a second lane, connected, for the threads sharing A
            a.acquire("warm", 1.0).release()
        self.timeline.log("clients A (shared, 2 lanes), B, C (own clock) connected")
        self._monitor = threading.Thread(target=self._watch, name="model-monitor", daemon=True)
        self._monitor.start()

    def teardown(self) -> None:
        problems: list[str] = []
        try:
            self._stop.set()
            if self._monitor is not None:
                self._monitor.join(timeout=5)
            if self.failed:
                return
            self._heal_everything()
            for held in self.all:
                try:
                    released: object = held.lease.release()
                except Exception as exc:  # noqa: BLE001 - reported below
                    problems.append(f"teardown: release of {held} raised {exc!r}")
                    continue
                if not isinstance(released, bool):
                    problems.append(f"teardown: release of {held} returned {released!r}")
            problems += self._heartbeat_problems()
            problems += self._keys_left_behind()
            problems += self.violations[:1]
        finally:
            self._cleanup()
        if problems:
            self._fail("; ".join(problems))

    def _heal_everything(self) -> None:
        for server in self.world.masters:
            if server.paused:
                server.resume()
        self.world.proxy.set("*", "pass")
        for port in self.held_ports:
            self.world.proxy.connection(port, "flow")
        self.held_ports.clear()

    def _keys_left_behind(self) -> list[str]:
        """Released keys go at once; keys of lost leases, failed acquires whose undo could
        not be sent, and requests that were delayed may stay, but each only for its TTL.

        So: poll briefly for the deletes still in flight, then every key left must carry
        an expiry no longer than the longest TTL used (Redis then removes it by itself).
        Waiting for them to go would cost up to that TTL per example.
        """
        bound_ms = int(self.max_ttl * 1000) + 50
        deadline = time.monotonic() + 0.5
        while True:
            left = {m: keys for m in range(MASTERS) if (keys := self.world.lock_keys(m))}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        bad = {
            name: pttl
            for keys in left.values()
            for name, pttl in keys.items()
            if pttl != -2 and not 0 <= pttl <= bound_ms  # -2: expired meanwhile
        }
        if bad:
            return [f"keys that outlive every TTL used ({self.max_ttl:g}s): {bad}"]
        return []

    def _heartbeat_problems(self) -> list[str]:
        engine = heartbeat._engine
        if not self.used_auto or engine is None:
            return []
        thread = engine._thread
        if thread is not None and not thread.is_alive():
            return ["the heartbeat thread died"]
        return []

    def _cleanup(self) -> None:
        engine = heartbeat._engine
        if engine is not None:
            for held in self.all:
                engine.remove(held.lease)
            thread = engine._thread
            if thread is not None and not thread.is_alive():
                heartbeat._engine = None  # a dead engine must not poison the next example
        for rl in self.rls.values():
            rl.close()

    # -- recording and failing ----------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.failed = True
        text = f"{message}\n{self.timeline.render()}"
        if currently_in_test_context():  # also replayed outside Hypothesis (regressions)
            note(text)
        raise ModelFailure(text)

    def _timed(
        self, what: str, bound: float, call: Callable[[], T]
    ) -> tuple[T | None, Exception | None]:
        started = time.monotonic()
        outcome: T | None = None
        error: Exception | None = None
        try:
            outcome = call()
        except Exception as exc:  # noqa: BLE001 - the caller checks which errors are allowed
            error = exc
        elapsed = time.monotonic() - started
        result = f"-> {type(error).__name__}: {error}" if error else f"-> {outcome!r}"
        self.timeline.log(f"{what} {result} ({elapsed:.3f}s)")
        if elapsed > bound:
            self._fail(f"{what} took {elapsed:.3f}s, more than its bound {bound:.3f}s")
        return outcome, error

    def _allow(self, what: str, error: Exception | None, *allowed: type[Exception]) -> None:
        if error is not None and not isinstance(error, allowed):
            names = ", ".join(a.__name__ for a in allowed)
            self._fail(f"{what} raised {error!r}; only {names} are documented")

    def _ticket(self, client: str, key: str, lease: Lease | None, auto: bool = False) -> Ticket:
        if lease is None:
            ticket = Ticket(f"T{next(self.tickets)}", None)
            self.timeline.log(f"  {ticket}: nothing granted")
            return ticket
        return Ticket("", self._granted(client, key, lease, auto))

    def _resolve(self, ticket: Ticket, what: str) -> Held | None:
        if ticket.held is None:
            self.timeline.log(f"{what}: skipped, {ticket} was not granted")
        return ticket.held

    def _granted(self, client: str, key: str, lease: Lease, auto: bool = False) -> Held:
        held = Held(
            f"L{next(self.labels)}", client, key, lease, granted_at=time.monotonic(), auto=auto
        )
        self.all.append(held)
        self.timeline.log(
            f"  {held} granted to {client} on {key!r} (ttl {lease.ttl:g}, "
            f"remaining {lease.remaining():.3f}s, token {lease.token[:8]})"
        )
        return held

    # -- client rules ---------------------------------------------------------------------------

    @precondition(enabled("acquire"))
    @rule(target=leases, client=clients, key=keys, ttl=ttls)
    def acquire(self, client: str, key: str, ttl: float) -> Any:
        rl = self.rls[client]
        what = f"{client}.acquire({key!r}, ttl={ttl:g})"
        lease, error = self._timed(what, 3 * NODE_TIMEOUT + SLACK, lambda: rl.acquire(key, ttl))
        self._allow(what, error, LockContended, QuorumUnavailable)
        return self._ticket(client, key, lease)

    @precondition(enabled("acquire_blocking"))
    @rule(
        target=leases,
        client=clients,
        key=keys,
        ttl=ttls,
        timeout=st.sampled_from([0.3, 1.0]),
    )
    def acquire_blocking(self, client: str, key: str, ttl: float, timeout: float) -> Any:
        rl = self.rls[client]
        what = f"{client}.acquire({key!r}, ttl={ttl:g}, blocking_timeout={timeout:g})"
        bound = timeout + 3 * NODE_TIMEOUT + SLACK
        lease, error = self._timed(
            what, bound, lambda: rl.acquire(key, ttl, blocking_timeout=timeout)
        )
        self._allow(what, error, LockContended, QuorumUnavailable)
        return self._ticket(client, key, lease)

    @precondition(enabled("acquire_blocking_busy_lane"))
    @rule(target=leases, key=keys, ttl=ttls, timeout=st.sampled_from([0.5, 1.0]))
    def acquire_blocking_busy_lane(self, key: str, ttl: float, timeout: float) -> Any:
        """A thread's blocking acquire on A while another thread of A uses lane 0.

        The other thread has lane 0 when the acquire starts, so the first attempt runs
        on lane 1; it keeps lane 0 for ``BUSY`` (less than one round that waits for a
        master), so the retries find lane 0 idle and run there.
        """
        rl = self.rls["A"]
        lane0 = rl._lanes[0]
        what = f"A.acquire({key!r}, ttl={ttl:g}, blocking_timeout={timeout:g}) [lane 0 busy]"
        out: dict[str, Any] = {}
        taken = threading.Event()

        def acquire() -> None:
            try:
                out["lease"] = rl.acquire(key, ttl, blocking_timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - checked by the rule
                out["error"] = exc

        def occupy() -> None:
            with lane0.lock:
                taken.set()
                self.timeline.log("  another thread of A took lane 0")
                time.sleep(BUSY)  # the other thread's round: the fault itself
            self.timeline.log("  lane 0 free again")

        started = time.monotonic()
        occupier = threading.Thread(target=occupy, name="model-lane0", daemon=True)
        occupier.start()
        if not taken.wait(2 * NODE_TIMEOUT + SLACK):
            self._fail("lane 0 of A stayed busy: a call on it did not return")
        worker = threading.Thread(target=acquire, name="model-acquire", daemon=True)
        worker.start()
        bound = timeout + 3 * NODE_TIMEOUT + SLACK
        worker.join(bound)
        occupier.join(BUSY + SLACK)
        elapsed = time.monotonic() - started
        error = out.get("error")
        lease = out.get("lease")
        result = f"-> {type(error).__name__}: {error}" if error else f"-> {lease!r}"
        self.timeline.log(f"{what} {result} ({elapsed:.3f}s)")
        if worker.is_alive():
            self._fail(f"{what} did not return within {bound:.3f}s")
        self._allow(what, error, LockContended, QuorumUnavailable)
        return self._ticket("A", key, lease)

    @precondition(enabled("acquire_auto_renew"))
    @rule(
        target=leases,
        client=st.sampled_from(["A", "B"]),
        key=keys,
        ttl=st.sampled_from([1.0, 2.0]),
        max_hold=st.sampled_from([None, 1.5, 3.0]),
    )
    def acquire_auto_renew(self, client: str, key: str, ttl: float, max_hold: float | None) -> Any:
        rl = self.rls[client]
        what = f"{client}.acquire({key!r}, ttl={ttl:g}, auto_renew=True, max_hold={max_hold})"
        lease, error = self._timed(
            what,
            3 * NODE_TIMEOUT + SLACK,
            lambda: rl.acquire(key, ttl, auto_renew=True, max_hold=max_hold),
        )
        self._allow(what, error, LockContended, QuorumUnavailable)
        if lease is not None:
            self.used_auto = True
        return self._ticket(client, key, lease, auto=True)

    @precondition(lambda self: "huge" not in DISABLED and not self.huge_tried)
    @rule(target=leases)
    def acquire_huge_ttl(self) -> Any:
        """A TTL of 1e11 s with renewal: refused (ValueError), or the engine keeps renewing."""
        self.huge_tried = True
        rl = self.rls["A"]
        what = "A.acquire('big', ttl=1e11, auto_renew=True)"
        lease, error = self._timed(
            what, 3 * NODE_TIMEOUT + SLACK, lambda: rl.acquire("big", 1e11, auto_renew=True)
        )
        self._allow(what, error, ValueError, LockContended, QuorumUnavailable)
        if lease is None:
            return self._ticket("A", "big", None)
        self.used_auto = True
        ticket = self._ticket("A", "big", lease, auto=True)
        # The user-visible promise: other auto-renewed leases are still renewed.
        probe, error = self._timed(
            "A.acquire('probe', ttl=1, auto_renew=True)",
            3 * NODE_TIMEOUT + SLACK,
            lambda: rl.acquire("probe", 1.0, auto_renew=True),
        )
        self._allow("probe", error, LockContended, QuorumUnavailable)
        if probe is not None:
            first = probe.deadline
            end = time.monotonic() + 2.0
            while probe.deadline == first and probe.held and time.monotonic() < end:
                time.sleep(0.02)
            renewed = probe.deadline != first
            alive = heartbeat.engine()._thread
            probe.release()
            self.timeline.log(
                f"  probe renewed: {renewed}; heartbeat thread alive: "
                f"{alive is not None and alive.is_alive()}"
            )
            if not renewed and not self._faulty():
                self._fail("after a huge-TTL lease, the heartbeat no longer renews leases")
        return ticket

    @precondition(enabled("extend"))
    @rule(ticket=leases, ttl=st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0]))
    def extend(self, ticket: Ticket, ttl: float) -> None:
        lease = self._resolve(ticket, "extend")
        if lease is None:
            return
        what = f"{lease}.extend({ttl:g})"
        self.max_ttl = max(self.max_ttl, ttl)
        before = time.monotonic()
        _, error = self._timed(what, 2 * NODE_TIMEOUT + SLACK, lambda: lease.lease.extend(ttl))
        after = time.monotonic()
        self._allow(what, error, LockLost, QuorumUnavailable)
        if error is None and "extend_contract" not in DISABLED:
            drift = ttl * lease.lease.redlock.clock_drift_factor + 0.002
            offset = self.skew if lease.client == "C" else 0.0
            low = before + offset + ttl - drift - 1e-6
            high = after + offset + ttl - drift + 1e-6
            deadline = lease.lease.deadline
            self.timeline.log(f"  {lease} deadline now {deadline - offset - self.timeline.t0:.3f}s")
            if not low <= deadline <= high:
                self._fail(
                    f"{what} confirmed, but the deadline is {deadline - offset - after:+.3f}s "
                    f"from the call's return, not that extension's validity "
                    f"({ttl - drift:.3f}s from its start)"
                )

    @precondition(enabled("release"))
    @rule(ticket=leases)
    def release(self, ticket: Ticket) -> None:
        lease = self._resolve(ticket, "release")
        if lease is None:
            return
        what = f"{lease}.release()"
        released, error = self._timed(what, 2 * NODE_TIMEOUT + SLACK, lease.lease.release)
        if error is not None:
            self._fail(f"{what} raised {error!r}: release never raises")
        if not isinstance(released, bool):
            self._fail(f"{what} returned {released!r}, not a bool")
        if lease.lease.held:
            self._fail(f"{lease} still reads held after release()")

    @precondition(enabled("read_fence"))
    @rule(ticket=leases)
    def read_fence(self, ticket: Ticket) -> None:
        lease = self._resolve(ticket, "read_fence")
        if lease is None:
            return
        what = f"{lease}.fence"
        was_held = lease.lease.held
        fence, error = self._timed(what, 4 * NODE_TIMEOUT + SLACK, lambda: lease.lease.fence)
        self._allow(what, error, LockLost, QuorumUnavailable)
        if fence is None:
            return
        if lease.fences and lease.fences[-1] != fence:
            self._fail(f"{what} changed from {lease.fences[-1]} to {fence}")
        if lease.fences:
            return
        if not was_held and not lease.lease.held:
            return  # read before (a cached value): nothing newly granted
        lease.fences.append(fence)
        self._grant_fence(lease.key, fence, str(lease))

    def _grant_fence(self, key: str, fence: int, who: str) -> None:
        earlier = self.fences.setdefault(key, [])
        if earlier and fence <= max(f for _, f, _ in earlier):
            best = max(earlier, key=lambda e: e[1])
            self._fail(
                f"fence {fence} granted to {who} on {key!r} is not larger than "
                f"{best[1]} granted before to {best[2]}"
            )
        earlier.append((time.monotonic(), fence, who))

    @precondition(lambda self: hasattr(Redlock, "locked"))
    @precondition(enabled("locked"))
    @rule(client=clients, key=keys)
    def locked(self, client: str, key: str) -> None:
        rl = self.rls[client]
        holders = [h for h in self.all if h.key == key and h.lease.held]
        what = f"{client}.locked({key!r})"
        answer, error = self._timed(what, 2 * NODE_TIMEOUT + SLACK, lambda: rl.locked(key))  # type: ignore[attr-defined]
        self._allow(what, error, QuorumUnavailable)
        still = [h for h in holders if h.lease.held]
        if answer is False and still and not self._faulty():
            self._fail(f"{what} said False while {still} held it throughout the call")

    @precondition(lambda self: hasattr(Lease, "owned"))
    @precondition(enabled("owned"))
    @rule(ticket=leases)
    def owned(self, ticket: Ticket) -> None:
        lease = self._resolve(ticket, "owned")
        if lease is None:
            return
        was_held = lease.lease.held
        what = f"{lease}.owned()"
        answer, error = self._timed(what, 2 * NODE_TIMEOUT + SLACK, lease.lease.owned)  # type: ignore[attr-defined]
        self._allow(what, error, QuorumUnavailable)
        if answer is False and was_held and lease.lease.held and not self._faulty():
            self._fail(f"{what} said False while the lease was held throughout the call")
        if answer is True and lease.lease.state == "released":
            self._fail(f"{what} said True after release()")

    @precondition(enabled("fork_child"))
    @rule(key=keys)
    def fork_child(self, key: str) -> None:
        rl = self.rls["A"]
        parents = [h.lease for h in self.all]
        started = time.monotonic()
        report = run_child(rl, key, 2.0, parents)
        self.timeline.log(
            f"forked child of A: acquire({key!r}, ttl=2) + fence + release -> {report} "
            f"({time.monotonic() - started:.3f}s)"
        )
        if report.get("problems"):
            self._fail(f"forked child: {report['problems']}")
        if report.get("acquire") not in ("granted", "LockContended", "QuorumUnavailable"):
            self._fail(f"forked child's acquire raised {report.get('acquire')}")
        if time.monotonic() - started > CHILD_BUDGET:
            self._fail("forked child took longer than its budget")
        if report.get("acquire") != "granted":
            return
        granted, held_until = report["granted_at"], report.get("held_until")
        if isinstance(report.get("fence"), int):
            self._grant_fence(key, report["fence"], f"child {os.getpid()}")
        if held_until is None:
            return
        for held in self.all:
            lease = held.lease
            # Still held now, and granted before the child's hold ended: held throughout.
            if held.key == key and lease.held and held.granted_at < held_until:
                self._fail(
                    f"forked child held {key!r} from {granted - self.timeline.t0:.3f}s to "
                    f"{held_until - self.timeline.t0:.3f}s while {held} held it"
                )

    @precondition(enabled("pause_client_c"))
    @rule(ticket=leases)
    def pause_client_c(self, ticket: Ticket) -> None:
        """Client C's process stands still past its lease's validity (its clock jumps)."""
        held = self._resolve(ticket, "pause_client_c")
        if held is None or held.client != "C":
            self.timeline.log(f"pause_client_c: skipped, {ticket} is not C's")
            return
        jump = held.lease.ttl + 0.1
        self.skew += jump
        self.timeline.log(f"fault: client C paused {jump:g}s past {held}'s validity")
        if held.lease.held:
            self._fail(f"{held} still reads held after a pause longer than its TTL")

    @precondition(enabled("idle"))
    @rule(seconds=st.sampled_from([0.3, 1.2, 2.5]))
    def idle(self, seconds: float) -> None:
        """Time passes: TTLs run out, renewals tick (the monitor keeps checking)."""
        self.timeline.log(f"time passes: {seconds:g}s")
        time.sleep(seconds)

    # -- fault rules --------------------------------------------------------------------------

    def _faulty(self) -> bool:
        """Any fault in force (liveness checks are skipped then)."""
        return bool(self.faults)

    @precondition(enabled("path_fault"))
    @rule(
        client=clients,
        m=masters,
        mode=st.sampled_from(PATH_MODES),
    )
    def path_fault(self, client: str, m: int, mode: str) -> None:
        params: tuple[float, ...] = (
            (NODE_TIMEOUT * 0.75, NODE_TIMEOUT * 0.75) if mode == "delay" else ()
        )
        self.world.proxy.set(self.world.listener(client, m), mode, *params)
        self.faults.add(f"{client}->m{m}")
        self.timeline.log(f"fault: path {client} -> master {m}: {mode} {params or ''}")

    @precondition(enabled("path_heal"))
    @rule(client=clients, m=masters)
    def path_heal(self, client: str, m: int) -> None:
        self.world.proxy.set(self.world.listener(client, m), "pass")
        self.faults.discard(f"{client}->m{m}")
        self.timeline.log(f"fault healed: path {client} -> master {m} passes")

    def _link_port(self, client: str, lane: int, m: int) -> int | None:
        lanes = self.rls[client]._lanes
        sock = lanes[lane].links[m].sock if lane < len(lanes) else None
        if sock is None:
            self.timeline.log(f"fault skipped: {client} lane {lane} -> m{m} is not connected")
            return None
        return int(sock.getsockname()[1])

    @precondition(enabled("hold_requests"))
    @rule(client=clients, lane=st.integers(0, 1), m=masters)
    def hold_requests(self, client: str, lane: int, m: int) -> None:
        """One lane's requests to one master wait in the proxy (the other lanes flow)."""
        port = self._link_port(client, lane, m)
        if port is None:
            return
        ok = self.world.proxy.connection(port, "hold", "up")
        self.held_ports.add(port)
        self.faults.add(f"{client}/{lane}->m{m}")
        self.timeline.log(
            f"fault: {client} lane {lane} -> master {m} ({port}): requests held [{ok}]"
        )

    @precondition(enabled("connection_fault"))
    @rule(
        client=clients,
        lane=st.integers(0, 1),
        m=masters,
        action=st.sampled_from(["hold down", "delay"]),
    )
    def connection_fault(self, client: str, lane: int, m: int, action: str) -> None:
        """Hold one lane's replies from one master, or slow that connection."""
        port = self._link_port(client, lane, m)
        if port is None:
            return
        if action == "delay":
            delay = NODE_TIMEOUT * 1.5
            ok = self.world.proxy.connection(port, "delay", delay, delay)
        else:
            ok = self.world.proxy.connection(port, "hold", "down")
            self.held_ports.add(port)
        self.faults.add(f"{client}/{lane}->m{m}")
        self.timeline.log(f"fault: {client} lane {lane} -> master {m} ({port}): {action} [{ok}]")

    @precondition(enabled("flow"))
    @rule()
    def flow(self) -> None:
        """Deliver every held connection's bytes (in order on each connection)."""
        for port in sorted(self.held_ports):
            self.world.proxy.connection(port, "flow")
        self.timeline.log(f"fault healed: held connections flow {sorted(self.held_ports)}")
        self.held_ports.clear()
        self.faults.difference_update({f for f in self.faults if "/" in f})

    @precondition(enabled("stop_master"))
    @rule(m=masters)
    def stop_master(self, m: int) -> None:
        server = self.world.masters[m]
        if not server.paused:
            server.pause()
        self.faults.add(f"m{m} stopped")
        self.timeline.log(f"fault: master {m} SIGSTOP")

    @precondition(enabled("continue_master"))
    @rule(m=masters)
    def continue_master(self, m: int) -> None:
        server = self.world.masters[m]
        if server.paused:
            server.resume()
        self.faults.discard(f"m{m} stopped")
        self.timeline.log(f"fault healed: master {m} SIGCONT")

    @precondition(enabled("restart_master_empty"))
    @rule(m=masters)
    def restart_master_empty(self, m: int) -> None:
        self.world.restart_empty(m)
        self.faults.discard(f"m{m} stopped")
        self.faults.add(f"m{m} restarted")
        self.timeline.log(f"fault: master {m} restarted empty")

    @precondition(enabled("heal"))
    @rule()
    def heal(self) -> None:
        self._heal_everything()
        self.faults.clear()
        self.timeline.log("fault healed: every master runs, every path and connection flows")

    # -- invariants ---------------------------------------------------------------------------

    def _held_pairs(self) -> list[tuple[Held, Held]]:
        live = [h for h in self.all if h.lease.state == "held"]
        first = [h for h in live if h.lease.held]
        again = [h for h in first if h.lease.held]
        return [(a, b) for i, a in enumerate(again) for b in again[i + 1 :] if a.key == b.key]

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            try:
                pairs = self._held_pairs()
            except Exception as exc:  # noqa: BLE001 - a monitor must not die silently
                self.violations.append(f"monitor failed: {exc!r}")
                return
            if pairs and not self.violations:
                a, b = pairs[0]
                text = (
                    f"two holders of {a.key!r} at one instant: {a} ({a.client}, "
                    f"remaining {a.lease.remaining():.3f}s) and {b} ({b.client}, "
                    f"remaining {b.lease.remaining():.3f}s)"
                )
                self.timeline.log("MONITOR: " + text)
                self.violations.append(text)

    @invariant()
    def one_holder_per_key(self) -> None:
        if self.violations:
            self._fail(self.violations[0])
        pairs = self._held_pairs()
        if pairs:
            a, b = pairs[0]
            self._fail(f"two holders of {a.key!r} at one instant: {a} and {b}")

    @invariant()
    def held_leases_are_backed_by_a_quorum(self) -> None:
        live = [h for h in self.all if h.lease.state == "held" and h.lease.held]
        if not live:
            return
        names = sorted({redis_key(PREFIX, h.key) for h in live})
        began = time.monotonic()
        values = [self.world.read(m, names) for m in range(MASTERS)]
        ended = time.monotonic()
        for held in live:
            lease = held.lease
            offset = self.skew if held.client == "C" else 0.0
            if lease.state != "held" or lease.deadline - offset <= ended + 0.005:
                continue  # not held throughout the read
            name = names.index(redis_key(PREFIX, held.key))
            backing = []
            for m, got in enumerate(values):
                restarted = any(
                    t > lease.acquired_at - offset for t in self.world.restarts.get(m, [])
                )
                if got is None or restarted or got[name] == lease.token.encode():
                    backing.append(m)
            if len(backing) < QUORUM:
                seen = {m: None if v is None else v[name] for m, v in enumerate(values)}
                self._fail(
                    f"{held} reads held ({lease.remaining():.3f}s left) but its token is on "
                    f"masters {backing} only, read between {began - self.timeline.t0:.3f}s and "
                    f"{ended - self.timeline.t0:.3f}s ({seen}): another client can take "
                    f"{held.key!r} now"
                )

    @invariant()
    def heartbeat_alive_while_renewing(self) -> None:
        engine = heartbeat._engine
        if engine is None or not any(h.auto and h.lease.held for h in self.all):
            return
        thread = engine._thread
        if thread is not None and not thread.is_alive():
            self._fail("the heartbeat thread died while leases are auto-renewed")
