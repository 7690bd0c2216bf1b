"""A link's reads and writes on its socket: RESP through hiredis, over real masters."""

from __future__ import annotations

import time

import pytest

from celery_redlock.lock.master import Link, make_master
from celery_redlock.lock.wire import ReplyError, fragment, pack
from celery_redlock.testing import Masters


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
