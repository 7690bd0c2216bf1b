"""The RESP2 codec the fan-out uses on its sockets: encoding, and incremental decoding."""

from __future__ import annotations

import socket
import time

import pytest

from celery_redlock.lock.master import Link, make_master
from celery_redlock.lock.resp import INCOMPLETE, ReplyError, RespReader, pack
from celery_redlock.testing import Masters

REPLIES: list[tuple[bytes, object]] = [
    (b"+OK\r\n", b"OK"),
    (b"-ERR unknown command 'NOPE'\r\n", ReplyError("ERR unknown command 'NOPE'")),
    (b":0\r\n", 0),
    (b":-42\r\n", -42),
    (b":1795326645895408\r\n", 1795326645895408),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"$5\r\na\r\nbc\r\n", b"a\r\nbc"),
    (b"*2\r\n:1\r\n:1795326645895408\r\n", [1, 1795326645895408]),
    (
        b"*3\r\n*2\r\n$1\r\na\r\n*1\r\n$-1\r\n:7\r\n-WRONGTYPE nope\r\n",
        [[b"a", [None]], 7, ReplyError("WRONGTYPE nope")],
    ),
]


def normalise(value: object) -> object:
    """ReplyError compares by identity; compare its class and text instead."""
    if isinstance(value, ReplyError):
        return ("error", str(value))
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


@pytest.mark.parametrize(("wire", "expected"), REPLIES)
def test_whole_reply(wire: bytes, expected: object) -> None:
    reader = RespReader()
    reader.feed(wire)
    assert normalise(reader.next()) == normalise(expected)
    assert reader.next() is INCOMPLETE


@pytest.mark.parametrize(("wire", "expected"), REPLIES)
def test_fed_byte_by_byte(wire: bytes, expected: object) -> None:
    reader = RespReader()
    for i in range(len(wire) - 1):
        reader.feed(wire[i : i + 1])
        assert reader.next() is INCOMPLETE, f"a reply came out after {i + 1} of {len(wire)} bytes"
    reader.feed(wire[-1:])
    assert normalise(reader.next()) == normalise(expected)
    assert reader.next() is INCOMPLETE


def test_many_replies_in_one_chunk_and_split_anywhere() -> None:
    stream = b"".join(wire for wire, _ in REPLIES)
    expected = [normalise(e) for _, e in REPLIES]
    for cut in range(len(stream) + 1):
        reader = RespReader()
        got = []
        for part in (stream[:cut], stream[cut:]):
            reader.feed(part)
            while (reply := reader.next()) is not INCOMPLETE:
                got.append(normalise(reply))
        assert got == expected, f"split at byte {cut}"


def test_errors_are_values_not_raised() -> None:
    reader = RespReader()
    reader.feed(b"-NOSCRIPT No matching script\r\n:1\r\n")
    error = reader.next()
    assert isinstance(error, ReplyError)
    assert "NOSCRIPT" in str(error)
    assert reader.next() == 1


def test_long_stream_is_compacted() -> None:
    # Far more than the 64 KiB after which the reader drops what it consumed.
    reader = RespReader()
    bulk = b"x" * 1000
    wire = b"$1000\r\n" + bulk + b"\r\n"
    for _ in range(300):
        reader.feed(wire[:500])
        assert reader.next() is INCOMPLETE
        reader.feed(wire[500:])
        assert reader.next() == bulk
    assert len(reader._buf) < 70_000


def test_clear_drops_partial_reply() -> None:
    reader = RespReader()
    reader.feed(b"*2\r\n:1\r\n")
    assert reader.next() is INCOMPLETE
    reader.clear()
    reader.feed(b":5\r\n")
    assert reader.next() == 5


def test_unknown_type_byte_is_an_error() -> None:
    reader = RespReader()
    reader.feed(b"?what\r\n")
    with pytest.raises(ValueError, match="unexpected RESP type"):
        reader.next()


def test_pack_encodes_commands() -> None:
    assert pack(("GET", "k")) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    assert pack(("SET", b"k\r\n", 10, 1.5), ("PING",)) == (
        b"*4\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n10\r\n$3\r\n1.5\r\n*1\r\n$4\r\nPING\r\n"
    )
    assert pack(("ECHO", "é")) == b"*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n"
    with pytest.raises(TypeError, match="bool"):
        pack(("SET", "k", True))


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_codec_against_a_real_server(masters: Masters) -> None:
    """Pipelined commands written with ``pack`` and read back one byte at a time."""
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
    with socket.create_connection((server.host, server.port), timeout=2) as sock:
        sock.sendall(payload)
        reader = RespReader()
        replies: list[object] = []
        while len(replies) < 7:
            chunk = sock.recv(1)
            assert chunk, "server closed the connection"
            reader.feed(chunk)
            while (reply := reader.next()) is not INCOMPLETE:
                replies.append(reply)
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
