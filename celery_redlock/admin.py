"""Operator tools behind ``celery redlock ...``: list, inspect, clear, check.

Celery-free: each function takes a :class:`~celery_redlock.lock.Redlock` and talks
to every master with a plain redis-py client (timeouts as configured, no
retries). Nothing here is on a task's hot path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from .keys import redis_key, split_redis_key
from .lock import Redlock
from .lock.master import Master
from .redact import scrub

__all__ = ["KeyRecord", "MasterReport", "check", "clear", "inspect_key", "list_keys"]

#: What each suffix of ``<prefix>:{<key>}:<suffix>`` is, for people.
KINDS = {
    None: "lock",
    "meta": "meta",
    "fence": "fence",
    "dedupe": "dedupe",
    "sent": "beat-claim",
    "run": "beat-run",
}
CHECK_KEY = "__check__"
_SCAN_COUNT = 1000


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clients(redlock: Redlock) -> list[tuple[Master, redis.Redis]]:
    return [(master, master.client()) for master in redlock.masters]


def _scan(client: redis.Redis, match: str) -> Iterator[str]:
    for name in client.scan_iter(match=match, count=_SCAN_COUNT):
        yield name.decode() if isinstance(name, bytes) else str(name)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def list_keys(redlock: Redlock, pattern: str = "*") -> tuple[list[KeyRecord], dict[str, str]]:
    """Every lock, dedupe marker and beat claim whose key matches ``pattern``.

    Returns the records (fence counters folded into their lock's row) and the
    masters that could not be read, with the error.
    """
    prefix = redlock.key_prefix
    match = f"{prefix}:{{{pattern}}}*"
    seen: dict[tuple[str, str | None], dict[str, Any]] = {}
    errors: dict[str, str] = {}
    n = len(redlock.masters)
    for master, client in _clients(redlock):
        try:
            names = list(_scan(client, match))
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
            values = pipe.execute()
        except redis.RedisError as exc:
            errors[master.name] = scrub(str(exc))
            continue
        for i, name in enumerate(names):
            parts = split_redis_key(prefix, name)
            if parts is None or parts[0] == CHECK_KEY:
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
        if suffix in ("meta", "fence"):
            continue
        records[(key, suffix)] = KeyRecord(
            key=key,
            kind=KINDS.get(suffix, suffix or "lock"),
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
            acquired = meta.get("acquired_at")
            lock.acquired_at = float(acquired) if acquired else None
        elif suffix == "fence" and lock is not None and entry["value"]:
            lock.fence = int(float(entry["value"]))
    rows = sorted(records.values(), key=lambda r: (r.kind, r.key))
    return rows, errors


def inspect_key(redlock: Redlock, key: str) -> list[dict[str, Any]]:
    """Every Redis key of one logical key, on every master, side by side."""
    rows: list[dict[str, Any]] = []
    for master, client in _clients(redlock):
        row: dict[str, Any] = {"master": master.name}
        try:
            for name in sorted(_scan(client, redis_key(redlock.key_prefix, key) + "*")):
                kind = _text(client.type(name))
                value: Any = client.hgetall(name) if kind == "hash" else client.get(name)
                if isinstance(value, dict):
                    value = {_text(k): _text(v) for k, v in value.items()}
                else:
                    value = _text(value)
                row[name] = {"value": value, "pttl_ms": client.pttl(name)}
        except redis.RedisError as exc:
            row["error"] = scrub(str(exc))
        rows.append(row)
    return rows


def clear(
    redlock: Redlock, pattern: str, *, dry_run: bool = False
) -> tuple[list[str], dict[str, str]]:
    """Force-delete locks, metadata, dedupe markers and beat claims matching ``pattern``.

    Fence counters are kept, so tokens keep increasing after a forced clear.
    Returns the Redis key names deleted (or that would be) and per-master errors.
    """
    prefix = redlock.key_prefix
    removed: set[str] = set()
    errors: dict[str, str] = {}
    for master, client in _clients(redlock):
        try:
            names = [
                name
                for name in _scan(client, f"{prefix}:{{{pattern}}}*")
                if (parts := split_redis_key(prefix, name)) is not None
                and parts[1] != "fence"
                and parts[0] != CHECK_KEY
            ]
            if names and not dry_run:
                client.delete(*names)
            removed.update(names)
        except redis.RedisError as exc:
            errors[master.name] = scrub(str(exc))
    return sorted(removed), errors


@dataclass
class MasterReport:
    """What ``check`` found on one master."""

    name: str
    reachable: bool = False
    latency_ms: float | None = None
    error: str | None = None
    version: str | None = None
    run_id: str | None = None
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
    with ``appendfsync always`` and a restart sooner than ``max_ttl``), clock
    skew between masters, run_id changes since the last check, and keys under
    our prefix that do not follow our layout (a prefix shared with something else).
    A master that is the same server as another one (the same run_id under two names,
    or another db number) has ``duplicate_of`` set and does not count as reachable.
    """
    reports: list[MasterReport] = []
    check_key = redis_key(redlock.key_prefix, CHECK_KEY, "run-ids")
    # The client's own view first: it refuses a master whose run_id another one has.
    statuses = redlock.check_masters()
    for master, client in _clients(redlock):
        report = MasterReport(master.name)
        reports.append(report)
        try:
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
            report.reachable = True
        except redis.RedisError as exc:
            report.error = scrub(str(exc))
    # run_id history: every master keeps every master's last seen run_id, so a master
    # that restarted empty is still remembered by the others.
    history: dict[str, str] = {}
    for _master, client in _clients(redlock):
        try:
            stored = client.hgetall(check_key)
            history.update({_text(k) or "": _text(v) or "" for k, v in stored.items()})
        except redis.RedisError:
            continue
    current = {r.name: r.run_id for r in reports if r.run_id}
    for report in reports:
        if not report.reachable:
            continue
        previous = history.get(report.name)
        if previous and previous != report.run_id:
            report.previous_run_id = previous
            report.warnings.append(
                f"restarted since the last check (run_id {previous[:8]} -> "
                f"{(report.run_id or '')[:8]})"
            )
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
        try:
            if current:
                client.hset(check_key, mapping=dict(current))  # type: ignore[arg-type]
            for count, name in enumerate(_scan(client, f"{redlock.key_prefix}:*"), 1):
                if split_redis_key(redlock.key_prefix, name) is None:
                    report.foreign_keys += 1
                if count >= sample:
                    break
            if report.foreign_keys:
                report.warnings.append(
                    f"{report.foreign_keys} keys under prefix {redlock.key_prefix!r} are not "
                    "ours: another application shares the prefix"
                )
        except redis.RedisError as exc:
            report.warnings.append(scrub(f"could not finish the check: {exc}"))
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
