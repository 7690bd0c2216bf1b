"""celery-redlock: Redlock-guarded singleton tasks and once-only beat schedules for Celery.

The lock core (:class:`Redlock`, :class:`Lease`, the exceptions) imports no Celery;
the Celery layer (:class:`SingletonTask`, :func:`install`) is imported on first use.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .exceptions import (
    AlreadyQueued,
    ImproperlyConfigured,
    LockContended,
    LockLost,
    QuorumUnavailable,
    RedlockError,
    StaleFence,
)
from .lock import Lease, Redlock

if TYPE_CHECKING:  # pragma: no cover
    from .client import redlock_for
    from .task import LockLostInterrupt, SingletonTask
    from .wiring import install

try:
    __version__ = version("celery-redlock")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AlreadyQueued",
    "ImproperlyConfigured",
    "Lease",
    "LockContended",
    "LockLost",
    "LockLostInterrupt",
    "QuorumUnavailable",
    "Redlock",
    "RedlockError",
    "SingletonTask",
    "StaleFence",
    "__version__",
    "install",
    "redlock_for",
]

#: Celery-layer names, imported lazily so that the core works without Celery.
_LAZY: dict[str, str] = {
    "SingletonTask": ".task",
    "LockLostInterrupt": ".task",
    "install": ".wiring",
    "redlock_for": ".client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_redlock' has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)
