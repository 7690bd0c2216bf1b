"""Operator tools behind ``celery redlock ...``: list, inspect, clear, check.

Celery-free: each function takes a :class:`~celery_redlock.lock.Redlock` and talks
to every master with a plain redis-py client (timeouts as configured, no
retries). Nothing here is on a task's hot path.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar, cast

import redis

from .keys import redis_key, split_redis_key
from .lock import Redlock
from .lock.master import Master
from .lock.scripts import CLAIMED_BY
from .redact import scrub

__all__ = [
    "ClearPlan",
    "KeyRecord",
    "MasterReport",
    "check",
    "clear",
    "delete_planned",
    "inspect_key",
    "list_keys",
    "plan_clear",
]

#: What each suffix of ``<prefix>:{<key>}:<suffix>`` is, for people.
KINDS = {
    None: "lock",
    "meta": "meta",
    "fence": "fence",
    "dedupe": "dedupe",
    "sent": "beat-claim",
    "run": "beat-run",
}
#: Written by ``check`` before 0.x (a hash without TTL): never listed nor cleared; ``check``
#: no longer writes anything.
CHECK_KEY = "__check__"
#: The suffix of a beat entry's anchor (``celery_redlock.beat.ANCHOR_SUFFIX``, repeated
#: here because this module stays Celery-free): ``<prefix>:{beat:<entry>}:anchor:<interval>``.
ANCHOR_SUFFIX = "anchor"
_SCAN_COUNT = 1000

#: Compare-and-delete of what ``clear`` listed, on one master.
#: KEYS[2i-1]: a key that was listed; KEYS[2i]: its lock's metadata hash, deleted with it
#: (the same name again when it has none). ARGV[i]: that key's ``DUMP`` when listed (its
#: value; renewals change only the TTL, which DUMP leaves out).
#: Returns a list with 1 for each key deleted, 0 for one that changed or went since.
CLEAR_IF_UNCHANGED = """
local deleted = {}
for i = 1, #ARGV do
    local name, companion = KEYS[2 * i - 1], KEYS[2 * i]
    if redis.call('DUMP', name) == ARGV[i] then
        redis.call('DEL', name)
        if companion ~= name then
            redis.call('DEL', companion)
        end
        deleted[i] = 1
    else
        deleted[i] = 0
    end
end
return deleted
"""


def _kind(suffix: str | None) -> str:
    """What a key with ``suffix`` is; a dedupe marker's suffix names its task."""
    if suffix is not None and suffix.startswith("dedupe:"):
        return "dedupe"
    return KINDS.get(suffix, suffix or "lock")


@dataclass
class KeyRecord:
    """One logical key (lock, dedupe marker, beat claim ...) as seen across masters."""

    key: str
    kind: str
    value: str | None = None
    ttl: float | None = None
    present_on: int = 0
    masters: int = 0
    owner_task_id: str | None = None
    task: str | None = None
    host: str | None = None
    pid: str | None = None
    acquired_at: float | None = None
    fence: int | None = None
    #: fields whose stored value is not what we write (a number): shown as unknown
    unreadable: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clients(redlock: Redlock) -> list[tuple[Master, redis.Redis]]:
    return [(master, master.client()) for master in redlock.masters]


#: The longest one master may take over one command of these tools, in all. The client's
#: timeouts bound each read, not a reply: a master that trickles its reply a byte at a
#: time would hold the command for ever.
MASTER_DEADLINE = 10.0

_T = TypeVar("_T")


def _bounded(client: redis.Redis, work: Callable[[], _T]) -> _T:
    """``work()`` (reads on ``client``) within :data:`MASTER_DEADLINE`; past it the client's
    connections are cut (which ends the read) and :class:`TimeoutError` is raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="redlock-admin", daemon=True)
    thread.start()
    thread.join(MASTER_DEADLINE)
    if thread.is_alive():
        client.connection_pool.disconnect()
        raise TimeoutError(f"no complete reply within {MASTER_DEADLINE:g}s")
    if "error" in box:
        raise box["error"]
    return cast("_T", box["value"])


def _failure(exc: BaseException) -> str:
    """What went wrong with one master, for the report (never a traceback): a reply of an
    unexpected type (a proxy or another server on the port) trips redis-py's parsing."""
    if isinstance(exc, (redis.RedisError, TimeoutError)):
        return scrub(str(exc))
    return scrub(f"unexpected reply ({type(exc).__name__}: {exc})")


def _scan(client: redis.Redis, match: str) -> Iterator[str]:
    for name in client.scan_iter(match=match, count=_SCAN_COUNT):
        yield name.decode() if isinstance(name, bytes) else str(name)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _escape_glob(text: str) -> str:
    """``text`` as a Redis ``MATCH`` pattern matching only itself."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _key_matches(prefix: str, key: str, *, pattern: bool) -> tuple[list[str], Any]:
    """The ``MATCH`` patterns for the Redis keys of lock key ``key`` (a Redis glob when
    ``pattern``), and a test on the lock key parsed back from a name.

    ``<prefix>:{KEY}*`` alone would also match ``<prefix>:{KEY}x}`` (the lock of a key
    that starts with ``KEY}``): the lock itself and its suffixed keys are matched apart.
    """
    glob = key if pattern else _escape_glob(key)
    matches = [f"{prefix}:{{{glob}}}", f"{prefix}:{{{glob}}}:*"]
    if pattern:
        return matches, lambda found: True
    return matches, lambda found: found == key


def _scan_all(client: redis.Redis, matches: list[str]) -> Iterator[str]:
    seen: set[str] = set()
    for match in matches:
        for name in _scan(client, match):
            if name not in seen:
                seen.add(name)
                yield name


def _number(text: str | None, kind: type[float] | type[int]) -> tuple[Any, bool]:
    """``(value, ok)``: the number in ``text``; ``(None, False)`` for one that is not."""
    if not text:
        return None, True
    try:
        number = float(text)
    except ValueError:
        return None, False
    if kind is int:
        if number != number or number in (float("inf"), float("-inf")):
            return None, False
        return int(number), True
    return number, True


def list_keys(redlock: Redlock, pattern: str = "*") -> tuple[list[KeyRecord], dict[str, str]]:
    """Every lock, dedupe marker and beat claim whose key matches ``pattern``.

    Returns the records (fence counters folded into their lock's row) and the
    masters that could not be read, with the error.
    """
    prefix = redlock.key_prefix
    matches, wanted = _key_matches(prefix, pattern, pattern=True)
    seen: dict[tuple[str, str | None], dict[str, Any]] = {}
    errors: dict[str, str] = {}
    n = len(redlock.masters)

    def read(client: redis.Redis) -> tuple[list[str], list[Any], list[Any]]:
        names = list(_scan_all(client, matches))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.type(name)
            pipe.pttl(name)
        info = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for i, name in enumerate(names):
            kind = _text(info[2 * i])
            if kind == "hash":
                pipe.hgetall(name)
            else:
                pipe.get(name)
        return names, info, pipe.execute()

    for master, client in _clients(redlock):
        try:
            names, info, values = _bounded(client, lambda client=client: read(client))  # type: ignore[misc]
            if len(info) != 2 * len(names) or len(values) != len(names):
                raise TypeError("replies do not match the commands")
        except Exception as exc:  # noqa: BLE001 - reported per master
            errors[master.name] = _failure(exc)
            continue
        for i, name in enumerate(names):
            parts = split_redis_key(prefix, name)
            if parts is None or parts[0] == CHECK_KEY or not wanted(parts[0]):
                continue
            entry = seen.setdefault(parts, {"present": 0, "value": None, "ttl": None})
            entry["present"] += 1
            pttl = info[2 * i + 1]
            if isinstance(pttl, int) and pttl >= 0:
                ttl = pttl / 1000
                entry["ttl"] = ttl if entry["ttl"] is None else max(entry["ttl"], ttl)
            value = values[i]
            if isinstance(value, dict):
                merged = entry.setdefault("hash", {})
                merged.update({_text(k): _text(v) for k, v in value.items()})
            elif value is not None and entry["value"] is None:
                entry["value"] = _text(value)
    records: dict[tuple[str, str | None], KeyRecord] = {}
    for (key, suffix), entry in seen.items():
        if suffix in ("meta", "fence") or _claimed_by(suffix):
            continue
        records[(key, suffix)] = KeyRecord(
            key=key,
            kind=_kind(suffix),
            value=entry["value"],
            ttl=entry["ttl"],
            present_on=entry["present"],
            masters=n,
        )
    for (key, suffix), entry in seen.items():
        lock = records.get((key, None))
        if suffix == "meta" and lock is not None:
            meta = entry.get("hash", {})
            lock.owner_task_id = meta.get("task_id") or meta.get("beat")
            lock.task = meta.get("task")
            lock.host = meta.get("host")
            lock.pid = meta.get("pid")
            # Anything may sit under a shared prefix: a value that is no number is
            # shown as unknown, never a crash of the whole listing.
            lock.acquired_at, ok = _number(meta.get("acquired_at"), float)
            if not ok:
                lock.unreadable.append("acquired_at")
        elif suffix == "fence" and lock is not None:
            lock.fence, ok = _number(entry["value"], int)
            if not ok:
                lock.unreadable.append("fence")
    rows = sorted(records.values(), key=lambda r: (r.kind, r.key))
    return rows, errors


def inspect_key(redlock: Redlock, key: str) -> list[dict[str, Any]]:
    """Every Redis key of one logical key, on every master, side by side."""
    rows: list[dict[str, Any]] = []
    matches, wanted = _key_matches(redlock.key_prefix, key, pattern=False)

    def read(client: redis.Redis) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name in sorted(_scan_all(client, matches)):
            parts = split_redis_key(redlock.key_prefix, name)
            if parts is None or not wanted(parts[0]):
                continue
            kind = _text(client.type(name))
            value: Any = client.hgetall(name) if kind == "hash" else client.get(name)
            if isinstance(value, dict):
                value = {_text(k): _text(v) for k, v in value.items()}
            else:
                value = _text(value)
            found[name] = {"value": value, "pttl_ms": client.pttl(name)}
        return found

    for master, client in _clients(redlock):
        row: dict[str, Any] = {"master": master.name}
        try:
            row.update(_bounded(client, lambda client=client: read(client)))  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - reported per master
            row["error"] = _failure(exc)
        rows.append(row)
    return rows


@dataclass
class ClearPlan:
    """What ``clear`` found, per master, to be shown before anything is deleted.

    ``dumps[i]`` maps each Redis key found on master ``i`` to its ``DUMP`` (its value),
    so that :func:`delete_planned` deletes a key only where it still holds what was
    listed; ``companions`` maps a lock's name to its metadata hash, found beside it and
    deleted with it.
    """

    dumps: list[dict[str, bytes]]
    companions: dict[str, str]
    #: beat anchors matched but left out (see :func:`plan_clear`)
    kept_anchors: list[str]
    errors: dict[str, str]

    @property
    def names(self) -> list[str]:
        """Every Redis key that would be deleted (on at least one master), sorted."""
        return sorted({name for dumps in self.dumps for name in dumps})


def _claimed_by(suffix: str | None) -> bool:
    """Whether ``suffix`` is a claim's writer id (listed with nothing of its own)."""
    return suffix is not None and (":" + suffix).endswith(CLAIMED_BY)


def _is_anchor(suffix: str | None) -> bool:
    return suffix is not None and suffix.split(":", 1)[0] == ANCHOR_SUFFIX


def plan_clear(redlock: Redlock, key: str, *, pattern: bool = False) -> ClearPlan:
    """Find the locks, metadata, dedupe markers and beat claims of ``key``, on every master.

    ``key`` is a lock key matched literally (``report:[1, 2]`` is that key, and
    ``report:1`` is not ``report:1}x``), or with ``pattern=True`` a Redis glob over lock
    keys. Fence counters are never included (tokens keep increasing after a forced
    clear). Beat anchors (``beat:<entry>`` with suffix ``anchor:<interval>``) are left out
    of a pattern, since a new anchor renumbers the entry's occurrences: they are cleared
    only when their key is given literally, and are listed in ``kept_anchors`` otherwise.
    Nothing is deleted here: see :func:`delete_planned`.
    """
    prefix = redlock.key_prefix
    matches, wanted = _key_matches(prefix, key, pattern=pattern)
    dumps: list[dict[str, bytes]] = []
    companions: dict[str, str] = {}
    kept: set[str] = set()
    errors: dict[str, str] = {}

    def read(client: redis.Redis) -> tuple[dict[str, bytes], set[str]]:
        names: list[str] = []
        anchors: set[str] = set()
        for name in _scan_all(client, matches):
            parts = split_redis_key(prefix, name)
            if parts is None or parts[0] == CHECK_KEY or not wanted(parts[0]):
                continue
            if parts[1] == "fence":
                continue
            if pattern and _is_anchor(parts[1]):
                anchors.add(name)
                continue
            names.append(name)
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.dump(name)
        return {
            name: dumped
            for name, dumped in zip(names, pipe.execute(), strict=True)
            if dumped is not None
        }, anchors

    for master, client in _clients(redlock):
        found: dict[str, bytes] = {}
        dumps.append(found)
        try:
            listed, anchors = _bounded(client, lambda client=client: read(client))  # type: ignore[misc]
            if not all(isinstance(dumped, bytes) for dumped in listed.values()):
                raise TypeError("a DUMP reply is not bytes")
        except Exception as exc:  # noqa: BLE001 - reported per master; the others go on
            errors[master.name] = _failure(exc)
            continue
        found.update(listed)
        kept |= anchors
        # A lock's metadata goes with the lock (renewals rewrite it, so it is not
        # compared itself), and a claim's writer id with the claim (see scripts.CLAIM);
        # one whose lock or claim is gone is compared like any key.
        for name in found:
            parts = split_redis_key(prefix, name)
            if parts is not None and parts[1] is None:
                meta = redis_key(prefix, parts[0], "meta")
                if meta in found:
                    companions[name] = meta
            elif parts is not None and name + CLAIMED_BY in found:
                companions[name] = name + CLAIMED_BY
    return ClearPlan(dumps, companions, sorted(kept), errors)


def delete_planned(
    redlock: Redlock, plan: ClearPlan
) -> tuple[list[str], list[str], dict[str, str]]:
    """Delete what ``plan`` listed, on each master only where it is unchanged.

    One atomic compare-and-delete per master (:data:`CLEAR_IF_UNCHANGED`): a key whose
    value changed since it was listed (a lock released and taken again, a new dedupe
    marker) or that appeared since is left alone. Returns the Redis keys deleted on at
    least one master, those kept because they changed everywhere they were, and the
    per-master errors.
    """
    deleted: set[str] = set()
    changed: set[str] = set()
    errors = dict(plan.errors)
    for (master, client), found in zip(_clients(redlock), plan.dumps, strict=True):
        if not found or master.name in errors:
            continue
        # Metadata listed beside its lock is deleted with it, not compared itself.
        riders = {plan.companions[n] for n in found if n in plan.companions}
        riders &= set(found)
        names = sorted(n for n in found if n not in riders)
        keys: list[str] = []
        for name in names:
            companion = plan.companions.get(name)
            keys += [name, companion if companion in riders else name]
        try:
            replies = _bounded(
                client,
                lambda client=client, keys=keys, names=names, found=found: client.eval(  # type: ignore[misc]
                    CLEAR_IF_UNCHANGED, len(keys), *keys, *(found[n] for n in names)
                ),
            )
            if not isinstance(replies, list) or len(replies) != len(names):
                raise TypeError(f"{replies!r:.80} is not one reply per key")
        except Exception as exc:  # noqa: BLE001 - reported per master
            errors[master.name] = _failure(exc)
            continue
        for name, reply in zip(names, replies, strict=True):
            if reply == 1:
                deleted.add(name)
                if plan.companions.get(name) in riders:
                    deleted.add(plan.companions[name])
            else:
                changed.add(name)
    return sorted(deleted), sorted(changed - deleted), errors


def clear(
    redlock: Redlock, key: str, *, pattern: bool = False, dry_run: bool = False
) -> tuple[list[str], dict[str, str]]:
    """:func:`plan_clear` then :func:`delete_planned`: force-delete ``key``'s locks,
    metadata, dedupe markers and beat claims (fence counters stay).

    Returns the Redis key names deleted (or, with ``dry_run``, that would be) and the
    per-master errors.
    """
    plan = plan_clear(redlock, key, pattern=pattern)
    if dry_run:
        return plan.names, plan.errors
    deleted, _, errors = delete_planned(redlock, plan)
    return deleted, errors


@dataclass
class MasterReport:
    """What ``check`` found on one master."""

    name: str
    reachable: bool = False
    latency_ms: float | None = None
    error: str | None = None
    version: str | None = None
    run_id: str | None = None
    #: always None: ``check`` keeps no history (it writes nothing); kept for --json readers
    previous_run_id: str | None = None
    uptime_s: int | None = None
    clock_offset_ms: float | None = None
    aof: bool | None = None
    appendfsync: str | None = None
    rdb_saves: bool | None = None
    foreign_keys: int = 0
    #: the number (from 1) of the master this one is the same server as (same run_id):
    #: it is never counted towards the quorum
    duplicate_of: int | None = None
    warnings: list[str] = field(default_factory=list)


def check(
    redlock: Redlock, *, max_ttl: float, sample: int = 1000
) -> tuple[list[MasterReport], bool]:
    """Probe every master; return the reports and whether a quorum is reachable.

    Warns about persistence that lets a restarted master forget locks (no AOF
    with ``appendfsync always`` and a restart sooner than ``max_ttl``, which should be
    the longest TTL any lock of the app uses), clock skew between masters, a master up
    for less than ``max_ttl`` (restarted recently), and keys under our prefix that do
    not follow our layout (a prefix shared with something else).

    Read-only: it sends PING, INFO, TIME, CONFIG GET and SCAN, and writes nothing.
    A master that is the same server as another one (the same run_id under two names,
    or another db number) has ``duplicate_of`` set and does not count as reachable.
    """
    reports: list[MasterReport] = []
    # The client's own view first: it refuses a master whose run_id another one has.
    statuses = redlock.check_masters()

    def probe(client: redis.Redis, report: MasterReport) -> None:
        start = time.perf_counter()
        client.ping()
        report.latency_ms = (time.perf_counter() - start) * 1000
        info = client.info("server")
        report.version = str(info.get("redis_version"))
        report.run_id = str(info.get("run_id"))
        report.uptime_s = int(info.get("uptime_in_seconds", 0))
        seconds, micros = client.time()
        report.clock_offset_ms = (seconds + micros / 1e6 - time.time()) * 1000  # noqa: TID251 - skew is wall clock
        persistence = client.info("persistence")
        report.aof = bool(persistence.get("aof_enabled"))
        try:
            report.appendfsync = _text(client.config_get("appendfsync").get("appendfsync"))
            report.rdb_saves = bool(client.config_get("save").get("save"))
        except redis.ResponseError:
            report.warnings.append("CONFIG is disabled: persistence settings unknown")

    for master, client in _clients(redlock):
        report = MasterReport(master.name)
        reports.append(report)
        probed = MasterReport(master.name)  # filled by the probe's thread, copied when done
        try:
            _bounded(client, lambda client=client, probed=probed: probe(client, probed))  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - reported per master
            report.error = _failure(exc)
            continue
        probed.reachable = True
        reports[-1] = report = probed
    for report in reports:
        if not report.reachable:
            continue
        if report.uptime_s is not None and report.uptime_s < max_ttl:
            report.warnings.append(
                f"up for {report.uptime_s}s, less than the longest TTL ({max_ttl:g}s): "
                "clients that never saw it before cannot tell a restart"
            )
        if not report.aof and not report.rdb_saves:
            report.warnings.append(
                "no persistence: a restart forgets held locks; restart it no sooner than "
                f"{max_ttl:g}s after a crash (clients that saw it keep it out that long)"
            )
        elif report.aof and report.appendfsync != "always":
            report.warnings.append(
                f"AOF with appendfsync {report.appendfsync}: a crash can lose the last "
                "second of locks; use 'always' or delay restarts by the longest TTL"
            )
        elif not report.aof:
            report.warnings.append(
                "RDB snapshots only: a crash loses locks taken since the last save"
            )
    offsets = [r.clock_offset_ms for r in reports if r.clock_offset_ms is not None]
    if (
        len(offsets) > 1
        and max(offsets) - min(offsets) > 1000 * redlock.clock_drift_factor * max_ttl
    ):
        for report in reports:
            if report.clock_offset_ms is not None:
                report.warnings.append(
                    f"clock skew between masters up to {max(offsets) - min(offsets):.0f} ms, more "
                    f"than the drift allowance ({redlock.clock_drift_factor:g} x {max_ttl:g}s)"
                )
    for master, client in _clients(redlock):
        report = next(r for r in reports if r.name == master.name)
        if not report.reachable:
            continue

        def foreign(client: redis.Redis) -> int:
            count = 0
            for seen, name in enumerate(_scan(client, f"{redlock.key_prefix}:*"), 1):
                if split_redis_key(redlock.key_prefix, name) is None:
                    count += 1
                if seen >= sample:
                    break
            return count

        try:
            report.foreign_keys = _bounded(client, lambda client=client: foreign(client))  # type: ignore[misc]
            if report.foreign_keys:
                report.warnings.append(
                    f"{report.foreign_keys} keys under prefix {redlock.key_prefix!r} are not "
                    "ours: another application shares the prefix"
                )
        except Exception as exc:  # noqa: BLE001 - reported per master
            report.warnings.append(f"could not finish the check: {_failure(exc)}")
    for report, status in zip(reports, statuses, strict=True):
        if status.duplicate_of is not None:
            report.duplicate_of = status.duplicate_of
            first, second = sorted((status.number, status.duplicate_of))
            report.warnings.append(
                f"masters #{first} and #{second} are the same server (run_id "
                f"{(status.run_id or '')[:8]}): it counts once, not twice"
            )
    reachable = sum(1 for r in reports if r.reachable and r.duplicate_of is None)
    return reports, reachable >= redlock.quorum
