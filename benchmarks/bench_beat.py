"""Beat failover and once-per-occurrence under kills, with real beats, worker and masters.

``python -m benchmarks.bench_beat --kills 50 --outages 5 --minutes 10 [--ttl 3] [--save]``

1. **Failover** (``--kills`` leader kills): three ``celery beat`` processes (lease TTL
   ``--ttl``), two 1 s interval entries, one worker. The leader is SIGKILLed, a fresh beat
   is started in its place (so three are up again), and we measure from the kill to the new
   leader's ``beat_status`` record (*takeover*) and to the first message it sends (*first
   send*, stamped into the message by the sending process). The design bound for takeover
   is the lease TTL plus the standby's poll (min(1 s, TTL/10)); the first send comes when
   the new leader's scheduler next wakes for a due entry, up to one interval later.
   Per takeover we also count the *largest burst*: the most sends of one entry within
   0.1 s after the kill (goal 1: missed occurrences are coalesced into one late send,
   ``redlock_beat_catch_up = "one"``), and over the run, how many times each occurrence
   was sent (goal: exactly 1, counting a coalesced send for the occurrences it stands for).
1b. **Masters outage** (``--outages``): two beats; all three masters are paused for twice
   the lease TTL (every lease runs out), then resumed: the same measures, from the resume.
2. **Random kills** (``--minutes``): three beats, two 1 s interval entries and an
   every-minute crontab entry; every few seconds (uniform in [TTL+1, 4·TTL]) a random beat,
   leader or not, is SIGKILLed and replaced. Afterwards the queue is drained and every run
   the task bodies recorded is checked: a *duplicate* is an occurrence that ran twice, a
   *missed* interval occurrence a gap in an entry's indexes. Crontab occurrences are
   reported apart: only interval occurrences are caught up after a takeover, so a crontab
   occurrence that falls due while nobody leads is missed by design.

The processes are ``tests/beat/proj`` (the beat tests' Celery project). Defaults (5 kills,
2 minutes) take about three minutes.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Goal, Report, num, percentile, progress, table
from celery_redlock.testing import RedisServer, start_masters

sys.path.insert(0, str(REPO / "tests" / "beat"))
# tests/beat/proj: the beat tests' Celery project and process harness (path set above)
from proj.cluster import Cluster, Proc, occurrence_problems

ENTRY_INTERVAL = 1.0
#: Two sends of one entry closer than this are one burst.
BURST_WINDOW = 0.1


def wall() -> float:
    return time.time()  # noqa: TID251 - compared with the wall times the beats record


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="leader kills to time (default 5)")
    parser.add_argument(
        "--minutes", type=float, default=2.0, help="length of the random-kill run (default 2)"
    )
    parser.add_argument(
        "--outages", type=int, default=3, help="masters outages to time (default 3)"
    )
    parser.add_argument("--ttl", type=float, default=3.0, help="beat lease TTL (default 3)")
    parser.add_argument("--seed", type=int, default=None, help="random seed of the kill run")
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    parser.add_argument(
        "--save", action="store_true", help="also write the output to docs/benchmarks/beat.txt"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a goal fails"
    )
    return parser


# --------------------------------------------------------------------------------------------
# Helpers over a Cluster
# --------------------------------------------------------------------------------------------


class Beats:
    """Three (or more) named beats of one cluster, replaced as they are killed."""

    def __init__(self, cluster: Cluster, count: int) -> None:
        self.cluster = cluster
        self.serial = 0
        self.live: list[Proc] = []
        for _ in range(count):
            self.add()
        for proc in self.live:
            proc.wait_log("leader election on", timeout=120)

    def add(self) -> Proc:
        self.serial += 1
        proc = self.cluster.beat(f"beat-{self.serial}")
        self.live.append(proc)
        return proc

    def by_name(self, name: str) -> Proc:
        return next(p for p in self.live if p.name == name)

    def kill(self, proc: Proc) -> float:
        killed_at = proc.kill()
        self.live.remove(proc)
        self.add()
        return killed_at


def wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (waited {timeout:g} s)")
        time.sleep(0.05)


def sends_after(cluster: Cluster, after: float, *, not_by: str = "") -> list[dict[str, Any]]:
    return [
        r
        for r in cluster.runs()
        if (r.get("sent_at") or 0) > after and r.get("sender") not in (None, not_by)
    ]


# --------------------------------------------------------------------------------------------
# 1. Failover over leader kills
# --------------------------------------------------------------------------------------------


def failover_run(
    workdir: Path, broker: str, masters: Sequence[str], kills: int, ttl: float
) -> dict[str, Any]:
    schedule: dict[str, float | str] = {"fo-a": ENTRY_INTERVAL, "fo-b": ENTRY_INTERVAL}
    takeovers: list[float] = []
    first_sends: list[float] = []
    kill_times: list[float] = []
    with Cluster(
        workdir / "failover", broker_url=broker, masters=masters, lease_ttl=ttl, schedule=schedule
    ) as cluster:
        cluster.worker()
        beats = Beats(cluster, 3)
        for i in range(kills):
            # A settled leader: it has sent for a while, and the standbys are all up.
            since = wall()
            wait(lambda s=since: len(sends_after(cluster, s)) >= 4, 60, "the leader sending")
            for proc in beats.live:
                proc.wait_log("leader election on", timeout=120)
            leader = wait(cluster.leader, 30, "a leader")
            killed_at = beats.kill(beats.by_name(leader))
            runs = wait(
                lambda k=killed_at, n=leader: sends_after(cluster, k, not_by=n),
                60,
                "a send by the new leader",
            )
            first = min(r["sent_at"] for r in runs) - killed_at
            statuses = [
                r
                for r in cluster.records("beat_status")
                if r["status"] == "leader" and r["t"] > killed_at and r["name"] != leader
            ]
            takeover = min(r["t"] for r in statuses) - killed_at if statuses else math.nan
            takeovers.append(takeover)
            first_sends.append(first)
            kill_times.append(killed_at)
            progress(
                f"failover {i + 1}/{kills}: killed {leader}; takeover {takeover:.2f} s, "
                f"first send {first:.2f} s"
            )
        for proc in list(beats.live):
            proc.kill()
        runs = cluster.drain(timeout=60)
    per_entry = {name: count_problems(runs, name) for name in schedule}
    return {
        "takeovers": takeovers,
        "first_sends": first_sends,
        "per_entry": per_entry,
        "bursts": [largest_burst(runs, schedule, at) for at in kill_times],
    }


def largest_burst(runs: Sequence[dict[str, Any]], names: Any, after: float) -> int:
    """The most sends of one entry within BURST_WINDOW, in the 3 intervals after ``after``
    plus the takeover (so one takeover's sends are judged, not the next one's)."""
    worst = 0
    for name in names:
        times = sorted(
            r["sent_at"]
            for r in runs
            if r["kind"] == name and after < (r.get("sent_at") or 0) < after + 30
        )
        for i, t in enumerate(times):
            worst = max(worst, sum(1 for u in times[i:] if u - t < BURST_WINDOW))
    return worst


def outage_run(
    workdir: Path, broker: str, masters: Any, outages: int, ttl: float
) -> dict[str, Any]:
    """Two beats; all masters paused for 2 x TTL, ``outages`` times."""
    schedule: dict[str, float | str] = {"out-a": ENTRY_INTERVAL, "out-b": ENTRY_INTERVAL}
    takeovers: list[float] = []
    first_sends: list[float] = []
    resume_times: list[float] = []
    with Cluster(
        workdir / "outage",
        broker_url=broker,
        masters=masters.urls,
        lease_ttl=ttl,
        schedule=schedule,
    ) as cluster:
        cluster.worker()
        beats = Beats(cluster, 2)
        for i in range(outages):
            since = wall()
            wait(lambda s=since: len(sends_after(cluster, s)) >= 4, 60, "the leader sending")
            for server in masters:
                server.pause()
            time.sleep(2 * ttl)  # the outage itself
            for server in masters:
                server.resume()
            resumed_at = wall()
            runs = wait(lambda r=resumed_at: sends_after(cluster, r), 60, "a send after it")
            first = min(r["sent_at"] for r in runs) - resumed_at
            statuses = [
                r
                for r in cluster.records("beat_status")
                if r["status"] == "leader" and r["t"] > resumed_at
            ]
            takeover = min(r["t"] for r in statuses) - resumed_at if statuses else math.nan
            takeovers.append(takeover)
            first_sends.append(first)
            resume_times.append(resumed_at)
            progress(
                f"outage {i + 1}/{outages}: leader after {takeover:.2f} s, "
                f"first send {first:.2f} s after the masters came back"
            )
        for proc in list(beats.live):
            proc.kill()
        runs = cluster.drain(timeout=60)
    return {
        "takeovers": takeovers,
        "first_sends": first_sends,
        "per_entry": {name: count_problems(runs, name) for name in schedule},
        "bursts": [largest_burst(runs, schedule, at) for at in resume_times],
        "coalesced": max((int(r.get("catch_up") or 1) for r in runs), default=1),
    }


# --------------------------------------------------------------------------------------------
# 2. Random kills
# --------------------------------------------------------------------------------------------


def count_problems(runs: Sequence[dict[str, Any]], name: str) -> tuple[int, int, int]:
    """(occurrences, duplicates, missed) of one interval entry; a coalesced late send
    (``catch_up`` = n) stands for its occurrence and the n - 1 before it."""
    counts: dict[int, int] = {}
    covered: set[int] = set()
    for r in runs:
        if r["kind"] == name and r.get("occurrence"):
            index = int(r["occurrence"].rpartition("#")[2])
            counts[index] = counts.get(index, 0) + 1
            covered.update(range(index - int(r.get("catch_up") or 1) + 1, index + 1))
    if not counts:
        return 0, 0, 0
    duplicates = sum(n - 1 for n in counts.values())
    missed = len(set(range(min(counts), max(counts) + 1)) - covered)
    return len(counts), duplicates, missed


def random_kill_run(
    workdir: Path, broker: str, masters: Sequence[str], minutes: float, ttl: float, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    schedule: dict[str, float | str] = {
        "rk-a": ENTRY_INTERVAL,
        "rk-b": ENTRY_INTERVAL,
        "rk-cron": "*",
    }
    kills = leader_kills = 0
    with Cluster(
        workdir / "random", broker_url=broker, masters=masters, lease_ttl=ttl, schedule=schedule
    ) as cluster:
        worker = cluster.worker()
        beats = Beats(cluster, 3)
        started = wall()
        end = time.monotonic() + minutes * 60
        while True:
            pause = rng.uniform(ttl + 1, 4 * ttl)
            if time.monotonic() + pause > end:
                time.sleep(max(0.0, end - time.monotonic()))
                break
            time.sleep(pause)
            victim = rng.choice(beats.live)
            leader = cluster.leader()
            beats.kill(victim)
            kills += 1
            leader_kills += victim.name == leader
            progress(
                f"random kills: {kills} ({leader_kills} leaders), "
                f"{(end - time.monotonic()) / 60:.1f} min left"
            )
        ended = wall()
        for proc in list(beats.live):
            proc.kill()
        runs = cluster.drain(timeout=60)
        logs = "".join(p.log() for p in cluster.procs if p is not worker)
        worker_log = worker.log()
    per_entry = {name: count_problems(runs, name) for name in ("rk-a", "rk-b")}
    cron = sorted(r["occurrence"] for r in runs if r["kind"] == "rk-cron")
    # Minute boundaries the run lived through, leaving a margin at both ends.
    boundaries = range(math.ceil((started + 10) / 60) * 60, int(ended) - 10, 60)
    cron_expected = {
        f"rk-cron@{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(m))}" for m in boundaries
    }
    return {
        "kills": kills,
        "leader_kills": leader_kills,
        "per_entry": per_entry,
        "cron_runs": len(cron),
        "cron_duplicates": len(cron) - len(set(cron)),
        "cron_missed": len(cron_expected - set(cron)),
        "cron_expected": len(cron_expected),
        "catch_up": logs.count("nobody sent it when it fell due") + logs.count("standing for"),
        "refused": logs.count("already sent by"),
        "worker_dropped": worker_log.count("already ran; dropped"),
        "task_id_dups": sum(1 for p in occurrence_problems(runs, ()) if p.startswith("task id")),
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    poll = min(1.0, args.ttl / 10)
    report = Report("beat", "celery-redlock beat: failover and once-per-occurrence under kills")
    report.add(
        f"setup:         3 masters, 1 broker (redis-server), 1 worker (prefork, 2), "
        f"beats: 3 `celery beat`; lease TTL {args.ttl:g} s, standby poll {poll:g} s; "
        f"entries every {ENTRY_INTERVAL:g} s",
        "",
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench-beat-"))
    progress(f"logs in {workdir}")
    with start_masters(3) as masters, RedisServer() as broker:
        failover = failover_run(workdir, broker.url, masters.urls, args.kills, args.ttl)
        outage = outage_run(workdir, broker.url, masters, args.outages, args.ttl)
        random_kills = random_kill_run(
            workdir, broker.url, masters.urls, args.minutes, args.ttl, seed
        )

    takeovers = [t for t in failover["takeovers"] if t == t]
    first_sends = failover["first_sends"]
    report.add(
        f"## 1. Failover: {args.kills} leader SIGKILLs (seconds from the kill; design bound for "
        f"takeover: TTL + poll = {args.ttl + poll:g} s, first send: + up to {ENTRY_INTERVAL:g} s)",
        "",
        *table(
            ["measure", "kills", "p50", "p95", "max"],
            [
                [
                    "takeover (new leader's lease)",
                    str(len(takeovers)),
                    num(percentile(takeovers, 50), 2),
                    num(percentile(takeovers, 95), 2),
                    num(max(takeovers, default=math.nan), 2),
                ],
                [
                    "first send by the new leader",
                    str(len(first_sends)),
                    num(percentile(first_sends, 50), 2),
                    num(percentile(first_sends, 95), 2),
                    num(max(first_sends, default=math.nan), 2),
                ],
            ],
        ),
        "",
    )
    fo = failover["per_entry"]
    report.add(
        "occurrences over the failover run: "
        + "; ".join(f"{n}: {o} ran, {d} duplicates, {m} missed" for n, (o, d, m) in fo.items())
        + f"; largest burst (sends of one entry within {BURST_WINDOW:g} s) per takeover: "
        + f"max {max(failover['bursts'], default=0)}",
        "",
    )
    out = outage
    out_takeovers = [t for t in out["takeovers"] if t == t]
    report.add(
        f"## 1b. Masters outage: {args.outages} x all masters paused {2 * args.ttl:g} s "
        "(seconds from the resume)",
        "",
        *table(
            ["measure", "outages", "p50", "p95", "max"],
            [
                [
                    "leader after the outage",
                    str(len(out_takeovers)),
                    num(percentile(out_takeovers, 50), 2),
                    num(percentile(out_takeovers, 95), 2),
                    num(max(out_takeovers, default=math.nan), 2),
                ],
                [
                    "first send after the outage",
                    str(len(out["first_sends"])),
                    num(percentile(out["first_sends"], 50), 2),
                    num(percentile(out["first_sends"], 95), 2),
                    num(max(out["first_sends"], default=math.nan), 2),
                ],
            ],
        ),
        "",
        "occurrences over the outage run: "
        + "; ".join(
            f"{n}: {o} ran, {d} duplicates, {m} missed" for n, (o, d, m) in out["per_entry"].items()
        )
        + f"; largest burst per outage: max {max(out['bursts'], default=0)}; "
        + f"largest coalesced send stood for {out['coalesced']} occurrences",
        "",
    )
    r = random_kills
    rows = [
        [f"{name} (every {ENTRY_INTERVAL:g} s)", str(o), str(d), str(m)]
        for name, (o, d, m) in r["per_entry"].items()
    ]
    rows.append(
        [
            "rk-cron (every minute)",
            str(r["cron_runs"]),
            str(r["cron_duplicates"]),
            f"{r['cron_missed']} of {r['cron_expected']}",
        ]
    )
    report.add(
        f"## 2. Random kills: {args.minutes:g} min, 3 beats, {r['kills']} SIGKILLs "
        f"({r['leader_kills']} of the leader), each beat replaced at once (seed {seed})",
        "",
        *table(["entry", "occurrences", "duplicates", "missed"], rows),
        "",
        "coalesced or late sends by catch-up (after a takeover or a failed claim): "
        f"{r['catch_up']}; claims refused (already sent): {r['refused']}; "
        "duplicates dropped by the worker: "
        f"{r['worker_dropped']}; task ids run twice: {r['task_id_dups']}",
        "",
    )
    counted = [*r["per_entry"].values(), *fo.values(), *out["per_entry"].values()]
    duplicates = sum(d for _, d, _ in counted) + r["cron_duplicates"] + r["task_id_dups"]
    missed = sum(m for _, _, m in counted) + r["cron_missed"]
    report.goal(
        Goal(
            f"takeover p95 (<= TTL + 1 = {args.ttl + 1:g} s)",
            percentile(takeovers, 95),
            args.ttl + 1,
            at_least=False,
            unit=" s",
        )
    )
    report.goal(
        Goal(
            "largest burst after a takeover or an outage (sends of one entry within 0.1 s)",
            float(max([*failover["bursts"], *out["bursts"]], default=0)),
            1,
            at_least=False,
            unit="",
        )
    )
    report.goal(Goal("duplicates (both runs)", float(duplicates), 0, at_least=False, unit=""))
    report.goal(
        Goal(
            "missed occurrences, interval and crontab (both runs)",
            float(missed),
            0,
            at_least=False,
            unit="",
        )
    )
    if args.save:
        report.save()
    if args.keep:
        progress(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if args.strict and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main())
