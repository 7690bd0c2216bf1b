"""The exception tree of celery-redlock.

Every exception derives from :class:`RedlockError` and carries its context as
attributes (``key``, ``masters``, ``errors``). Each one can be rebuilt from its
``args`` with ``cls(*exc.args)``: Celery's result backends serialise an
exception as its class and ``args`` and re-create it that way, so every piece
of context is a positional argument made of JSON-friendly values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .redact import scrub

__all__ = [
    "AlreadyQueued",
    "ImproperlyConfigured",
    "LockContended",
    "LockLost",
    "QuorumUnavailable",
    "RedlockError",
    "StaleFence",
]


class RedlockError(Exception):
    """Root of every error raised by celery-redlock.

    :param message: human readable text, returned by ``str(exc)``.
    :param key: the lock key involved, when there is one.
    :param masters: the masters involved, as passwordless descriptions.
    :param errors: per master description, what went wrong there.

    ``message`` and ``errors`` are scrubbed of every secret this process knows (see
    :func:`celery_redlock.redact.scrub`): they travel to result backends and logs.
    """

    def __init__(
        self,
        message: str = "",
        key: str | None = None,
        masters: Sequence[str] = (),
        errors: Mapping[str, str] | None = None,
    ) -> None:
        message = scrub(message)
        masters = list(masters)
        errors = {name: scrub(text) for name, text in (errors or {}).items()}
        super().__init__(message, key, masters, errors)
        self.message = message
        self.key = key
        self.masters = masters
        self.errors = errors

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[RedlockError], tuple[object, ...]]:
        return (type(self), self.args)


class LockContended(RedlockError):
    """Somebody else holds the key on enough masters that we cannot get a quorum."""


class QuorumUnavailable(RedlockError):
    """Too few masters answered to decide: servers down or too slow, not contention.

    ``errors`` names each master that did not answer and why.
    """


class LockLost(RedlockError):
    """The holder lost its lease: it expired, or a quorum no longer knows it."""


class StaleFence(RedlockError):
    """A fenced resource refused a token that is not newer than the last one it saw.

    ``fence`` is the refused token and ``current`` the newest one the resource holds.
    """

    def __init__(
        self,
        message: str = "",
        key: str | None = None,
        masters: Sequence[str] = (),
        errors: Mapping[str, str] | None = None,
        fence: int | None = None,
        current: int | None = None,
    ) -> None:
        super().__init__(message, key, masters, errors)
        self.args = (*self.args, fence, current)
        self.fence = fence
        self.current = current


class AlreadyQueued(RedlockError):
    """A publish found an identical job already queued (``raise_on_duplicate``).

    ``task_id`` is the queued job's id (``AsyncResult(exc.task_id)`` follows it) and
    ``key`` the lock key both jobs share.
    """

    def __init__(
        self,
        message: str = "",
        key: str | None = None,
        masters: Sequence[str] = (),
        errors: Mapping[str, str] | None = None,
        task_id: str | None = None,
    ) -> None:
        super().__init__(message, key, masters, errors)
        self.args = (*self.args, task_id)
        self.task_id = task_id


class ImproperlyConfigured(RedlockError, ValueError):
    """A setting, task option or argument has a value we cannot use.

    The message names the setting and the values that are accepted.
    """
