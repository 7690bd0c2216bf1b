"""CPU per job to the microsecond, in one process: what each library adds to a job (issue 17).

The task benchmark (``tasks``) runs a real worker and reads CPU from ``/proc``, in 10 ms
ticks, while a publisher, a worker, the broker and the masters share the cores: its own-cost
column swings by hundreds of µs between runs. This one takes the two halves of a job apart,
in this process, with ``time.process_time``:

* **publish**: ``task.apply_async((i,))`` on an in-memory broker (``memory://``);
* **run**: what a pool process does with the message, Celery's tracer (``build_tracer``,
  as the worker calls it) running the job: the task's ``__call__``, body, hooks.

Every batch publishes ``--batch`` jobs with fresh arguments, then runs exactly those jobs;
contenders take turns batch by batch; a cell is the **lowest** CPU per job over the batches
(the least disturbed; the median is shown beside it).

The floor is measured **in context**: ``raw rounds`` is the plain task's publish with one
CLAIM round added and its run with an ACQUIRE round and a RELEASE sent, the same scripts
and payloads SingletonTask sends, on non-blocking sockets, deciding at a quorum and leaving
a late reply to be read by the next round, as any Redlock client must (so it waits for
the quorum, not for every master), but with no library code. Measured between the plain
job's own work rather than in a tight loop: a round costs more there (caches, the late
reply), for any client, and that is the cost the plain job's neighbours pay.
``own cost`` = SingletonTask's job minus the raw rounds' job; the masters' CPU is read for
both over the same batches (``/proc``; summed over all batches, so ticks do not matter).
"""

from __future__ import annotations

import cProfile
import itertools
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer

from benchmarks.common import (
    Goal,
    Report,
    arguments,
    cpu_seconds,
    num,
    progress,
    table,
)
from benchmarks.raw_rounds import (
    RawRounds,
    acquire_payload,
    claim_payload,
    connect,
    lock_name,
    release_payload,
)
from celery_redlock import SingletonTask
from celery_redlock.client import redlock_for
from celery_redlock.lock.wire import pack_command, reader
from celery_redlock.testing import Masters, RedisServer, start_masters

PLAIN, RAW, OURS, SINGLETON, ONCE = (
    "plain task",
    "raw rounds",
    "SingletonTask",
    "celery-singleton",
    "celery-once",
)


def _app(masters: Masters, counter: RedisServer) -> Celery:
    from celery_once import QueueOnce  # type: ignore[import-untyped]
    from celery_singleton import Singleton  # type: ignore[import-untyped]

    app = Celery("jobcost", broker="memory://", backend=None, set_as_current=False)
    app.conf.update(
        redlock_redis_urls=masters.urls,
        task_ignore_result=True,
        singleton_backend_url=counter.url,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": counter.url, "default_timeout": 300},
        },
    )

    def body(i: int) -> int:
        return i

    app.task(name="bench.plain")(body)
    app.task(name="bench.job", base=SingletonTask, lock_ttl=30)(body)
    app.task(name="bench.singleton", base=Singleton, lock_expiry=300)(body)
    app.task(name="bench.once", base=QueueOnce, once={"graceful": True})(body)
    return app


class Contender:
    """Publishes a batch, then runs it; keeps the CPU per job of each half."""

    def __init__(self, app: Celery, name: str, task_name: str, raw: RawRounds | None) -> None:
        self.app, self.name, self.raw = app, name, raw
        self.task = app.tasks[task_name]
        self.tracer = build_tracer(task_name, self.task, eager=False, app=app, propagate=True)
        self.publish: list[float] = []
        self.run: list[float] = []
        self.master_cpu = 0.0
        self.jobs = 0

    def batch(self, args: Sequence[int], masters: Masters | None) -> None:
        before = _masters_cpu(masters)
        ids = self._publish(args)
        self._run(args, ids)
        self.master_cpu += _masters_cpu(masters) - before
        self.jobs += len(args)
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_purge("celery")

    def _publish(self, args: Sequence[int]) -> list[str]:
        task, raw, ids = self.task, self.raw, []
        started = time.process_time()
        for i in args:
            result = task.apply_async((i,))
            if raw is not None:
                raw.round(claim_payload(f"{lock_name('bench.job', i)}:dedupe:bench.job", result.id))
            ids.append(result.id)
        self.publish.append((time.process_time() - started) / len(args) * 1e6)
        return ids

    def _run(self, args: Sequence[int], ids: Sequence[str]) -> None:
        tracer, raw = self.tracer, self.raw
        requests = [
            {"id": task_id, "hostname": "celery@bench", "delivery_info": {}, "headers": {}}
            for task_id in ids
        ]
        started = time.process_time()
        for i, task_id, request in zip(args, ids, requests, strict=True):
            if raw is not None:
                lock = lock_name("bench.job", i)
                token = f"{i:032x}"
                raw.round(acquire_payload(lock, f"{lock}:dedupe:bench.job", token, task_id))
            tracer(task_id, (i,), {}, request)
            if raw is not None:
                raw.round(release_payload(lock, token), wait=False)
        self.run.append((time.process_time() - started) / len(args) * 1e6)

    def cell(self, values: list[float]) -> tuple[float, float]:
        return min(values), statistics.median(values)

    @property
    def job(self) -> float:
        return min(p + r for p, r in zip(self.publish, self.run, strict=True))


def _masters_cpu(masters: Masters | None) -> float:
    return sum(cpu_seconds(m.pid) for m in masters) if masters else 0.0


def _measure(
    n_masters: int, counter: RedisServer, batches: int, size: int, ids: Any, with_anchors: bool
) -> tuple[dict[str, Contender], Masters]:
    masters = start_masters(n_masters)
    app = _app(masters, counter)
    redlock_for(app)  # connects lazily; created here so the first batch does not pay it
    raw = RawRounds((m.host, m.port) for m in masters)
    contenders = {
        PLAIN: Contender(app, PLAIN, "bench.plain", None),
        RAW: Contender(app, RAW, "bench.plain", raw),
        OURS: Contender(app, OURS, "bench.job", None),
    }
    if with_anchors:
        contenders[SINGLETON] = Contender(app, SINGLETON, "bench.singleton", None)
        contenders[ONCE] = Contender(app, ONCE, "bench.once", None)
    watched = {RAW: masters, OURS: masters}
    for contender in contenders.values():  # warm-up: connections, scripts, imports
        contender.batch([next(ids) for _ in range(100)], None)
        contender.publish.clear()
        contender.run.clear()
        contender.master_cpu, contender.jobs = 0.0, 0
    order = list(contenders.values())
    for b in range(batches):
        progress(f"{n_masters} master(s): batch {b + 1} of {batches}")
        for contender in order[b % len(order) :] + order[: b % len(order)]:
            contender.batch([next(ids) for _ in range(size)], watched.get(contender.name))
    raw.close()
    return contenders, masters


_SYSCALLS = ("<method 'send'", "<method 'recv'", "<method 'poll'", "<method 'sendall'")


def _profile(n_masters: int, counter: RedisServer, jobs: int, ids: Any) -> list[str]:
    """Where SingletonTask's job goes: cProfile's own time per area."""
    with start_masters(n_masters) as masters:
        app = _app(masters, counter)
        contender = Contender(app, OURS, "bench.job", None)
        contender.batch([next(ids) for _ in range(200)], None)
        profile = cProfile.Profile()
        profile.enable()
        contender.batch([next(ids) for _ in range(jobs)], None)
        profile.disable()
    areas: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if "celery_redlock" in path:
            area = "celery-redlock: " + path.rsplit("celery_redlock/", 1)[1].removesuffix(".py")
        elif path == "~" and name.startswith(_SYSCALLS):
            area = "socket system calls (send, recv, poll)"
        elif "celery/" in path or "kombu/" in path or "/celery_" in path:
            area = "Celery and kombu"
        else:
            area = "builtins and standard library"
        areas[area] = areas.get(area, 0.0) + own
    total = sum(areas.values())
    rows = [
        [area, f"{seconds / total * 100:.0f} %"]
        for area, seconds in sorted(areas.items(), key=lambda kv: -kv[1])
        if seconds / total >= 0.01
    ]
    return table(["where (own time, cProfile)", "share"], rows)


_AREAS = (
    ("celery-redlock", "celery_redlock"),
    ("raw rounds (benchmarks/raw_rounds.py)", "raw_rounds"),
    ("celery-singleton", "/celery_singleton/"),
    ("celery-once", "/celery_once/"),
    ("redis-py", "/redis/"),
    ("Celery", "/celery/"),
    ("kombu", "/kombu/"),
)
_OTHER = "other (stdlib, json, vine ...)"


def _area(filename: str) -> str:
    return next((name for name, marker in _AREAS if marker in filename), _OTHER)


class _Counter:
    """A ``sys.settrace`` function counting the bytecodes run, per library."""

    def __init__(self) -> None:
        self.per_area: dict[str, int] = {}
        self._areas: dict[Any, str] = {}

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            code = frame.f_code
            area = self._areas.get(code)
            if area is None:
                area = self._areas[code] = _area(code.co_filename)
            self.per_area[area] = self.per_area.get(area, 0) + 1
        return self


def _bytecodes(n_masters: int, counter: RedisServer, jobs: int, ids: Any) -> list[str]:
    """Python bytecodes executed per job, per contender and per library (``sys.settrace``).

    A count, not a time: nearly the same on every machine and run for the same code and
    library versions (how replies arrive, and polling for them on an idle core, move it by
    a few per cent), so changes to the library's own work show in it, where CPU times move
    by tens of µs between runs and by 1.7x between hosts. It leaves out what a
    bytecode costs (a C call counts one) and the system calls, which the rows above time.
    The raw rounds build their payloads with the library's script encoder (the same
    scripts): those few bytecodes count in its row.
    """
    with start_masters(n_masters) as masters:
        app = _app(masters, counter)
        raw = RawRounds((m.host, m.port) for m in masters)
        contenders = [
            Contender(app, name, task, rounds)
            for name, task, rounds in ((PLAIN, "bench.plain", None), (RAW, "bench.plain", raw),
                                       (OURS, "bench.job", None),
                                       (SINGLETON, "bench.singleton", None),
                                       (ONCE, "bench.once", None))
        ]  # fmt: skip
        counts: dict[str, dict[str, int]] = {}
        for contender in contenders:
            contender.batch([next(ids) for _ in range(100)], None)  # warm: imports, connects
            tracer = _Counter()
            batch = [next(ids) for _ in range(jobs)]
            sys.settrace(tracer)
            try:
                contender.batch(batch, None)
            finally:
                sys.settrace(None)
            counts[contender.name] = {a: round(c / jobs) for a, c in tracer.per_area.items()}
        raw.close()
    plain = sum(counts[PLAIN].values())
    names = [name for name, _ in _AREAS] + [_OTHER]
    rows = [[name, *(str(counts[c.name].get(name, 0)) for c in contenders)] for name in names]
    rows.append(["total", *(str(sum(counts[c.name].values())) for c in contenders)])
    beyond = (str(sum(counts[c.name].values()) - plain) for c in contenders)
    rows.append(["beyond plain", *beyond])
    floor = sum(counts[RAW].values())
    rows.append(["beyond the raw rounds", *(
        str(sum(counts[c.name].values()) - floor) if c.name == OURS else "-" for c in contenders
    )])  # fmt: skip
    return [
        f"Python bytecodes per job ({jobs} jobs each, {n_masters} master(s); sys.settrace): a",
        "count, nearly the same on every machine for the same code and library versions",
        *table(["library", *(c.name for c in contenders)], rows),
    ]


#: (what, top-level command in ``INFO commandstats``, payload of call ``i``)
_COMMANDS: tuple[tuple[str, str, Any], ...] = (
    ("CLAIM (publish)", "evalsha",
     lambda i: claim_payload(f"{lock_name('t', i)}:dedupe:t", f"{i:036d}")),
    ("ACQUIRE, 6 metadata fields (run)", "evalsha",
     lambda i: acquire_payload(lock_name("t", i), f"{lock_name('t', i)}:dedupe:t", f"{i:032x}",
                               f"{i:036d}")),
    ("RELEASE (run's end)", "evalsha", lambda i: release_payload(lock_name("t", i), f"{i:032x}")),
    ("SET NX PX (celery-singleton's lock)", "set",
     lambda i: pack_command(("SET", f"singleton:{i:032x}", f"{i:036d}", "NX", "PX", 300_000))),
    ("DEL (celery-singleton's unlock)", "del",
     lambda i: pack_command(("DEL", f"singleton:{i:032x}"))),
)  # fmt: skip


def _server_time(calls: int, repeats: int = 3) -> list[str]:
    """Each command's own time on the server, µs per call (``INFO commandstats``, the
    top-level command: a script's includes the commands it calls), on one fresh server:
    ``calls`` calls of each, pipelined 1,000 at a time, ``repeats`` times."""
    seen: dict[str, list[float]] = {what: [] for what, _, _ in _COMMANDS}
    with RedisServer() as server:
        link, stats = connect(server.host, server.port), server.client()
        try:
            for _ in range(repeats):
                stats.flushall()
                for what, name, payload in _COMMANDS:
                    stats.config_resetstat()
                    for start in range(0, calls, 1000):
                        batch = range(start, min(calls, start + 1000))
                        link.sendall(b"".join(payload(i) for i in batch))
                        replies, got = reader(), 0
                        while got < len(batch):
                            replies.feed(link.recv(1 << 20))
                            while replies.gets() is not False:
                                got += 1
                    found = stats.info("commandstats")[f"cmdstat_{name}"]
                    seen[what].append(found["usec"] / found["calls"])
        finally:
            link.close()
    rows = [[what, f"{min(v):.1f} .. {max(v):.1f}"] for what, v in seen.items()]
    return [
        f"Server time per command (one fresh server; INFO commandstats, {calls:,} pipelined",
        f"calls each, {repeats} times; µs per call, lowest .. highest): what runs on a master",
        "apart from reading the command and writing the reply",
        *table(["command", "µs per call"], rows),
    ]


def main(argv: list[str]) -> int:
    parser = arguments(__doc__.splitlines()[0], rounds=9, seconds=0)
    parser.add_argument("--batch", type=int, default=500, help="jobs per batch (default 500)")
    parser.add_argument(
        "--masters", type=int, nargs="+", default=[1, 3], help="master counts (default 1 3)"
    )
    parser.add_argument("--profile", action="store_true", help="also profile SingletonTask")
    parser.add_argument(
        "--no-bytecodes", action="store_true", help="skip the bytecode count per job"
    )
    args = parser.parse_args(argv)
    report = Report("jobcost", "CPU per job in one process: publish and run, µs (issue 17)")
    report.add(
        f"{args.rounds} batches of {args.batch} jobs per contender, taking turns; a cell is the"
        " lowest batch's CPU per job [median]; process_time; in-memory broker",
        "",
    )
    ids = itertools.count()
    rows: list[list[str]] = []
    summary: list[list[str]] = []
    goals: list[Goal] = []
    with RedisServer() as counter:
        for i, n in enumerate(args.masters):
            contenders, masters = _measure(n, counter, args.rounds, args.batch, ids, i == 0)
            with masters:
                plain_job = contenders[PLAIN].job
                for contender in contenders.values():
                    pub, pub_med = contender.cell(contender.publish)
                    run, run_med = contender.cell(contender.run)
                    masters_us = (
                        num(contender.master_cpu / contender.jobs * 1e6)
                        if contender.jobs and contender.name in (RAW, OURS)
                        else "-"
                    )
                    rows.append(
                        [
                            str(n) if contender.name in (RAW, OURS) else "-",
                            contender.name,
                            f"{num(pub)} [{num(pub_med)}]",
                            f"{num(run)} [{num(run_med)}]",
                            num(contender.job),
                            num(contender.job - plain_job),
                            masters_us,
                        ]
                    )
                ours, raw = contenders[OURS], contenders[RAW]
                own = ours.job - raw.job
                # /proc counts 10 ms ticks: a short run (few batches) may read none.
                raw_cpu = raw.master_cpu / raw.jobs if raw.jobs else 0.0
                ratio = (ours.master_cpu / ours.jobs) / raw_cpu if raw_cpu else None
                shown = "-" if ratio is None else f"{ratio:.2f}x"
                summary.append([str(n), num(ours.job - plain_job), num(raw.job - plain_job),
                                num(own), shown])  # fmt: skip
                goals.append(Goal(f"own cost per job, {n} master(s)", own, 100, False, " µs"))
                if ratio is not None:
                    goals.append(Goal(f"masters' CPU vs the raw rounds, {n} master(s)", ratio,
                                      1.15, False))  # fmt: skip
        report.add(
            *table(
                ["masters", "contender", "publish", "run", "job", "beyond plain", "masters/job"],
                rows,
            ),
            "",
            "SingletonTask beyond a plain job, the raw rounds beyond it (in context), and the",
            "difference: the library's own cost per job; masters' CPU against the raw rounds'.",
            *table(["masters", "SingletonTask", "raw rounds", "own cost", "masters/raw"], summary),
            "",
        )
        report.add(*_server_time(20_000), "")
        if not args.no_bytecodes:
            for n in args.masters:
                report.add(*_bytecodes(n, counter, 200, ids), "")
        if args.profile:
            report.add(*_profile(max(args.masters), counter, 3000, ids), "")
    for goal in goals:
        report.goal(goal)
    report.finish()
    if args.save:
        report.save()
    return 1 if args.strict and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
