"""``celery -A proj redlock ls|inspect|clear|check``: see and clear locks.

Registered through Celery's ``celery.commands`` entry point; the functions doing
the work live in :mod:`celery_redlock.admin`.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from . import admin
from .client import redlock_for
from .exceptions import ImproperlyConfigured
from .lock import Redlock
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


def _refuse(message: str) -> NoReturn:
    """Print ``error: ...`` and exit 1: a refusal, never a traceback."""
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _client(ctx: click.Context) -> Redlock:
    """The app's Redlock client; a bad configuration is printed and exits 1."""
    try:
        client = redlock_for(ctx.obj.app)
    except (ImproperlyConfigured, ValueError, TypeError) as exc:
        _refuse(f"celery-redlock is not configured correctly: {exc}")
    if not isinstance(client, Redlock) or getattr(client, "in_process", False):
        _refuse(
            "redlock_backend is 'memory': its locks live inside one process, there is "
            "nothing for this command to read; use the 'redis' backend"
        )
    return client


def _longest_ttl(app: Any) -> tuple[float, list[str]]:
    """The longest TTL any lock of ``app`` uses, and the problems met finding it.

    ``redlock_ttl``, ``redlock_beat_lease_ttl`` and every registered SingletonTask's
    ``lock_ttl`` (a task may hold its lock longer than the app-wide default): a master
    that restarts empty must stay out that long.
    """
    from .task import SingletonTask

    settings = get_settings(app)
    longest = max(settings.ttl, settings.beat_lease_ttl)
    problems: list[str] = []
    try:
        app.loader.import_default_modules()
    except Exception as exc:  # noqa: BLE001 - reported; the tasks already registered count
        problems.append(f"could not import the app's task modules: {exc}")
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, SingletonTask):
            continue
        try:
            longest = max(longest, task.redlock_options().lock_ttl)
        except ImproperlyConfigured as exc:
            problems.append(f"task {name}: {exc}")
    return longest, problems


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
    client = _client(ctx)
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
                "unknown" if "acquired_at" in r.unreadable else _when(r.acquired_at),
                "" if r.ttl is None else f"{r.ttl:.1f}s",
                "unknown" if "fence" in r.unreadable else r.fence,
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
    rows = admin.inspect_key(_client(ctx), key)
    click.echo(json.dumps(rows, indent=2, default=str))


@redlock.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option(
    "--pattern",
    "as_pattern",
    is_flag=True,
    help="Read KEY as a Redis glob ('report:*') instead of one exact key.",
)
@click.option("--all", "all_", is_flag=True, help="Clear every key (with KEY: like --pattern).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@handle_preload_options
def clear(
    ctx: click.Context, key: str | None, as_pattern: bool, all_: bool, yes: bool, **_: Any
) -> None:
    """Force-release KEY (exact), or with --pattern every key matching the glob KEY, or
    with --all every key; fence counters and (unless named exactly) beat anchors stay.

    Only what is listed and confirmed is deleted: a key that changed on a master since
    it was listed (a lock taken again) is left there.
    """
    if key is not None and not key.strip():
        # An explicit empty KEY is almost always an unset shell variable
        # (`clear --all "$KEY"`): never read it as "everything".
        raise click.UsageError(
            "PATTERN is empty; give a KEY, --pattern with a glob such as 'report:*', or "
            "--all alone to clear every key"
        )
    if not key and not all_:
        raise click.UsageError("give a KEY, --pattern GLOB, or --all to clear every key")
    if as_pattern and not key:
        raise click.UsageError("--pattern needs a glob, such as 'report:*'")
    pattern = as_pattern or all_
    key = key or "*"
    client = _client(ctx)
    plan = admin.plan_clear(client, key, pattern=pattern)
    for name, error in plan.errors.items():
        click.echo(f"warning: {name} not read: {error}", err=True)
    for name in plan.kept_anchors:
        click.echo(
            f"kept beat anchor {name} (a new one renumbers the entry's occurrences); "
            "clear it by its exact key if you mean it",
            err=True,
        )
    names = plan.names
    if not names:
        hint = ""
        if not pattern and any(c in key for c in "*?["):
            hint = f" ({key!r} is matched exactly; add --pattern to read it as a glob)"
        click.echo(f"nothing to clear{hint}")
        if plan.errors:
            sys.exit(1)
        return
    click.echo("\n".join(printable(name) for name in names))
    if not yes:
        click.confirm(f"Delete these {len(names)} keys on every master?", abort=True)
    deleted, changed, errors = admin.delete_planned(client, plan)
    click.echo(f"removed {len(deleted)} keys")
    for name in changed:
        click.echo(f"kept {name}: it changed since it was listed", err=True)
    for name, error in errors.items():
        if name not in plan.errors:
            click.echo(f"warning: {name} not cleared: {shown(error)}", err=True)
    if errors:
        sys.exit(1)


def _beat_state(app: Any) -> dict[str, Any] | None:
    """Beat leadership as the masters see it (read only); None when beat is not guarded."""
    from .beat import beat_status
    from .settings import get_settings

    if not get_settings(app).beat_leader:
        return None
    return beat_status(app)


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
    client = _client(ctx)
    max_ttl, problems = _longest_ttl(app)
    reports, quorum = admin.check(client, max_ttl=max_ttl)
    beat = _beat_state(app)
    if as_json:
        report = {
            "quorum": quorum,
            "max_ttl": max_ttl,
            "problems": problems,
            "beat": beat,
            "masters": [vars(r) for r in reports],
        }
        click.echo(json.dumps(report, indent=2))
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
        for problem in problems:
            click.echo(f"warning: {shown(problem)}")
        click.echo(f"longest lock TTL: {max_ttl:g}s (tasks' lock_ttl, redlock_ttl, beat lease)")
        if beat is not None:
            state = beat["state"]
            shown_state = "led" if state == "led" else state.upper()
            click.echo(f"beat ({shown(beat['namespace'])}): {shown_state}: {shown(beat['detail'])}")
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
