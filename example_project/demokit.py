"""Plumbing for ``demo.py``: the processes it starts, and how they are all stopped.

Every process the demo starts is registered in a :class:`Stack` first and stopped by
:meth:`Stack.stop`, which ``demo.py`` calls in ``finally``, also on Ctrl-C and SIGTERM:

* redis-server masters and the broker (``celery_redlock.testing``): killed, directories
  removed;
* ``celery worker`` / ``celery beat``: each in its own process group (the group id is the
  pid printed at start), so a worker's pool children go with it: SIGCONT (a paused child
  must be able to exit), SIGTERM, then SIGKILL of the whole group after a grace period.

On Linux every child also gets ``PR_SET_PDEATHSIG=SIGKILL``: even ``kill -9`` of the demo
takes its direct children along.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from celery_redlock.testing import Masters, RedisServer, start_masters, wait_for

HERE = Path(__file__).resolve().parent
T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_pending: list[int] = []


def raise_on_signals() -> None:
    """Turn SIGINT and SIGTERM into :class:`Interrupted`, so ``finally`` blocks run.

    The signal is also remembered: an exception raised while a ``__del__`` runs (Celery's
    AsyncResult has one) is swallowed by Python, so :func:`check_interrupted`, called by
    every wait, raises it again.
    """

    def handler(signum: int, _frame: object) -> None:
        _pending.append(signum)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def check_interrupted() -> None:
    if _pending:
        raise Interrupted(_pending[0])


def wait(predicate: Callable[[], T], timeout: float, message: str, interval: float = 0.05) -> T:
    """:func:`celery_redlock.testing.wait_for` that also notices a swallowed Ctrl-C."""

    def checked() -> T:
        check_interrupted()
        return predicate()

    return wait_for(checked, timeout=timeout, interval=interval, message=message)


def pause(seconds: float) -> None:
    """Sleep ``seconds`` (to watch for something that must not happen), Ctrl-C aware."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        check_interrupted()
        time.sleep(min(0.1, left))


def ignore_signals() -> None:
    """While cleaning up, a second Ctrl-C must not cut the cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_us() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def setup() -> None:  # runs between fork and exec: prctl and getppid only
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


@dataclass
class CeleryProcess:
    """One ``celery ...`` subprocess, leader of its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    nodename: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the whole group at once (main process and pool children): a crash."""
        self.signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait_log(self, text: str, timeout: float = 60) -> None:
        """Wait until ``text`` appears in the log; fail with the log if the process exits."""

        def seen() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; its log "
                    f"({self.log_path}):\n{self.log()[-3000:]}"
                )
            return text in self.log()

        wait(seen, timeout, f"{self.name}: {text!r} in its log", interval=0.1)


@dataclass
class Stack:
    """Everything the demo started, in order; :meth:`stop` ends all of it."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    masters: Masters = field(default_factory=Masters)
    broker: RedisServer | None = None
    celery: list[CeleryProcess] = field(default_factory=list)

    def start_redis(self) -> None:
        self.masters = start_masters(3)
        self.broker = RedisServer()

    def start_celery(self, name: str, *args: str, nodename: str = "") -> CeleryProcess:
        # Only the main thread may fork these: PR_SET_PDEATHSIG fires when the *thread*
        # that forked exits.
        assert threading.current_thread() is threading.main_thread()
        log_path = self.run_dir / f"{name}.log"
        argv = [sys.executable, "-m", "celery", "-A", "exampleproj", *args]
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=HERE,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group; Ctrl-C reaches only the demo
                preexec_fn=_die_with_us(),
            )
        process = CeleryProcess(name, proc, log_path, nodename)
        self.celery.append(process)
        return process

    def by_nodename(self, nodename: str) -> CeleryProcess | None:
        return next((p for p in self.celery if p.nodename and p.nodename == nodename), None)

    def pids(self) -> list[tuple[str, int]]:
        """``(what, pid)`` of every process started so far (celery pids are group ids)."""
        found = [(f"redis master {i + 1}", s.pid) for i, s in enumerate(self.masters)]
        if self.broker is not None:
            found.append(("redis broker", self.broker.pid))
        found += [(p.name, p.pid) for p in self.celery]
        return found

    def stop(self, grace: float = 5.0) -> None:
        """Stop every process; never raises. Celery first (they talk to Redis on the way out)."""
        alive = [p for p in self.celery if p.alive]
        for process in alive:
            process.signal_group(signal.SIGCONT)
            process.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.celery:
            # Pool children that outlived their main process, and anything that hung.
            process.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.proc.wait(timeout=5)
        servers: Sequence[RedisServer] = [*self.masters, *([self.broker] if self.broker else [])]
        for server in servers:
            with contextlib.suppress(Exception):
                server.close()


# -- output -------------------------------------------------------------------------------


class Clock:
    """Seconds since the demo started, for progress lines."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.start

    def say(self, text: str) -> None:
        print(f"[{self():6.1f}s] {text}", flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
