"""Issue 3: what holding many renewed locks costs one process.

Two parts:

1. **Holding N leases** (10, 100, 1,000, 10,000), each case in a fresh child process so
   threads and RSS belong to that case alone:

   * celery-redlock on 3 masters: N leases (``ttl=30``, ``renew_every=2``) are acquired,
     then handed to the process's renewal engine together (``Heartbeat.add``, which is what
     ``acquire(auto_renew=True)`` does), so every tick renews all N: the worst case for one
     tick. Wall time per tick is the engine's ``last_tick_seconds`` read after each tick;
     CPU per tick is the process CPU time (``time.process_time``, all threads) over the
     window divided by the ticks in it.
   * python-redis-lock on 1 master (it has no multi-master mode): N ``Lock(expire=3,
     auto_renewal=True)`` acquired; each starts its own renewal thread, which extends every
     ``expire * 2/3`` = 2 s: the same renewal period as ours. CPU is measured over the
     same window.

   Threads are ``threading.active_count()`` while holding, RSS is ``VmRSS`` while holding
   (its growth over the same process before the first lock in brackets).

2. **acquire+release with and without renewal**, interleaved rounds on one process:
   celery-redlock on 3 masters (``auto_renew=True`` vs not), python-redis-lock on 1 master
   (``auto_renewal=True`` vs not), TTL 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
import redis_lock  # type: ignore[import-untyped]

from benchmarks.common import (
    REPO,
    Goal,
    Handle,
    LogCounter,
    Report,
    Run,
    arguments,
    interleave,
    median,
    num,
    progress,
    ratio,
    rss_bytes,
    table,
    timed_cycles,
    times,
)
from celery_redlock import LockContended, Redlock
from celery_redlock.testing import start_masters

SIZES = (10, 100, 1_000, 10_000)
#: Renewal period of both libraries (python-redis-lock: expire * 2/3 with expire=3).
PERIOD = 2.0
PRL_EXPIRE = 3
#: Our leases live long enough that acquiring 10,000 of them before the first tick is safe.
OURS_TTL = 30.0
#: Ticks (renewal periods) observed per case.
PERIODS = 4
CYCLE_TTL = 10.0
CASE_TIMEOUT = 120.0
#: python-redis-lock starts a thread per lock: 10,000 of them are not a fair fight on a
#: small machine (and load it for everyone else), so the default stops at 1,000.
PRL_MAX = 1_000
PRL_CAP = (
    "Observed on the 2-core reference machine (2026-11-22): with 10,000 locks the case did not "
    "finish within 120 s (load average above 1,000); with redis-py's default pool instead of a "
    "blocking one, 7,635 of the 10,000 renewal threads died within 8 s and 2,365 locks were "
    "still held."
)


# --------------------------------------------------------------------------------------------
# Holding N locks (runs in a child process)
# --------------------------------------------------------------------------------------------


def hold_ours(urls: Sequence[str], n: int, window: float) -> dict[str, Any]:
    from celery_redlock.lock import engine

    logs = LogCounter()
    rl = Redlock(list(urls))
    rl.acquire("bench:renew:warmup", OURS_TTL).release()  # connect outside the measurement
    gc.collect()
    threads_before, rss_before = threading.active_count(), rss_bytes()
    started = time.perf_counter()
    leases = [rl.acquire(f"bench:renew:{i}", OURS_TTL, renew_every=PERIOD) for i in range(n)]
    acquire_seconds = time.perf_counter() - started
    eng = engine()
    for lease in leases:
        lease.auto_renew = True
        eng.add(lease)
    # The first tick renews all N; measure from the end of it.
    deadline = time.monotonic() + PERIOD + 30
    # (ticks too: a tick counts its renewals before it counts itself)
    while eng.renewals < n or eng.ticks < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine renewed {eng.renewals} of {n} leases in its first tick")
        time.sleep(0.002)
    ticks0, renewals0, seen = eng.ticks, eng.renewals, eng.ticks
    walls: list[float] = []
    cpu0, own0, t0 = time.process_time(), time.thread_time(), time.monotonic()
    while time.monotonic() - t0 < window:
        # Ticks are PERIOD apart and last_tick_seconds stays until the next one, so a slow
        # poll sees each; this thread's own CPU is taken out of the process's below.
        time.sleep(0.02)
        if eng.ticks != seen:
            seen = eng.ticks
            walls.append(eng.last_tick_seconds)
    cpu = (time.process_time() - cpu0) - (time.thread_time() - own0)
    elapsed = time.monotonic() - t0
    threads, rss = threading.active_count(), rss_bytes()
    ticks, renewals = eng.ticks - ticks0, eng.renewals - renewals0
    held = sum(lease.held for lease in leases)
    for lease in leases:
        lease.release()
    return {
        "threads": threads,
        "threads_before": threads_before,
        "rss": rss,
        "rss_before": rss_before,
        "acquire_seconds": acquire_seconds,
        "ticks": ticks,
        "renewals": renewals,
        "tick_walls": walls,
        "cpu": cpu,
        "elapsed": elapsed,
        "held": held,
        "errors": {},
        "warnings": logs.counts.get("setup", {}),
    }


def hold_python_redis_lock(url: str, n: int, window: float) -> dict[str, Any]:
    errors: dict[str, int] = {}

    def count(args: threading.ExceptHookArgs) -> None:
        # A renewal thread died (python-redis-lock lets the exception end the thread):
        # count it by kind instead of printing thousands of tracebacks.
        kind = args.exc_type.__name__
        errors[kind] = errors.get(kind, 0) + 1

    threading.excepthook = count
    # redis-py 8 caps a client's default pool at 100 connections and raises when a thread
    # wants a 101st: renewal threads that wake together then die (MaxConnectionsError) and
    # their locks expire. A blocking pool makes them wait their turn instead.
    client = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(
            url, max_connections=100, timeout=None
        )
    )
    warm = redis_lock.Lock(client, "bench:renew:warmup", expire=PRL_EXPIRE)
    warm.acquire(blocking=False)
    warm.release()
    gc.collect()
    threads_before, rss_before = threading.active_count(), rss_bytes()
    started = time.perf_counter()
    locks = []
    for i in range(n):
        lock = redis_lock.Lock(client, f"bench:renew:{i}", expire=PRL_EXPIRE, auto_renewal=True)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"python-redis-lock could not take bench:renew:{i}")
        locks.append(lock)
    acquire_seconds = time.perf_counter() - started
    time.sleep(PERIOD)  # the same settling as ours: one renewal period
    cpu0, own0, t0 = time.process_time(), time.thread_time(), time.monotonic()
    time.sleep(window)
    cpu = (time.process_time() - cpu0) - (time.thread_time() - own0)
    elapsed = time.monotonic() - t0
    threads, rss = threading.active_count(), rss_bytes()
    held = sum(lock.get_owner_id() == lock.id for lock in locks)
    for lock in locks:
        with contextlib.suppress(redis_lock.NotAcquired):
            lock.release()
    return {
        "threads": threads,
        "threads_before": threads_before,
        "rss": rss,
        "rss_before": rss_before,
        "acquire_seconds": acquire_seconds,
        "ticks": 0,
        # each lock renews once per period: the renewals due in the window
        "renewals": round(n * elapsed / (PRL_EXPIRE * 2 / 3)),
        "tick_walls": [],
        "cpu": cpu,
        "elapsed": elapsed,
        "held": held,
        "errors": errors,
        "warnings": {},
    }


def run_case(library: str, urls: Sequence[str], n: int, window: float) -> dict[str, Any]:
    """Run one holding case in a child process; its JSON result, or ``{"error": text}``."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_renewal",
        "--hold",
        library,
        str(n),
        "--urls",
        ",".join(urls),
        "--window",
        str(window),
    ]
    try:
        done = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=CASE_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {CASE_TIMEOUT:g} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------------------------
# acquire+release with and without renewal (in this process)
# --------------------------------------------------------------------------------------------


def ours_cycle(urls: Sequence[str], *, auto_renew: bool) -> tuple[Any, Any]:
    rl = Redlock(list(urls))
    key = f"bench:cycle:ours:{'renew' if auto_renew else 'plain'}"

    def acquire() -> Handle:
        try:
            return rl.acquire(key, CYCLE_TTL, auto_renew=auto_renew)
        except LockContended:
            return None

    return acquire, lambda lease: lease.release()


def prl_cycle(url: str, *, auto_renewal: bool) -> tuple[Any, Any]:
    lock = redis_lock.Lock(
        redis.Redis.from_url(url),
        f"bench:cycle:prl:{'renew' if auto_renewal else 'plain'}",
        expire=int(CYCLE_TTL),
        auto_renewal=auto_renewal,
    )

    def acquire() -> Handle:
        return lock if lock.acquire(blocking=False) else None

    return acquire, lambda held: held.release()


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _mb(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def case_row(library: str, masters: int, n: int, r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [library, str(masters), num(n), *["-"] * 10]
    walls = [w * 1000 for w in r["tick_walls"]]
    periods = r["elapsed"] / PERIOD
    return [
        library,
        str(masters),
        num(n),
        str(r["threads"]),
        f"{_mb(r['rss'])} (+{_mb(r['rss'] - r['rss_before'])})",
        num(median(walls), 1) if walls else "-",
        num(max(walls), 1) if walls else "-",
        f"{r['renewals'] / r['ticks']:,.0f}" if r["ticks"] else "-",
        num(r["cpu"] * 1000 / periods, 1),
        num(r["cpu"] / r["elapsed"] * 100, 1),
        num(r["cpu"] * 1e6 / r["renewals"], 1) if r["renewals"] else "-",
        f"{r['held']:,}/{n:,}",
        num(sum(r["warnings"].values())) if library == "celery-redlock" else "-",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0], rounds=10, seconds=0.5)
    parser.add_argument(
        "--prl-max",
        type=int,
        default=PRL_MAX,
        help=f"most python-redis-lock locks to hold (one thread each; default {PRL_MAX})",
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help=argparse.SUPPRESS)
    parser.add_argument("--hold", nargs=2, metavar=("LIBRARY", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument(
        "--window", type=float, default=PERIODS * PERIOD + 0.5, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.hold:  # child process: one holding case, JSON on stdout
        library, n = args.hold[0], int(args.hold[1])
        urls = args.urls.split(",")
        if library == "ours":
            result = hold_ours(urls, n, args.window)
        else:
            result = hold_python_redis_lock(urls[0], n, args.window)
        print(json.dumps(result))
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    report = Report("renewal", "renewal cost of many held locks (issue 3)")
    logs = LogCounter()
    progress("starting 3 redis-server masters ...")
    with start_masters(3) as masters:
        urls = masters.urls
        contenders = {}
        for name, (acquire, release) in {
            "ours": ours_cycle(urls, auto_renew=False),
            "ours+renew": ours_cycle(urls, auto_renew=True),
            "prl": prl_cycle(urls[0], auto_renewal=False),
            "prl+renew": prl_cycle(urls[0], auto_renewal=True),
        }.items():
            contenders[name] = lambda seconds, a=acquire, r=release: timed_cycles(a, r, seconds)
        cycles: dict[str, list[Run]] = interleave(
            contenders, args.rounds, args.seconds, "cycle", logs
        )

        cases: list[tuple[str, int, int, dict[str, Any]]] = []
        for n in sizes:
            progress(f"hold: celery-redlock, 3 masters, {n:,} leases ...")
            cases.append(("celery-redlock", 3, n, run_case("ours", urls, n, args.window)))
            if n <= args.prl_max:
                progress(f"hold: python-redis-lock, 1 master, {n:,} locks ...")
                cases.append(("python-redis-lock", 1, n, run_case("prl", urls[:1], n, args.window)))
            else:
                cases.append(
                    (
                        "python-redis-lock",
                        1,
                        n,
                        {"error": f"not run, capped at {args.prl_max:,} (--prl-max). {PRL_CAP}"},
                    )
                )
        top = max(sizes)
        progress(f"hold: celery-redlock, 1 master, {top:,} leases ...")
        cases.append(("celery-redlock", 1, top, run_case("ours", urls[:1], top, args.window)))

    report.add(
        "",
        f"Holding N locks, each renewed every {PERIOD:g} s; each case in a fresh process, "
        f"observed for {args.window:g} s after the first renewal.",
        "celery-redlock: one engine tick renews all N leases (one pipelined round to every "
        "master per 2,000 leases); python-redis-lock: one thread per lock.",
        "",
        *table(
            [
                "library",
                "masters",
                "locks",
                "threads",
                "RSS MB (+locks)",
                "tick wall p50 ms",
                "max ms",
                "leases/tick",
                "CPU ms per period",
                "CPU % core",
                "CPU µs/renewal",
                "held at end",
                "warnings",
            ],
            [case_row(*case) for case in cases],
        ),
        "",
        "threads: threading.active_count() while holding (the main thread included). CPU: "
        "process CPU time over the window (all threads but the observing main thread).",
        "python-redis-lock's renewals are not counted by the library: CPU µs/renewal assumes "
        "every lock renewed once per period.",
    )
    for library, masters_n, n, r in cases:
        if "error" in r:
            report.add(f"{library}, {masters_n} master(s), {n:,} locks: {r['error']}")
    prl_errors = [c for c in cases if c[0] == "python-redis-lock" and c[3].get("errors")]
    for library, _, n, r in prl_errors:
        died = ", ".join(f"{count:,} {kind}" for kind, count in sorted(r["errors"].items()))
        report.add(f"{library} with {n:,} locks: renewal threads died during the run: {died}")

    rows = []
    for label, plain, renewed, masters_n in (
        ("celery-redlock", "ours", "ours+renew", 3),
        ("python-redis-lock", "prl", "prl+renew", 1),
    ):
        rows.append(
            [
                label,
                str(masters_n),
                num(median(run.rate for run in cycles[plain])),
                num(median(run.rate for run in cycles[renewed])),
                num(median(run.acquire_us(50) for run in cycles[plain]), 1),
                num(median(run.acquire_us(50) for run in cycles[renewed]), 1),
                times(ratio(cycles[renewed], cycles[plain])),
            ]
        )
    report.add(
        "",
        f"acquire+release with and without renewal: {args.rounds} interleaved rounds x "
        f"{args.seconds:g} s, medians; ratio = median of per-round ratios.",
        "",
        *table(
            [
                "library",
                "masters",
                "cycles/s plain",
                "cycles/s renewed",
                "acquire p50 µs plain",
                "renewed",
                "renewed / plain",
            ],
            rows,
        ),
        "",
        "Goals (issue 3):",
    )
    ours_top = next(
        (r for lib, m, n, r in cases if lib == "celery-redlock" and m == 3 and n == top), {}
    )
    if "error" in ours_top or not ours_top:
        report.goal(
            Goal(f"{top:,} leases on 3 masters: one tick (no result)", math.nan, 100, False, " ms")
        )
    else:
        wall = median(w * 1000 for w in ours_top["tick_walls"])
        engine_threads = ours_top["threads"] - ours_top["threads_before"]
        per_tick = ours_top["renewals"] / max(1, ours_top["ticks"])
        report.goal(
            Goal(
                f"{top:,} leases on 3 masters renewed in one tick ({per_tick:,.0f} per tick), "
                f"median tick wall",
                wall,
                100,
                at_least=False,
                unit=" ms",
            )
        )
        report.goal(
            Goal(
                "threads the renewal engine adds while holding them",
                engine_threads,
                1,
                at_least=False,
                unit="",
            )
        )
    report.goal(
        Goal(
            "acquire+release with auto_renew=True vs without (3 masters)",
            ratio(cycles["ours+renew"], cycles["ours"]),
            0.9,
        )
    )
    warned = [
        f"  hold, {lib}, {m} masters, {n:,}: {count:,} x {message!r}"
        for lib, m, n, r in cases
        for message, count in r.get("warnings", {}).items()
    ]
    report.add("", *logs.summary(), *warned)
    report.finish()
    if args.save:
        report.save()
    return 1 if args.strict and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main())
