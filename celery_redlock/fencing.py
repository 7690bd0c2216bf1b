"""Fenced writes: a resource that refuses a holder whose fencing token is not newer.

A lock alone cannot stop a holder that was paused (GC, swap, SIGSTOP) past its
lease from writing after the next holder did. The fix (Kleppmann) is on the
resource side: every write carries the writer's ``lease.fence``, and the
resource keeps the newest fence it accepted and refuses anything not newer::

    A acquires, fence 100 ... A pauses ..........................  A resumes, writes(100)
                     lease expires; B acquires, fence 101, writes(101)      -> StaleFence

Two helpers, both Celery-free:

* :class:`FencedRedis`: a value in Redis (``SET`` or hash fields) written only
  when the caller's fence is strictly greater than the one stored beside it,
  checked and written in one Lua script;
* :func:`fenced_update_sql`: the same rule for a table row over any DB-API 2
  connection (``UPDATE ... WHERE pk = ? AND fence < ?``). With Django, use
  :func:`celery_redlock.contrib.django.fencing.fenced_update`.

The rule is *strictly* greater: a fence is spent by the write that uses it, so
one lease writes one resource once (put every field in that one call) and a
duplicated or replayed write of the same holder is refused too.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import redis

from .exceptions import StaleFence

__all__ = ["FENCED_WRITE", "FencedRedis", "fenced_update_sql"]

Value: TypeAlias = bytes | str | int | float

#: KEYS[1] the value key (a string, or a hash with ARGV[1] = 'hset'),
#: KEYS[2] where the fence is kept: a string key beside the value ('set'), or the
#: hash itself, with the fence in field ARGV[3] ('hset').
#: ARGV[1] 'set' or 'hset', ARGV[2] the caller's fence (a non-negative integer in
#: decimal), ARGV[3] the fence field ('hset'; ignored for 'set'),
#: ARGV[4] the value ('set'), or ARGV[4..] field, value pairs ('hset').
#: Returns {1, fence} when the value and fence were written; {0, current} when the
#: stored fence is equal or newer (nothing written). Fences are compared as decimal
#: strings (longer is larger, then lexically), so tokens above 2^53 stay exact.
FENCED_WRITE = """
local mode, fence = ARGV[1], ARGV[2]
local current
if mode == 'hset' then
    current = redis.call('HGET', KEYS[2], ARGV[3])
else
    current = redis.call('GET', KEYS[2])
end
if current then
    if #current > #fence or (#current == #fence and current >= fence) then
        return {0, current}
    end
end
if mode == 'hset' then
    redis.call('HSET', KEYS[1], ARGV[3], fence, unpack(ARGV, 4))
else
    redis.call('SET', KEYS[1], ARGV[4])
    redis.call('SET', KEYS[2], fence)
end
return {1, fence}
"""

#: Default companion key suffix: the fence of ``SET key`` lives in ``key + ":fence"``.
FENCE_SUFFIX = ":fence"
#: Default hash field holding the fence of a fenced hash.
FENCE_FIELD = "__fence__"


def _fence_text(fence: object) -> str:
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise TypeError(f"fence must be a non-negative int (lease.fence), got {fence!r}")
    return str(fence)


def _int_or_none(value: object) -> int | None:
    if value is None:
        return None
    return int(value.decode() if isinstance(value, bytes) else str(value))


class FencedRedis:
    """Write Redis values only with a newer fencing token than the last write's.

    ::

        fenced = FencedRedis(redis.Redis.from_url("redis://db:6379/0"))
        fenced.set("balance:{42}", "100", fence=lease.fence)  # StaleFence if not newer
        value, fence = fenced.get("balance:{42}")

    The fence of a string key is kept in a companion key (``key + fence_suffix``),
    which never expires: a stale holder must not find it gone. In a Redis Cluster
    give the key a hash tag (``balance:{42}``) so both land in one slot. A hash
    keeps its fence in its own field ``fence_field``.

    The script is registered once per instance and run with ``EVALSHA`` (redis-py
    loads it again after a ``SCRIPT FLUSH`` or a server restart).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        fence_suffix: str = FENCE_SUFFIX,
        fence_field: str = FENCE_FIELD,
    ) -> None:
        if not fence_suffix or not fence_field:
            raise ValueError("fence_suffix and fence_field must be non-empty")
        self.client = client
        self.fence_suffix = fence_suffix
        self.fence_field = fence_field
        self._write = client.register_script(FENCED_WRITE)

    def fence_key(self, key: str) -> str:
        """The Redis key holding the fence of the string value at ``key``."""
        return key + self.fence_suffix

    # -- writes ----------------------------------------------------------------

    def set(self, key: str, value: Value, *, fence: int) -> None:
        """``SET key value`` if ``fence`` is newer than the stored one, and store it.

        :raises StaleFence: the stored fence is equal or newer (``exc.fence`` is
            ours, ``exc.current`` the stored one); nothing was written.
        :raises TypeError: ``fence`` is not a non-negative int.
        """
        self.do_write(key, self.fence_key(key), ["set", _fence_text(fence), "", value])

    def hset(
        self,
        key: str,
        field: str | None = None,
        value: Value | None = None,
        *,
        mapping: Mapping[str, Value] | None = None,
        fence: int,
    ) -> None:
        """``HSET key field value [field value ...]`` plus the fence field, atomically,
        if ``fence`` is newer than the hash's. Give every field of the write in one
        call (``mapping=``): the fence is spent by it.

        :raises StaleFence: the hash's fence is equal or newer; nothing was written.
        :raises ValueError: no field given, or a field named like the fence field.
        """
        pairs: dict[str, Value] = dict(mapping or {})
        if field is not None:
            if value is None:
                raise ValueError("hset(key, field, value): value is missing")
            pairs[field] = value
        if not pairs:
            raise ValueError("hset needs a field and value, or mapping=")
        if self.fence_field in pairs:
            raise ValueError(f"{self.fence_field!r} is the fence field; it is written for you")
        args: list[Value] = ["hset", _fence_text(fence), self.fence_field]
        for name, item in pairs.items():
            args += [name, item]
        self.do_write(key, key, args)

    def do_write(self, key: str, fence_key: str, args: Sequence[Value]) -> None:
        """Run :data:`FENCED_WRITE`; map a refusal to :class:`StaleFence`."""
        written, stored = self._write(keys=[key, fence_key], args=list(args))
        if written == 1:
            return
        fence, current = int(str(args[1])), _int_or_none(stored)
        raise StaleFence(
            f"write to {key!r} refused: fence {fence} is not newer than {current}",
            key,
            [],
            None,
            fence,
            current,
        )

    # -- reads -----------------------------------------------------------------

    def get(self, key: str) -> tuple[bytes | str | None, int | None]:
        """``(value, fence)`` of a fenced string key; ``(None, None)`` when never written.

        The value is ``bytes``, or ``str`` from a client with ``decode_responses=True``.
        """
        value, fence = self.client.mget([key, self.fence_key(key)])
        return value, _int_or_none(fence)

    def hget(self, key: str, field: str) -> tuple[bytes | str | None, int | None]:
        """``(value of field, fence of the hash)``."""
        value, fence = self.client.hmget(key, [field, self.fence_field])
        return value, _int_or_none(fence)

    def fence(self, key: str, *, hash_key: bool = False) -> int | None:
        """The newest fence accepted for ``key`` (a hash with ``hash_key=True``)."""
        if hash_key:
            return _int_or_none(self.client.hget(key, self.fence_field))
        return _int_or_none(self.client.get(self.fence_key(key)))


# -- SQL over DB-API 2 ----------------------------------------------------------------------

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


def _identifier(name: str, what: str) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"{what} must be a plain SQL identifier, got {name!r}")
    return name


def _placeholders(paramstyle: str, count: int) -> list[str]:
    if paramstyle == "qmark":
        return ["?"] * count
    if paramstyle in ("format", "pyformat"):
        return ["%s"] * count
    if paramstyle == "numeric":
        return [f":{i}" for i in range(1, count + 1)]
    if paramstyle == "named":
        return [f":p{i}" for i in range(1, count + 1)]
    raise ValueError(f"unknown DB-API paramstyle {paramstyle!r}")


def _paramstyle_of(connection: Any) -> str:
    module = sys.modules.get(type(connection).__module__.partition(".")[0])
    style = getattr(module, "paramstyle", None)
    if not isinstance(style, str):
        raise ValueError(
            f"cannot tell the paramstyle of {type(connection).__name__}; pass paramstyle="
        )
    return style


def fenced_update_sql(
    connection: Any,
    table: str,
    pk: object,
    fence: int,
    values: Mapping[str, object],
    *,
    pk_column: str = "id",
    fence_column: str = "fence",
    paramstyle: str | None = None,
) -> None:
    """``UPDATE table SET <values>, fence = :fence WHERE pk = :pk AND fence < :fence``.

    ``connection`` is a DB-API 2 connection (``sqlite3``, ``psycopg``, ...); a
    ``NULL`` fence counts as older than any. Runs in the connection's current
    transaction and commits nothing: the caller commits. Table and column names
    must be plain identifiers (they are not quoted); values are parameters.

    :raises StaleFence: the row's fence is equal or newer (``exc.current``).
    :raises LookupError: no row has that primary key.
    """
    token = int(_fence_text(fence))
    table = _identifier(table, "table")
    pk_column = _identifier(pk_column, "pk_column")
    fence_column = _identifier(fence_column, "fence_column")
    if not values:
        raise ValueError("values: give at least one column to write")
    columns = [_identifier(name, "column") for name in values]
    if fence_column in columns:
        raise ValueError(f"{fence_column!r} is the fence column; it is written for you")
    style = paramstyle or _paramstyle_of(connection)
    params: list[object] = [*values.values(), token, pk, token]
    marks = _placeholders(style, len(params))
    assignments = ", ".join(f"{c} = {m}" for c, m in zip(columns, marks, strict=False))
    m_fence, m_pk, m_below = marks[len(columns) :]
    sql = (
        f"UPDATE {table} SET {assignments}, {fence_column} = {m_fence} "
        f"WHERE {pk_column} = {m_pk} AND ({fence_column} IS NULL OR {fence_column} < {m_below})"
    )
    bound: Sequence[object] | dict[str, object] = params
    if style == "named":
        bound = {m[1:]: p for m, p in zip(marks, params, strict=True)}
    cursor = connection.cursor()
    try:
        cursor.execute(sql, bound)
        if cursor.rowcount != 0:
            return
        select = f"SELECT {fence_column} FROM {table} WHERE {pk_column} = {marks[0]}"
        cursor.execute(select, {marks[0][1:]: pk} if style == "named" else [pk])
        row = cursor.fetchone()
    finally:
        cursor.close()
    if row is None:
        raise LookupError(f"no row in {table} with {pk_column} = {pk!r}")
    current = None if row[0] is None else int(row[0])
    raise StaleFence(
        f"update of {table} {pk_column}={pk!r} refused: fence {token} is not newer than {current}",
        f"{table}:{pk}",
        [],
        None,
        token,
        current,
    )
