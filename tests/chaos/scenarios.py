"""The lock scenarios: a workload (:class:`~tests.chaos.run.Config`), a fault script, and
what the checker must find for each variant.

A scenario's ``faults(run)`` runs in the test process while the agents work; it records
every fault it applies (see :class:`~tests.chaos.run.Injector`). After it returns, the
agents get ``recovery`` seconds of healed cluster, then stop.

Expectations start from :data:`BASE` (per variant) and the scenario's ``expect``
overrides them; ``none`` = zero violations (a gate), ``some`` = the checker must show at
least one (a negative control, or a fault that breaks Redlock's assumptions), ``any`` =
reported only.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from .checker import ANY, SOME
from .run import Config, Run

__all__ = ["BASE", "SCENARIOS", "Scenario"]

SAFETY_FENCED = ("stale_write_accepted", "fence_order", "lost_update_fenced")

BASE: dict[str, dict[str, str]] = {
    "correct": {},
    "noquarantine": {},
    "nofence": dict.fromkeys(SAFETY_FENCED, ANY),
    # The negative control: the checker must see the broken lock let two holders in.
    "broken": {
        "overlap": SOME,
        "overlap_in_validity": SOME,
        "lost_update_unfenced": SOME,
        "stale_write_accepted": ANY,
        "fence_order": ANY,
        "lost_update_fenced": ANY,
        "token_order": ANY,
        "takeover": ANY,
        "recovered": ANY,
    },
    # Broken lock, fencing on: overlaps galore, and still no stale write gets in.
    "broken+fence": {
        "overlap": SOME,
        "overlap_in_validity": SOME,
        "lost_update_unfenced": ANY,
        "token_order": ANY,
        "takeover": ANY,
        "recovered": ANY,
    },
}


@dataclasses.dataclass
class Scenario:
    id: str
    title: str
    config: Callable[[], Config]
    faults: Callable[[Run], None]
    #: per variant, property -> expectation (overrides BASE)
    expect: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    #: variants in the default subset (``chaos``, part of scripts/test.sh, about 5 minutes
    #: in all); the full matrix (scripts/chaos.sh) also runs every variant in ``full``
    default: tuple[str, ...] = ("correct",)
    full: tuple[str, ...] = ("correct", "broken")
    recovery: float = 2.0
    needs_proxies: bool = False
    needs_redis7: bool = False
    #: network namespaces: root only, full matrix only
    needs_root: bool = False
    takeover: bool = False
    #: extra checks on the report and run (raise AssertionError)
    extra: Callable[[Run, Any], None] | None = None

    def expectations(self, variant: str) -> dict[str, str]:
        out = dict(BASE[variant])
        out.update(self.expect.get(variant, {}))
        return out


def _sleep(s: float) -> None:
    time.sleep(s)


# -- 1 baseline -------------------------------------------------------------------------------


def s01_faults(run: Run) -> None:
    _sleep(7.0)


# -- 2 SIGKILL the holder mid critical section ------------------------------------------------


def s02_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    for _ in range(2):
        agent, _ = inj.holder_in_cs(min_ms=5)
        inj.kill_agent(agent)
        _sleep(run.config.ttl * 2.5)
        run.spawn(agent.index)
        _sleep(1.0)


# -- 3 SIGSTOP the holder longer than the TTL -------------------------------------------------


def s03_faults(run: Run) -> None:
    """A holder stopped (GC pause, swap) in the middle of a long critical section."""
    inj = run.injector
    assert inj is not None
    _sleep(0.5)
    for _ in range(2):
        agent, _ = inj.holder_in_cs(min_ms=int(run.config.ttl * 1000))
        inj.pause_agent(agent, run.config.ttl * 2.5)
        _sleep(1.0)


def s03w_faults(run: Run) -> None:
    """Kleppmann's pause at the worst moment: after the validity check, before the write.

    Agent a0 stops itself there on its 2nd critical section; we resume it after 2.5 TTLs.
    """
    inj = run.injector
    assert inj is not None
    inj.wait_event(lambda e: e["ev"] == "self_stop", timeout=30, what="self_stop")
    inj.start_fault("sigstop_self", "a0")
    _sleep(run.config.ttl * 2.5)
    inj.resume_agent(run.agent(0))
    _sleep(1.0)


def _s03w_extra(run: Run, report: Any) -> None:
    if run.variant == "correct":
        assert report.stats["store_refused"] >= 1, "the stale holder's write was not refused"


# -- 4 pause shorter than the TTL -------------------------------------------------------------


def s04_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(0.5)
    for _ in range(3):
        agent, _ = inj.holder_in_cs(min_ms=int(run.config.ttl * 1000))
        inj.pause_agent(agent, run.config.ttl * 0.3)
        _sleep(0.5)


# -- 5 kill 1 of 3 masters --------------------------------------------------------------------


def s05_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.5)
    inj.kill_master(0)
    _sleep(3.0)
    inj.restart_master(0, keep_data=False)
    _sleep(1.5)


# -- 6 restart a master empty -----------------------------------------------------------------


def s06_faults(run: Run) -> None:
    """a0's lock lives on m0, m1 only (m2 cut off for a0); m1 restarts empty at once.

    The other clients saw m1 before: they must keep it out of the quorum for a TTL, or
    they would take the key on m1 + m2 while a0 still holds it.
    """
    inj = run.injector
    assert inj is not None
    _sleep(1.5)  # every client has talked to every master (and seen its run_id)
    inj.proxy(0, 2, "blackhole")
    inj.wait_event(
        lambda e: e["ev"] == "work" and e["proc"] == "a0" and e["ms"] >= 1000,
        timeout=30,
        what="a0 in a long critical section",
    )
    inj.kill_master(1)
    inj.restart_master(1, keep_data=False)
    _sleep(run.config.ttl * 2)
    inj.proxy(0, 2, "pass")
    _sleep(1.0)


def s06d_faults(run: Run) -> None:
    """The spec's delayed restart: m1 comes back empty only after a TTL."""
    inj = run.injector
    assert inj is not None
    _sleep(1.5)
    inj.proxy(0, 2, "blackhole")
    inj.wait_event(
        lambda e: e["ev"] == "work" and e["proc"] == "a0" and e["ms"] >= 1000,
        timeout=30,
        what="a0 in a long critical section",
    )
    inj.kill_master(1)
    _sleep(run.config.ttl * 1.2)
    inj.restart_master(1, keep_data=False)
    _sleep(run.config.ttl * 2)
    inj.proxy(0, 2, "pass")
    _sleep(1.0)


def s06p_faults(run: Run) -> None:
    """appendfsync always: m1 killed and restarted at once keeps every acknowledged key."""
    inj = run.injector
    assert inj is not None
    _sleep(1.5)
    for _ in range(3):
        inj.holder_in_cs(min_ms=5)
        inj.kill_master(1)
        inj.restart_master(1, keep_data=True)
        _sleep(1.0)


# -- 7, 8 clock jumps on one master -----------------------------------------------------------


def _lock_key(key: str) -> str:
    return f"redlock:{{{key}}}"


def s07_faults(run: Run) -> None:
    """m0's clock jumps forward: every lock key on m0 expires at once, repeatedly."""
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    with inj.client(0) as c:
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            for key in run.config.keys:
                if c.pexpire(_lock_key(key), 1):
                    inj.h.write("fault_start", fault="clock_jump_forward", target="m0", key=key)
                    inj.h.write("fault_end", fault="clock_jump_forward", target="m0", key=key)
            _sleep(0.1)


def s07k_faults(run: Run) -> None:
    """Kleppmann's case: a0 holds on m0 + m1 only (m2 cut off for it), m1's clock jumps.

    Redlock assumes bounded clock drift; here it does not hold, so the checker must show
    two holders inside their validity at once, and fencing must refuse the stale writer.
    """
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    inj.proxy(0, 2, "blackhole")
    for _ in range(2):
        inj.wait_event(
            lambda e: e["ev"] == "work" and e["proc"] == "a0" and e["ms"] >= 1000,
            timeout=30,
            what="a0 in a long critical section",
        )
        with inj.client(1) as c:
            c.pexpire(_lock_key("hot"), 1)
        inj.h.write("fault_start", fault="clock_jump_forward", target="m1")
        inj.h.write("fault_end", fault="clock_jump_forward", target="m1")
        _sleep(run.config.ttl * 2)
    inj.proxy(0, 2, "pass")


def s08_faults(run: Run) -> None:
    """m0's clock runs slow: the holder's key lives a minute there. Then the holder dies.

    The others must still take over within a TTL, on m1 + m2.
    """
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    for _ in range(2):
        agent, _ = inj.holder_in_cs(min_ms=5)
        with inj.client(0) as c:
            c.pexpire(_lock_key("hot"), 60_000)
        inj.h.write("fault_start", fault="clock_jump_backward", target="m0")
        inj.kill_agent(agent)
        _sleep(run.config.ttl * 2.5)
        with inj.client(0) as c:
            c.delete(_lock_key("hot"))
        inj.h.write("fault_end", fault="clock_jump_backward", target="m0")
        run.spawn(agent.index)
        _sleep(0.5)


# -- 9 holder cut off from a majority ---------------------------------------------------------


def s09_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    for _ in range(2):
        agent, _ = inj.holder_in_cs(min_ms=int(run.config.ttl * 1000))
        inj.proxy(agent.index, [1, 2], "blackhole")
        _sleep(run.config.ttl * 2.5)
        inj.proxy(agent.index, [1, 2], "pass")
        _sleep(1.0)


def s09n_faults(run: Run) -> None:
    """The same cut with the kernel: a0 runs in its own network namespace, and blackhole
    routes there drop its packets to m1 and m2 (other clients still reach them)."""
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    for _ in range(2):
        inj.wait_event(
            lambda e: e["ev"] == "work" and e["proc"] == "a0" and e["ms"] >= 1000,
            timeout=30,
            what="a0 in a long critical section",
        )
        inj.cut([1, 2])
        _sleep(run.config.ttl * 2.5)
        inj.heal()
        _sleep(1.0)


# -- 10 replies dropped while requests apply --------------------------------------------------


def s10_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    inj.proxy(None, 0, "drop_replies")
    _sleep(3.0)
    inj.proxy(None, 1, "drop_replies")
    inj.quorum_lost()
    _sleep(2.0)
    inj.quorum_back()
    inj.proxy(None, [0, 1], "pass")
    _sleep(1.0)


# -- 11 latency above the per-master timeout --------------------------------------------------


def s11_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    nt = run.config.node_timeout
    _sleep(1.0)
    inj.proxy(None, 0, "delay", nt, nt)  # 2 x node_timeout per round trip
    _sleep(3.0)
    inj.proxy(None, 1, "delay", nt, nt)
    inj.quorum_lost()
    _sleep(2.0)
    inj.quorum_back()
    inj.proxy(None, [0, 1], "pass")
    _sleep(1.0)
    # Below the timeout on every master, with connections cut so that every client
    # reconnects through the latency: each connect must stay within its bound too. A
    # round trip of 0.6 x node_timeout: at 0.8 the proxies' own scheduling on a loaded
    # 2-core CI host (40 ms) pushed two masters of two renewal rounds in a row past the
    # timeout, and a holder in a long critical section lost its lease (CI, 2026-11-27).
    # Round trips past the timeout are the first phases' subject.
    inj.proxy(None, [0, 1, 2], "delay", nt * 0.3, nt * 0.3)
    inj.proxy(None, [0, 1, 2], "reset")
    _sleep(2.0)
    inj.proxy(None, [0, 1, 2], "pass")
    _sleep(0.5)


# -- 12 a slow or frozen master ---------------------------------------------------------------


def s12_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    inj.client_pause(0, 1.5)
    _sleep(0.5)
    inj.debug_sleep(1, 1.5)
    _sleep(0.5)
    inj.pause_master(2)
    _sleep(1.5)
    inj.resume_master(2)
    _sleep(0.5)
    # A majority frozen at once: nobody may enter; late commands run after the thaw.
    # Both faults end on their own, on the masters' clocks, 1.5 s after they start; the
    # threads that started them notice later. The window without a quorum is therefore
    # recorded from after both started to before either can end, never up to the
    # threads' return: an acquire that started once the masters thawed, a few ms
    # before the injector woke up, is not a violation.
    frozen = 1.5
    started = time.monotonic()
    a = inj.in_background(lambda: inj.client_pause(0, frozen))
    b = inj.in_background(lambda: inj.debug_sleep(1, frozen))
    time.sleep(0.05)
    inj.quorum_lost()
    time.sleep(max(0.0, started + frozen - 0.05 - time.monotonic()))
    inj.quorum_back()
    a.join()
    b.join()
    _sleep(0.5)


# -- 13 fence order under partial acquisitions with a lossy master ----------------------------


def s13_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    rng = random.Random(13)
    end = time.monotonic() + 7.0
    restarted = False
    while time.monotonic() < end:
        inj.proxy(None, 0, "drop_replies")
        _sleep(rng.uniform(0.05, 0.3))
        inj.proxy(None, 0, "pass")
        _sleep(rng.uniform(0.05, 0.3))
        if not restarted and time.monotonic() > end - 4:
            inj.kill_master(2)
            inj.restart_master(2, keep_data=False)
            restarted = True


# -- 16 heartbeat starvation ------------------------------------------------------------------


def s16_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(0.5)
    import signal as _signal

    for _ in range(2):
        inj.wait_event(
            lambda e: e["ev"] == "work" and e["proc"] == "a0" and e["ms"] >= 1000,
            timeout=30,
            what="a0 in a long critical section",
        )
        _sleep(0.2)
        inj.start_fault("gil_starvation", "a0")
        run.agent(0).signal(_signal.SIGUSR1)
        inj.wait_event(lambda e: e["ev"] == "starve_end" and e["proc"] == "a0", timeout=30)
        inj.end_fault("gil_starvation", "a0")
        _sleep(1.0)


# -- 5 masters, 2 then 3 down -----------------------------------------------------------------


def s17_faults(run: Run) -> None:
    inj = run.injector
    assert inj is not None
    _sleep(1.0)
    inj.kill_master(0)
    inj.pause_master(1)
    _sleep(2.5)  # 2 of 5 down: still a quorum of 3
    inj.kill_master(2)
    inj.quorum_lost()
    _sleep(2.0)
    inj.quorum_back()
    inj.restart_master(2, keep_data=False)
    _sleep(1.0)
    inj.resume_master(1)
    inj.restart_master(0, keep_data=False)
    _sleep(1.0)


# -- the registry -----------------------------------------------------------------------------

PAUSE_LIKE = {"overlap": SOME, "lost_update_unfenced": ANY}


SCENARIOS: dict[str, Scenario] = {
    s.id: s
    for s in [
        Scenario(
            "s01",
            "baseline contention: 4 clients, 2 hot keys",
            lambda: Config(agents=4, keys=("hot", "warm")),
            s01_faults,
            default=("correct", "broken"),
        ),
        Scenario(
            "s02",
            "SIGKILL the holder mid critical section",
            lambda: Config(agents=3),
            s02_faults,
            takeover=True,
        ),
        Scenario(
            "s03",
            "SIGSTOP the holder longer than the TTL",
            lambda: Config(agents=3, long_cs=0.3),
            s03_faults,
            expect={"correct": {"overlap": SOME}, "nofence": {"overlap": SOME}},
            full=("correct", "broken", "nofence"),
        ),
        Scenario(
            "s03w",
            "SIGSTOP the holder after its validity check, before its write",
            lambda: Config(agents=3, agent_args={0: ["--stop-in-window", "2"]}),
            s03w_faults,
            expect={
                "correct": {"overlap": SOME, "lost_update_unfenced": SOME},
                "nofence": {
                    "overlap": SOME,
                    "lost_update_unfenced": SOME,
                    "stale_write_accepted": SOME,
                    "lost_update_fenced": SOME,
                    "fence_order": SOME,
                },
            },
            default=("correct", "nofence", "broken"),
            full=("correct", "nofence", "broken", "broken+fence"),
            extra=_s03w_extra,
        ),
        Scenario(
            "s04",
            "SIGSTOP the holder for less than the TTL",
            lambda: Config(agents=3, long_cs=0.3),
            s04_faults,
        ),
        Scenario(
            "s05",
            "kill 1 of 3 masters, restart it empty",
            lambda: Config(agents=3),
            s05_faults,
        ),
        Scenario(
            "s06",
            "restart a master empty at once (restart quarantine)",
            # A TTL well above the client's reconnect backoff (1 s), which would otherwise
            # hide the restart until the old holder's validity is over anyway.
            lambda: Config(
                agents=3, ttl=3.0, long_cs=0, proxies=True, agent_args={0: ["--long-cs", "1"]}
            ),
            s06_faults,
            expect={
                "correct": {"overlap": ANY, "lost_update_unfenced": ANY},
                # Negative control: the same, with the quarantine switched off.
                "noquarantine": {
                    "overlap_in_validity": SOME,
                    "overlap": SOME,
                    "lost_update_unfenced": ANY,
                },
            },
            needs_proxies=True,
            recovery=4.0,
            default=("correct", "noquarantine"),
            full=("correct", "noquarantine", "broken"),
        ),
        Scenario(
            "s06d",
            "restart a master empty after a TTL (delayed restart)",
            lambda: Config(agents=3, proxies=True, agent_args={0: ["--long-cs", "1"]}),
            s06d_faults,
            expect={"correct": {"overlap": ANY, "lost_update_unfenced": ANY}},
            needs_proxies=True,
            default=(),
        ),
        Scenario(
            "s06p",
            "kill and restart a master at once with appendfsync always",
            lambda: Config(agents=3, persistence="aof-always"),
            s06p_faults,
            default=(),
        ),
        Scenario(
            "s07",
            "clock jump forward on one master (every key there expires)",
            lambda: Config(agents=3),
            s07_faults,
            default=(),
        ),
        Scenario(
            "s07k",
            "clock jump forward on a master of a bare-majority holder (Kleppmann)",
            lambda: Config(agents=3, proxies=True, agent_args={0: ["--long-cs", "1"]}),
            s07k_faults,
            expect={
                "correct": {
                    "overlap": SOME,
                    "overlap_in_validity": SOME,
                    "lost_update_unfenced": ANY,
                },
                "nofence": {
                    "overlap": SOME,
                    "overlap_in_validity": SOME,
                    "lost_update_unfenced": ANY,
                },
            },
            needs_proxies=True,
            default=(),
        ),
        Scenario(
            "s08",
            "clock jump backward on one master, then the holder dies",
            lambda: Config(agents=3),
            s08_faults,
            takeover=True,
            default=(),
        ),
        Scenario(
            "s09",
            "holder cut off from a majority (proxy blackhole)",
            lambda: Config(agents=3, proxies=True, long_cs=0.3),
            s09_faults,
            expect={"correct": {"overlap": ANY, "lost_update_unfenced": ANY}},
            needs_proxies=True,
        ),
        Scenario(
            "s09n",
            "holder cut off from a majority by kernel blackhole routes (netns, root)",
            lambda: Config(agents=3, netns_agents=(0,), agent_args={0: ["--long-cs", "0.5"]}),
            s09n_faults,
            expect={"correct": {"overlap": ANY, "lost_update_unfenced": ANY}},
            needs_root=True,
            default=(),
        ),
        Scenario(
            "s10",
            "replies dropped while requests apply (1, then 2 of 3 masters)",
            lambda: Config(agents=3, proxies=True),
            s10_faults,
            needs_proxies=True,
        ),
        Scenario(
            "s11",
            "latency above the per-master timeout (1, then 2 masters), then below it",
            lambda: Config(agents=3, proxies=True, node_timeout=0.2),
            s11_faults,
            needs_proxies=True,
        ),
        Scenario(
            "s12",
            "slow or frozen masters: CLIENT PAUSE, DEBUG SLEEP, SIGSTOP; a majority frozen",
            lambda: Config(agents=3),
            s12_faults,
            needs_redis7=True,
        ),
        Scenario(
            "s13",
            "fence order under partial acquisitions: a lossy master, a master restarted empty",
            lambda: Config(agents=4, proxies=True, long_cs=0.05),
            s13_faults,
            needs_proxies=True,
            default=(),
        ),
        Scenario(
            "s16",
            "heartbeat starvation: the holder's GIL held past the TTL",
            lambda: Config(agents=3, agent_args={0: ["--long-cs", "1", "--starve", "2.5"]}),
            s16_faults,
            expect={"correct": {"overlap": ANY, "lost_update_unfenced": ANY}},
            default=(),
        ),
        Scenario(
            "s17",
            "5 masters: 2 down, then 3 down",
            lambda: Config(masters=5, agents=3),
            s17_faults,
            default=(),
        ),
    ]
}
