"""Lua scripts run on every master, one per operation.

Every script checks ownership and changes keys in one atomic step, so that a
holder whose lease ran out can never delete or extend the next holder's lock.
Each script's header names its ``KEYS``, ``ARGV`` and reply. All keys of one
lock share a hash tag (``<prefix>:{<key>}``), so a script never touches two
Redis Cluster slots except :data:`EXTEND_MANY`, which the heartbeat sends to a
plain master only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .wire import fragment, pack_command

__all__ = [
    "ACQUIRE",
    "ALL_SCRIPTS",
    "CLAIM",
    "CLAIMED_BY",
    "EXTEND",
    "EXTEND_MANY",
    "EXTENSION_FIELD",
    "FENCE",
    "RELABEL",
    "RELEASE",
    "RELEASE_OWNER",
    "UNCLAIM",
    "Script",
]


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    #: the SHA1 that EVALSHA names the script by (computed once: it is on the hot path)
    sha: str = field(init=False, repr=False)
    #: ``EVALSHA <sha>`` as RESP bulk strings, the constant start of every call
    #: (for callers that assemble a call from fragments, see :func:`.wire.fragment`)
    head: bytes = field(init=False, repr=False)
    _sha_bytes: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode()).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "_sha_bytes", sha.encode())
        object.__setattr__(self, "head", fragment((b"EVALSHA", sha)))

    def call(self, numkeys: int, *args: str | int) -> bytes:
        """One ``EVALSHA`` of this script, RESP-encoded: ``numkeys`` keys, then ``args``."""
        return pack_command((b"EVALSHA", self._sha_bytes, numkeys, *args))


#: KEYS[1] lock, KEYS[2] metadata hash, KEYS[3] companion key (see ARGV[3]).
#: ARGV[1] token, ARGV[2] ttl in ms, ARGV[3] a value: on success KEYS[3] is deleted
#: if it holds exactly this value ('' = leave KEYS[3] alone), ARGV[4..] metadata
#: field, value pairs (may be none).
#: Returns 1 when the key was free and is ours now, 0 when it is held (by anyone: every
#: acquire attempt has a fresh token, so an attempt never finds its own).
#: The metadata hash starts afresh: it also holds the extension count (``EXTEND``), which
#: must not carry over from an earlier holder.
ACQUIRE = Script(
    "acquire",
    """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
if #ARGV > 3 then
    redis.call('HSET', KEYS[2], unpack(ARGV, 4))
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) == ARGV[3] then
    redis.call('DEL', KEYS[3])
end
return 1
""",
)

#: KEYS[1] lock, KEYS[2] metadata hash, KEYS[3] companion key (see ARGV[2]).
#: ARGV[1] token, ARGV[2] a value: KEYS[3] is deleted too if it holds exactly this
#: value ('' = leave KEYS[3] alone).
#: Returns 1 when the lock was ours and is now deleted (with its metadata), else 0.
RELEASE = Script(
    "release",
    """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) == ARGV[2] then
    redis.call('DEL', KEYS[3])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1], KEYS[2])
    return 1
end
return 0
""",
)

#: KEYS[1] lock, KEYS[2] metadata hash.
#: ARGV[1] metadata field, ARGV[2] value.
#: Returns 1 when the metadata says the lock belongs to that owner (for example
#: ``task_id`` = a task that was killed) and both keys are now deleted, else 0.
RELEASE_OWNER = Script(
    "release_owner",
    """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
    redis.call('DEL', KEYS[1], KEYS[2])
    return 1
end
return 0
""",
)

#: KEYS[1] claim key, KEYS[2] the key naming the call that wrote it (see ``CLAIMED_BY``).
#: ARGV[1] value, ARGV[2] ttl in ms, ARGV[3] this call's own random id, ARGV[4] how long
#: the id is kept, in ms (as long as a claim call can last; at most ARGV[2]).
#: Returns 1 when the key was free and now holds ARGV[1] for ARGV[2] ms (and KEYS[2] this
#: call's id for ARGV[4] ms), or holds ARGV[1] under this call's id already, the two TTLs
#: as this call sets them (written by an earlier attempt of it, or ceded to it by a call
#: that declined, see ``RELABEL``);
#: else {the value it already holds, the id of the call that wrote it ('' when unknown:
#: written by an older client, or long enough ago that its id expired)}. The value may be
#: ARGV[1]: the same value claimed by another call (one job id published twice), which the
#: id tells apart from this call's own.
CLAIM = Script(
    "claim",
    """
local current = redis.call('GET', KEYS[1])
if current == false then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
    return 1
end
local writer = redis.call('GET', KEYS[2]) or ''
if writer == ARGV[3] and current == ARGV[1]
    and redis.call('PTTL', KEYS[1]) - redis.call('PTTL', KEYS[2]) <= ARGV[2] - ARGV[4] + 1 then
    -- the value and the id as this call sets them together: an older client writing the
    -- value again later, where this call's id outlived its copy, leaves the value's TTL
    -- further ahead of the id's (+ 1: before Redis 7 the clock may tick between the two)
    return 1
end
return {current, writer}
""",
)

#: KEYS[1] a claim's writer id key (``CLAIM``'s KEYS[2]).
#: ARGV[1] the id it should hold, ARGV[2] the id to put there instead ('' = delete it).
#: Returns 1 when it held ARGV[1] and now holds ARGV[2] (its TTL kept), else 0. A call
#: that declines a claim it wrote somewhere cedes its copies to the call it declined for.
RELABEL = Script(
    "relabel",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
if ARGV[2] == '' then
    redis.call('DEL', KEYS[1])
else
    local left = redis.call('PTTL', KEYS[1])
    if left > 0 then
        redis.call('SET', KEYS[1], ARGV[2], 'PX', left)
    end
end
return 1
""",
)

#: What a claim key's name ends in, after the claim's own name, for the key holding the
#: id of the call that wrote it (``CLAIM``'s KEYS[2]). The brace keeps it apart from every
#: claim's own name (claim suffixes have none), and after the lock's hash tag it does not
#: change the key's Redis Cluster slot. It lives only as long as a claim
#: call can last: the id tells calls racing to claim one value apart; a value found
#: later, its id gone, is one call's (a finished claim), as it should be.
CLAIMED_BY = ":{claimed-by"

#: KEYS[1] claim key, KEYS[2] the id of the call that wrote it (``CLAIM``'s KEYS[2]).
#: ARGV[1] value, ARGV[2] (optional) a call's id: then only a copy that call wrote (or
#: was ceded) is deleted, never the same value another call wrote.
#: Returns 1 when the key held exactly ARGV[1] (written by ARGV[2]) and is now deleted
#: (with KEYS[2]), else 0.
UNCLAIM = Script(
    "unclaim",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
if ARGV[2] and redis.call('GET', KEYS[2]) ~= ARGV[2] then
    return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
""",
)

#: The metadata field holding the number of the last extension applied (see ``EXTEND``).
EXTENSION_FIELD = "_ext"

#: KEYS[1] lock, KEYS[2] metadata hash.
#: ARGV[1] token, ARGV[2] new ttl in ms, ARGV[3] the extension's number (1, 2, ... per lease).
#: Returns 1 when the lock was ours and now lives ARGV[2] ms (metadata too), 0 when it is
#: not ours, 2 when it is ours but a later extension of this lease was applied already:
#: an extension delayed on its connection never changes the TTL a later one set.
EXTEND = Script(
    "extend",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
if tonumber(redis.call('HGET', KEYS[2], '_ext') or '0') >= tonumber(ARGV[3]) then
    return 2
end
redis.call('HSET', KEYS[2], '_ext', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
""",
)

#: KEYS[2i-1] lock i, KEYS[2i] metadata hash i, for i in 1..n.
#: ARGV[3i-2] token i, ARGV[3i-1] new ttl in ms for lock i, ARGV[3i] its extension number.
#: Returns a string of n characters, as ``EXTEND`` per lock: '1' extended, '0' not ours,
#: '2' ours but a later extension was applied already.
EXTEND_MANY = Script(
    "extend_many",
    """
local out = {}
for i = 1, #KEYS, 2 do
    local a = (i - 1) / 2 * 3 + 1
    if redis.call('GET', KEYS[i]) ~= ARGV[a] then
        out[#out + 1] = '0'
    elseif tonumber(redis.call('HGET', KEYS[i + 1], '_ext') or '0') >= tonumber(ARGV[a + 2]) then
        out[#out + 1] = '2'
    else
        redis.call('HSET', KEYS[i + 1], '_ext', ARGV[a + 2])
        redis.call('PEXPIRE', KEYS[i], ARGV[a + 1])
        redis.call('PEXPIRE', KEYS[i + 1], ARGV[a + 1])
        out[#out + 1] = '1'
    end
end
return table.concat(out)
""",
)

#: KEYS[1] lock, KEYS[2] fence counter.
#: ARGV[1] token, ARGV[2] proposed fence, ARGV[3] counter ttl in ms.
#: Returns {0, counter} when the lock is not ours; {1, proposal} when the counter was
#: below the proposal and now holds it; {2, counter} when the counter is already at
#: or above the proposal (nothing written).
FENCE = Script(
    "fence",
    """
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return {0, counter}
end
if counter < tonumber(ARGV[2]) then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
    return {1, tonumber(ARGV[2])}
end
return {2, counter}
""",
)

ALL_SCRIPTS: tuple[Script, ...] = (
    ACQUIRE,
    RELEASE,
    RELEASE_OWNER,
    EXTEND,
    EXTEND_MANY,
    FENCE,
    CLAIM,
    UNCLAIM,
    RELABEL,
)
