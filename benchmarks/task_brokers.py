"""The broker the task benchmark's worker uses: a fresh Redis, or the RabbitMQ on this host.

RabbitMQ is not started by the benchmark (``rabbitmq-server`` needs more than a port and a
directory): it must already run at ``--amqp-url``. Its queue is named per run, so a
benchmark never takes another program's messages, nor they its own, and it is deleted at
the end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kombu.connection import Connection

from celery_redlock.testing import RedisServer

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


class BrokerUnreachable(RuntimeError):
    """The broker the benchmark was asked to use does not answer."""


@dataclass
class Broker:
    """The broker of one run: its URL, queue, what to call it, and whose CPU to count."""

    kind: str  # "redis" or "amqp"
    url: str
    queue: str
    #: the broker's processes, for the CPU columns (empty when none can be told apart)
    pids: list[int]
    #: the Redis broker (queue lengths for the duplicate storm); None on RabbitMQ
    server: RedisServer | None = None

    @property
    def label(self) -> str:
        return "Redis broker" if self.kind == "redis" else "RabbitMQ broker"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            return
        try:
            with Connection(self.url, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
                channel = conn.default_channel
                channel.queue_delete(self.queue)
                channel.exchange_delete(self.queue)
        except Exception:  # noqa: BLE001 - clean-up of a queue on a shared broker
            pass


def safe_url(url: str) -> str:
    """``url`` with its password masked (for messages and saved output)."""
    try:
        return str(Connection(url).as_uri())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - an unparsable URL: say nothing of it
        return "<broker URL>"


def check_amqp(url: str, timeout: float = 5.0) -> None:
    """Connect to RabbitMQ at ``url`` once; raise :class:`BrokerUnreachable` saying why."""
    try:
        with Connection(url, connect_timeout=timeout) as conn:  # type: ignore[no-untyped-call]
            conn.connect()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        raise BrokerUnreachable(
            f"RabbitMQ is unreachable at {safe_url(url)}: {exc.__class__.__name__}: {exc}. "
            "Start it, give its URL with --amqp-url, or use --broker redis."
        ) from None


def _rabbitmq_pids() -> list[int]:
    """The RabbitMQ server's Erlang VM (``beam.smp``), when exactly one runs here."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "beam.smp":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found if len(found) == 1 else []


def start(kind: str, amqp_url: str = DEFAULT_AMQP_URL) -> Broker:
    """The broker for one run: a fresh ``redis-server``, or the RabbitMQ at ``amqp_url``
    (checked first: :class:`BrokerUnreachable` if it does not answer)."""
    if kind == "redis":
        server = RedisServer()
        if not server.alive:
            server.start()
        return Broker("redis", server.url, "celery", [server.pid], server)
    if kind == "amqp":
        check_amqp(amqp_url)
        return Broker("amqp", amqp_url, f"taskbench-{os.getpid()}", _rabbitmq_pids())
    raise ValueError(f"unknown broker {kind!r}")
