"""The RESP wire format on the fan-out's sockets, spoken by ``hiredis``.

redis-py opens, authenticates and closes our connections; once a connection is up,
the fan-out writes and reads its socket itself, so that one thread can wait on every
master at once and never blocks on a half-read reply. Decoding is hiredis's
``Reader`` (C): ``feed`` bytes, ``gets`` whole replies (``False`` while incomplete).
Bytes stay bytes, arrays are lists, error replies are :class:`ReplyError` values (also
nested in arrays), never raised; anything that is not RESP raises
``hiredis.ProtocolError`` (the fan-out then drops the link and counts the master as
failed).

Encoding is ``hiredis.pack_command`` too, also for the fragments that callers
encode once and join later (a lease's keys and token in the heartbeat's renewal, the
``EVALSHA <sha>`` head of a script call): :func:`fragment` is a packed command
without its ``*<count>`` header, so no encoder of our own is left. Measured on
CPython 3.11 (one ``ACQUIRE`` call, 9 arguments): the Python encoder this replaces
took 2.4 µs, ``pack_command`` 0.8 µs; reading a lone ``:1`` reply took 0.59 µs with
the Python reader, 0.11 µs with hiredis, less than the 0.22 µs of the special case
the Python reader had for it (which is gone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import hiredis

__all__ = ["ProtocolError", "ReplyError", "fragment", "pack", "pack_command", "reader"]

Arg = bytes | str | int | float

#: Raised by a reader fed bytes that are not RESP.
ProtocolError = hiredis.ProtocolError


class ReplyError(Exception):
    """An error reply (``-ERR ...``) from a master; a value, never raised by the reader."""


def reader() -> hiredis.Reader:
    """A reader for one connection: bytes undecoded, error replies as :class:`ReplyError`."""
    return hiredis.Reader(replyError=ReplyError)


def pack(*commands: Sequence[Arg]) -> bytes:
    """Encode one or more commands as one payload, ready for ``send``.

    ``str`` is sent UTF-8 encoded, ``int`` and ``float`` as their decimal text;
    anything else (``bool``, ``None``) is refused with ``TypeError``.
    """
    return b"".join([pack_command(tuple(command)) for command in commands])


def fragment(args: Iterable[Arg]) -> bytes:
    """Bulk strings without the array header: a part of a command, encoded ahead of time.

    Prefix the joined parts with ``*<count>\\r\\n`` (the count of every argument).
    """
    packed = pack_command(tuple(args))
    return packed[packed.index(b"\n") + 1 :]


#: ``hiredis.pack_command``: one command (a tuple of arguments) as RESP bytes. Typed
#: here because hiredis's stub declares a one-element tuple and an ``Any`` result.
pack_command = cast(Callable[[tuple[Arg, ...]], bytes], hiredis.pack_command)
