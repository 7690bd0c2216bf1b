"""A lock client process: ``python -m tests.chaos.agent --name a0 --history H ...``.

Loops until ``--duration`` seconds passed (or ``--stop-file`` exists): picks a hot key,
acquires it (blocking up to ``--blocking``), and runs a critical section against the
protected resource, recording everything in the history:

    acq_try -> acq_ok (start_ns, deadline_ns, votes) | acq_fail (contended / unavailable)
    fence -> cs_enter -> read (fenced store, registers the fence) -> counter read
          -> work (sleep; sometimes longer than the TTL: renewal must carry it)
          -> held? (the correct holder aborts when its lease is no longer valid)
          -> counter SET..GET (unfenced) -> fenced write -> cs_exit | cs_abort
    rel_start -> rel

Faults the agent takes part in (so they hit the worst moment, deterministically):

``--stop-in-window N``  on its N-th critical section, SIGSTOP itself right after the
                        ``held`` check, before the writes (Kleppmann's GC pause); the
                        injector resumes it.
``SIGUSR1``             hold the GIL for ``--starve`` seconds in a signal handler, with a C
                        call that never returns to the eval loop (a catastrophic ``re``
                        backtrack): the heartbeat thread cannot run (heartbeat starvation).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import redis

from celery_redlock.exceptions import LockContended, LockLost, QuorumUnavailable, RedlockError

from .history import History, ns
from .instrument import BrokenRedlock, InstrumentedRedlock, lease_id
from .resource import FencedStore, UnfencedCounter

# -- heartbeat starvation ----------------------------------------------------------------------

_EVIL = re.compile(r"(a+)+$")


def _calibrate() -> tuple[int, float]:
    """Length n and seconds of one ``_EVIL.match('a'*n + 'b')`` (time doubles per +1)."""
    n = 16
    while True:
        started = time.monotonic()
        _EVIL.match("a" * n + "b")
        took = time.monotonic() - started
        if took > 0.02:
            return n, took
        n += 1


def hold_gil(seconds: float, calibration: tuple[int, float]) -> float:
    """Block every thread of this process for about ``seconds``; returns the time taken.

    ``re`` matching runs entirely inside ``_sre``'s C loop: it never goes back to the
    bytecode evaluation loop, which is the only place a thread gives the GIL up when
    another asks for it (every ``sys.getswitchinterval()``). So no other thread runs until
    the match fails. (``time.sleep`` would release the GIL; so would I/O.)
    """
    n0, t0 = calibration
    n = n0 + max(0, round(_log2(seconds / t0)))
    started = time.monotonic()
    _EVIL.match("a" * n + "b")
    return time.monotonic() - started


def _log2(x: float) -> float:
    import math

    return math.log2(x) if x > 0 else 0.0


# -- the loop ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--masters", required=True, help="comma-separated URLs")
    p.add_argument("--resource", required=True)
    p.add_argument("--keys", default="hot")
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--node-timeout", type=float, default=0.1)
    p.add_argument("--blocking", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--cs-ms", default="5,40", help="work time range in ms")
    p.add_argument(
        "--long-cs",
        type=float,
        default=0.0,
        help="share of critical sections that last --long-factor * ttl",
    )
    p.add_argument("--long-factor", type=float, default=1.6)
    p.add_argument("--gap-ms", default="0,20", help="pause between critical sections")
    p.add_argument("--mode", choices=("correct", "broken"), default="correct")
    p.add_argument("--fencing", choices=("on", "off"), default="on")
    p.add_argument("--stop-in-window", type=int, default=0)
    p.add_argument("--starve", type=float, default=0.0)
    p.add_argument("--max-cs", type=int, default=0, help="stop after this many critical sections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quarantine", type=float, default=-1.0, help="restart_quarantine (s); -1 = default"
    )
    args = p.parse_args(argv)

    rng = random.Random(args.seed or os.getpid())
    history = History(args.history, args.name)
    cls = BrokenRedlock if args.mode == "broken" else InstrumentedRedlock
    rl = cls(
        args.masters.split(","),
        history=history,
        node_timeout=args.node_timeout,
        restart_quarantine=None if args.quarantine < 0 else args.quarantine,
    )
    store = FencedStore(args.resource, enforce=args.fencing == "on", writer=args.name)
    counter = UnfencedCounter(args.resource)
    keys = args.keys.split(",")
    cs_lo, cs_hi = (float(x) / 1000 for x in args.cs_ms.split(","))
    gap_lo, gap_hi = (float(x) / 1000 for x in args.gap_ms.split(","))
    renew = args.mode == "correct"

    if args.starve:
        calibration = _calibrate()

        def starve(signum: int, frame: object) -> None:
            history.write("starve_start", seconds=args.starve)
            took = hold_gil(args.starve, calibration)
            history.write("starve_end", took_ms=round(took * 1000))

        signal.signal(signal.SIGUSR1, starve)

    history.write("agent_start", mode=args.mode, fencing=args.fencing, keys=keys, ttl=args.ttl)
    end = time.monotonic() + args.duration
    done = 0
    while time.monotonic() < end and not (args.stop_file and Path(args.stop_file).exists()):
        if args.max_cs and done >= args.max_cs:
            break
        key = rng.choice(keys)
        history.write("acq_try", key=key)
        started = time.monotonic_ns()
        try:
            lease = rl.acquire(key, args.ttl, blocking_timeout=args.blocking, auto_renew=renew)
        except LockContended:
            history.write(
                "acq_fail", key=key, error="contended", dur_ns=time.monotonic_ns() - started
            )
            continue
        except QuorumUnavailable as exc:
            history.write(
                "acq_fail",
                key=key,
                error="unavailable",
                dur_ns=time.monotonic_ns() - started,
                detail=str(exc)[:100],
            )
            time.sleep(rng.uniform(0.02, 0.1))
            continue
        lid = lease_id(lease)
        history.write(
            "acq_ok",
            key=key,
            lease=lid,
            start_ns=ns(lease.acquired_at),
            deadline_ns=ns(lease.deadline) if rl.believes_deadline else None,
            votes=rl.last_codes(),
            dur_ns=time.monotonic_ns() - started,
        )
        done += 1
        try:
            critical_section(
                args, rng, history, lease, lid, key, store, counter, done, cs_lo, cs_hi
            )
        finally:
            history.write("rel_start", key=key, lease=lid)
            t0 = time.monotonic_ns()
            ok = lease.release()
            history.write("rel", key=key, lease=lid, ok=ok, dur_ns=time.monotonic_ns() - t0)
        time.sleep(rng.uniform(gap_lo, gap_hi))
    history.write("agent_exit", done=done)
    rl.close()
    return 0


def critical_section(
    args: argparse.Namespace,
    rng: random.Random,
    history: History,
    lease: object,
    lid: str,
    key: str,
    store: FencedStore,
    counter: UnfencedCounter,
    number: int,
    cs_lo: float,
    cs_hi: float,
) -> None:
    from celery_redlock.lock import Lease

    assert isinstance(lease, Lease)
    try:
        fence = lease.fence
    except LockLost as exc:
        history.write("fence_fail", key=key, lease=lid, error=str(exc)[:100])
        if args.mode == "correct":
            return
        fence = 0
    except RedlockError as exc:
        history.write("fence_fail", key=key, lease=lid, error=str(exc)[:100])
        if args.mode == "correct":
            return
        fence = 0
    else:
        history.write("fence", key=key, lease=lid, fence=fence)
    history.write("cs_enter", key=key, lease=lid, fence=fence)
    try:
        accepted, value, seq = store.read(key, fence, lid)
        history.write(
            "read", key=key, lease=lid, fence=fence, value=value, accepted=accepted, seq=seq
        )
        if not accepted:
            history.write("cs_abort", key=key, lease=lid, reason="stale read refused")
            return
        seen = counter.read(key)
        work = cs_hi * rng.random() + cs_lo
        if args.long_cs and rng.random() < args.long_cs:
            work = args.long_factor * args.ttl
        history.write("work", key=key, lease=lid, ms=round(work * 1000))
        time.sleep(work)
        if not lease.held:
            history.write(
                "cs_abort", key=key, lease=lid, reason=lease.lost_reason or "validity ran out"
            )
            return
        if args.stop_in_window and number == args.stop_in_window:
            # The worst moment: the check said "held", the writes have not happened yet.
            history.write("self_stop", key=key, lease=lid)
            os.kill(os.getpid(), signal.SIGSTOP)
            history.write("self_resumed", key=key, lease=lid)
        old = counter.client.set(f"ctr:{{{key}}}", seen + 1, get=True)
        history.write(
            "ctr_write", key=key, lease=lid, based_on=seen, overwrote=int(old or 0), value=seen + 1
        )
        ok, seq = store.write(key, fence, lid, value + 1, value)
        history.write(
            "write", key=key, lease=lid, fence=fence, value=value + 1, accepted=ok, seq=seq
        )
        if not ok:
            history.write("cs_abort", key=key, lease=lid, reason="stale write refused")
            return
    except redis.RedisError as exc:  # the resource server is never faulted; report it
        history.write("cs_abort", key=key, lease=lid, reason=f"resource error: {exc}")
        raise
    history.write("cs_exit", key=key, lease=lid)


if __name__ == "__main__":
    sys.exit(main())
