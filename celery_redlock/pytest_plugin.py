"""pytest fixtures for projects that use celery-redlock (a ``pytest11`` entry point).

Installed with the package and loaded by pytest by itself; every name starts with
``redlock_`` so it never shadows a fixture of your own. Compose them with Celery's own
fixtures (``pytest_plugins = ("celery.contrib.pytest",)``) through ``celery_config``::

    @pytest.fixture
    def celery_config(redlock_app_config):  # real masters
        return {
            "broker_url": "memory://",
            "result_backend": "cache+memory://",
            **redlock_app_config,
        }

or, for unit tests without Redis, ``redlock_memory_config`` (``redlock_backend = "memory"``).
The settings are plain dicts, so they fit any app factory (pytest-celery's, your own).

* ``redlock_masters`` (session): three real ``redis-server`` processes from
  :mod:`celery_redlock.testing` (a :class:`~celery_redlock.testing.Masters`), stopped at
  the end of the session.
* ``redlock_app_config``: ``{"redlock_redis_urls": [...]}`` for those masters, emptied
  before the test (restarted if a test killed one, and what this process knew of their
  identities forgotten, so that a restarted one is not kept out of the quorum); the
  cached settings and clients are reset after it.
* ``redlock_memory_config``: ``{"redlock_backend": "memory"}``; caches reset after the test.

This module imports nothing heavy at load time: pytest loads it in every run of a virtualenv
where celery-redlock is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from .testing import Masters

__all__ = ["redlock_app_config", "redlock_masters", "redlock_memory_config"]

#: How many masters ``redlock_masters`` starts (a quorum of 2).
MASTERS = 3


def _reset() -> None:
    from .client import reset_clients
    from .settings import reset_settings

    reset_clients()
    reset_settings()


@pytest.fixture(scope="session")
def redlock_masters() -> Iterator[Masters]:
    """Three real ``redis-server`` masters on free loopback ports, for the whole session."""
    from .testing import start_masters

    with start_masters(MASTERS) as masters:
        yield masters


@pytest.fixture
def redlock_app_config(redlock_masters: Masters) -> Iterator[dict[str, Any]]:
    """celery-redlock settings for ``redlock_masters``, emptied before each test."""
    from .lock.master import forget_restarts

    for server in redlock_masters:
        if server.paused:
            server.resume()  # a test paused it
        elif not server.alive:
            server.start()  # a test killed it
        with server.client() as conn:
            conn.flushall()
    # A server a test killed is back with a new identity: this process would take it for
    # a restarted master and keep it out of every quorum for the longest TTL granted so
    # far. The masters were just emptied, so no lock it could have forgotten exists.
    forget_restarts()
    _reset()
    yield {"redlock_redis_urls": list(redlock_masters.urls)}
    _reset()


@pytest.fixture
def redlock_memory_config() -> Iterator[dict[str, Any]]:
    """celery-redlock settings for the in-process backend (no Redis; unit tests only)."""
    _reset()
    yield {"redlock_backend": "memory"}
    _reset()
