"""Issue 17: what one master of three that is down costs a job that comes now and then.

A worker process that runs a job every few seconds meets a down master on every job if
the client tries to reconnect on the job's path. Three ways a master can be down:

* **killed**: the server is gone; connects are refused at once.
* **blackholed**: the host drops packets; a connect hangs until its timeout (simulated on
  loopback by a listener whose backlog is full, see ``celery_redlock.testing.blackhole``).
* **paused**: the server is stopped (``SIGSTOP``); the kernel accepts connections, nothing
  answers.

For each, after one untimed cycle that meets the down master, ``--cycles`` acquire+release
cycles run ``--gap`` seconds apart (past celery-redlock's reconnect backoff of 1 s, so that
every one of them would reconnect if the jobs did it) and are timed one by one:

* celery-redlock ``Redlock`` on the 3 masters (``node_timeout`` 0.25 s, the default);
* pottery ``Redlock`` on the same 3 masters, its clients given the same connect and read
  timeout (0.25 s).

Then the blackholed master comes back (a ``redis-server`` on its port) and the time until
celery-redlock counts it again is taken (cycles every 10 ms meanwhile).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

import redis
from pottery import Redlock as PotteryRedlock

from benchmarks.common import Goal, Report, arguments, num, percentile, progress, table
from celery_redlock.exceptions import LockContended, QuorumUnavailable
from celery_redlock.lock import Redlock
from celery_redlock.testing import RedisServer, blackhole, start_masters, wait_for

NODE_TIMEOUT = 0.25
TTL = 10
OURS = "celery-redlock"
POTTERY = "pottery"
WAYS = ("killed", "blackholed", "paused")


def _ours(urls: list[str]) -> tuple[Callable[[], bool], Callable[[], None], Redlock]:
    rl = Redlock(urls, node_timeout=NODE_TIMEOUT)

    def cycle() -> bool:
        try:
            return bool(rl.acquire("bench:down:ours", TTL).release())
        except (LockContended, QuorumUnavailable):
            return False

    return cycle, rl.close, rl


def _pottery(urls: list[str]) -> tuple[Callable[[], bool], Callable[[], None]]:
    clients = [
        redis.Redis.from_url(url, socket_connect_timeout=NODE_TIMEOUT, socket_timeout=NODE_TIMEOUT)
        for url in urls
    ]
    lock = PotteryRedlock(key="bench:down:pottery", masters=set(clients), auto_release_time=TTL)

    def cycle() -> bool:
        try:
            if not lock.acquire(blocking=False):
                return False
            lock.release()
        except Exception:  # noqa: BLE001 - pottery raises its own errors without a quorum
            return False
        return True

    def close() -> None:
        for client in clients:
            client.close()

    return cycle, close


def _timed(cycle: Callable[[], bool], cycles: int, gap: float) -> tuple[list[float], int]:
    cycle()  # meets the down master once, untimed
    took: list[float] = []
    failed = 0
    for _ in range(cycles):
        time.sleep(gap)
        started = time.perf_counter()
        if not cycle():
            failed += 1
        took.append((time.perf_counter() - started) * 1000)
    return took, failed


@contextlib.contextmanager
def _down(way: str) -> Iterator[tuple[list[str], int | None]]:
    """Three master URLs, the third down in ``way``; the blackholed one's port too."""
    with start_masters(2) as masters:
        if way == "blackholed":
            with blackhole() as (url, port):
                yield [*masters.urls, url], port
            return
        third = RedisServer()
        try:
            if way == "killed":
                third.kill()
            else:
                third.pause()
            yield [*masters.urls, third.url], None
        finally:
            third.close()


def _came_back(urls: list[str], port: int, close_hole: Callable[[], None]) -> float:
    """Seconds from the blackholed master answering again to celery-redlock counting it."""
    cycle, close, rl = _ours(urls)
    try:
        cycle()
        cycle()
        close_hole()
        server = RedisServer(port=port)
        try:
            started = time.monotonic()
            wait_for(
                lambda: cycle() and not rl.masters[2].down,
                timeout=10,
                interval=0.01,
                message="the master that came back was never counted",
            )
            return time.monotonic() - started
        finally:
            server.close()
    finally:
        close()


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0], rounds=1, seconds=0)
    parser.add_argument("--cycles", type=int, default=20, help="timed cycles per case")
    parser.add_argument("--gap", type=float, default=1.1, help="seconds between two cycles")
    args = parser.parse_args(argv)
    report = Report("down", "one master of three down: cost per job, jobs now and then")
    report.add(
        f"{args.cycles} acquire+release cycles per case, {args.gap:g} s apart, after one "
        f"untimed cycle; node_timeout {NODE_TIMEOUT} s (pottery: same connect/read timeout)",
        "",
    )
    rows = []
    p90: dict[tuple[str, str], float] = {}
    for way in WAYS:
        for name in (OURS, POTTERY):
            progress(f"{way}: {name}")
            with _down(way) as (urls, _):
                if name == OURS:
                    cycle, close, _rl = _ours(urls)
                else:
                    cycle, close = _pottery(urls)
                try:
                    took, failed = _timed(cycle, args.cycles, args.gap)
                finally:
                    close()
            p90[(way, name)] = percentile(took, 90)
            rows.append(
                [
                    way,
                    name,
                    num(percentile(took, 50), 1),
                    num(p90[(way, name)], 1),
                    num(max(took), 1),
                    str(failed),
                ]
            )
    report.add(*table(["third master", "library", "p50 ms", "p90 ms", "max ms", "failed"], rows))
    progress("blackholed master comes back")
    with start_masters(2) as masters:
        hole = contextlib.ExitStack()
        url, port = hole.enter_context(blackhole())
        with hole:
            back = _came_back([*masters.urls, url], port, hole.close)
    report.add("", f"a blackholed master answering again was counted after {back * 1000:.0f} ms")
    report.add("")
    worst = max(p90[(way, OURS)] for way in WAYS)
    report.goal(
        Goal(
            "worst p90 cycle with a master down, jobs past the reconnect backoff",
            worst,
            NODE_TIMEOUT * 1000 / 10,
            at_least=False,
            unit=" ms",
        )
    )
    report.goal(Goal("a returning master counted within", back, 1.0, at_least=False, unit=" s"))
    report.finish()
    if args.save:
        report.save()
    return 1 if args.strict and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
