"""This process's id and random lock tokens, without a system call each time.

Both run on every acquire and release, where a system call costs microseconds on a
virtual machine. Both are reset in a forked child (``os.register_at_fork``): the child
learns its own pid, and drops the random bytes it inherited, so that a parent and a
child never hand out the same token.
"""

from __future__ import annotations

import os
import threading

__all__ = ["pid", "token_hex"]

#: random bytes drawn per ``os.urandom`` call (256 tokens)
DRAW = 4096
TOKEN_BYTES = 16

_pid = os.getpid()
_pool = b""
_pos = 0
_lock = threading.Lock()


def pid() -> int:
    """``os.getpid()``, answered from memory."""
    return _pid


def token_hex() -> str:
    """A random 128-bit token as 32 hex digits, like ``secrets.token_hex(16)``.

    From ``os.urandom``, the source :mod:`secrets` uses, drawn 4 KiB at a time.
    """
    global _pool, _pos
    with _lock:
        if _pos + TOKEN_BYTES > len(_pool):
            _pool = os.urandom(DRAW)
            _pos = 0
        chunk = _pool[_pos : _pos + TOKEN_BYTES]
        _pos += TOKEN_BYTES
    return chunk.hex()


def _after_fork_in_child() -> None:
    global _pid, _pool, _pos, _lock
    _pid = os.getpid()
    _pool = b""
    _pos = 0
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
