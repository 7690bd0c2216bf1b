"""Fixtures for the beat tests: a broker server and real ``celery beat``/``worker`` processes.

Every process is started by :class:`proj.cluster.Cluster` in its own process group, killed
(SIGCONT first if paused, then SIGKILL to the group) when the test ends, pass or fail; its
output is kept in ``tmp_path`` and the tail of every log is printed when the test failed.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import Masters, RedisServer

from .proj.cluster import Cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def broker(master_factory: Callable[..., RedisServer]) -> RedisServer:
    """The Celery broker (and result backend): a harness redis-server, never 6379."""
    return master_factory()


@pytest.fixture
def cluster_factory(
    request: pytest.FixtureRequest, tmp_path: Path, broker: RedisServer, masters: Masters
) -> Iterator[Callable[..., Cluster]]:
    """``cluster_factory(lease_ttl=3, schedule={...}, masters=...)`` -> a :class:`Cluster`.

    ``masters`` (a :class:`Masters`) defaults to the ``masters`` fixture (3 servers); the
    cluster keeps it as ``masters_servers``. Processes are killed and, when
    the test failed, their logs printed at teardown.
    """
    made: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        kwargs.setdefault("broker_url", broker.url)
        servers = kwargs.pop("masters", masters)
        cluster = Cluster(tmp_path / f"cluster{len(made)}", masters=servers.urls, **kwargs)
        cluster.masters_servers = servers  # type: ignore[attr-defined]  # for the chaos tests
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
    failed = any(
        getattr(request.node, f"rep_{when}", None) is not None
        and getattr(request.node, f"rep_{when}").failed
        for when in ("setup", "call")
    )
    if failed:
        for cluster in made:
            print(cluster.logs())  # noqa: T201 - captured, shown with the failure
