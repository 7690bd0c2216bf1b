"""What the client makes of its masters: malformed replies, one server listed under two
names, restarts seen by another client of the process, masters that stay down (logging),
and the connections a burst of threads leaves open.

Real ``redis-server`` masters throughout; the only stand-ins are the misbehaving servers
these tests are about (:class:`FakeMaster`), which speak TCP like a master would.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import hiredis
import pytest

from celery_redlock.exceptions import LockContended, QuorumUnavailable
from celery_redlock.lock import Redlock
from celery_redlock.lock.redlock import IDLE_LANES_KEPT, LANE_IDLE
from celery_redlock.testing import Masters, blackhole, wait_for

from . import helpers
from .helpers import keys_on, lock_name, make_redlock, open_fds

NODE_TIMEOUT = 0.2


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def cycle(rl: Redlock, key: str) -> bool:
    """One acquire and release; True when both got a quorum."""
    try:
        return rl.acquire(key, 10).release()
    except (LockContended, QuorumUnavailable):
        return False


# -- misbehaving servers ----------------------------------------------------------------------


def http_answer(_: list[bytes]) -> bytes:
    return b"HTTP/1.1 400 Bad Request\r\n\r\n"


def wrong_type_answer(command: list[bytes]) -> bytes:
    """A master that connects fine (INFO, SCRIPT LOAD, PING as Redis answers them) but
    answers every other command with a simple string where our scripts return an int."""
    name = command[0].upper()
    if name == b"INFO":
        info = b"# Server\r\nrun_id:" + secrets.token_hex(20).encode() + b"\r\n"
        return b"$%d\r\n%s\r\n" % (len(info), info)
    if name == b"SCRIPT":
        sha = hashlib.sha1(command[2]).hexdigest().encode()
        return b"$40\r\n" + sha + b"\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    return b"+OK\r\n"


def garbage_after_handshake(command: list[bytes]) -> bytes:
    """Connects fine, then answers our scripts with bytes that are not RESP at all."""
    if command[0].upper() in (b"INFO", b"SCRIPT", b"PING"):
        return wrong_type_answer(command)
    return http_answer(command)


class FakeMaster:
    """A loopback TCP server answering each request with ``answer(command)``.

    ``http_answer`` ignores the request; for the others, requests are parsed as RESP.
    One thread serves every connection; :meth:`close` stops it and drops them.
    """

    def __init__(self, answer: Callable[[list[bytes]], bytes], *, trickle: bool = False) -> None:
        self.answer = answer
        #: every command but PING gets the header of a 100 MB reply, then a byte every
        #: 0.05 s for ever (a reply whose each read is quick and whose whole never comes)
        self.trickle = trickle
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conns: dict[socket.socket, hiredis.Reader] = {}
        dribbling: set[socket.socket] = set()
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([self.listener, *conns], [], [], 0.05)
                for conn in dribbling:
                    with contextlib.suppress(OSError):
                        conn.send(b"x")
                for sock in readable:
                    if sock is self.listener:
                        conn, _ = sock.accept()
                        conns[conn] = hiredis.Reader()
                        continue
                    data = b""
                    with contextlib.suppress(OSError):
                        data = sock.recv(65536)
                    if not data:
                        del conns[sock]
                        dribbling.discard(sock)
                        sock.close()
                        continue
                    out = b""
                    if self.answer is http_answer:
                        out = http_answer([])
                    else:
                        reader = conns[sock]
                        reader.feed(data)
                        while (command := reader.gets()) is not False:
                            if self.trickle and command[0].upper() != b"PING":
                                out += b"$100000000\r\n"
                                dribbling.add(sock)
                                break
                            out += self.answer(command)
                    with contextlib.suppress(OSError):
                        sock.sendall(out)
        finally:
            for conn in conns:
                conn.close()
            self.listener.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def fake_master() -> Iterator[Callable[[Callable[[list[bytes]], bytes]], FakeMaster]]:
    started: list[FakeMaster] = []

    def start(answer: Callable[[list[bytes]], bytes]) -> FakeMaster:
        fake = FakeMaster(answer)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.close()


# -- garbage replies --------------------------------------------------------------------------


@pytest.mark.parametrize("masters", [2], indirect=True)
@pytest.mark.parametrize("answer", [http_answer, wrong_type_answer, garbage_after_handshake])
def test_a_master_answering_garbage_is_one_failed_master(
    masters: Masters,
    fake_master: Callable[[Callable[[list[bytes]], bytes]], FakeMaster],
    answer: Callable[[list[bytes]], bytes],
) -> None:
    garbage = fake_master(answer)
    rl = make_redlock([*masters, garbage.url], node_timeout=NODE_TIMEOUT)
    for attempt in range(5):  # the first connects, later ones back off or reuse the link
        lease = rl.acquire("g", 10)
        assert lease.held
        assert lease.release() is True, attempt
        assert keys_on(masters[0]) == keys_on(masters[1]) == {}
    lease = rl.acquire("g", 10, blocking_timeout=2)
    assert rl.held_elsewhere("g")
    assert rl.claim("beat", "claim", "me", 10) == ("me", True)
    assert lease.fence > 0
    lease.extend(10)
    assert lease.release() is True
    assert rl.unclaim("beat", "claim", "me")
    assert rl.release_owned_by("g", "task_id", "nobody") is False
    for server in masters:  # the fence counter stays (it must: tokens only grow)
        assert list(keys_on(server)) == [lock_name("g", "fence")]


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_two_garbage_masters_of_three_leave_nothing_behind(
    masters: Masters, fake_master: Callable[[Callable[[list[bytes]], bytes]], FakeMaster]
) -> None:
    rl = make_redlock(
        [masters[0], fake_master(garbage_after_handshake).url, fake_master(wrong_type_answer).url],
        node_timeout=NODE_TIMEOUT,
    )
    for _ in range(3):
        with pytest.raises(QuorumUnavailable):
            rl.acquire("g", 10)
        assert keys_on(masters[0]) == {}  # the undo reached the healthy master
    with pytest.raises(QuorumUnavailable):
        rl.acquire("g", 10, blocking_timeout=0.3)
    assert keys_on(masters[0]) == {}


# -- one server under two names ---------------------------------------------------------------


@pytest.mark.parametrize("masters", [2], indirect=True)
@pytest.mark.parametrize("alias", ["localhost", "other db"])
def test_one_server_under_two_names_counts_once(
    masters: Masters, alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    server, third = masters
    if alias == "localhost":
        names = [f"redis://localhost:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"]
    else:
        names = [f"redis://127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/1"]
    with third.client() as conn:  # another client's lock, on the third master only
        conn.set(lock_name("dup"), "someone-else", px=30000)
    rl = make_redlock([*names, third.url], node_timeout=NODE_TIMEOUT)
    caplog.set_level(logging.ERROR, logger="celery_redlock.lock")
    for _ in range(3):
        with pytest.raises(LockContended):  # one server's word is not a quorum of three
            rl.acquire("dup", 10)
    errors = [r for r in caplog.records if "are the same server" in r.getMessage()]
    assert len(errors) == 1, caplog.text
    statuses = rl.check_masters()
    duplicates = [s for s in statuses if s.duplicate_of is not None]
    assert len(duplicates) == 1
    assert {duplicates[0].number, duplicates[0].duplicate_of} == {1, 2}
    assert not duplicates[0].up
    assert duplicates[0].run_id == server.run_id()
    assert [s.up for s in statuses if s.duplicate_of is None] == [True, True]


# -- quarantine after a restart, process-wide -------------------------------------------------


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_client_created_after_a_restart_keeps_the_master_out(masters: Masters) -> None:
    ttl = 30.0
    first = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    first.acquire("warm", ttl).release()  # saw every run_id; a 30 s lease was granted
    masters[2].restart(keep_data=False)

    def noticed() -> bool:
        with contextlib.suppress(LockContended, QuorumUnavailable):
            first.acquire("probe", ttl).release()
        return first.masters[2].restarted_at is not None

    wait_for(noticed, timeout=10, message="the first client never noticed the restart")
    # Another owner holds "k" on master 0; master 2 restarted empty (it may have held it).
    with masters[0].client() as conn:
        conn.set(lock_name("k"), "someone-else", px=30000)
    second = make_redlock(masters, node_timeout=NODE_TIMEOUT)  # created after the restart
    with pytest.raises(LockContended):
        second.acquire("k", 5)  # masters 1 and 2 would say yes; 2 must not count yet
    assert second.masters[2].restarted_at is not None


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_the_quarantine_follows_ttls_granted_not_asked(masters: Masters) -> None:
    """A refused or never-granted TTL does not lengthen the quarantine; a beat claim does."""
    from celery_redlock.lock import master as master_module

    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    holder = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    held = holder.acquire("busy", 5)
    assert master_module.longest_granted_ttl() == 5
    with pytest.raises(LockContended):
        rl.acquire("busy", 600)
    assert master_module.longest_granted_ttl() == 5
    rl.claim("beat", "tick", "me", 60)
    assert master_module.longest_granted_ttl() == 60
    held.release()


# -- masters that stay down: logging ----------------------------------------------------------


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_stopped_master_does_not_flood_the_log(
    masters: Masters, caplog: pytest.LogCaptureFixture
) -> None:
    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    rl.acquire("warm", 10).release()
    masters[2].kill()
    caplog.set_level(logging.INFO, logger="celery_redlock")
    for _ in range(200):
        lease = rl.acquire("flood", 10)
        assert lease.release() is True
    lease = rl.acquire("flood", 10)
    assert lease.release(wait=False) is False  # nothing waited for: no quorum confirmed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3, caplog.text
    assert "released" not in caplog.text
    masters[2].start()
    wait_for(
        lambda: cycle(rl, "back") and not rl.masters[2].down,
        timeout=10,
        message="master 2 never counted again",
    )
    assert "answers again" in caplog.text


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_master_that_comes_back_is_noticed_within_the_probe_period(
    masters: Masters,
) -> None:
    """A master down for a long time (many operations, 1.5 s apart) is noticed within the
    probe period once it answers again, so it counts when another master fails.
    A backoff that grew while it stayed down (up to 16 s, reverted) left it unnoticed: with
    the second master gone, acquires raised QuorumUnavailable although two of three
    masters answered."""
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    rl = make_redlock([m.url for m in masters], node_timeout=NODE_TIMEOUT, clock=clock)
    try:
        assert rl.acquire("warm", 10).release() is True
        masters[2].kill()
        for i in range(40):  # 60 s of operations with the master down
            assert rl.acquire(f"sparse:{i}", 10).release() is True
            offset[0] += 1.5
        assert rl.masters[2].down
        masters[2].start()
        # The probe thread notices it within its period of real time (the offset clock
        # plays no part there); a grown backoff would wait for 16 s of the offset clock.
        wait_for(
            lambda: not rl.masters[2].probing,
            timeout=5,
            message="the returned master was not noticed",
        )
        for i in range(8):  # 12 s: past the restarted master's quarantine (TTLs of 10 s)
            assert rl.acquire(f"back:{i}", 10).release() is True
            offset[0] += 1.5
        masters[1].kill()
        failed = 0
        for i in range(3):
            try:
                assert rl.acquire(f"after:{i}", 10).release() is not None
            except QuorumUnavailable:
                failed += 1
        assert failed <= 1, f"{failed} of 3 acquires found no quorum with 2 of 3 masters up"
        assert not rl.masters[2].down
    finally:
        rl.close()


@pytest.mark.parametrize("masters", [2], indirect=True)
def test_a_blackholed_master_costs_the_jobs_one_connect_attempt_not_one_per_backoff(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17: with one master of three dropping packets, every job more than a
    reconnect backoff after the last attempt waited a node_timeout on its connect. Now
    the rounds try it once; then the probe thread tries it, off the jobs' path."""
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    from celery_redlock.lock import probe

    tried = helpers.count_connects(monkeypatch)
    with blackhole() as (url, _):
        rl = make_redlock([m.url for m in masters] + [url], node_timeout=NODE_TIMEOUT, clock=clock)
        try:
            assert rl.acquire("first", 10).release() is True
            third = rl.masters[2]
            assert third.down
            assert third.probing
            assert third in probe.watching()
            attempts = tried.count(third.name)
            assert attempts == 1
            for i in range(20):  # 20 jobs, each past the rounds' reconnect backoff
                offset[0] += rl.reconnect_backoff + 0.5
                lease = rl.acquire(f"job:{i}", 10)
                assert lease.release() is True
            assert tried.count(third.name) == attempts, "the jobs tried the blackholed master"
            assert third.probing
        finally:
            rl.close()
    assert third not in probe.watching()  # close() stops the watch


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_watched_master_is_handed_back_when_it_answers_and_a_forked_child_does_not_wait(
    masters: Masters,
) -> None:
    import os

    from celery_redlock.lock import probe

    rl = make_redlock(masters, node_timeout=NODE_TIMEOUT)
    rl.reconnect_backoff = 3600.0  # only the probe thread can give the master back
    assert rl.acquire("warm", 10).release() is True
    masters[2].kill()
    rl.close()  # reconnect: the refused connect puts the master under watch
    assert rl.acquire("down", 10).release() is True
    assert rl.masters[2].probing

    pid = os.fork()
    if pid == 0:  # the child: no probe thread, so its rounds connect by themselves
        os._exit(0 if not rl.masters[2].probing and not probe.watching() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    masters[2].start()
    wait_for(
        lambda: cycle(rl, "back") and not rl.masters[2].down,
        timeout=10,
        message="the master that answers again was never used",
    )
    assert rl.masters[2] not in probe.watching()


# -- lanes shrink back ------------------------------------------------------------------------


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_idle_lanes_beyond_the_bound_are_closed(masters: Masters) -> None:
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    rl = make_redlock(masters, node_timeout=0.3, clock=clock)
    rl.acquire("warm", 10).release()
    base = open_fds()
    threads = 20
    start = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        start.wait()
        try:
            rl.acquire(f"burst:{i}", 10).release()
        except (LockContended, QuorumUnavailable):
            pass  # two masters paused: every round waits its node_timeout
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    # Two masters paused make every round last node_timeout, so the threads' rounds
    # overlap and each opens a lane of its own.
    masters[1].pause()
    masters[2].pause()
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        start.wait()
        for worker in workers:
            worker.join(timeout=30)
    finally:
        masters[1].resume()
        masters[2].resume()
    assert not errors
    # (the links to the paused masters failed their handshake and are closed already)
    assert open_fds() - base >= threads // 2, "the burst did not open its lanes"
    offset[0] += LANE_IDLE + 1  # the burst's lanes have been idle that long
    wait_for(lambda: cycle(rl, "after"), timeout=10, message="masters never recovered")
    assert open_fds() - base <= IDLE_LANES_KEPT * len(masters)
    # The kept lanes still work, and a new burst can open lanes again.
    for _ in range(3):
        assert rl.acquire("again", 10).release() is True
