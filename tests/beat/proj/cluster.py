"""Start, signal and watch real ``celery beat`` / ``celery worker`` processes of ``proj.app``.

Shared by the beat tests (``tests/beat/conftest.py``) and ``benchmarks/bench_beat.py``.
Every process runs in its own process group (``start_new_session``), so a kill reaches
its pool children too; with ``PR_SET_PDEATHSIG`` on Linux a process never outlives the
runner that started it. Output goes to ``<workdir>/<name>.log``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent  # tests/beat/proj
REPO = HERE.parent.parent.parent
DATABASE_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Proc:
    """One ``celery`` subprocess (a process group leader)."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                list(argv),
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self.pid = self.popen.pid
        self.stopped = False

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.popen.returncode}"
        return f"<Proc {self.name} pid={self.pid} {state}>"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int, *, group: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)

    def kill(self) -> float:
        """SIGKILL the whole group; returns the wall time just before the signal."""
        at = time.time()  # noqa: TID251 - compared with times other processes record
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        return at

    def pause(self) -> float:
        at = time.time()  # noqa: TID251
        self.signal(signal.SIGSTOP)
        self.stopped = True
        return at

    def resume(self) -> float:
        at = time.time()  # noqa: TID251
        self.signal(signal.SIGCONT)
        self.stopped = False
        return at

    def close(self) -> None:
        if self.stopped:
            self.resume()
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    # -- log -------------------------------------------------------------------------

    def log(self, since: int = 0) -> str:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(since)
                return handle.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_times(self, pattern: str, since: int = 0) -> list[float]:
        """Epoch times of the log lines matching ``pattern`` (the app logs ``%(created)``)."""
        out = []
        for line in self.log(since).splitlines():
            if re.search(pattern, line):
                match = re.match(r"\[(\d+\.\d+) ", line)
                if match:
                    out.append(float(match.group(1)))
        return out

    def wait_log(self, pattern: str, timeout: float = 60.0, since: int = 0) -> str:
        """Wait for a log line matching ``pattern``; the process must stay alive meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log(since).splitlines():
                if re.search(pattern, line):
                    return line
            if not self.alive:
                raise RuntimeError(f"{self!r} exited while waiting for {pattern!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: no log line matching {pattern!r} in {timeout:g} s"
                )
            time.sleep(0.05)

    def tail(self, lines: int = 120) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


class Cluster:
    """The processes of one test: beats and workers of ``proj.app`` sharing one workdir.

    :param schedule: entry name -> seconds (interval) or a crontab minute field.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        broker_url: str,
        masters: Sequence[str],
        lease_ttl: float = 3.0,
        schedule: dict[str, float | str] | None = None,
        django_db: Path | None = None,
        catch_up: str | None = None,
        app_name: str | None = None,
        opt_out: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.broker_url = broker_url
        self.masters = list(masters)
        self.lease_ttl = lease_ttl
        self.schedule = dict(schedule or {})
        self.django_db = django_db
        self.catch_up = catch_up
        self.app_name = app_name
        self.opt_out = list(opt_out)
        #: per process name: its wall clock offset (BEAT_TEST_CLOCK_OFFSET)
        self.clock_offsets: dict[str, float] = {}
        self.output = workdir / "records.jsonl"
        self.output.touch()
        self.procs: list[Proc] = []

    # -- processes ---------------------------------------------------------------------

    def env(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        path = [str(HERE.parent), str(REPO)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            PYTHONUNBUFFERED="1",
            PYTHONWARNINGS="ignore",
            BEAT_TEST_NAME=name,
            BEAT_TEST_BROKER=self.broker_url,
            BEAT_TEST_MASTERS=",".join(self.masters),
            BEAT_TEST_OUTPUT=str(self.output),
            BEAT_TEST_LEASE_TTL=f"{self.lease_ttl:g}",
            BEAT_TEST_SCHEDULE=json.dumps(self.schedule),
        )
        env["BEAT_TEST_CATCH_UP"] = self.catch_up or ""
        env["BEAT_TEST_APP_NAME"] = self.app_name or ""
        env["BEAT_TEST_OPT_OUT"] = ",".join(self.opt_out)
        env["BEAT_TEST_CLOCK_OFFSET"] = f"{self.clock_offsets.get(name, 0.0):g}"
        env.pop("DJANGO_SETTINGS_MODULE", None)
        if self.django_db is not None:
            env["BEAT_TEST_DJANGO_DB"] = str(self.django_db)
        else:
            env.pop("BEAT_TEST_DJANGO_DB", None)
        return env

    def _start(self, name: str, args: Iterable[str]) -> Proc:
        argv = [sys.executable, "-m", "celery", "-A", "proj.app", *args]
        proc = Proc(name, argv, self.env(name), self.workdir)
        self.procs.append(proc)
        return proc

    def beat(self, name: str, *extra: str) -> Proc:
        """Start ``celery beat`` (its own schedule file; DatabaseScheduler with a django DB)."""
        args = ["beat", "-l", "INFO", "-s", str(self.workdir / f"{name}.schedule")]
        if self.django_db is not None:
            args += ["-S", DATABASE_SCHEDULER]
        return self._start(name, [*args, *extra])

    def worker(self, name: str = "worker", *extra: str, concurrency: int = 2) -> Proc:
        """Start ``celery worker`` (prefork); ``"-B"`` in ``extra`` embeds a beat."""
        args = [
            "worker",
            "-l",
            "INFO",
            "-n",
            f"{name}@%h",
            "-c",
            str(concurrency),
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        if "-B" in extra:
            args += ["-s", str(self.workdir / f"{name}.schedule")]
            if self.django_db is not None:
                args += ["-S", DATABASE_SCHEDULER]
        return self._start(name, [*args, *extra])

    def setup_django_db(self, *specs: str) -> None:
        """Migrate the sqlite DB and add interval tasks (``"name=seconds"``)."""
        assert self.django_db is not None
        subprocess.run(
            [sys.executable, "-m", "proj.dbsetup", *specs],
            cwd=self.workdir,
            env=self.env("dbsetup"),
            check=True,
            timeout=120,
            capture_output=True,
        )

    def close(self) -> None:
        for proc in self.procs:
            proc.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def logs(self, lines: int = 120) -> str:
        parts = []
        for proc in self.procs:
            parts.append(f"===== {proc!r}: last {lines} lines of {proc.log_path} =====")
            parts.append(proc.tail(lines))
        return "\n".join(parts)

    # -- what happened -----------------------------------------------------------------

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.output.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                if kind is None or item["kind"] == kind:
                    out.append(item)
        return out

    def runs(self) -> list[dict[str, Any]]:
        """Task body records (everything but beat status changes and no-leader alarms)."""
        return [r for r in self.records() if r["kind"] not in ("beat_status", "beat_no_leader")]

    def wait_runs(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            runs = self.runs()
            if predicate(runs):
                return runs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} (waited {timeout:g} s; {len(runs)} runs so far)")
            time.sleep(0.1)

    def leader(self) -> str | None:
        """Name of the beat whose latest status record says leader (None if none does)."""
        latest: dict[str, str] = {}
        for item in self.records("beat_status"):
            latest[item["name"]] = item["status"]
        alive = {p.name for p in self.procs if p.alive and not p.stopped}
        leaders = [name for name, status in latest.items() if status == "leader" and name in alive]
        return leaders[-1] if leaders else None

    def broker(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker_url, socket_timeout=5)

    def drain(self, timeout: float = 30.0, quiet: float = 1.5) -> list[dict[str, Any]]:
        """Wait until the queue is empty, nothing is unacked, and no new run for ``quiet`` s."""
        deadline = time.monotonic() + timeout
        with self.broker() as conn:
            count, since = -1, time.monotonic()
            while True:
                busy = conn.llen("celery") or conn.hlen("unacked")
                now_count = len(self.runs())
                if busy or now_count != count:
                    count, since = now_count, time.monotonic()
                elif time.monotonic() - since >= quiet:
                    return self.runs()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"queue did not drain in {timeout:g} s")
                time.sleep(0.1)


# -- checks ------------------------------------------------------------------------------------


def occurrence_problems(
    runs: Sequence[dict[str, Any]], interval_entries: Iterable[str]
) -> list[str]:
    """Why ``runs`` are not "every occurrence exactly once" (empty when they are).

    Every run must carry an occurrence id and a task id seen once. Each occurrence is
    accounted for by one run: its own, or a coalesced late send that stands for it (the
    ``covers`` list the worker left; without one, ``catch_up`` = n stands for the n - 1
    before it). For an interval entry the indexes (``name#<index>``) accounted for must be
    contiguous: a gap is a missed occurrence, one accounted for twice a double fire.
    """
    problems = []
    seen: dict[str, int] = {}
    task_ids: dict[str, int] = {}
    for run in runs:
        occurrence = run.get("occurrence")
        if not occurrence:
            problems.append(f"run without an occurrence header: {run}")
            continue
        stands_for = [occurrence, *(run.get("covers") or [])]
        n = int(run.get("catch_up") or 1)
        if not run.get("covers") and n > 1 and "#" in occurrence:
            name, _, index = occurrence.rpartition("#")
            stands_for = [f"{name}#{int(index) - back}" for back in range(n)]
        for o in stands_for:
            seen[o] = seen.get(o, 0) + 1
        task_ids[run["task_id"]] = task_ids.get(run["task_id"], 0) + 1
    problems += [f"occurrence {o} ran {n} times" for o, n in seen.items() if n > 1]
    problems += [f"task id {t} ran {n} times" for t, n in task_ids.items() if n > 1]
    for name in interval_entries:
        indexes = sorted(int(o.rpartition("#")[2]) for o in seen if o.startswith(f"{name}#"))
        if not indexes:
            problems.append(f"{name}: no occurrence ran")
            continue
        missing = sorted(set(range(indexes[0], indexes[-1] + 1)) - set(indexes))
        if missing:
            problems.append(f"{name}: occurrences {missing} missing (ran {indexes})")
    return problems


def interval_counts(runs: Sequence[dict[str, Any]], names: Iterable[str]) -> dict[str, int]:
    return {name: sum(1 for r in runs if r["kind"] == name) for name in names}
