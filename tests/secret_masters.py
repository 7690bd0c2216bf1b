"""Masters whose connection settings carry passwords, none of them reachable.

For the tests that no password reaches what an operator reads: the lock core's errors,
logs and status (tests/core/test_quiet_and_secret.py), and a worker's logs, result
backend and ``celery redlock check`` (tests/celery/test_log_safety.py).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from redis import connection as redis_connection

SENTINEL_PASSWORD = "sentinel-pw-4f1c"
MASTER_PASSWORD = "master-pw-93ab"
URL_PASSWORD = "url-pw-77d0"
DICT_PASSWORD = "dict-pw-15e2"
#: Every password below: none may appear in any text an operator reads.
SECRETS = (SENTINEL_PASSWORD, MASTER_PASSWORD, URL_PASSWORD, DICT_PASSWORD)


def unreachable_masters() -> list[Any]:
    """A Sentinel spec, a URL and a dict, each with its password(s), on loopback ports where
    nothing listens: each master fails with redis-py's error text."""
    sentinel, url_port, dict_port = _free_ports(3)
    return [
        {
            "sentinels": [("127.0.0.1", sentinel)],
            "service_name": "mymaster",
            "password": MASTER_PASSWORD,
            "sentinel_kwargs": {"password": SENTINEL_PASSWORD},
        },
        f"redis://:{URL_PASSWORD}@127.0.0.1:{url_port}/0",
        {"host": "127.0.0.1", "port": dict_port, "password": DICT_PASSWORD},
    ]


def print_passwords_in_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this redis-py print passwords in its reprs, as redis-py < 7.4 did."""
    monkeypatch.setattr(
        redis_connection.ConnectionPool, "SENSITIVE_REPR_KEYS", frozenset(), raising=False
    )


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
