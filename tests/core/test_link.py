"""A link's reads and writes on its socket: RESP through hiredis, over real masters."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import select
import textwrap
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock.lock import Redlock, waiting
from celery_redlock.lock import redlock as redlock_mod
from celery_redlock.lock.fanout import Validator
from celery_redlock.lock.master import Link, make_master
from celery_redlock.lock.wire import ReplyError, fragment, pack
from celery_redlock.testing import Masters

from . import helpers


def read_all(link: Link, expected: int) -> list[object]:
    slot = link.outstanding[-1]
    deadline = time.monotonic() + 10
    while not slot.done and time.monotonic() < deadline:
        if link.wait_readable(deadline - time.monotonic()):
            link.read_available()
    slot_replies = slot.replies
    assert len(slot_replies) == expected, slot_replies
    return slot_replies


def normalise(value: object) -> object:
    """ReplyError compares by identity; compare its class and text instead."""
    if isinstance(value, ReplyError):
        return ("error", str(value))
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def test_fragments_join_into_the_packed_command() -> None:
    """The heartbeat assembles one command from parts packed ahead of time."""
    parts = fragment(("EVALSHA", "x")) + fragment((1, b"k\r\n")) + fragment(("é", 1.5))
    assert b"*6\r\n" + parts == pack(("EVALSHA", "x", 1, b"k\r\n", "é", 1.5))
    assert pack(("GET", "k"), ("PING",)) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n"
    with pytest.raises(TypeError):
        pack(("SET", "k", True))


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_replies_from_a_real_server(masters: Masters) -> None:
    """Pipelined commands written with ``pack`` and read back by a link: bytes stay bytes,
    arrays are lists (nested too), error replies are values, also inside an array."""
    server = masters[0]
    script = "return {1, {ARGV[1], false}, redis.error_reply('MINE bad'), tonumber(ARGV[2])}"
    payload = pack(
        ("SET", "bin", b"a\r\n\x00b"),
        ("GET", "bin"),
        ("GET", "missing"),
        ("EVAL", script, 0, "hé", 1795326645895408),
        ("RPUSH", "list", "x", "y"),
        ("LRANGE", "list", 0, -1),
        ("NOSUCHCOMMAND",),
    )
    link = Link(make_master(server.url, 2.0))
    link.connect(time.monotonic())
    try:
        link.send(payload, 7)
        replies = read_all(link, 7)
    finally:
        link.close()
    assert replies[:3] == [b"OK", b"a\r\n\x00b", None]
    nested = replies[3]
    assert isinstance(nested, list)
    assert nested[:2] == [1, ["hé".encode(), None]]  # Lua false is a null bulk
    assert normalise(nested[2]) == ("error", "MINE bad")  # an error nested in an array
    assert nested[3] == 1795326645895408
    assert replies[4:6] == [2, [b"x", b"y"]]
    assert isinstance(replies[6], ReplyError)
    assert "unknown command" in str(replies[6])


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_link_sends_a_payload_larger_than_the_socket_buffer(masters: Masters) -> None:
    """Links are non-blocking: a send the kernel takes in parts is finished in parts."""
    master = make_master(masters[0].url, 2.0)
    link = Link(master)
    link.connect(time.monotonic())
    try:
        assert link.sock is not None
        assert link.sock.getblocking() is False
        value = b"x" * (8 * 1024 * 1024)  # far more than a loopback send takes at once
        slot = link.send(pack(("SET", "big", value), ("STRLEN", "big")), 2)
        deadline = time.monotonic() + 10
        while not slot.done and time.monotonic() < deadline:
            if link.wait_readable(deadline - time.monotonic()):
                link.read_available()
        assert slot.replies == [b"OK", len(value)]
    finally:
        link.close()


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_link_gives_up_a_send_a_stopped_master_never_takes(masters: Masters) -> None:
    master = make_master(masters[0].url, 0.3)
    link = Link(master)
    link.connect(time.monotonic())
    masters[0].pause()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"could not send within 0\.3s"):
            link.send(pack(("SET", "big", b"x" * (64 * 1024 * 1024))), 1)
        assert time.monotonic() - started < 5
    finally:
        masters[0].resume()
        link.close()


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_a_link_waits_on_its_watcher_and_on_a_patched_poll(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link registers its socket with the standard library's ``poll`` once and its
    rounds wait on that; once an event library has put another ``poll`` in place, rounds
    wait through that one (the watcher's own would block every green thread), and a link
    opened then has no watcher (gevent's waits on the loop of the thread that made it)."""
    generic: list[int] = []
    readable_fds = waiting.readable_fds

    def counted(by_fd: Any, timeout: float) -> Any:
        generic.append(len(by_fd))
        return readable_fds(by_fd, timeout)

    monkeypatch.setattr(waiting, "readable_fds", counted)
    real = select.poll
    made: list[str] = []

    def patched() -> Any:
        made.append("patched")
        return real()

    redlock = Redlock(masters.urls, spin_wait=0)
    try:
        for _ in range(20):
            redlock.acquire("watched", 5).release()
        (link,) = redlock._lanes[0].links
        assert link.watcher is not None
        assert generic == []  # every wait went through the watcher's poll object
        monkeypatch.setattr(select, "poll", patched)
        for _ in range(3):
            redlock.acquire("watched", 5).release()
        assert generic
        assert made
        link.close()  # reopened under the patched poll: no watcher
        redlock.acquire("watched", 5).release()
        assert link.sock is not None
        assert link.watcher is None
    finally:
        redlock.close()
    assert link.watcher is None  # dropped with its socket


GEVENT_THREADS = textwrap.dedent(
    """
    import json
    import sys
    import threading

    from gevent import monkey

    monkey.patch_all(thread=False)

    import redis

    from celery_redlock.lock import Redlock

    urls = json.loads(sys.argv[1])
    rl = Redlock(urls, node_timeout=0.5)
    rl.acquire("warm", 10).release()  # this thread opens the lane
    errors = []

    def other_thread():
        for k in range(5):
            try:
                rl.acquire(f"k{k}", 10).release()
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        # The first master answers 0.1 s late: the check ends up waiting on its link alone.
        redis.Redis.from_url(urls[0]).execute_command("CLIENT", "PAUSE", 100, "ALL")
        rl.check_masters()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    down = [m.last_error for m in rl.masters if m.down]
    print(json.dumps({"errors": errors, "down": down}))
    """
)


@pytest.mark.parametrize("masters", [1, 3], indirect=True)
def test_gevent_rounds_on_another_thread_see_their_replies(masters: Masters) -> None:
    """Review of the watcher: made from gevent's ``poll``, it waited on the loop of the
    thread that opened the link, and another OS thread taking the lane (``patch_all(
    thread=False)``, gevent's threadpool) never saw its replies: every round timed out
    and a healthy master was marked down (on 3 masters, when one answered last)."""
    assert importlib.util.find_spec("gevent") is not None, "gevent is not installed"
    result = helpers.run_python(GEVENT_THREADS, json.dumps(masters.urls))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"errors": [], "down": []}


# -- the rounds' reply validators ------------------------------------------------------

_RESP = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)


def _validators() -> dict[str, Validator]:
    """Every validator a round of :class:`Redlock` is given (``valid=`` in its source, and
    the default), by name: a new one is checked here without being listed."""
    source = inspect.getsource(redlock_mod)
    names = set(re.findall(r"valid=(_[a-z_]+)\)", source)) | {"_script_replies"}
    assert len(names) >= 7, names
    return {name: getattr(redlock_mod, name) for name in sorted(names)}


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_no_validator_accepts_an_error_reply(data: st.DataObject) -> None:
    """run_round looks for error replies (a NOSCRIPT closes the link) only among replies
    a validator refused: a validator accepting one would count an error as a vote."""
    name = data.draw(st.sampled_from(sorted(_validators())), label="validator")
    replies = data.draw(st.lists(_RESP, max_size=3), label="other replies")
    at = data.draw(st.integers(0, len(replies)), label="error at")
    text = data.draw(st.sampled_from(["NOSCRIPT No matching script", "ERR wrong", "OOM"]))
    replies.insert(at, ReplyError(text))
    try:
        accepted = _validators()[name](replies)
    except Exception:  # noqa: BLE001 - run_round counts a validator raising as a refusal
        accepted = False
    assert not accepted, (name, replies)
