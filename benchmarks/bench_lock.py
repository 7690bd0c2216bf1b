"""Issue 2: acquire+release cycles/s and acquire latency, side by side in one run.

Contenders, each a non-blocking acquire followed by a release, TTL 10 s:

* redis-py ``Lock`` (``r.lock(name, timeout=10)``), 1 master: the reference, a plain
  single-instance lock (SET NX PX, Lua compare-and-delete).
* python-redis-lock ``redis_lock.Lock`` (``expire=10``), 1 master.
* pottery ``Redlock`` (``auto_release_time=10``) on 1, 3 and 5 masters.
* celery-redlock ``Redlock.acquire`` + ``Lease.release`` on 1, 3 and 5 masters, and on 3
  masters reading ``lease.fence`` between acquire and release: as configured by default
  (after the first read the client commits the key's fence in the acquire round) and with
  ``eager_fence_keys=0`` (every read is a round of its own, as on a key's first read).

Each contender cycles on one key of its own (every cycle releases, so the key is free
again), with one client object created up front and reused: the other libraries are not
charged for constructing their lock objects, celery-redlock's acquire builds a new Lease
every time. Rounds are interleaved (every contender runs once per round, order rotated);
the table shows medians over rounds, and each ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis_lock  # type: ignore[import-untyped]
from pottery import Redlock as PotteryRedlock

from benchmarks.common import (
    Acquire,
    Goal,
    Handle,
    LogCounter,
    Release,
    Report,
    Run,
    arguments,
    busy_processes,
    interleave,
    median,
    num,
    progress,
    ratio,
    table,
    timed_cycles,
    times,
)
from celery_redlock import LockContended, Redlock
from celery_redlock.testing import start_masters

TTL = 10.0
REDIS_PY = "redis-py Lock"
PRL = "python-redis-lock"
POTTERY = "pottery Redlock"
OURS = "celery-redlock"
OURS_FENCE = "celery-redlock + fence"
OURS_LAZY_FENCE = "celery-redlock + fence, lazy"


@dataclass
class Contender:
    library: str
    masters: int
    acquire: Acquire
    release: Release
    extra: Callable[[Handle], object] | None = None
    #: pids of the masters this contender uses, whose CPU time is counted per cycle
    servers: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.library} ({self.masters})"

    def run(self, seconds: float) -> Run:
        return timed_cycles(
            self.acquire, self.release, seconds, extra=self.extra, servers=self.servers
        )


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def redis_py(url: str) -> Contender:
    lock = _client(url).lock("bench:lock:redis-py", timeout=TTL)

    def acquire() -> Handle:
        return lock if lock.acquire(blocking=False) else None

    return Contender(REDIS_PY, 1, acquire, lambda held: held.release())  # type: ignore[attr-defined]


def python_redis_lock(url: str) -> Contender:
    lock = redis_lock.Lock(_client(url), "bench:lock:python-redis-lock", expire=int(TTL))

    def acquire() -> Handle:
        return lock if lock.acquire(blocking=False) else None

    return Contender(PRL, 1, acquire, lambda held: held.release())  # type: ignore[attr-defined]


def pottery(urls: list[str]) -> Contender:
    lock = PotteryRedlock(
        key=f"bench:lock:pottery:{len(urls)}",
        masters={_client(url) for url in urls},
        auto_release_time=TTL,
    )

    def acquire() -> Handle:
        return lock if lock.acquire(blocking=False) else None

    return Contender(POTTERY, len(urls), acquire, lambda held: held.release())  # type: ignore[attr-defined]


def celery_redlock(urls: list[str], *, fence: bool = False, lazy: bool = False) -> Contender:
    rl = Redlock(urls, eager_fence_keys=0) if lazy else Redlock(urls)
    key = f"bench:lock:ours:{len(urls)}:{'fence' if fence else 'plain'}:{'lazy' if lazy else ''}"

    def acquire() -> Handle:
        try:
            return rl.acquire(key, TTL)
        except LockContended:
            return None

    return Contender(
        (OURS_LAZY_FENCE if lazy else OURS_FENCE) if fence else OURS,
        len(urls),
        acquire,
        lambda lease: lease.release(),  # type: ignore[attr-defined]
        extra=(lambda lease: lease.fence) if fence else None,  # type: ignore[attr-defined]
    )


def _cpu_table(contenders: list[Contender], results: dict[str, list[Run]]) -> list[str]:
    """CPU per cycle (this process, and the masters it uses), and the rate it allows here.

    Everything shares this machine's cores, so a contender cannot cycle faster than
    ``cores / (client + masters CPU per cycle)``, however little it waits.
    """
    cores = os.cpu_count() or 1
    rows = []
    for c in contenders:
        runs = results[c.name]
        cycles = sum(run.cycles for run in runs)
        if not cycles:
            continue
        client = sum(run.client_cpu for run in runs) / cycles * 1e6
        server = sum(run.server_cpu for run in runs) / cycles * 1e6
        ceiling = cores * 1e6 / (client + server)
        rate = median(run.rate for run in runs)
        rows.append(
            [
                c.library,
                str(c.masters),
                num(client),
                num(server),
                num(client + server),
                num(ceiling),
                f"{rate / ceiling:.0%}",
            ]
        )
    return [
        f"CPU per cycle over all rounds (µs; /proc and process_time). With {cores} cores shared",
        "by the client and the masters, ceiling = cores / (client + masters CPU per cycle).",
        *table(
            ["library", "masters", "client", "masters", "total", "ceiling/s", "of ceiling"],
            rows,
        ),
    ]


def _busy_line(n: int) -> str:
    return (
        f"Beside {n} busy processes (a Python loop each), started after the masters and "
        "stopped after the last round."
    )


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0], rounds=8, seconds=0.6)
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes beside the benchmark (one per core: a loaded worker "
        "host); saved as lock-busy.txt",
    )
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error(f"--busy must be 0 or more, got {args.busy}")
    if args.busy:
        report = Report(
            "lock-busy",
            f"acquire+release throughput and latency beside {args.busy} busy processes "
            "(issues 2 and 17)",
        )
    else:
        report = Report("lock", "acquire+release throughput and latency (issue 2)")
    logs = LogCounter()
    progress("starting 5 redis-server masters ...")
    with start_masters(5) as masters, busy_processes(args.busy):
        urls = masters.urls
        contenders = [
            redis_py(urls[0]),
            python_redis_lock(urls[0]),
            pottery(urls[:1]),
            celery_redlock(urls[:1]),
            pottery(urls[:3]),
            celery_redlock(urls[:3]),
            celery_redlock(urls[:3], fence=True),
            celery_redlock(urls[:3], fence=True, lazy=True),
            pottery(urls[:5]),
            celery_redlock(urls[:5]),
        ]
        for c in contenders:
            c.servers = tuple(m.pid for m in masters[: c.masters])
        results = interleave(
            {c.name: c.run for c in contenders}, args.rounds, args.seconds, "lock", logs
        )

    reference = results[f"{REDIS_PY} (1)"]
    rows = []
    for c in contenders:
        runs = results[c.name]
        pottery_runs = results.get(f"{POTTERY} ({c.masters})")
        failures = sum(run.failures for run in runs)
        rows.append(
            [
                c.library,
                str(c.masters),
                num(median(run.rate for run in runs)),
                num(median(run.acquire_us(50) for run in runs), 1),
                num(median(run.acquire_us(99) for run in runs), 1),
                times(ratio(runs, reference)),
                times(ratio(runs, pottery_runs)) if pottery_runs else "-",
                str(failures),
                num(logs.total(c.name)) if c.library.startswith(OURS) else "-",
            ]
        )
    report.add(
        "",
        f"{args.rounds} interleaved rounds x {args.seconds:g} s per contender; medians over "
        "rounds; ratio = median of per-round ratios of cycles/s.",
        "Same key per contender (each cycle releases it); non-blocking acquire; TTL 10 s.",
        *([_busy_line(args.busy)] if args.busy else []),
        "",
        *table(
            [
                "library",
                "masters",
                "cycles/s",
                "acquire p50 µs",
                "p99 µs",
                "vs redis-py Lock (1)",
                "vs pottery (same N)",
                "failed acquires",
                "warnings",
            ],
            rows,
        ),
    )
    fenced, lazy = results[f"{OURS_FENCE} (3)"], results[f"{OURS_LAZY_FENCE} (3)"]
    report.add("", "the first lease.fence of a lease on 3 masters:")
    for runs, what in (
        (fenced, "committed in the acquire round (waits only for replies still in flight)"),
        (lazy, "lazy, eager_fence_keys=0 (one round that waits for every reachable master)"),
    ):
        report.add(
            f"  {what}:",
            f"    p50 {num(median(run.extra_us(50) for run in runs), 1)} µs, p99 "
            f"{num(median(run.extra_us(99) for run in runs), 1)} µs, mean "
            f"{num(median(run.extra_mean_us() for run in runs), 1)} µs; acquire on the same "
            f"rows: mean {num(median(run.acquire_mean_us() for run in runs), 1)} µs",
        )
    report.add("", *_cpu_table(contenders, results))
    report.add(
        "",
        *logs.summary(),
        "",
        "Goals (issue 2):",
    )
    ours3, ours5 = results[f"{OURS} (3)"], results[f"{OURS} (5)"]
    report.goal(Goal("3 masters vs redis-py Lock on 1 master", ratio(ours3, reference), 1.0))
    pottery3, pottery5 = results[f"{POTTERY} (3)"], results[f"{POTTERY} (5)"]
    report.goal(Goal("3 masters vs pottery on 3 masters", ratio(ours3, pottery3), 12))
    report.goal(Goal("5 masters vs redis-py Lock on 1 master", ratio(ours5, reference), 0.6))
    report.goal(Goal("5 masters vs pottery on 5 masters", ratio(ours5, pottery5), 12))
    report.goal(
        Goal(
            "fence read cost on 3 masters (cycles/s without / with fence)",
            ratio(ours3, fenced),
            1.6,
            at_least=False,
        )
    )
    report.add(f"      (lazy, every read its own round: {times(ratio(ours3, lazy))})")
    report.finish()
    if args.save:
        report.save()
    return 1 if args.strict and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main())
