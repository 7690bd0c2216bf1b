"""The protected resource: a fenced store whose own log is the authority, and a plain counter.

Both live on their own ``redis-server`` (never one of the lock's masters, never faulted).

**Fenced store** (Kleppmann's storage service that checks tokens). One Lua script handles
a fenced *read* and a fenced *write* of ``res:{key}``; it keeps the largest fence it has
seen per key and appends what it did, accepted or refused, to the list ``res:log`` as a
JSON object with a global sequence number. The list is the authority on write order: the
checker reads it instead of trusting what clients believe they wrote.

* a read with ``fence < max_seen`` is stale; otherwise ``max_seen = fence``. Registering
  the reader's fence matters: without it, a stale holder that read the value before the
  next holder and writes after the next holder's *read* (but before its write) would be
  accepted, and the next holder's write would overwrite it with a value computed from the
  same read: a lost update that write-only fencing lets through.
* a write with ``fence < max_seen`` is stale. Equal is allowed: the holder that read with
  that fence writes with it (fences are unique per lease).
* ``enforce=1`` refuses stale operations; ``enforce=0`` ("fencing off", a negative
  control) accepts them but still logs ``stale``, so the checker can count accepted stale
  writes.

Each write sends the value it computed (``read + 1``) and the value it was based on; the
log records the value current at the write, so a lost update (an accepted write based on
something other than the current value) is visible in the log itself.

**Unfenced counter**: ``GET ctr:{key}``, pause, ``SET ctr:{key} value+1``. No fencing, no
atomicity: the number of increments clients completed minus the final value is the number
of lost updates, i.e. of moments two clients were in the critical section together.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

__all__ = ["FENCED_OP", "FencedStore", "UnfencedCounter", "read_log"]

LOG_KEY = "res:log"
SEQ_KEY = "res:seq"

#: KEYS[1] the item hash res:{key} (fields value, fence), KEYS[2] the log list, KEYS[3] the
#: sequence counter.
#: ARGV[1] 'read' or 'write', ARGV[2] the caller's fence (decimal, '0' = none), ARGV[3]
#: '1' to refuse stale operations, '0' to accept and log them, ARGV[4] writer name,
#: ARGV[5] lease id, ARGV[6] the key, ARGV[7] new value (write), ARGV[8] the value the new
#: one was computed from (write).
#: Returns {accepted 0/1, current value, max fence before, seq}.
#: Fences are compared as decimal strings (longer is larger, then lexically), exactly.
FENCED_OP = """
local op, fence, enforce = ARGV[1], ARGV[2], ARGV[3]
local max_seen = redis.call('HGET', KEYS[1], 'fence') or '0'
local current = redis.call('HGET', KEYS[1], 'value') or '0'
local function less(a, b)
    if #a ~= #b then return #a < #b end
    return a < b
end
local stale = less(fence, max_seen)
local accepted = (not stale) or enforce == '0'
local seq = redis.call('INCR', KEYS[3])
local now = redis.call('TIME')
local entry = {seq = seq, op = op, key = ARGV[6], fence = fence, max_before = max_seen,
    stale = stale, accepted = accepted, current = current, writer = ARGV[4],
    lease = ARGV[5], wall_us = now[1] .. string.format('%06d', tonumber(now[2]))}
if accepted then
    if less(max_seen, fence) then
        redis.call('HSET', KEYS[1], 'fence', fence)
    end
    if op == 'write' then
        redis.call('HSET', KEYS[1], 'value', ARGV[7])
        entry['value'] = ARGV[7]
        entry['based_on'] = ARGV[8]
    end
end
redis.call('RPUSH', KEYS[2], cjson.encode(entry))
return {accepted and 1 or 0, current, max_seen, seq}
"""


class FencedStore:
    """Client side of the fenced store (one per process)."""

    def __init__(self, url: str, *, enforce: bool = True, writer: str = "?") -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._op = self.client.register_script(FENCED_OP)
        self.enforce = enforce
        self.writer = writer

    def _call(self, op: str, key: str, fence: int, lease: str, *extra: Any) -> list[Any]:
        reply = self._op(
            keys=[f"res:{{{key}}}", LOG_KEY, SEQ_KEY],
            args=[op, str(fence), "1" if self.enforce else "0", self.writer, lease, key, *extra],
        )
        return list(reply)

    def read(self, key: str, fence: int, lease: str) -> tuple[bool, int, int]:
        """``(accepted, value, seq)``: a stale read is refused when fencing is on."""
        accepted, current, _, seq = self._call("read", key, fence, lease)
        return bool(accepted), int(current), int(seq)

    def write(
        self, key: str, fence: int, lease: str, value: int, based_on: int
    ) -> tuple[bool, int]:
        """``(accepted, seq)``."""
        accepted, _, _, seq = self._call("write", key, fence, lease, str(value), str(based_on))
        return bool(accepted), int(seq)

    def close(self) -> None:
        self.client.close()


class UnfencedCounter:
    """``GET``, pause, ``SET``: loses updates whenever two holders overlap."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def read(self, key: str) -> int:
        return int(self.client.get(f"ctr:{{{key}}}") or 0)

    def write(self, key: str, value: int) -> None:
        self.client.set(f"ctr:{{{key}}}", value)

    def close(self) -> None:
        self.client.close()


def read_log(client: redis.Redis) -> list[dict[str, Any]]:
    """The store's log, in the order the store executed the operations.

    Each entry gets ``t``: the server's wall clock (``TIME``, same host) moved onto the
    monotonic clock with the offset between the two clocks now. Only for timelines: the
    order the checker relies on is ``seq``.
    """
    offset = time.time_ns() - time.monotonic_ns()
    out = []
    for raw in client.lrange(LOG_KEY, 0, -1):
        entry = json.loads(raw)
        entry["seq"] = int(entry["seq"])
        entry["t"] = int(entry.pop("wall_us")) * 1000 - offset
        out.append(entry)
    return out


def counters(client: redis.Redis) -> dict[str, int]:
    """Final values of the unfenced counters, per key."""
    out = {}
    for name in client.scan_iter(match="ctr:*"):
        text = name.decode()
        out[text[5:-1]] = int(client.get(name) or 0)
    return out
