"""The forked-child client: a child of the test process tries the lock and reports back.

The child inherits the parent's :class:`Redlock` and every parent lease (as Celery's
prefork pool does). It must never see a parent's lease as held, and whatever it gets
itself is a holder like any other: its hold is reported as an interval of
``time.monotonic()`` (system-wide on Linux) for the parent to compare with its own.
"""

from __future__ import annotations

import json
import os
import select
import time
import warnings
from collections.abc import Sequence
from typing import Any

from celery_redlock.exceptions import RedlockError
from celery_redlock.lock import Lease, Redlock

from .world import kill_child

__all__ = ["run_child"]

#: Seconds the child may take in all (acquire, fence, release, each bounded).
CHILD_BUDGET = 5.0


def _child(rl: Redlock, key: str, ttl: float, parents: Sequence[Lease]) -> dict[str, Any]:
    report: dict[str, Any] = {"problems": []}
    for lease in parents:
        if lease.held or lease.remaining() != 0.0:
            report["problems"].append(f"child sees a parent lease on {lease.key!r} as held")
        if lease.release() is not False:
            report["problems"].append("child released a parent lease")
    try:
        lease = rl.acquire(key, ttl)
    except RedlockError as exc:
        report["acquire"] = type(exc).__name__
        return report
    report["acquire"] = "granted"
    report["granted_at"] = time.monotonic()
    try:
        report["fence"] = lease.fence
    except RedlockError as exc:
        report["fence"] = type(exc).__name__
    report["held_until"] = time.monotonic() if lease.held else None
    try:
        report["released"] = lease.release()
    except Exception as exc:  # noqa: BLE001 - release must not raise: reported, not lost
        report["problems"].append(f"release raised {exc!r}")
    return report


def run_child(rl: Redlock, key: str, ttl: float, parents: Sequence[Lease]) -> dict[str, Any]:
    """Fork, run :func:`_child` in the child, return its report (the child is reaped)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a threaded process may deadlock; the child
        # here touches only the lock core, whose fork handlers are what is under test.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which leaves by os._exit
        code = 0
        try:
            os.close(read_end)
            try:
                report = _child(rl, key, ttl, parents)
            except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
                report = {"problems": [f"child raised {exc!r}"]}
            os.write(write_end, json.dumps(report).encode())
        except BaseException:  # noqa: BLE001 - a child must never return into pytest
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_BUDGET
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                kill_child(pid)
                return {"problems": [f"child did not finish within {CHILD_BUDGET}s"]}
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not chunks or status != 0:
        return {"problems": [f"child exited with status {status} and no report"]}
    out: dict[str, Any] = json.loads(b"".join(chunks))
    return out
