"""Fixtures shared by the whole suite: real redis-server masters, RabbitMQ, Celery's own.

Every Redis a test talks to is a ``redis-server`` process started here on a free loopback
port (see :mod:`celery_redlock.testing`); the machine's own Redis on 6379 is never used.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_redlock.lock.master import forget_restarts
from celery_redlock.testing import (
    Masters,
    RedisServer,
    find_redis_server,
    redis_server_version,
    start_masters,
)

# Celery's fixtures (celery_app, celery_worker, @pytest.mark.celery(...)); Celery 5 no longer
# registers them by itself.
# pytester runs pytest on generated test files (tests/test_harness.py checks our fixtures).
pytest_plugins = ("celery.contrib.pytest", "pytester")

#: Environment variable with the AMQP URL of the RabbitMQ the `rabbitmq` tests use.
RABBITMQ_URL_ENV = "REDLOCK_RABBITMQ_URL"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def pytest_report_header(config: pytest.Config) -> str:
    try:
        binary = find_redis_server()
    except RuntimeError as exc:
        return f"redis-server: NONE FOUND ({exc})"
    version = ".".join(map(str, redis_server_version(binary)))
    return f"redis-server: {binary} (v{version})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that uses RabbitMQ is a `rabbitmq` test whether or not its author marked it, so
    # `-m "not rabbitmq"` always deselects it.
    for item in items:
        if "rabbitmq_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.rabbitmq)


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """Path of the redis-server binary; the test fails (never skips) when there is none."""
    try:
        return find_redis_server()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def master_factory(redis_binary: str) -> Iterator[Callable[..., RedisServer]]:
    """Start extra servers: ``master_factory(persistence="aof", password="s3cret")``.

    Keyword arguments go to :class:`~celery_redlock.testing.RedisServer`; every server
    started is killed and its directory removed after the test, pass or fail.
    """
    started = Masters()

    def start(**kwargs: Any) -> RedisServer:
        kwargs.setdefault("binary", redis_binary)
        server = RedisServer(**kwargs)
        started.append(server)
        return server

    with started:  # closes every server appended, even if closing one of them fails
        yield start


@pytest.fixture
def masters(request: pytest.FixtureRequest, redis_binary: str) -> Iterator[Masters]:
    """Independent masters for a Redlock, 3 by default.

    Another count: ``@pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)``.
    """
    count = getattr(request, "param", 3)
    # Master identities (run_ids) are kept per address for the whole process: a fresh
    # server on a port an earlier test's server had would look restarted, and be kept out
    # of every quorum for the longest TTL granted so far (an acquire then lands on 2 of 3).
    forget_restarts()
    with start_masters(count, binary=redis_binary) as servers:
        yield servers
    forget_restarts()


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """AMQP URL of the RabbitMQ on 127.0.0.1:5672 (or ``$REDLOCK_RABBITMQ_URL``).

    When nothing listens there the test is skipped with the reason shown, unless ``CI=true``:
    CI has a RabbitMQ, so there its absence fails the test.
    """
    url = os.environ.get(RABBITMQ_URL_ENV) or DEFAULT_RABBITMQ_URL
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 5672)
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError as exc:
        error: OSError | None = exc
    else:
        return url
    reason = (
        f"RabbitMQ not reachable on {address[0]}:{address[1]} ({error}); start one "
        f"(e.g. `rabbitmq-server -detached`) or set ${RABBITMQ_URL_ENV} to run these tests"
    )
    if os.environ.get("CI", "").lower() in {"true", "1"}:
        pytest.fail(f"{reason}. CI=true requires it.", pytrace=False)
    pytest.skip(reason)
