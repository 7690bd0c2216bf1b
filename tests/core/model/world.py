"""What the model checker runs against: 3 real masters behind one fault proxy, a timeline.

Every client of the model has its own 3 listeners on the proxy (client ``c`` reaches
master ``m`` through listener ``c * 3 + m``), so a network fault can hit one client's
path to one master while the others flow, and one *connection* (one lane's link) can be
held or slowed on its own (``ProxyProcess.connection``). Master faults (SIGSTOP, restart
empty) hit every client.

The masters and the proxy live for the whole test (starting them per example would cost
more than most examples); :meth:`World.reset` puts them back in order between examples.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis

from celery_redlock.lock import Lease
from celery_redlock.testing import Masters, start_masters

from ...chaos.proxy import ProxyProcess
from ..helpers import forget_masters

__all__ = ["CLIENTS", "Held", "Timeline", "World", "world"]

#: The model's clients, in proxy-listener order: ``A`` is shared by several threads,
#: ``B`` is a separate client, ``C`` a separate client on an injectable clock.
CLIENTS = ("A", "B", "C")
MASTERS = 3
PREFIX = "redlock"


class Timeline:
    """Every step and fault with a monotonic time stamp, printed when a check fails."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.lines: list[str] = []

    def log(self, text: str) -> None:
        with self._lock:
            self.lines.append(f"{time.monotonic() - self.t0:8.3f}s  {text}")

    def render(self) -> str:
        with self._lock:
            return "timeline (seconds since the example started):\n" + "\n".join(self.lines)


@dataclass
class Held:
    """A lease the model was granted, and what the model saw of it."""

    label: str
    client: str
    key: str
    lease: Lease
    #: time.monotonic() when acquire returned it
    granted_at: float
    auto: bool = False
    fences: list[int] = field(default_factory=list)

    def __repr__(self) -> str:
        return self.label

    def held_now(self) -> bool:
        return self.lease.held


class World:
    """3 masters and one proxy process with a listener per (client, master)."""

    def __init__(self) -> None:
        self.masters: Masters = start_masters(MASTERS)
        try:
            upstreams = [("127.0.0.1", m.port) for _ in CLIENTS for m in self.masters]
            self.proxy = ProxyProcess(upstreams)
        except BaseException:
            self.masters.stop_all()
            raise
        self._direct: dict[int, redis.Redis] = {}
        #: time.monotonic() of every restart, per master
        self.restarts: dict[int, list[float]] = {}

    def urls(self, client: str) -> list[str]:
        c = CLIENTS.index(client)
        return self.proxy.urls()[c * MASTERS : (c + 1) * MASTERS]

    def listener(self, client: str, master: int) -> int:
        return CLIENTS.index(client) * MASTERS + master

    def direct(self, m: int) -> redis.Redis:
        """A client straight to master ``m`` (no proxy), short timeouts."""
        conn = self._direct.get(m)
        if conn is None:
            conn = self._direct[m] = self.masters[m].client(
                socket_timeout=0.3, socket_connect_timeout=0.3
            )
        return conn

    def read(self, m: int, names: list[str]) -> list[bytes | None] | None:
        """The values of ``names`` on master ``m``; None when it cannot be read (stopped)."""
        if self.masters[m].paused:
            return None
        try:
            values = self.direct(m).mget(names)
            return [v.encode() if isinstance(v, str) else v for v in values]
        except redis.RedisError:
            conn = self._direct.pop(m, None)
            if conn is not None:
                conn.close()
            return None

    def lock_keys(self, m: int) -> dict[str, int]:
        """Lock and metadata keys on master ``m`` with their PTTL (fence counters left out)."""
        if self.masters[m].paused:
            return {}
        conn = self.direct(m)
        names = [
            n.decode()
            for n in conn.scan_iter(match=f"{PREFIX}:*", count=1000)
            if not n.endswith(b":fence")
        ]
        return {n: int(conn.pttl(n)) for n in names}

    def restart_empty(self, m: int) -> None:
        self.masters[m].restart(keep_data=False)
        self.restarts.setdefault(m, []).append(time.monotonic())
        conn = self._direct.pop(m, None)
        if conn is not None:
            conn.close()

    def reset(self) -> None:
        """Between examples: every master running and empty, every path passing."""
        for server in self.masters:
            if server.paused:
                server.resume()
            if not server.alive:
                server.start()
        self.proxy.set("*", "pass")
        self.proxy.set("*", "reset")  # held bytes of the last example die with their links
        for m in range(MASTERS):
            conn = self._direct.pop(m, None)
            if conn is not None:
                conn.close()
            self.direct(m).flushall()
        self.restarts.clear()
        forget_masters()  # run_ids, restarts and granted TTLs are process-wide

    def close(self) -> None:
        for conn in self._direct.values():
            conn.close()
        self._direct.clear()
        try:
            self.proxy.close()
        finally:
            self.masters.stop_all()


_world: World | None = None


@contextlib.contextmanager
def world() -> Iterator[World]:
    """The world for one test function; everything it started is stopped on leaving."""
    global _world
    _world = World()
    try:
        yield _world
    finally:
        current, _world = _world, None
        current.close()


def current_world() -> World:
    if _world is None:
        raise RuntimeError("the model's world runs inside `with world():` only")
    return _world


def kill_child(pid: int) -> None:
    """Kill a forked child that outlived its budget, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
