"""What makes two publishes the same job, and the Redis keys that say so.

* **Wire form.** A worker sees a job's arguments after the task's serializer carried
  them: with json a tuple arrives as a list, ``{1: x}`` as ``{"1": x}``, a ``(str, Enum)``
  member as its plain value. A ``lock_key`` template or callable formats what it is given,
  so the publisher builds its keys from the arguments after the same round trip
  (:func:`wire_arguments`), and both sides write the same text.
* **Dedupe marker.** Identity is the task name plus its key: the marker of a job lives at
  ``<prefix>:{<key>}:dedupe:<task name>`` (:func:`dedupe_suffix`), so two tasks that share a
  ``lock_key`` template share the run-time lock (they never run at once) but never a
  marker (a publish of one never returns the other's job).
* **Per-call options** travel with the message in the :data:`OPTIONS_HEADER` header
  (:func:`encode_call_options`, :func:`decode_call_options`), so a contention reschedule
  or a ``retry()`` (both copy the request's headers) keeps them.
* **Clearing** one task's lock or marker by hand (:meth:`.Redlock.force_delete`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kombu.serialization import dumps, loads

from .keys import MAX_KEY_LENGTH
from .lock import interrupts
from .redact import guard

__all__ = [
    "DEDUPE_SUFFIX",
    "OPTIONS_HEADER",
    "decode_call_options",
    "dedupe_suffix",
    "encode_call_options",
    "message_serializer",
    "wire_arguments",
]

logger = guard(logging.getLogger("celery_redlock.identity"))  # see celery_redlock.redact

#: First part of every dedupe marker's suffix; the task name follows (:func:`dedupe_suffix`).
DEDUPE_SUFFIX = "dedupe"
#: Message header carrying a publish's ``redlock={...}`` overrides, as a JSON object.
OPTIONS_HEADER = "redlock_options"


#: Serializers that give back a value of one of :data:`_PLAIN_TYPES` as itself.
_PLAIN_SERIALIZERS = frozenset({"json", "pickle", "msgpack"})
_PLAIN_TYPES = frozenset({str, int, float, bool, type(None)})


def message_serializer(task: Any, options: Mapping[str, Any]) -> str:
    """The serializer a publish of ``task`` with ``options`` uses, as Celery picks it."""
    name = options.get("serializer") or getattr(task, "serializer", None)
    return str(name or task.app.conf.task_serializer)


def wire_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as a worker receives them: a round trip through ``serializer``.

    Arguments already in their wire form come back equal (every serializer's round trip
    is idempotent), so keys built from either side's arguments are the same text. When
    the arguments cannot be serialized the publish itself fails with kombu's error, so
    they are returned unchanged and the key is built from them.
    """
    if serializer in _PLAIN_SERIALIZERS and all(
        type(value) in _PLAIN_TYPES for value in (*args, *kwargs.values())
    ):
        return args, kwargs  # each of these comes back as itself: skip the round trip
    try:
        # kombu ships no type hints.
        content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
            (list(args), dict(kwargs)), serializer=serializer
        )
    except Exception as exc:  # noqa: BLE001 - the publish reports it properly
        interrupts.raise_wrapped(exc)  # a soft time limit, not the arguments' failure
        logger.debug(
            "arguments do not survive serializer %s (%s); key from them as given", serializer, exc
        )
        return args, kwargs
    try:
        wire_args, wire_kwargs = loads(  # type: ignore[no-untyped-call]
            data, content_type, encoding, force=True
        )
    except Exception as exc:
        interrupts.raise_wrapped(exc)  # a soft time limit, not the arguments' failure
        raise UndecodableArguments(
            f"the arguments serialize with {serializer} but do not deserialize ({exc}): "
            "a worker could not decode this message"
        ) from exc
    return wire_args, wire_kwargs


class UndecodableArguments(ValueError):
    """Arguments a serializer encodes but cannot decode (msgpack and a dict with int keys):
    the worker will drop the message, so no dedupe marker may stand for it."""


@functools.lru_cache(maxsize=1024)  # per task name, on every publish and every run
def dedupe_suffix(task_name: str) -> str:
    """The suffix of ``task_name``'s dedupe marker: ``dedupe:<task name>``.

    A name with braces (which would break the Cluster hash tag) or longer than
    :data:`~celery_redlock.keys.MAX_KEY_LENGTH` is replaced by ``#`` and 32 hex digits of
    its SHA-256.
    """
    if "{" in task_name or "}" in task_name or len(task_name) > MAX_KEY_LENGTH:
        digest = hashlib.sha256(task_name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{DEDUPE_SUFFIX}:#{digest}"
    return f"{DEDUPE_SUFFIX}:{task_name}"


def encode_call_options(clean: Mapping[str, Any]) -> str:
    """The header value carrying validated per-call overrides."""
    return json.dumps(dict(clean), sort_keys=True)


def decode_call_options(value: object) -> dict[str, Any]:
    """The overrides in an :data:`OPTIONS_HEADER` value (a JSON object; a dict is accepted).

    :raises ValueError: the value is neither.
    """
    if isinstance(value, (str, bytes)):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{OPTIONS_HEADER} header must be a JSON object, got {value!r}")
    return dict(value)
