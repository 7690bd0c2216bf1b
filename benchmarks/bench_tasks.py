"""End-to-end task throughput, latency and the duplicate storm (issues 4 and 17).

One real ``celery worker`` (prefork, 2 processes) on a Redis broker (or the RabbitMQ
running on this host: ``--broker amqp``), 3 Redlock masters (``--masters``).
Contenders, interleaved per round: a plain task, the plain task with SingletonTask's three
rounds sent around it over raw sockets (``raw rounds``: the floor, see ``raw_rounds``),
SingletonTask, celery-singleton and celery-once, each publishing N jobs with distinct
arguments; the time from the first publish until every body has run gives tasks/s.
Then the latency a job adds (publish to
body start, p50 and p99; plain task and SingletonTask; see ``task_latency``). Then the
duplicate storm (Redis broker only): one job whose body runs 2 s, published again 1,000
times while it runs: how many publishes were accepted, how many bodies ran, and (for a
run-time lock alone, no dedupe) how fast the worker skips the duplicates. Last, with 3
masters or more, one master is killed and throughput and latency taken again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

from benchmarks import task_brokers, task_latency
from benchmarks.common import (
    REPO,
    Goal,
    Report,
    arguments,
    child_pids,
    cpu_seconds,
    median,
    num,
    progress,
    table,
    times,
)
from benchmarks.raw_rounds import (
    acquire_payload,
    claim_payload,
    connect,
    lock_name,
    release_payload,
)
from celery_redlock.testing import RedisServer, start_masters, wait_for

STORM = 1000
RAW = "raw rounds"


def ratio(rates: dict[str, list[float]], name: str, reference: str) -> float:
    """``name``'s tasks/s over ``reference``'s: the median of the rounds' ratios."""
    return median(a / b for a, b in zip(rates[name], rates[reference], strict=True))


def _start_worker(env: dict[str, str], logdir: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "celery", "-A", "benchmarks.taskbench_app", "worker",
        "-P", "prefork", "-c", "2", "-l", "warning",
        "--without-mingle", "--without-gossip", "--without-heartbeat",
    ]  # fmt: skip
    log = open(os.path.join(logdir, "worker.log"), "wb")  # noqa: SIM115 - lives with the worker
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


def _drain(counter: redis.Redis, want: int, timeout: float) -> float:
    start = time.perf_counter()
    wait_for(lambda: int(counter.get("bench:done") or 0) >= want, timeout, interval=0.005)
    return time.perf_counter() - start


#: where the CPU of a job goes: column name -> the processes counted there
Processes = dict[str, list[int]]


def _cpu(processes: Processes) -> dict[str, float]:
    out = {}
    for name, pids in processes.items():
        total = 0.0
        for pid in pids:
            with contextlib.suppress(OSError):  # a pool process that was replaced
                total += cpu_seconds(pid)
        out[name] = total
    return out


def _throughput(
    task: Any, counter: redis.Redis, n: int, base: int, processes: Processes
) -> tuple[float, dict[str, float]]:
    """Publish ``n`` jobs, wait until all ran: (jobs/s, CPU µs per job per column).

    The publisher column counts this process while it publishes only (not while it
    polls for the end); the others count the whole run.
    """
    counter.set("bench:done", 0)
    before = _cpu(processes)
    start = time.perf_counter()
    publisher = time.process_time()
    for i in range(n):
        task.apply_async((base + i,))
    publisher = time.process_time() - publisher
    _drain(counter, n, timeout=300)
    rate = n / (time.perf_counter() - start)
    after = _cpu(processes)
    cpu = {name: (after[name] - before[name]) / n * 1e6 for name in processes}
    return rate, {"publisher": publisher / n * 1e6, **cpu}


def _round_trip_floor(masters: Any, jobs: int = 3000) -> tuple[float, float]:
    """CPU µs per job of SingletonTask's three rounds alone: (this process, the masters).

    The same three scripts a job sends (the dedupe claim, the acquire that clears the
    marker and stores metadata, the release) go to every master over raw sockets, one
    round after another, each waiting for all replies, with every payload built before
    the clock starts: what any implementation of these three rounds must pay here, with
    no library code in it.
    """
    links = [connect(master.host, master.port) for master in masters]
    try:
        payloads = []
        for job in range(jobs):
            lock = lock_name("floor", job)
            marker, task_id, token = f"{lock}:dedupe:floor", f"{job:036d}", f"{job:032x}"
            payloads += [
                claim_payload(marker, task_id),
                acquire_payload(lock, marker, token, task_id),
                release_payload(lock, token),
            ]
        before = sum(cpu_seconds(m.pid) for m in masters)
        started = time.process_time()
        for payload in payloads:
            for link in links:
                link.sendall(payload)
            for link in links:
                link.recv(128)  # one small reply: ":1\r\n"
        client = time.process_time() - started
        server = sum(cpu_seconds(m.pid) for m in masters) - before
    finally:
        for link in links:
            link.close()
    return client / jobs * 1e6, server / jobs * 1e6


def _storm(
    task: Any, counter: redis.Redis, broker: redis.Redis, arg: int, body: float = 2.0
) -> tuple[int, int, float, int]:
    """Returns (publishes accepted, bodies run, seconds the worker spent on the queue,
    bodies that ran while another was running).

    ``body`` is how long the first job runs. For a run-time lock alone it must outlast
    the whole storm, or duplicates still queued when it ends run their own bodies and the
    skip rate would count their run time.
    """
    runs_key = f"bench:runs:{arg}"  # this storm's bodies only (see taskbench_app._done)
    counter.delete(runs_key)
    ids = {task.apply_async((arg, body)).id}
    rejected = 0
    for _ in range(STORM):
        result = task.apply_async((arg, body))
        if getattr(result, "state", None) == "REJECTED":  # celery-once, graceful
            rejected += 1
        else:
            ids.add(result.id)
    accepted = len(ids)
    published = time.perf_counter()
    wait_for(lambda: broker.llen("celery") == 0, 300, interval=0.01)
    drained = time.perf_counter() - published
    # The first body runs 2 s; wait for it, then until every accepted job has started
    # or was dropped: nothing waits in the queue or in the worker (a job rescheduled on
    # contention, as dedupe="queued"'s follow-up is while the first runs, waits there
    # unacknowledged for its backoff). Then let the last body started finish, so it is
    # counted.
    wait_for(lambda: counter.llen(runs_key) >= 1, 30, interval=0.01)
    wait_for(lambda: broker.llen("celery") == 0 and broker.hlen("unacked") == 0, 300, 0.05)
    time.sleep(body + 0.5)
    runs = sorted(tuple(float(t) for t in raw.split()) for raw in counter.lrange(runs_key, 0, -1))
    overlapping, busy_until = 0, float("-inf")
    for started, ended in runs:
        overlapping += started < busy_until
        busy_until = max(busy_until, ended)
    return accepted, len(runs), drained, overlapping


def _one_master_down(
    report: Report,
    args: argparse.Namespace,
    masters: Sequence[RedisServer],
    bench_app: Any,
    counter: redis.Redis,
    processes: Processes,
    healthy_rates: dict[str, list[float]],
    base: int,
) -> dict[str, list[list[float]]]:
    """Kill the last master (SIGKILL), then take throughput and latency again: plain
    task and SingletonTask. Returns the latencies (see :mod:`task_latency`)."""
    dead = masters[-1]
    progress(f"killing master {dead.url}")
    dead.kill()
    # Every process that takes a lock (the publisher, both pool processes) meets the
    # dead master once and marks it down before anything is timed.
    _throughput(bench_app.redlocked, counter, 50, base, processes)
    base += 50
    contenders = {"plain task": bench_app.plain, "SingletonTask": bench_app.redlocked}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for rnd in range(args.rounds):
        order = list(contenders.items())
        if rnd % 2:
            order.reverse()
        for name, task in order:
            progress(f"one master down, round {rnd + 1}: {name}")
            base += args.tasks
            rates[name].append(_throughput(task, counter, args.tasks, base, processes)[0])
    down_ratio = ratio(rates, "SingletonTask", "plain task")
    healthy = ratio(healthy_rates, "SingletonTask", "plain task")
    report.add(
        f"One master of {len(masters)} killed (SIGKILL; the others hold the quorum): tasks/s",
        "(SingletonTask vs plain: the median of the rounds' ratios; healthy: the same from",
        "the first table's rounds).",
        *table(
            ["contender", "tasks/s", "vs plain", "healthy vs plain"],
            [
                ["plain task", num(median(rates["plain task"])), "-", "-"],
                [
                    "SingletonTask",
                    num(median(rates["SingletonTask"])),
                    times(down_ratio),
                    times(healthy),
                ],
            ],
        ),
        "",
    )
    if args.latency_jobs <= 0:
        return {}
    latency = task_latency.measure(
        contenders, counter, args.rounds, args.latency_jobs, base, "latency, one master down"
    )
    report.add(
        *task_latency.lines(
            latency,
            "plain task",
            [f"Latency per job with one master of {len(masters)} killed, as above, in µs:"],
        )
    )
    return latency


def main(argv: list[str]) -> int:
    parser = arguments(__doc__.splitlines()[0], rounds=3, seconds=0)
    parser.add_argument("--tasks", type=int, default=1000, help="jobs per contender per round")
    parser.add_argument(
        "--masters", type=int, default=3, help="Redlock masters SingletonTask uses (default 3)"
    )
    parser.add_argument(
        "--no-storm", action="store_true", help="skip the duplicate storms (throughput only)"
    )
    parser.add_argument(
        "--broker",
        choices=("redis", "amqp"),
        default="redis",
        help="redis: a fresh redis-server (default); amqp: the RabbitMQ at --amqp-url",
    )
    parser.add_argument(
        "--amqp-url",
        default=task_brokers.DEFAULT_AMQP_URL,
        help=f"RabbitMQ for --broker amqp (default {task_brokers.DEFAULT_AMQP_URL})",
    )
    parser.add_argument(
        "--latency-jobs",
        type=int,
        default=300,
        help="jobs per contender per round in the latency rounds (default 300; 0: none)",
    )
    parser.add_argument(
        "--no-down",
        action="store_true",
        help="skip killing one master at the end (done with 3 masters or more)",
    )
    args = parser.parse_args(argv)
    n_masters = args.masters
    masters_column = f"{n_masters} master" + ("s" if n_masters != 1 else "")
    try:
        broker = task_brokers.start(args.broker, args.amqp_url)
    except task_brokers.BrokerUnreachable as exc:
        progress(f"tasks benchmark: {exc}")
        return 2
    storms = not args.no_storm and broker.kind == "redis"
    # Killing one master leaves a quorum from 3 masters on.
    down = not args.no_down and n_masters - 1 >= n_masters // 2 + 1
    masters = start_masters(n_masters)
    counter_server = RedisServer()
    worker = None
    try:
        if not counter_server.alive:
            counter_server.start()
        env = dict(
            os.environ,
            BENCH_BROKER=broker.url,
            BENCH_QUEUE=broker.queue,
            BENCH_MASTERS=",".join(m.url for m in masters),
            BENCH_COUNTER=counter_server.url,
            PYTHONPATH=str(REPO),
        )
        names = ("BENCH_BROKER", "BENCH_QUEUE", "BENCH_MASTERS", "BENCH_COUNTER")
        os.environ.update({k: env[k] for k in names})
        from benchmarks import taskbench_app as bench_app

        counter = counter_server.client()
        logdir = os.path.join(str(counter_server.dir), "worker")
        os.makedirs(logdir, exist_ok=True)
        worker = _start_worker(env, logdir)
        progress("waiting for the worker")
        counter.set("bench:done", 0)
        bench_app.plain.delay(0)
        _drain(counter, 1, timeout=60)

        name = "tasks" if broker.kind == "redis" else "tasks-amqp"
        report = Report(
            name if n_masters == 3 else f"{name}-{n_masters}",
            f"End-to-end tasks/s through a prefork worker ({broker.label}, {masters_column})",
        )
        if broker.kind == "amqp":
            report.add(
                f"broker: RabbitMQ at {task_brokers.safe_url(broker.url)}, queue {broker.queue}"
                " (this run's own; not started by the benchmark, and shared with whatever else"
                " uses it: its CPU column counts all of its work)."
            )
        processes: Processes = {
            "worker main": [worker.pid],
            "pool processes": child_pids(worker.pid),
            masters_column: [m.pid for m in masters],
        }
        if broker.pids:
            processes["broker"] = broker.pids
        processes["counter Redis"] = [counter_server.pid]
        rates: dict[str, list[float]] = {name: [] for name in bench_app.TASKS}
        cpus: dict[str, list[dict[str, float]]] = {name: [] for name in bench_app.TASKS}
        base = 1_000_000
        for rnd in range(args.rounds):
            order = list(bench_app.TASKS.items())
            if rnd % 2:
                order.reverse()
            for name, task in order:
                progress(f"round {rnd + 1}: {name}")
                base += args.tasks
                rate, cpu = _throughput(task, counter, args.tasks, base, processes)
                rates[name].append(rate)
                cpus[name].append(cpu)
        rows = [
            [name, num(median(r)), times(ratio(rates, name, "plain task"))]
            for name, r in rates.items()
        ]
        report.add("", *table(["contender", "tasks/s", "vs plain"], rows), "")
        columns = ["publisher", *processes]
        cpu_rows = []
        totals: dict[str, float] = {}
        for name, per_round in cpus.items():
            cells = [median(c[column] for c in per_round) for column in columns]
            totals[name] = sum(cells)
            cpu_rows.append([name, *(num(v) for v in cells), num(totals[name])])
        report.add(
            "CPU per job in µs (medians over rounds; /proc, 10 ms ticks). Everything runs on",
            "this machine's cores, so tasks/s follows the total. The counter Redis takes every",
            "body's INCR, and celery-singleton's and celery-once's locks.",
            *table(["contender", *columns, "total"], cpu_rows),
            "",
        )
        # Issue 17: the floor is the "raw rounds" contender, a plain job with the three
        # rounds around it in this same worker, under this same load; the tight loop
        # below only shows what a round costs where nothing else runs.
        progress("round trips alone, in a tight loop")
        loop_client, loop_masters = _round_trip_floor(masters)
        plain_cpu = totals["plain task"]
        medians = {
            name: {c: median(x[c] for x in per_round) for c in columns}
            for name, per_round in cpus.items()
        }
        client_columns = ("publisher", "worker main", "pool processes")

        def beyond_plain(name: str, column: str) -> float:
            return medians[name][column] - medians["plain task"][column]

        raw_client = sum(beyond_plain(RAW, c) for c in client_columns)
        raw_masters = medians[RAW][masters_column]
        report.add(
            f"The three rounds alone ({RAW}): the same three scripts and payloads, over raw",
            "sockets with no library code, around a plain job in this worker, so under the",
            "same load: the floor any client of these rounds pays here. CPU per job in µs",
            "beyond the plain task, in this run; and the same rounds in a tight loop (one",
            "process, nothing else running, payloads built in advance):",
            *table(
                ["rounds alone", "client", masters_column, "total"],
                [
                    [
                        f"in the worker ({RAW})",
                        num(raw_client),
                        num(raw_masters),
                        num(totals[RAW] - plain_cpu),
                    ],
                    [
                        "in a tight loop",
                        num(loop_client),
                        num(loop_masters),
                        num(loop_client + loop_masters),
                    ],
                ],
            ),
            "The best the rounds allow: the raw rounds' tasks/s against each reference, and",
            "SingletonTask's (medians of the rounds' ratios):",
            *table(
                ["against", RAW, "SingletonTask"],
                [
                    [
                        reference,
                        times(ratio(rates, RAW, reference)),
                        times(ratio(rates, "SingletonTask", reference)),
                    ]
                    for reference in ("plain task", "celery-singleton", "celery-once")
                ],
            ),
            f"SingletonTask of the best the rounds allow (SingletonTask / {RAW}): "
            f"{times(ratio(rates, 'SingletonTask', RAW))}",
            "",
        )
        # Issue 17: SingletonTask's own cost, what it adds beyond a plain job less what
        # the raw rounds add (the client side; the masters' side is compared as a ratio).
        beyond = {c: beyond_plain("SingletonTask", c) for c in columns}
        client_side = sum(beyond[c] for c in client_columns)
        own = client_side - raw_client
        masters_ratio = medians["SingletonTask"][masters_column] / raw_masters
        report.add(
            "SingletonTask beyond a plain job, CPU per job in µs (the table above), and its",
            f"own cost: publisher + worker main + pool beyond plain, less the {RAW}' same.",
            *table(
                ["publisher", "worker main", "pool", masters_column, "own cost", "masters/raw"],
                [
                    [
                        *(
                            num(beyond[c])
                            for c in ("publisher", "worker main", "pool processes", masters_column)
                        ),
                        num(own),
                        times(masters_ratio),
                    ]
                ],
            ),
            "",
        )

        latency_tasks = {
            "plain task": bench_app.plain,
            RAW: bench_app.TASKS[RAW],  # the least the three rounds add
            "SingletonTask": bench_app.redlocked,
        }
        healthy_latency: dict[str, list[list[float]]] = {}
        if args.latency_jobs > 0:
            healthy_latency = task_latency.measure(
                latency_tasks, counter, args.rounds, args.latency_jobs, base, "latency"
            )
            base += 2 * args.rounds * args.latency_jobs
            report.add(
                *task_latency.lines(
                    healthy_latency,
                    "plain task",
                    [
                        "Latency per job, publish to body start, in µs: jobs published one at a",
                        f"time ({args.latency_jobs} per contender per round), each once the one",
                        "before it started its body. Medians over rounds; 'added' is the median",
                        "of the rounds' differences from the plain task in the same round.",
                    ],
                )
            )

        storm_rows = []
        storm_results: dict[str, tuple[int, int, float, int]] = {}
        contenders = [
            ("SingletonTask (dedupe active)", bench_app.redlocked_active, 2.0),
            ("SingletonTask (dedupe queued)", bench_app.redlocked, 2.0),
            ("SingletonTask (run-time lock only, skip)", bench_app.redlocked_skip, 10.0),
            ("celery-singleton", bench_app.singleton, 2.0),
            ("celery-once", bench_app.once, 2.0),
        ]
        broker_client = broker.server.client() if broker.server is not None else None
        for i, (name, task, body) in enumerate(contenders if storms else []):
            assert broker_client is not None
            progress(f"duplicate storm: {name}")
            accepted, ran, drained, overlapping = _storm(task, counter, broker_client, 42 + i, body)
            storm_results[name] = (accepted, ran, drained, overlapping)
            skipped = max(0, accepted - ran)
            # Only where the worker really skipped duplicates (more than the one
            # follow-up job that dedupe="queued" lets wait behind the running one).
            rate = skipped / drained if skipped > 1 and drained > 0 else float("nan")
            storm_rows.append(
                [
                    name,
                    str(accepted),
                    str(ran),
                    str(overlapping),
                    "-" if rate != rate else num(rate),
                ]
            )
        if not storms and not args.no_storm:
            report.add("No duplicate storm: it reads the queue's length in the Redis broker.", "")
        if storms:
            report.add(
                "Duplicate storm: one job (body 2 s; 10 s for the run-time lock alone, so that",
                f"it outlasts the storm) published again {STORM} times while it runs.",
                "accepted = distinct jobs the publishes returned. dedupe='queued' (the default)",
                "coalesces duplicates into one follow-up job queued behind the running one;",
                "'active' returns the running job itself. Run-time lock only: every publish",
                "reaches the broker and the worker skips the duplicates (skipped/s); a duplicate",
                "the worker takes after the first body ended runs a body of its own.",
                "overlapping = bodies that started while another was running (from the times",
                "they recorded).",
                *table(
                    ["contender", "accepted at publish", "bodies run", "overlapping", "skipped/s"],
                    storm_rows,
                ),
                "",
            )
        down_latency: dict[str, list[list[float]]] = {}
        if down:
            down_latency = _one_master_down(
                report, args, masters, bench_app, counter, processes, rates, base
            )
            base += 10 * args.tasks
        # Issue 17's goals (they replace issue 4's three throughput goals).
        if n_masters == 1:
            # Equal ground: all three then use one Redis.
            for anchor in ("celery-singleton", "celery-once"):
                report.goal(
                    Goal(f"SingletonTask vs {anchor}", ratio(rates, "SingletonTask", anchor), 1.0)
                )
        else:
            report.goal(
                Goal(
                    f"SingletonTask vs the {RAW} (the best they allow)",
                    ratio(rates, "SingletonTask", RAW),
                    0.95,
                )
            )
        report.goal(Goal("own cost per job", own, 100, at_least=False, unit=" µs"))
        report.goal(Goal("masters' CPU per job vs the rounds alone", masters_ratio, 1.15, False))
        if healthy_latency and down_latency:
            # A master marked down is not waited for, nor reconnected to on every job.
            node_timeout_us = 0.25e6
            report.goal(
                Goal(
                    "p99 latency SingletonTask adds with one master down",
                    task_latency.added(down_latency, "SingletonTask", "plain task", 99),
                    node_timeout_us / 10,
                    at_least=False,
                    unit=" µs",
                )
            )
        if storms:
            # "queued" (the default) lets one follow-up job wait behind the running one, by
            # contract: 2 bodies. "active" is the celery-singleton semantics the anchors have.
            ran = storm_results["SingletonTask (dedupe active)"][1]
            report.goal(Goal("bodies run in the duplicate storm", ran, 1, at_least=False, unit=""))
            accepted, ran = storm_results["SingletonTask (dedupe queued)"][:2]
            report.goal(
                Goal(
                    "accepted jobs that never ran (dedupe queued storm)",
                    accepted - ran,
                    0,
                    at_least=False,
                    unit="",
                )
            )
            overlaps = sum(r[3] for n, r in storm_results.items() if n.startswith("SingletonTask"))
            report.goal(
                Goal(
                    "SingletonTask bodies overlapping in storms",
                    overlaps,
                    0,
                    at_least=False,
                    unit="",
                )
            )
        if args.save:
            report.save()
        return 0 if report.passed or not args.strict else 1
    finally:
        if worker is not None:
            _stop(worker)
        for server in (*masters, counter_server):
            server.close()
        broker.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
