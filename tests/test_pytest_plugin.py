"""The ``pytest11`` plugin (celery_redlock.pytest_plugin) in a user's own suite.

pytester writes a small project's tests and runs pytest on them in a subprocess, where the
plugin is found through its entry point, as in a user's virtualenv.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

CONFTEST = """
import pytest

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(scope="session")
def celery_enable_logging():
    return False
"""

REAL_MASTERS = """
import pytest
import redis

from celery_redlock import SingletonTask
from celery_redlock.client import redlock_for


@pytest.fixture
def celery_config(redlock_app_config):
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        **redlock_app_config,
    }


def test_a_singleton_task_locks_on_the_real_masters(
    celery_app, celery_worker, redlock_masters, redlock_app_config
):
    @celery_app.task(bind=True, base=SingletonTask, lock_key="acct:{n}", shared=False)
    def fenced(self, n):
        return self.lease.fence

    celery_worker.reload()
    fence = fenced.delay(1).get(timeout=20)
    assert fence > 0
    assert len(redlock_masters) == 3
    assert type(redlock_for(celery_app)).__name__ == "Redlock"
    for url in redlock_app_config["redlock_redis_urls"]:
        with redis.Redis.from_url(url) as conn:
            assert int(conn.get("redlock:{acct:1}:fence")) == fence


def test_each_test_starts_with_empty_masters(redlock_app_config):
    for url in redlock_app_config["redlock_redis_urls"]:
        with redis.Redis.from_url(url) as conn:
            assert conn.dbsize() == 0
"""

MEMORY = """
import pytest

from celery_redlock import SingletonTask
from celery_redlock.client import redlock_for


@pytest.fixture
def celery_config(redlock_memory_config):
    return {"task_always_eager": True, "redlock_redis_urls": ["redis://127.0.0.1:1/0"],
            **redlock_memory_config}


def test_eager_tasks_run_without_redis(celery_app):
    @celery_app.task(bind=True, base=SingletonTask, lock_key="acct:{n}", shared=False)
    def nested(self, n):
        return nested.delay(n - 1).result if n > 0 else "ran"

    assert nested.delay(0).get() == "ran"
    assert nested.delay(1).get() == "ran"  # acct:0 inside acct:1: another key, free
    assert type(redlock_for(celery_app)).__name__ == "MemoryRedlock"
"""

MEMORY_CONTENDED = """
import pytest

from celery_redlock import SingletonTask


@pytest.fixture
def celery_config(redlock_memory_config):
    return {"task_always_eager": True, **redlock_memory_config}


def test_the_same_key_inside_a_run_is_contended(celery_app):
    @celery_app.task(bind=True, base=SingletonTask, lock_key="acct", shared=False)
    def nested(self, again):
        return type(nested.delay(False).result).__name__ if again else "ran"

    assert nested.delay(True).get() == "LockContended"
"""


def test_plugin_fixtures_in_a_user_suite(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_real=REAL_MASTERS, test_memory=MEMORY, test_memory_contended=MEMORY_CONTENDED
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", timeout=90
    )
    result.assert_outcomes(passed=4)


KILLED_MASTERS = """
from celery_redlock import QuorumUnavailable, Redlock


def test_1_an_outage(redlock_masters, redlock_app_config):
    rl = Redlock(redlock_app_config["redlock_redis_urls"])
    rl.acquire("warm-up", 600).release()  # a long TTL granted in this process
    redlock_masters[0].kill()
    redlock_masters[1].kill()
    try:
        rl.acquire("k", 5)
    except QuorumUnavailable:
        pass
    rl.close()


def test_2_the_next_test_has_its_quorum(redlock_app_config):
    rl = Redlock(redlock_app_config["redlock_redis_urls"])
    try:
        rl.acquire("k", 5).release()
    finally:
        rl.close()
"""


def test_masters_a_test_killed_are_not_kept_out_of_the_next_tests_quorum(
    pytester: pytest.Pytester,
) -> None:
    """Review r10: the plugin restarted killed masters, but the process still took them
    for restarted masters and kept them out of every quorum for the longest TTL granted
    (here 600 s): every later test of the session got QuorumUnavailable."""
    pytester.makepyfile(test_killed=KILLED_MASTERS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", timeout=90
    )
    result.assert_outcomes(passed=2)


def test_plugin_is_registered_by_its_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider", timeout=60)
    result.stdout.fnmatch_lines(
        [
            "*redlock_masters* [[]session scope[]]*",
            "*redlock_app_config*",
            "*redlock_memory_config*",
        ]
    )
