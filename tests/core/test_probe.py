"""The probe threads that try down masters off the jobs' path (``celery_redlock.lock.probe``).

Each test here reproduces a finding of the hostile review of the first version (one
thread for all masters, a plain ``probing`` flag): a TLS master never handed back, a
forked child stuck with a master nobody would hand back, a hang under gevent patched
late, dropped clients probed forever, one slow probe delaying every other master, and
badly answering masters handed straight back. Real ``redis-server`` masters throughout.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

from celery_redlock.exceptions import LockContended, QuorumUnavailable
from celery_redlock.lock import Redlock, probe
from celery_redlock.lock.master import make_master
from celery_redlock.testing import Masters, RedisServer, blackhole, wait_for

from . import helpers
from .helpers import make_redlock
from .test_masters import FakeMaster, http_answer

NODE_TIMEOUT = 0.2


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    # Counting probe threads needs the earlier tests' ones gone: they end within a
    # period once their clients are closed.
    wait_for(lambda: not _probe_threads(), timeout=5, message="earlier probe threads live on")
    yield from helpers.clean_state()


def _cycle(rl: Redlock, key: str) -> bool:
    try:
        return rl.acquire(key, 10).release()
    except (LockContended, QuorumUnavailable):
        return False


def _probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "redlock-probe" and t.is_alive()]


@contextlib.contextmanager
def closing_server(reply: bytes | None = None) -> Iterator[int]:
    """A port whose server ends every connection at once: with ``reply``, it sends it and
    closes, as redis-server does when ``maxclients`` is reached; without, it reads two
    bytes and resets the connection, as a redis-server TLS port does to a plaintext
    ``PING`` (it closes with unread bytes)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(1)
            with contextlib.suppress(OSError):
                if reply is None:
                    conn.recv(2)  # leaves bytes unread, as redis does with a bad TLS hello
                    linger = struct.pack("ii", 1, 0)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                else:
                    conn.sendall(reply)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_what_counts_as_an_answer() -> None:
    """Review r7 #1 and r8 F1: the probe must judge as the rounds' connect would. A TLS
    port that resets a plaintext PING was taken for down (a rediss:// master never came
    back); then any reset was taken for an answer, and a TLS terminator whose server did
    not answer was handed back to the jobs every 0.5 s. TLS masters are now tried through
    redis-py (TLS handshake, then PING); every master must answer PONG."""
    with closing_server() as port:
        # Plain TCP: a server that closes without a word is nobody serving.
        assert probe.probe(make_master(f"redis://127.0.0.1:{port}/0", NODE_TIMEOUT)) is False
        # TLS: reset during the TLS handshake: nobody serving either.
        assert probe.probe(make_master(f"rediss://127.0.0.1:{port}/0", NODE_TIMEOUT)) is False
    fake = FakeMaster(http_answer)
    try:
        # A plaintext server on a TLS port: the rounds could not use it either.
        assert not probe.probe(make_master(f"rediss://127.0.0.1:{fake.port}/0", NODE_TIMEOUT))
        assert not probe.probe(make_master(fake.url, NODE_TIMEOUT))  # not PONG
    finally:
        fake.close()
    with blackhole() as (url, _):
        assert probe.probe(make_master(url.replace("redis://", "rediss://"), 0.1)) is False


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_the_redis_py_probe_needs_a_reply_to_its_ping(masters: Masters) -> None:
    """The TLS path (redis-py's connection) on a plain master: a paused server behind a
    connection that opens (as behind a TLS terminator) is not answering."""
    master = make_master(masters[0].url, NODE_TIMEOUT)
    assert probe._probe_with_redis_py(master) is True
    masters[0].pause()
    try:
        assert probe._probe_with_redis_py(master) is False
    finally:
        masters[0].resume()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_child_forked_while_a_master_was_being_watched_connects_to_it(
    masters: Masters,
) -> None:
    """Review r7 #2: a fork between setting the flag and registering the master (or
    between unregistering and clearing it) left the child a master marked as watched that
    no thread of the child would ever hand back. The watch now names its process."""
    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    assert rl.acquire("warm", 10).release() is True
    masters[2].kill()
    rl.close()
    assert rl.acquire("down", 10).release() is True
    master = rl.masters[2]
    assert master.probing
    # The fork lands in the window: the master is marked, the registry does not show it.
    probe._watched.pop(id(master), None)
    masters[2].start()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # The child's rounds connect once the reconnect backoff (1 s) has passed.
            wait_for(lambda: _cycle(rl, "child") and not master.down, timeout=5)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child never used the master again"


GEVENT_LATE = textwrap.dedent(
    """
    import json, sys, time

    from celery_redlock.lock import Redlock  # imported before the patching: its locks are real

    from gevent import monkey

    monkey.patch_all()

    urls = json.loads(sys.argv[1])
    rl = Redlock(urls, node_timeout=0.2)
    for i in range(20):
        assert rl.acquire(f"late-{i}", 5).release() is True
        time.sleep(0.05)
    print("done")
    """
)


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_gevent_patched_after_the_import_does_not_hang_on_a_down_master(
    masters: Masters,
) -> None:
    """Review r7 #3: the probe thread was started while a real lock was held; under gevent
    patched late, starting it switched to the new greenlet, which blocked the only OS
    thread on that lock (gunicorn --preload, or any late patching)."""
    assert importlib.util.find_spec("gevent") is not None, "gevent is not installed"
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        refused = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"  # nobody listens
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(helpers.REPO), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [sys.executable, "-c", GEVENT_LATE, json.dumps([*masters.urls, refused])],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_a_client_dropped_without_close_is_not_probed_forever(masters: Masters) -> None:
    """Review r7 #4: the thread's locals kept every master it had tried alive, so a
    dropped client's dead master was probed for the life of the process."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        refused = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"
    rl = Redlock([*masters.urls, refused], node_timeout=NODE_TIMEOUT)
    assert rl.acquire("once", 10).release() is True
    assert rl.masters[2].probing
    gone = weakref.ref(rl.masters[2])
    for lane in rl._lanes:  # its connections, not its watch (close() would end that)
        for link in lane.links:
            link.close()
    del rl, lane, link

    def collected() -> bool:
        gc.collect()
        return gone() is None

    wait_for(collected, timeout=5, message="the dropped client's master is still referenced")
    wait_for(lambda: not _probe_threads(), timeout=5, message="a probe thread outlived it")


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_slow_probe_does_not_delay_noticing_another_master(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r7 #5: one thread tried every watched master in turn, so a master with a
    long node_timeout that stayed blackholed delayed noticing a returned one by seconds."""
    stuck = threading.Event()
    release = threading.Event()
    real_probe = probe.probe

    def probing(master: object) -> bool:
        if getattr(master, "node_timeout", None) == 3.0:  # the slow client's master
            stuck.set()
            release.wait(20)
            return False
        return real_probe(master)  # type: ignore[arg-type]

    monkeypatch.setattr(probe, "probe", probing)
    try:
        with blackhole() as (hole, _):
            slow = make_redlock([masters[0].url, masters[1].url, hole], node_timeout=3.0)
            assert slow.acquire("slow", 30).release() is True
            wait_for(stuck.is_set, timeout=5, message="the slow master was never probed")

            rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
            rl.reconnect_backoff = 3600.0  # only a probe gives the master back
            assert rl.acquire("warm", 10).release() is True
            masters[2].kill()
            rl.close()
            assert rl.acquire("down", 10).release() is True
            assert rl.masters[2].probing
            masters[2].start()
            # The slow master's probe is still blocked: this one is tried on its own.
            wait_for(
                lambda: _cycle(rl, "back") and not rl.masters[2].down,
                timeout=5,
                message="the returned master waited behind the slow one's probe",
            )
            assert not release.is_set()
    finally:
        release.set()


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_masters_that_answer_badly_keep_the_backoff(
    masters: Masters,
) -> None:
    """Review r7 #6: a handshake that failed on the master's answer (another master's
    run_id, a reply that is not RESP) went to the probe, whose PING is answered, so the
    jobs redid the whole handshake every 0.5 s instead of once per backoff."""
    server = masters[0]
    fake = FakeMaster(http_answer)
    try:
        rl = make_redlock(
            [
                f"redis://127.0.0.1:{server.port}/0",
                f"redis://localhost:{server.port}/0",  # the same server under another name
                masters[1].url,
                fake.url,
                masters[1].url.replace("/0", "/2"),  # and another db of the second one
            ],
            node_timeout=NODE_TIMEOUT,
        )
        _cycle(rl, "dup")
        assert rl.masters[3].down  # not RESP
        refused = [m for m in rl.masters if m.down]
        assert len(refused) >= 3, [m.status() for m in rl.masters]
        assert not any(m.probing for m in rl.masters), [m.name for m in rl.masters if m.probing]
        assert all(m.connect_after > 0 for m in refused)
    finally:
        fake.close()


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_a_master_out_of_connection_slots_is_not_handed_back_to_the_jobs(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r8 F3: "-ERR max number of clients reached" and a close came as a closed
    connection, so the master went to the probe, which got the same reply and handed it
    straight back: twice the connects to a server already out of slots."""
    tried = helpers.count_connects(monkeypatch)
    with closing_server(b"-ERR max number of clients reached\r\n") as port:
        rl = make_redlock([*masters.urls, f"redis://127.0.0.1:{port}/0"], node_timeout=NODE_TIMEOUT)
        third = rl.masters[2]
        assert rl.acquire("full", 10).release() is True
        assert third.down
        # Jobs back to back for 3 s: the rounds' backoff (1 s), or the watch (which this
        # reply does not end), allow 3 more connects at most; handed back at every
        # probe, the jobs connected every 0.5 s.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert _cycle(rl, "full")
        assert tried.count(third.name) <= 4, tried.count(third.name)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_name_whose_first_address_drops_packets_is_connected_at_the_next(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r8 F2: the rounds connect to a name's first address only; the probe found
    the server at the second and handed the master back, and the rounds timed out on the
    first again: never connected (acquires failed with every server up). The rounds now
    connect where the probe was answered."""
    real = socket.getaddrinfo
    port = masters[2].port

    def resolve(host: object, *args: object, **kwargs: object) -> object:
        if host == "two-addresses.test":
            first = real("127.0.0.2", port, socket.AF_INET, socket.SOCK_STREAM)
            second = real("127.0.0.1", port, socket.AF_INET, socket.SOCK_STREAM)
            return [*first, *second]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with blackhole("127.0.0.2", port):
        rl = make_redlock(
            [masters[0].url, masters[1].url, f"redis://two-addresses.test:{port}/0"],
            node_timeout=NODE_TIMEOUT,
        )
        assert rl.acquire("first", 10).release() is True
        assert rl.masters[2].down
        wait_for(
            lambda: _cycle(rl, "again") and not rl.masters[2].down,
            timeout=5,
            message="the master at the name's second address was never connected",
        )


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_a_watch_ends_after_its_limit_and_one_thread_serves_a_master(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r8 F4 and F5: a client dropped without close() kept its probe threads until
    a full garbage collection, and every forget-and-watch (check_masters in a loop)
    started a thread while the earlier ones slept out their period (600 alive)."""
    monkeypatch.setattr(probe, "WATCH_LIMIT", 1.0)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        refused = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"
    rl = make_redlock([*masters.urls, refused], node_timeout=NODE_TIMEOUT)
    most = 0
    for _ in range(200):
        rl.check_masters()
        most = max(most, len(_probe_threads()))
    assert most <= 1, f"{most} probe threads for one master"
    assert rl.masters[2].probing
    # Nobody answers: after the limit the rounds get the master back, and the thread ends.
    wait_for(lambda: not rl.masters[2].probing, timeout=5, message="the watch never ended")
    assert rl.masters[2].connect_after == 0.0
    wait_for(lambda: not _probe_threads(), timeout=5, message="the probe thread lives on")


def test_a_password_master_is_answering_only_with_its_password() -> None:
    """The probe sends the AUTH the rounds' handshake sends: PONG after it counts; a
    refused password keeps the watch (the rounds would fail on it too)."""
    with RedisServer(password="s3cret-probe") as server:
        assert probe.probe(make_master(server.url, NODE_TIMEOUT)) is True
        wrong = server.url.replace("s3cret-probe", "wrong")
        assert wrong != server.url
        assert probe.probe(make_master(wrong, NODE_TIMEOUT)) is False
        # No password configured: PING gets -NOAUTH, not PONG.
        bare = f"redis://127.0.0.1:{server.port}/0"
        assert probe.probe(make_master(bare, NODE_TIMEOUT)) is False
