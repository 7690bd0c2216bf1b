"""A small RESP2 encoder and incremental decoder for the fan-out path.

redis-py opens, authenticates and closes our connections; once a connection is
up, the fan-out writes and reads its socket itself so that one thread can wait
on every master at once and never blocks on a half-read reply. Only the reply
types our scripts and handshakes produce matter, but every RESP2 type parses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["INCOMPLETE", "ReplyError", "RespReader", "pack", "pack_args"]

Arg = bytes | str | int | float


class ReplyError(Exception):
    """An error reply (``-ERR ...``) from a master; a value, never raised by the reader."""


class _Incomplete:
    __slots__ = ()

    def __repr__(self) -> str:
        return "INCOMPLETE"


#: Returned by :meth:`RespReader.next` while the buffer holds no whole reply.
INCOMPLETE = _Incomplete()


def _encode(arg: Arg) -> bytes:
    if type(arg) is str:  # the common case first: this runs for every argument sent
        return arg.encode()
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):
        raise TypeError("refusing to send a bool to Redis; convert it first")
    return repr(arg).encode() if isinstance(arg, float) else str(arg).encode()


def pack(*commands: Sequence[Arg]) -> bytes:
    """Encode one or more commands as one RESP2 payload, ready for ``sendall``."""
    return b"".join(b"*%d\r\n%s" % (len(command), pack_args(command)) for command in commands)


def pack_args(args: Iterable[Arg]) -> bytes:
    """Encode bulk strings without the array header: a fragment of a command.

    For callers that assemble one large command from parts encoded ahead of time
    (the heartbeat's multi-lease renewal); prefix the result with ``*<count>\\r\\n``.
    """
    out: list[bytes] = []
    for arg in args:
        data = _encode(arg)
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def pack_many(commands: Iterable[Sequence[Arg]]) -> bytes:
    """Like :func:`pack` for an iterable of commands."""
    return pack(*commands)


class RespReader:
    """Incremental RESP2 decoder over a growing byte buffer."""

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def clear(self) -> None:
        self._buf.clear()
        self._pos = 0

    def empty(self) -> bool:
        """True when every byte fed so far has been parsed."""
        return self._pos == len(self._buf)

    def next(self) -> object:
        """Return the next whole reply, or :data:`INCOMPLETE`."""
        try:
            reply, pos = self._parse(self._pos)
        except IndexError:
            return INCOMPLETE
        self._pos = pos
        if pos > 65536 and pos * 2 > len(self._buf):
            del self._buf[:pos]
            self._pos = 0
        return reply

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            raise IndexError
        return bytes(self._buf[pos:end]), end + 2

    def _parse(self, pos: int) -> tuple[object, int]:
        buf = self._buf
        kind = buf[pos]  # IndexError when empty: incomplete
        line, pos = self._line(pos + 1)
        if kind == 58:  # ':' integer
            return int(line), pos
        if kind == 36:  # '$' bulk string
            size = int(line)
            if size < 0:
                return None, pos
            end = pos + size
            if end + 2 > len(buf):
                raise IndexError
            return bytes(buf[pos:end]), end + 2
        if kind == 43:  # '+' simple string
            return line, pos
        if kind == 45:  # '-' error
            return ReplyError(line.decode(errors="replace")), pos
        if kind == 42:  # '*' array
            count = int(line)
            if count < 0:
                return None, pos
            items: list[object] = []
            for _ in range(count):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        raise ValueError(f"unexpected RESP type byte {kind!r}")
