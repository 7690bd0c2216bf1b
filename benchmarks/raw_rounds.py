"""SingletonTask's three rounds with no library code: the floor the benchmarks subtract.

A job of SingletonTask sends three scripts to every master: the dedupe CLAIM at publish,
the ACQUIRE that takes the lock, stores the metadata and clears the marker when the run
starts, and the RELEASE when it ends. :class:`RawRounds` sends the same scripts with the
same payloads over raw non-blocking sockets: send to every master, ``poll`` until a
quorum answered, leave the other replies to be read by the next round, as any Redlock
client must (so it waits for the quorum, not for every master). ``jobcost`` runs it in
one process between a plain job's publish and run; the task benchmark runs it in a real
worker (:mod:`benchmarks.taskbench_app`): the publisher claims, the pool process
acquires before a plain body and releases after it.

Hand-written rather than redis-py: a floor must hold nothing a client could leave out.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterable

import hiredis

from benchmarks.common import META_FIELDS
from celery_redlock.lock import scripts
from celery_redlock.lock.wire import pack_command

__all__ = [
    "RawRounds",
    "acquire_payload",
    "claim_payload",
    "connect",
    "lock_name",
    "release_payload",
]


def connect(host: str, port: int) -> socket.socket:
    """A blocking connection to a master, ``TCP_NODELAY``, with the three scripts loaded."""
    link = socket.create_connection((host, port), timeout=10)
    link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for script in (scripts.CLAIM, scripts.ACQUIRE, scripts.RELEASE):
        link.sendall(pack_command(("SCRIPT", "LOAD", script.source)))
        link.recv(128)
    return link


def lock_name(task: str, i: int) -> str:
    """The lock of job ``i``: as long as SingletonTask's (``redlock:{<task>:<32 hex>}``),
    so the masters read and store as many bytes."""
    return f"rawlock:{{{task}:{i:032x}}}"


def claim_payload(marker: str, task_id: str) -> bytes:
    """The publish's CLAIM of the dedupe marker ``marker`` for ``task_id``, with the
    call's own random id (stored beside the marker where it writes it)."""
    return scripts.CLAIM.call(
        2, marker, marker + scripts.CLAIMED_BY, task_id, 3_600_000, os.urandom(16).hex(), 10_000
    )


def acquire_payload(lock: str, marker: str, token: str, task_id: str) -> bytes:
    """The run's ACQUIRE: the lock for 30 s, its metadata, the marker cleared."""
    return scripts.ACQUIRE.call(
        3, lock, f"{lock}:meta", marker, token, 30_000, task_id, "task_id", task_id, *META_FIELDS
    )


def release_payload(lock: str, token: str) -> bytes:
    """The run's RELEASE of ``lock`` (and its metadata) where it holds ``token``."""
    return scripts.RELEASE.call(3, lock, f"{lock}:meta", lock, token, "")


class RawRounds:
    """Rounds on raw non-blocking sockets to ``addresses`` (host, port); see the module."""

    def __init__(self, addresses: Iterable[tuple[str, int]]) -> None:
        self.links: list[socket.socket] = []
        self.readers: dict[int, hiredis.Reader] = {}
        self.owed: dict[int, int] = {}
        for host, port in addresses:
            link = connect(host, port)
            link.setblocking(False)
            self.links.append(link)
            self.readers[link.fileno()] = hiredis.Reader()
            self.owed[link.fileno()] = 0
        self.by_fd = {link.fileno(): link for link in self.links}
        self.quorum = len(self.links) // 2 + 1

    def round(self, payload: bytes, wait: bool = True) -> None:
        """Send ``payload`` to every master; with ``wait``, until a quorum answered."""
        for link in self.links:
            link.send(payload)
            self.owed[link.fileno()] += 1
        if not wait:
            return
        answered = 0
        waiting = set(self.by_fd)
        while answered < self.quorum:
            poller = select.poll()
            for fd in waiting:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(1000):
                reader = self.readers[fd]
                reader.feed(self.by_fd[fd].recv(65536))
                while reader.gets() is not False:
                    self.owed[fd] -= 1
                if not self.owed[fd]:
                    waiting.discard(fd)
                    answered += 1

    def close(self) -> None:
        for link in self.links:
            link.close()
