"""``celery -A proj redlock ls|inspect|clear|check``: see and clear locks.

Registered through Celery's ``celery.commands`` entry point; the functions doing
the work live in :mod:`celery_redlock.admin`.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from . import admin
from .client import redlock_for
from .redact import printable, shown
from .settings import get_settings

__all__ = ["redlock"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[("" if c is None else shown(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


@click.group(name="redlock")
def redlock() -> None:
    """See and clear celery-redlock locks, dedupe markers and beat claims."""


@redlock.command(cls=CeleryCommand)
@click.argument("pattern", default="*")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
@handle_preload_options
def ls(ctx: click.Context, pattern: str, as_json: bool, **_: Any) -> None:
    """List held locks, dedupe markers and beat claims (PATTERN: glob over keys)."""
    client = redlock_for(ctx.obj.app)
    records, errors = admin.list_keys(client, pattern)
    if as_json:
        click.echo(json.dumps({"keys": [r.as_dict() for r in records], "errors": errors}, indent=2))
    else:
        rows = [
            (
                r.kind,
                r.key,
                r.owner_task_id or r.value,
                r.task,
                f"{r.host}:{r.pid}" if r.host else "",
                _when(r.acquired_at),
                "" if r.ttl is None else f"{r.ttl:.1f}s",
                r.fence,
                f"{r.present_on}/{r.masters}",
            )
            for r in records
        ]
        headers = ("kind", "key", "owner", "task", "worker", "acquired (UTC)", "ttl", "fence", "on")
        click.echo(_table(headers, rows) if rows else "no keys match")
    for name, error in errors.items():
        click.echo(f"warning: {name} not read: {shown(error)}", err=True)


@redlock.command(cls=CeleryCommand)
@click.argument("key")
@click.pass_context
@handle_preload_options
def inspect(ctx: click.Context, key: str, **_: Any) -> None:
    """Show one key (lock, metadata, fence, dedupe ...) on every master."""
    rows = admin.inspect_key(redlock_for(ctx.obj.app), key)
    click.echo(json.dumps(rows, indent=2, default=str))


@redlock.command(cls=CeleryCommand)
@click.argument("pattern", required=False)
@click.option("--all", "all_", is_flag=True, help="Clear every key matching PATTERN (default *).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@handle_preload_options
def clear(ctx: click.Context, pattern: str | None, all_: bool, yes: bool, **_: Any) -> None:
    """Force-release KEY, or with --all every key matching PATTERN (fence counters stay)."""
    if pattern is not None and not pattern.strip():
        # An explicit empty PATTERN is almost always an unset shell variable
        # (`clear --all "$KEY"`): never read it as "everything".
        raise click.UsageError(
            "PATTERN is empty; give a KEY, a pattern such as 'report:*', or --all alone "
            "to clear every key"
        )
    if not pattern and not all_:
        raise click.UsageError("give a KEY, or --all [PATTERN] to clear many")
    if all_:
        pattern = pattern or "*"
    elif pattern and any(c in pattern for c in "*?["):
        raise click.UsageError(f"{pattern!r} is a pattern: add --all to clear every match")
    assert pattern is not None
    client = redlock_for(ctx.obj.app)
    names, errors = admin.clear(client, pattern, dry_run=True)
    if not names:
        click.echo("nothing to clear")
        return
    click.echo("\n".join(printable(name) for name in names))
    if not yes:
        click.confirm(f"Delete these {len(names)} keys on every master?", abort=True)
    names, errors = admin.clear(client, pattern)
    click.echo(f"removed {len(names)} keys")
    for name, error in errors.items():
        click.echo(f"warning: {name} not cleared: {shown(error)}", err=True)
    if errors:
        sys.exit(1)


@redlock.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
@handle_preload_options
def check(ctx: click.Context, as_json: bool, **_: Any) -> None:
    """Check every master: reachability, latency, restarts, clock skew, persistence.

    Exits 2 when fewer than a quorum of masters answer, 3 when two masters are the same
    server (the same run_id under two names: it would count twice).
    """
    app = ctx.obj.app
    settings = get_settings(app)
    client = redlock_for(app)
    reports, quorum = admin.check(client, max_ttl=max(settings.ttl, settings.beat_lease_ttl))
    if as_json:
        click.echo(json.dumps({"quorum": quorum, "masters": [vars(r) for r in reports]}, indent=2))
    else:
        rows = [
            (
                r.name,
                "up" if r.reachable else f"DOWN ({r.error})",
                "" if r.latency_ms is None else f"{r.latency_ms:.1f}",
                r.version,
                (r.run_id or "")[:8],
                r.uptime_s,
                "" if r.clock_offset_ms is None else f"{r.clock_offset_ms:+.0f}",
                ("aof " + (r.appendfsync or "?")) if r.aof else ("rdb" if r.rdb_saves else "none"),
            )
            for r in reports
        ]
        headers = (
            "master",
            "status",
            "ms",
            "version",
            "run_id",
            "uptime s",
            "clock ms",
            "persistence",
        )
        click.echo(_table(headers, rows))
        for r in reports:
            for warning in r.warnings:
                click.echo(f"warning: {r.name}: {shown(warning)}")
        up = sum(1 for r in reports if r.reachable and r.duplicate_of is None)
        verdict = "OK" if quorum else "UNAVAILABLE"
        click.echo(f"quorum: {up} of {len(reports)} masters up, {client.quorum} needed: {verdict}")
        for number, r in enumerate(reports, start=1):
            if r.duplicate_of is not None:
                first, second = sorted((number, r.duplicate_of))
                click.echo(
                    f"error: masters #{first} and #{second} are the same server "
                    f"(run_id {(r.run_id or '')[:8]}); list each server once",
                    err=True,
                )
    if not quorum:
        sys.exit(2)
    if any(r.duplicate_of is not None for r in reports):
        sys.exit(3)
