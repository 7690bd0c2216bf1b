"""The worker's revoke commands are wrapped once per process, keeping Celery's handler
(its behaviour and reply: tests/celery/test_revoke_dedupe.py) and its registry entry."""

from __future__ import annotations

from celery.worker import control

from celery_redlock.revoke import wrap_revoke_commands


def test_revoke_commands_are_wrapped_once_around_celerys_own() -> None:
    meta = {name: control.Panel.meta[name] for name in ("revoke", "revoke_by_stamped_headers")}
    wrap_revoke_commands()
    wrapped = {name: control.Panel.data[name] for name in meta}
    wrap_revoke_commands()
    for name, command in wrapped.items():
        assert control.Panel.data[name] is command, f"{name} wrapped twice"
        inner = command.__wrapped__  # type: ignore[attr-defined]
        assert inner is getattr(control, name), f"{name} does not call Celery's handler"
        assert command.__name__ == name
        assert control.Panel.meta[name] is meta[name]
