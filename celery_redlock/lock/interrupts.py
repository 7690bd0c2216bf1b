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

The core imports no Celery: the Celery layer registers its exception here
(:func:`register`, from ``celery_redlock.task``). ``KeyboardInterrupt`` and ``SystemExit``
are ``BaseException``: no ``except Exception`` takes them. The core's ``except
BaseException`` paths (undo an interrupted round, release a lease cut short) handle both
kinds alike.
"""

from __future__ import annotations

__all__ = ["ASYNC", "register"]

#: Raised from outside (a signal's handler), never a failure of the call they land in.
ASYNC: tuple[type[BaseException], ...] = ()


def register(kind: type[BaseException]) -> None:
    """Count ``kind`` among :data:`ASYNC` (once)."""
    global ASYNC
    if kind not in ASYNC:
        ASYNC = (*ASYNC, kind)
