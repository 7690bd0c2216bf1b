"""Helpers for the lock core's tests (``tests/core``).

Everything here talks to real ``redis-server`` masters (started by the fixtures in
``tests/conftest.py``); nothing stands in for Redis.

This file is also a script: ``python tests/core/helpers.py holder ...`` is the worker the
multi-process tests start. It runs in its own interpreter, so it shares nothing with the
test process but the masters, and records every hold it had as one JSON line
``[enter_ns, exit_ns, fence, pid]`` (``time.monotonic_ns()`` is system-wide on Linux, so
the intervals of several processes can be compared).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.exceptions import LockContended, LockLost, QuorumUnavailable
from celery_redlock.keys import redis_key
from celery_redlock.lock import Redlock, heartbeat
from celery_redlock.lock import master as master_module
from celery_redlock.testing import RedisServer

__all__ = [
    "Ledger",
    "assert_no_overlap",
    "clean_state",
    "command_calls",
    "count_connects",
    "forget_masters",
    "in_child",
    "keys_on",
    "lock_name",
    "make_redlock",
    "open_fds",
    "run_holders",
    "start_holders",
    "wait_holders",
]

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
PREFIX = "redlock"

_made: list[Redlock] = []


# -- clients and state ------------------------------------------------------------------------


def count_connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the masters the rounds start a TCP connect to, in order, from now on
    (``Master.start_connect`` counted)."""
    from celery_redlock.lock import master as master_module

    tried: list[str] = []
    start_connect = master_module.Master.start_connect

    def counting(self: master_module.Master, *args: Any, **kwargs: Any) -> object:
        tried.append(self.name)
        return start_connect(self, *args, **kwargs)

    monkeypatch.setattr(master_module.Master, "start_connect", counting)
    return tried


def make_redlock(masters: Sequence[Any], **kwargs: Any) -> Redlock:
    """A :class:`Redlock` over ``masters`` (servers or specs), closed after the test."""
    specs = [m.url if isinstance(m, RedisServer) else m for m in masters]
    rl = Redlock(specs, **kwargs)
    _made.append(rl)
    return rl


def clean_state() -> Iterator[None]:
    """Body of each module's autouse fixture.

    Before: forget the run_ids, restarts and TTLs this process has seen (see
    :func:`forget_masters`). They are kept per master address for the whole process (so
    a new client still notices a restart), and a port that a later test's server happens
    to reuse would otherwise look like a restarted master and be kept out of the quorum.
    After: stop renewing leases a failed test left behind, close every client made here.
    """
    forget_masters()
    yield
    made = set(map(id, _made))
    current = heartbeat._engine
    if current is not None:
        for lease in current.leases():
            if id(lease.redlock) in made:
                current.remove(lease)
    for rl in _made:
        rl.close()
    _made.clear()
    forget_masters()


def forget_masters() -> None:
    """Forget what this process learnt of masters: run_ids, restarts, the longest TTL granted.

    All three are process-wide on purpose (a new client still keeps a restarted master
    out); between tests they would leak one test's servers and TTLs into the next.
    """
    master_module.forget_restarts()


def lock_name(key: str, suffix: str | None = None) -> str:
    return redis_key(PREFIX, key, suffix)


def keys_on(server: RedisServer) -> dict[str, int]:
    """Every key on ``server`` with its PTTL in ms (-1: no expiry)."""
    with server.client(decode_responses=True) as conn:
        return {name: conn.pttl(name) for name in conn.scan_iter(count=1000)}


def value_on(server: RedisServer, name: str) -> str | None:
    with server.client(decode_responses=True) as conn:
        value = conn.get(name)
        return None if value is None else str(value)


def command_calls(server: RedisServer, command: str = "evalsha") -> int:
    """How many times ``server`` ran ``command`` (``INFO commandstats``), scripts included."""
    with server.client() as conn:
        stats = conn.info("commandstats")
    entry = stats.get(f"cmdstat_{command.lower()}")
    return int(entry["calls"]) if entry else 0


def in_child(body: Callable[[], bytes], timeout: float = 10.0) -> bytes:
    """Run ``body`` in a forked child and return what it returned (or the repr of what it
    raised, at most 200 bytes). The child is killed if it says nothing within ``timeout``
    (a hang fails the test, it does not stall it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        try:
            try:
                answer = body()
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = repr(exc).encode()[:200]
            os.write(write, answer)
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)
        return os.read(read, 4096) if ready else b"<the child said nothing: it hung>"
    finally:
        os.close(read)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def run_python(
    script: str, *args: str, timeout: float = 90, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a child interpreter with this repository on its path (for what
    cannot be undone in this process: an event library's monkey-patching), ``env`` added
    to its environment; its output is captured as text."""
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), child_env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        check=False,
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- recording holds ------------------------------------------------------------------------


class Ledger:
    """Thread-safe record of holds: ``(enter_ns, exit_ns, who)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: list[tuple[int, int, object]] = []
        self.errors: list[BaseException] = []

    def record(self, enter: int, leave: int, who: object) -> None:
        with self._lock:
            self.holds.append((enter, leave, who))

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)


def assert_no_overlap(holds: Iterable[Sequence[Any]]) -> None:
    """Holds are ``(enter_ns, exit_ns, ...)``; no two may overlap in time."""
    ordered = sorted(holds, key=lambda h: h[0])
    for before, after in itertools.pairwise(ordered):
        assert before[1] < after[0], f"two holders at once: {before} and {after}"


# -- holder processes -----------------------------------------------------------------------


def start_holders(
    count: int,
    urls: Sequence[str],
    out_dir: Path,
    *,
    key: str,
    acquisitions: int,
    ttl: float = 5.0,
    fence: bool = False,
    budget: float = 60.0,
    restart_quarantine: float | None = None,
    counter: Path | None = None,
    own_keys: bool = False,
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """Start ``count`` holder processes on ``key``; see :func:`wait_holders`.

    ``counter``: a file holding an integer that every hold increments with a read, a
    2 ms pause and a write, so holds overlapping in time lose increments. ``own_keys``:
    each holder locks a key of its own (a broken lock: the control run that shows the
    checks do catch overlapping holders).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    started = []
    for i in range(count):
        out = out_dir / f"holder-{i}.jsonl"
        args = [
            sys.executable,
            str(HERE),
            "holder",
            "--urls",
            json.dumps(list(urls)),
            "--key",
            key,
            "--acquisitions",
            str(acquisitions),
            "--ttl",
            str(ttl),
            "--budget",
            str(budget),
            "--out",
            str(out),
        ]
        if fence:
            args.append("--fence")
        if restart_quarantine is not None:
            args += ["--restart-quarantine", str(restart_quarantine)]
        if counter is not None:
            args += ["--counter", str(counter)]
        if own_keys:
            args[args.index("--key") + 1] = f"{key}:{i}"
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append((proc, out))
    return started


def read_holds(path: Path) -> list[list[Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("]")]


def wait_holders(
    started: list[tuple[subprocess.Popen[bytes], Path]], timeout: float
) -> list[list[Any]]:
    """Wait for the holders (killing them past ``timeout``); return every hold recorded."""
    deadline = time.monotonic() + timeout
    failures = []
    for proc, _ in started:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            failures.append(f"pid {proc.pid} still running after {timeout}s")
            continue
        if proc.returncode != 0:
            failures.append(f"pid {proc.pid} exited {proc.returncode}: {err.decode()[-2000:]}")
    assert not failures, failures
    holds: list[list[Any]] = []
    for _, out in started:
        holds += read_holds(out)
    return holds


def run_holders(count: int, urls: Sequence[str], out_dir: Path, **kwargs: Any) -> list[list[Any]]:
    timeout = kwargs.get("budget", 60.0) + 30.0
    return wait_holders(start_holders(count, urls, out_dir, **kwargs), timeout)


def _holder(args: argparse.Namespace) -> int:
    """Acquire ``key`` ``acquisitions`` times (or until ``budget`` runs out), recording holds."""
    rl = Redlock(json.loads(args.urls), restart_quarantine=args.restart_quarantine)
    end = time.monotonic() + args.budget
    done = 0
    with open(args.out, "w", buffering=1) as out:
        while done < args.acquisitions and time.monotonic() < end:
            try:
                lease = rl.acquire(args.key, args.ttl, blocking_timeout=2.0)
            except (LockContended, QuorumUnavailable):
                continue
            enter = time.monotonic_ns()
            token: int | None = None
            if args.fence:
                with contextlib.suppress(LockLost, QuorumUnavailable):
                    token = lease.fence
            if args.counter:
                value = int(Path(args.counter).read_text() or 0)
                time.sleep(0.002)  # the critical section's work: a window for a lost update
                Path(args.counter).write_text(str(value + 1))
            leave = time.monotonic_ns()
            valid = lease.held  # still valid after `leave`, so valid during [enter, leave]
            lease.release()
            if valid:
                out.write(json.dumps([enter, leave, token, os.getpid()]) + "\n")
                done += 1
    rl.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    holder = sub.add_parser("holder")
    holder.add_argument("--urls", required=True, help="JSON list of master URLs")
    holder.add_argument("--key", required=True)
    holder.add_argument("--acquisitions", type=int, required=True)
    holder.add_argument("--ttl", type=float, default=5.0)
    holder.add_argument("--budget", type=float, default=60.0)
    holder.add_argument("--out", required=True)
    holder.add_argument("--fence", action="store_true")
    holder.add_argument("--restart-quarantine", type=float, default=None)
    holder.add_argument("--counter", default=None, help="file incremented in every hold")
    args = parser.parse_args(argv)
    return _holder(args)


if __name__ == "__main__":
    sys.exit(main())
