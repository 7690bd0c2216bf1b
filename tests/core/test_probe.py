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
import weakref
from collections.abc import Iterator

import pytest

from celery_redlock.exceptions import LockContended, QuorumUnavailable
from celery_redlock.lock import Redlock, probe
from celery_redlock.lock.master import make_master
from celery_redlock.testing import Masters, blackhole, wait_for

from . import helpers
from .helpers import make_redlock
from .test_masters import FakeMaster, http_answer

NODE_TIMEOUT = 0.2


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def _cycle(rl: Redlock, key: str) -> bool:
    try:
        return rl.acquire(key, 10).release()
    except (LockContended, QuorumUnavailable):
        return False


def _probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "redlock-probe" and t.is_alive()]


@contextlib.contextmanager
def resetting_server() -> Iterator[int]:
    """A port whose server accepts, reads what comes, and resets the connection: what a
    redis-server TLS port does to a plaintext ``PING`` (it closes with unread bytes)."""
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
                conn.recv(2)  # leaves bytes unread, as redis does with a bad TLS hello
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_a_tls_port_that_resets_the_plaintext_ping_is_answering() -> None:
    """Review r7 #1: the reset came as ConnectionResetError and counted as "down", so a
    rediss:// master that failed one connect was never used again."""
    with resetting_server() as port:
        master = make_master(f"rediss://127.0.0.1:{port}/0", NODE_TIMEOUT)
        assert probe.probe(master) is True
        plain = make_master(f"redis://127.0.0.1:{port}/0", NODE_TIMEOUT)
        assert probe.probe(plain) is True  # a server is there, acting
    with blackhole() as (url, _):
        assert probe.probe(make_master(url.replace("redis://", "rediss://"), 0.1)) is False


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
    del rl

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
