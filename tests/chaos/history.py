"""Append-only JSON-lines histories shared by every process of a chaos scenario.

Every process (lock clients, Celery workers and beats, the fault injector, the test that
reads the protected resource's own log) appends one JSON object per line to one file.
Each line is written with a single ``os.write`` on an ``O_APPEND`` descriptor: the kernel
appends it atomically with respect to the other writers, and a ``SIGKILL`` loses nothing
that was already written (there is no user-space buffer).

Every line carries ``t``, ``time.monotonic_ns()``: ``CLOCK_MONOTONIC`` is one clock for all
processes of the host (network namespaces do not change it), so events of different
processes can be ordered and compared. ``lease.deadline`` is on the same clock
(``time.monotonic()`` seconds); :func:`ns` converts it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["MSG_HEADER", "History", "load", "ns"]

#: Celery message header carrying a work item message's own id (set by the test at submit and
#: by :mod:`tests.chaos.celeryproj` at every republish; read back from the broker).
MSG_HEADER = "chaos_msg"

#: Lines longer than this are still written with one ``os.write``; PIPE_BUF does not
#: apply to regular files, where O_APPEND makes each write(2) atomic on Linux.
Event = dict[str, Any]


def ns(seconds: float | None) -> int | None:
    """A ``time.monotonic()`` value (or a deadline on that clock) in nanoseconds."""
    if seconds is None or seconds == float("inf"):
        return None
    return int(seconds * 1_000_000_000)


class History:
    """One process's writer into a shared history file.

    ``proc`` names the process in every line (``"agent-2"``, ``"injector"``...). Safe to
    use from several threads: each event is one ``os.write``. After ``fork()`` the child
    reopens the file lazily (its pid changes in the lines).
    """

    def __init__(self, path: str | os.PathLike[str], proc: str) -> None:
        self.path = str(path)
        self.proc = proc
        self._fd = -1
        self._pid = -1
        self._open_lock = threading.Lock()

    def _descriptor(self) -> int:
        pid = os.getpid()
        if self._pid != pid:
            with self._open_lock:
                if self._pid != pid:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    self._pid = pid
        return self._fd

    def write(self, ev: str, **fields: Any) -> int:
        """Append one event now; returns its time (ns)."""
        t = time.monotonic_ns()
        self.write_at(t, ev, **fields)
        return t

    def write_at(self, t: int, ev: str, **fields: Any) -> None:
        """Append one event stamped ``t`` (for the resource's log, read afterwards)."""
        line = json.dumps(
            {"t": t, "ev": ev, "proc": self.proc, "pid": os.getpid(), **fields},
            separators=(",", ":"),
            default=str,
        )
        os.write(self._descriptor(), (line + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = -1, -1


def read_lines(path: str | os.PathLike[str]) -> Iterator[Event]:
    """The events of one file; a torn last line (a writer killed mid-write) is skipped."""
    with Path(path).open("rb") as handle:
        for raw in handle:
            raw = raw.strip()
            if not raw:
                continue
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue


def load(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[Event]:
    """Every event of the given files, ordered by time (stable for equal times)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    events: list[Event] = []
    for path in paths:
        events.extend(read_lines(path))
    events.sort(key=lambda e: e["t"])
    return events
