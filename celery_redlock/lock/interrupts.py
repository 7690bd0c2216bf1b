"""Exceptions that a signal handler raises into the main thread, wherever it happens to be.

Celery's soft time limit is one: billiard's ``SIGUSR1`` handler (also sent by
``revoke(terminate=True, signal="SIGUSR1")``) raises ``SoftTimeLimitExceeded``, which is
an ``Exception``. A best-effort guard (``except Exception``: a master that failed to
connect, a reply that is not RESP, an observer that raised) would take it for that failure
and carry on, and the job would run past its soft limit, or be reported as something it
is not. Each such guard on a caller's thread lets these through first::

    except interrupts.ASYNC:
        raise
    except Exception:
        ...

The core imports no Celery: billiard's exception (Celery's pool, which raises it) counts
where billiard is installed, and :func:`register` adds others. ``KeyboardInterrupt`` and
``SystemExit`` are ``BaseException``: no ``except Exception`` takes them. The core's
``except BaseException`` paths (undo an interrupted round, release a lease cut short)
handle both kinds alike.
"""

from __future__ import annotations

__all__ = ["ASYNC", "raise_wrapped", "register", "wrapped"]

#: Raised from outside (a signal's handler), never a failure of the call they land in.
ASYNC: tuple[type[BaseException], ...] = ()


def register(kind: type[BaseException]) -> None:
    """Count ``kind`` among :data:`ASYNC` (once)."""
    global ASYNC
    if kind not in ASYNC:
        ASYNC = (*ASYNC, kind)


try:
    from billiard.exceptions import SoftTimeLimitExceeded
except ImportError:  # pragma: no cover - the lock core used without Celery
    pass
else:
    register(SoftTimeLimitExceeded)


def wrapped(exc: BaseException) -> BaseException | None:
    """The one of :data:`ASYNC` that ``exc`` stands for, or None: ``exc`` itself, or the
    exception it wraps (kombu re-raises whatever a serializer raised as its
    ``EncodeError`` or ``DecodeError``, with the original as its cause or context)."""
    for found in (exc, exc.__cause__, exc.__context__):
        if isinstance(found, ASYNC):
            return found
    return None


def raise_wrapped(exc: BaseException) -> None:
    """Raise the one of :data:`ASYNC` that ``exc`` stands for (:func:`wrapped`), if any:
    for a best-effort guard that would otherwise take it for the failure it caught."""
    found = wrapped(exc)
    if found is not None:
        raise found from None
