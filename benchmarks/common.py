"""What the benchmarks share: the environment header, timed loops, rounds, tables, goals.

Output discipline: tables and goal lines go to stdout through a :class:`Report` (and, with
``--save``, to ``docs/benchmarks/<name>.txt``); progress goes to stderr, so what is saved is
exactly what a reader needs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import hashlib
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from celery_redlock.keys import STORAGE_FORMAT
from celery_redlock.testing import _preexec, find_redis_server, redis_server_version

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"

#: A handle that ``release`` gets back; falsy means the acquire did not get the lock.
Handle = object
Acquire = Callable[[], Handle]
Release = Callable[[Handle], object]

#: the metadata SingletonTask stores with a run's lock besides its task_id (same fields,
#: same sizes: see SingletonTask.__call__)
META_FIELDS = (
    "task", "bench.job", "host", "celery@bench", "pid", "12345",
    "acquired_at", "1764230000.123", "format", STORAGE_FORMAT,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Where and with what the numbers were taken
# --------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _own_version() -> str:
    installed = _version("celery-redlock")
    if installed != "not installed":
        return f" {installed}"
    try:
        text = (REPO / "pyproject.toml").read_text()
    except OSError:
        text = ""
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    found = f" {match.group(1)}" if match else ""
    return f"{found} (source tree, not installed)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def core_digest() -> str:
    """A short digest of the lock core's sources, so a saved table names the code it measured
    (the package version alone does not change between commits)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "celery_redlock" / "lock").glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def environment(title: str) -> list[str]:
    binary = find_redis_server()
    server = ".".join(str(part) for part in redis_server_version(binary))
    now = dt.datetime.now(dt.timezone.utc)
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    return [
        f"# {title}",
        f"date:          {now:%Y-%m-%d %H:%M} UTC",
        f"python:        {platform.python_implementation()} {platform.python_version()}",
        f"redis-server:  {server} ({binary}), fresh servers started for this run, no persistence",
        (
            f"machine:       {os.cpu_count()} cores, {_cpu_model()}, "
            f"{platform.system()} {platform.release()}; {load} at start"
        ),
        f"celery-redlock:{_own_version()} (lock core sources sha256 {core_digest()})",
        "libraries:     "
        + ", ".join(
            f"{name} {_version(name)}"
            for name in ("redis", "pottery", "python-redis-lock", "celery-singleton", "celery-once")
        ),
    ]


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed block of acquire+release cycles of one contender."""

    cycles: int
    seconds: float
    acquire_ns: list[int]
    extra_ns: list[int] = field(default_factory=list)
    failures: int = 0
    #: CPU seconds the timed cycles cost: this process, and the servers ``timed_cycles``
    #: was told to watch (``servers``)
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds if self.seconds > 0 else 0.0

    def acquire_us(self, q: float) -> float:
        return percentile(self.acquire_ns, q) / 1000

    def extra_us(self, q: float) -> float:
        return percentile(self.extra_ns, q) / 1000 if self.extra_ns else float("nan")

    def acquire_mean_us(self) -> float:
        return statistics.fmean(self.acquire_ns) / 1000 if self.acquire_ns else float("nan")

    def extra_mean_us(self) -> float:
        return statistics.fmean(self.extra_ns) / 1000 if self.extra_ns else float("nan")


def percentile(values: Sequence[int | float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of unsorted ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5 - 1e-9))
    return float(ordered[min(rank, len(ordered)) - 1])


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """Run ``n`` processes that spin in a Python loop (the load of a worker host whose
    cores run task bodies) for the duration of the block; killed and reaped after it."""
    # They die with this process even when it is killed (PR_SET_PDEATHSIG, as the
    # test servers): an orphaned busy loop would load the machine for ever.
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_preexec())
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time process ``pid`` has used so far, all threads (``/proc``)."""
    # Fields after the parenthesised command name start at field 3 (state): utime is
    # field 14 and stime field 15 of proc(5).
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of process ``pid`` (``/proc/<pid>/task/*/children``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(child) for child in (task / "children").read_text().split()]
    return out


def timed_cycles(
    acquire: Acquire,
    release: Release,
    seconds: float,
    *,
    extra: Callable[[Handle], object] | None = None,
    warmup: int = 100,
    warmup_seconds: float = 0.05,
    servers: Sequence[int] = (),
) -> Run:
    """Run acquire (timed), optional ``extra`` (timed apart), release, for ``seconds``.

    Only the ``acquire`` call is in the acquire latency; cycles/s counts whole cycles
    (acquire, extra, release) that got the lock. A falsy handle counts as a failure.
    Before timing, up to ``warmup`` cycles run untimed (at most ``warmup_seconds``).
    The CPU time of this process and of the processes ``servers`` over the timed cycles
    is kept in the run (``/proc`` counts in clock ticks, 10 ms: sum it over runs).
    """
    warm_until = time.perf_counter() + warmup_seconds
    for _ in range(warmup):
        if time.perf_counter() > warm_until:
            break
        handle = acquire()
        if handle:
            if extra is not None:
                extra(handle)
            release(handle)
    gc.collect()
    clock = time.perf_counter_ns
    acquire_ns: list[int] = []
    extra_ns: list[int] = []
    failures = cycles = 0
    client0 = time.process_time()
    server0 = sum(cpu_seconds(pid) for pid in servers)
    start = now = clock()
    end = start + int(seconds * 1e9)
    while now < end:
        t0 = clock()
        handle = acquire()
        t1 = clock()
        if handle:
            if extra is not None:
                extra(handle)
                extra_ns.append(clock() - t1)
            release(handle)
            acquire_ns.append(t1 - t0)
            cycles += 1
        else:
            failures += 1
        now = clock()
    client = time.process_time() - client0
    server = sum(cpu_seconds(pid) for pid in servers) - server0
    return Run(cycles, (now - start) / 1e9, acquire_ns, extra_ns, failures, client, server)


def interleave(
    contenders: Mapping[str, Callable[[float], Run]],
    rounds: int,
    seconds: float,
    what: str,
    logs: LogCounter | None = None,
) -> dict[str, list[Run]]:
    """Run every contender once per round, rotating the order each round.

    On a small machine the background (other processes, CPU frequency, the masters' own
    housekeeping) drifts over a run; interleaving puts every contender under the same drift,
    and the rotation keeps any one of them from always running first or after the slowest.
    """
    names = list(contenders)
    results: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if logs is not None:
                logs.context = name
            run = contenders[name](seconds)
            results[name].append(run)
            progress(
                f"{what}: round {r + 1}/{rounds}: {name}: {run.rate:,.0f} cycles/s, "
                f"acquire p50 {run.acquire_us(50):,.1f} µs"
            )
    return results


def median(values: Iterable[float]) -> float:
    data = [v for v in values if v == v]  # drop NaN
    return statistics.median(data) if data else float("nan")


def ratio(a: Sequence[Run], b: Sequence[Run]) -> float:
    """Median over rounds of ``a``'s rate ÷ ``b``'s rate in the same round."""
    return median(x.rate / y.rate for x, y in zip(a, b, strict=True) if y.rate > 0)


def rss_bytes() -> int:
    """Resident set size of this process (``VmRSS`` in ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class LogCounter(logging.Handler):
    """Counts celery-redlock's log records (WARNING and up) per contender, without printing.

    A benchmark must say when the library under test complained during the run (a master
    dropped, a release that missed masters): the numbers are then not those of a healthy
    N-master setup. Counting instead of printing also keeps a burst of thousands of
    identical warnings from turning the benchmark into a stderr-writing benchmark.
    """

    def __init__(self, logger: str = "celery_redlock") -> None:
        super().__init__(logging.WARNING)
        self.context = "setup"
        self.counts: dict[str, dict[str, int]] = {}
        target = logging.getLogger(logger)
        target.addHandler(self)
        target.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        per = self.counts.setdefault(self.context, {})
        per[str(record.msg)] = per.get(str(record.msg), 0) + 1

    def total(self, context: str) -> int:
        return sum(self.counts.get(context, {}).values())

    def summary(self) -> list[str]:
        if not self.counts:
            return ["celery-redlock logged no warnings during the run."]
        lines = ["celery-redlock warnings during the run (count x message template):"]
        for context, per in self.counts.items():
            for message, count in sorted(per.items(), key=lambda item: -item[1]):
                lines.append(f"  {context}: {count:,} x {message!r}")
        return lines


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(headers), rule, *(line(row) for row in rows)]


def num(value: float, digits: int = 0) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:,.{digits}f}"


def times(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


@dataclass
class Goal:
    """One goal from an issue, with the measured value."""

    text: str
    value: float
    target: float
    at_least: bool = True  # False: the value must be at most the target
    unit: str = "x"

    @property
    def passed(self) -> bool:
        if self.value != self.value:
            return False
        return self.value >= self.target if self.at_least else self.value <= self.target

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}  {self.text}: {self.value:.2f}{self.unit} "
            f"(goal {sign} {self.target:g}{self.unit})"
        )


class Report:
    """Collects printed lines; prints them as they come and saves them on request."""

    def __init__(self, name: str, title: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.goals: list[Goal] = []
        self.add(*environment(title))

    def add(self, *lines: str) -> None:
        for text in lines:
            self.lines.append(text)
            print(text, flush=True)

    def goal(self, goal: Goal) -> None:
        self.goals.append(goal)
        self.add(goal.line())

    @property
    def passed(self) -> bool:
        return all(goal.passed for goal in self.goals)

    def finish(self) -> None:
        try:
            load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
        except OSError:
            load = "unknown"
        self.add("", f"load average at end: {load}")

    def save(self) -> Path:
        DOCS.mkdir(parents=True, exist_ok=True)
        path = DOCS / f"{self.name}.txt"
        path.write_text("\n".join(self.lines) + "\n")
        progress(f"saved {path.relative_to(REPO)}")
        return path


def arguments(description: str, rounds: int, seconds: float) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=seconds,
        help=f"seconds per contender per round (default {seconds:g})",
    )
    parser.add_argument(
        "--save", action="store_true", help="also write the output to docs/benchmarks/"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a goal fails"
    )
    return parser
