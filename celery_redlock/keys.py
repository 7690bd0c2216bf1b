"""Lock keys: task and arguments to a key, key to Redis key names, beat occurrences to claims.

A task's lock key is, by default, ``"<task name>:<digest>"`` where the digest is a
BLAKE2b hash of a canonical encoding of the task's bound arguments (or only of the
``unique_on`` names). With a ``lock_key`` format string the key is the formatted
string itself, verbatim up to :data:`MAX_KEY_LENGTH` characters (longer ones keep a
readable prefix and end in a hash, :func:`cap_key`). Either way the key is wrapped in a
hash tag in Redis, ``<prefix>:{<key>}``, so every Redis key of one lock lands in one
Cluster slot.

The task layer calls a key builder with the arguments in their wire form (after a round
trip through the task's serializer, see :mod:`celery_redlock.identity`), on the publish
side as on the worker, so a template or callable formats the same values on both sides.

Which argument values make the same key
=======================================

The key computed when a job is published (enqueue dedupe) must equal the key the
worker computes from the arguments it receives after the message went through the
serializer (json by default). So the encoding follows Python equality, adjusted
to what survives a json round trip:

* ``None``, ``str``, ``bytes`` and bools are only equal to themselves: ``True`` is
  not ``1`` and ``"1"`` is not ``1`` nor ``b"1"``.
* Numbers compare by value, like Python: ``1 == 1.0 == Decimal("1.00")`` make the
  same key; ``0.1`` (a binary float) and ``Decimal("0.1")`` do not.
* ``list`` and ``tuple`` with equal items are the same (json sends tuples as lists).
* ``dict`` compares order-independently; its keys compare as json sends them,
  as text: ``{1: x}`` and ``{"1": x}`` are the same, ``{1: x}`` and ``{1.0: x}`` are
  not (``"1"`` and ``"1.0"``).
* ``set`` and ``frozenset`` compare order-independently (both are one kind).
* An :class:`~enum.Enum` member is its ``value`` (json sends an ``IntEnum`` as an int).
* Aware datetimes compare by instant (the zone does not matter), naive ones by
  wall time, and the two kinds never match; ``date``, ``time``, ``timedelta``,
  :class:`~uuid.UUID` and :class:`~decimal.Decimal` are supported as such.
* A dataclass is its class name plus its compared fields.
* An object with a ``__redlock_key__()`` method is its class name plus whatever
  that method returns (which must itself be supported).

Anything else raises :class:`KeyArgumentError`, naming the argument: pick the
identifying arguments with ``unique_on`` or write a ``lock_key``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import difflib
import enum
import hashlib
import inspect
import json
import string
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any, Final, TypeAlias

from kombu.serialization import dumps, loads

from .exceptions import ImproperlyConfigured

#: The layout of what celery-redlock stores on the masters (key names, the metadata hash's
#: fields, marker values), written as the ``format`` field of every lock's metadata. It
#: changes only with a release whose upgrade notes say how to roll it out (docs/upgrading).
STORAGE_FORMAT = "1"

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyArgumentError",
    "KeyBuilder",
    "arguments_digest",
    "bind_arguments",
    "canonical_bytes",
    "cap_key",
    "compile_lock_key",
    "occurrence_key",
    "redis_key",
    "split_redis_key",
    "validate_prefix",
]

KeyBuilder: TypeAlias = Callable[[Sequence[Any], Mapping[str, Any]], str]
"""Builds a task's lock key from the positional and keyword arguments of one call."""

# The personalisation string versions the encoding: change it whenever the
# encoding changes, so that old and new keys cannot be mistaken for each other.
_PERSON = b"celery-redlock/1"
_DIGEST_SIZE = 16
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)

#: Longest lock key (in characters) a ``lock_key`` template or callable makes; a longer
#: one keeps its first characters and ends in a hash of the whole text (:func:`cap_key`).
MAX_KEY_LENGTH = 200
_CAP_MARK = "~sha256:"
_CAP_DIGITS = 32


class KeyArgumentError(ImproperlyConfigured, TypeError):
    """An argument's value has a type the default lock key cannot encode.

    It is a :class:`TypeError` too, as the problem is the type of a value.
    """


# -- canonical encoding --------------------------------------------------------------------


class _Encoder:
    """Writes the canonical, self-delimiting encoding of one value tree."""

    def __init__(self, task_name: str) -> None:
        self.task_name = task_name
        self._path_ids: set[int] = set()

    def fail(self, path: str, value: object, why: str | None = None) -> KeyArgumentError:
        root = path.split(".", 1)[0].split("[", 1)[0]
        where = f" (at {path})" if path != root else ""
        reason = why or f"type {type(value).__qualname__}{where} is not supported"
        return KeyArgumentError(
            f"cannot build a lock key from argument {root!r} of task {self.task_name!r}: "
            f"{reason}; pass unique_on=[...] or a lock_key"
        )

    def encode(self, value: object, path: str) -> bytes:
        # The commonest exact types first (an exact str or int is no Enum member and has
        # no __redlock_key__ hook: built-in types take no new attributes); same bytes as
        # the general branches below.
        kind = type(value)
        if kind is str:
            return b"S" + _text(value)  # type: ignore[arg-type]
        if kind is int:
            return _integer(value)  # type: ignore[arg-type]
        # Enum first: IntEnum and StrEnum members are ints and strs too.
        if isinstance(value, enum.Enum):
            return self.encode(value.value, path)
        hook = getattr(type(value), "__redlock_key__", None)
        if hook is not None:
            return self._hooked(value, hook, path)
        if value is None:
            return b"N"
        if isinstance(value, bool):
            return b"T" if value else b"F"
        if isinstance(value, (int, float, Decimal)):
            try:
                return _number(value)
            except _TooManyDigits as exc:
                raise self.fail(path, value, str(exc)) from None
        if isinstance(value, str):
            return b"S" + _text(value)
        if isinstance(value, (bytes, bytearray)):
            return b"B" + _sized(bytes(value))
        if isinstance(value, uuid.UUID):
            return b"U" + value.hex.encode("ascii")
        if isinstance(value, dt.datetime):
            return _datetime(value)
        if isinstance(value, dt.date):
            return b"Y" + value.isoformat().encode("ascii") + b";"
        if isinstance(value, dt.time):
            return b"H" + value.isoformat(timespec="microseconds").encode("ascii") + b";"
        if isinstance(value, dt.timedelta):
            return f"R{value.days},{value.seconds},{value.microseconds};".encode("ascii")
        if isinstance(value, (list, tuple)):
            return self._sequence(value, path)
        if isinstance(value, Mapping):
            return self._mapping(value, path)
        if isinstance(value, (set, frozenset)):
            return self._set(value, path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._dataclass(value, path)
        raise self.fail(path, value)

    @contextlib.contextmanager
    def _inside(self, container: object, path: str) -> Iterator[None]:
        # A value that holds itself would recurse forever.
        ident = id(container)
        if ident in self._path_ids:
            raise self.fail(path, container, "the value contains itself")
        self._path_ids.add(ident)
        try:
            yield
        finally:
            self._path_ids.discard(ident)

    def _hooked(self, value: object, hook: Callable[[object], object], path: str) -> bytes:
        with self._inside(value, path):
            return b"K" + _text(_qualname(value)) + self.encode(hook(value), path)

    def _sequence(self, value: Sequence[object], path: str) -> bytes:
        with self._inside(value, path):
            parts = [self.encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return b"L" + _count(parts) + b"".join(parts)

    def _set(self, value: set[object] | frozenset[object], path: str) -> bytes:
        parts = sorted(self.encode(item, f"{path}[...]") for item in value)
        return b"Z" + _count(parts) + b"".join(parts)

    def _mapping(self, value: Mapping[object, object], path: str) -> bytes:
        with self._inside(value, path):
            pairs = sorted(
                (self._dict_key(k, path), self.encode(v, f"{path}[{k!r}]"))
                for k, v in value.items()
            )
        return b"M" + _count(pairs) + b"".join(k + v for k, v in pairs)

    def _dict_key(self, key: object, path: str) -> bytes:
        if isinstance(key, enum.Enum):
            key = key.value
        # json turns these keys into text, so the worker sees {"1": ...} for {1: ...}.
        if isinstance(key, str):
            return b"S" + _text(key)
        if key is None or isinstance(key, (bool, int, float)):
            return b"S" + _text(json.dumps(key))
        return b"O" + self.encode(key, f"{path}[{key!r}]")

    def _dataclass(self, value: Any, path: str) -> bytes:
        fields = [f for f in dataclasses.fields(value) if f.compare]
        with self._inside(value, path):
            parts = [
                _text(f.name) + self.encode(getattr(value, f.name), f"{path}.{f.name}")
                for f in fields
            ]
        return b"C" + _text(_qualname(value)) + _count(parts) + b"".join(parts)


def _qualname(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _sized(data: bytes) -> bytes:
    return str(len(data)).encode("ascii") + b":" + data


def _text(text: str) -> bytes:
    # surrogatepass: a lone surrogate is still a str the task may receive.
    return _sized(text.encode("utf-8", "surrogatepass"))


def _count(parts: Sequence[object]) -> bytes:
    return str(len(parts)).encode("ascii") + b":"


#: The most integer digits a whole ``Decimal`` may have in a key (Python's own limit on
#: int-to-str conversions): turning one into an int, so that it keys as the equal int does,
#: takes quadratic time, and ``Decimal("1e1000000")`` (nine characters) would block every
#: publish and run of the job for half a minute.
MAX_INTEGRAL_DIGITS: Final = 4300


class _TooManyDigits(ValueError):
    pass


def _number(value: int | float | Decimal) -> bytes:
    if isinstance(value, int):
        return _integer(value)
    number = Decimal(value)  # exact for floats: Decimal(0.1) keeps every binary digit
    if number.is_nan():
        return b"Xnan;"
    if number.is_infinite():
        return b"X-inf;" if number < 0 else b"Xinf;"
    if number.is_zero():
        return _integer(0)  # 0E+5000 is a zero, whatever its exponent
    if number == number.to_integral_value():
        if number.adjusted() >= MAX_INTEGRAL_DIGITS:
            raise _TooManyDigits(
                f"a whole number of {number.adjusted() + 1} digits (at most {MAX_INTEGRAL_DIGITS})"
            )
        return _integer(int(number))
    sign, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)  # finite, checked above
    kept = list(digits)
    # Strip trailing zeros by hand: Decimal.normalize() would round to the context precision.
    while kept and kept[-1] == 0:
        kept.pop()
        exponent += 1
    text = ("-" if sign else "") + "".join(map(str, kept)) + f"e{exponent}"
    return b"D" + text.encode("ascii") + b";"


def _integer(value: int) -> bytes:
    # Hex, not str(): str() refuses ints past sys.get_int_max_str_digits().
    return b"I" + format(value, "x").encode("ascii") + b";"


def _datetime(value: dt.datetime) -> bytes:
    offset = value.utcoffset()
    if offset is None:
        return b"W" + value.isoformat(timespec="microseconds").encode("ascii") + b";"
    instant = (value - offset).replace(tzinfo=None)
    return b"A" + instant.isoformat(timespec="microseconds").encode("ascii") + b";"


def canonical_bytes(value: object, *, task_name: str = "?", argument: str = "value") -> bytes:
    """Return the canonical encoding of ``value``: equal values (see the module doc) give
    equal bytes, in every process and Python run.

    :raises KeyArgumentError: ``value`` holds a type that cannot be encoded; the
        message names ``argument`` and ``task_name``.
    """
    return _Encoder(task_name).encode(value, argument)


def arguments_digest(arguments: Mapping[str, object], *, task_name: str = "?") -> str:
    """Return a 32-hex-digit BLAKE2b digest of named argument values, order-independent.

    :raises KeyArgumentError: a value cannot be encoded; the message names it.
    """
    encoder = _Encoder(task_name)
    parts = sorted(_text(name) + encoder.encode(value, name) for name, value in arguments.items())
    data = _count(parts) + b"".join(parts)
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE, person=_PERSON).hexdigest()


# -- binding arguments ---------------------------------------------------------------------


def bind_arguments(
    func: Callable[..., object], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind one call's arguments to ``func``'s parameter names, defaults applied.

    Pass the function the task runs as seen from the task *instance*: ``task.run``.
    For a ``bind=True`` task that is a bound method, whose signature no longer has
    ``self``, so ``args`` are the call's arguments exactly as Celery passes them.

    The result maps each parameter name to its value. A ``*args`` parameter maps
    to the tuple of extra positionals; the entries of a ``**kwargs`` catch-all are
    merged in at the top level, by their own names. Keyword order is irrelevant.

    :raises TypeError: the arguments do not fit the signature (as calling would).
    """
    return _bind(inspect.signature(func), args, kwargs)


def _bind(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    result: dict[str, Any] = {}
    extra: Mapping[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            extra = value
        else:
            result[name] = value
    apart: dict[str, Any] = {}
    for name, value in extra.items():
        # A **kwargs entry named like a parameter (a positional-only one, or the *args
        # one) is another argument than that parameter: render("a.html", template="A")
        # and render("A") are two jobs. Such entries (and one named like the group, so
        # that none can pass for it) key as a group of their own; the others as before,
        # so keys of calls that never collided do not change.
        if name in result or name == _APART:
            apart[name] = value
        else:
            result[name] = value
    if apart:
        result[_APART] = apart
    return result


#: The name the default key gives the **kwargs entries that are not plain names of their
#: own (see :func:`_bind`); no parameter or identifier can have it.
_APART = "**"


def _binder(
    signature: inspect.Signature,
) -> Callable[[Sequence[Any], Mapping[str, Any]], dict[str, Any]]:
    """:func:`_bind` for one signature, fast for plain parameters.

    ``Signature.bind`` costs about 10 µs per call, on every publish and every run. For a
    signature of plain parameters (no ``*args``, ``**kwargs`` or positional-only ones)
    the binding is a zip and a few dict operations; a call that does not fit (a missing,
    unknown, extra or repeated argument) goes to ``Signature.bind``, which raises the
    same ``TypeError`` as before. The result holds the same names and values as
    :func:`_bind`'s (the digest does not depend on their order).
    """
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = list(signature.parameters.values())
    if any(p.kind not in plain for p in parameters):
        return lambda args, kwargs: _bind(signature, args, kwargs)
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    names = frozenset(p.name for p in parameters)
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    count = len(parameters)

    def bind(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) <= len(positional):
            result = dict(zip(positional, args, strict=False))
            for name, value in kwargs.items():
                if name in result or name not in names:
                    break
                result[name] = value
            else:
                for name, default in defaults.items():
                    if name not in result:
                        result[name] = default
                if len(result) == count:
                    return result
        return _bind(signature, args, kwargs)  # raises the TypeError a call would

    return bind


def _read_signature(func: Callable[..., object], task_name: str) -> inspect.Signature:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(
            f"cannot read the signature of task {task_name!r} to build its lock key: {exc}"
        ) from exc


def _parameter_names(signature: inspect.Signature) -> tuple[list[str], bool]:
    names: list[str] = []
    open_ended = False
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            open_ended = True
        else:
            names.append(parameter.name)
    return names, open_ended


def _unknown_name(task_name: str, what: str, name: str, valid: list[str]) -> ImproperlyConfigured:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listing = ", ".join(valid) if valid else "none: the task takes no arguments"
    return ImproperlyConfigured(
        f"{what} of task {task_name!r} uses {name!r}, which is not an argument of the task"
        f"{hint}; valid names: {listing}"
    )


# -- compiling lock_key / unique_on --------------------------------------------------------


#: Conversions a key template accepts: Python's own, and ``!h`` (a digest of the value).
_CONVERSIONS = (None, "r", "s", "a", "h")


class _ShownSet(frozenset[Any]):
    """A set that shows its items in a fixed order: a set of texts (or of anything holding
    one) follows its hash order, which differs between processes (``PYTHONHASHSEED``) and
    between a set and its unpickled copy, so ``"tags:{tags}"`` gave the publisher and each
    worker another key; even a set of ints shows in the order it was built in (``{1, 9}``
    and ``{9, 1}``). Numbers come first, by value, then the rest by their text."""

    __slots__ = ("_display",)
    _display: str

    def __new__(cls, items: set[Any] | frozenset[Any], seen: frozenset[int]) -> _ShownSet:
        self = super().__new__(cls, items)
        shown = [_shown(item, seen) for item in items]
        ordered = sorted(shown, key=_display_order)
        body = ", ".join(repr(item) for item in ordered)
        if isinstance(items, frozenset):
            self._display = f"frozenset({{{body}}})" if body else "frozenset()"
        else:
            self._display = f"{{{body}}}" if body else "set()"
        return self

    def __repr__(self) -> str:
        return self._display

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self._display, spec)


def _display_order(item: Any) -> tuple[int, Any, str]:
    if type(item) in (int, float) and item == item:  # numbers by value (NaN by its text)
        return (0, item, "")
    return (1, 0, repr(item))


def _shown(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """``value``, or an equal copy whose text does not depend on hash order: its sets (of
    exactly ``set`` or ``frozenset``; a subclass shows itself), at any depth in lists,
    tuples and dicts, become :class:`_ShownSet`. Values without such sets come back as
    they are (no copy); a value that contains itself is left as it is there."""
    kind = type(value)
    if kind not in (set, frozenset, list, tuple, dict) or id(value) in seen:
        return value
    seen = seen | {id(value)}
    if kind is set or kind is frozenset:
        return _ShownSet(value, seen)
    if kind is dict:
        pairs = [(_shown(k, seen), _shown(v, seen)) for k, v in value.items()]
        old = value.items()
        if any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(pairs, old, strict=True)):
            return dict(pairs)
        return value
    items = [_shown(item, seen) for item in value]
    if any(new is not old for new, old in zip(items, value, strict=True)):
        return kind(items)
    return value


class _KeyFormatter(string.Formatter):
    """``str.format`` plus the ``!h`` conversion: ``"user:{email!h}"`` puts a 16-hex-digit
    BLAKE2b digest of the value's canonical encoding in the key instead of the value, so a
    template stays readable without writing personal data into Redis, logs and results.
    A field's value shows its sets in a fixed order (see :class:`_ShownSet`), also one
    reached through attributes or items (``{order.tags}``); a ``!h`` field is left to the
    canonical encoding."""

    def __init__(self, task_name: str) -> None:
        self.task_name = task_name

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "h":
            # The digest's encoding sorts sets itself, and keeps a value's own key hook.
            data = canonical_bytes(value, task_name=self.task_name, argument="a !h field")
            return hashlib.blake2b(data, digest_size=8, person=_PERSON).hexdigest()
        return super().convert_field(_shown(value), conversion)


def _template_fields(template: str) -> list[str]:
    """Every field expression in ``template``, including ones nested in format specs.

    :raises ValueError: a malformed template, or a conversion other than ``!r``, ``!s``,
        ``!a`` and ``!h``.
    """
    fields: list[str] = []
    pending = [template]
    while pending:
        for _, field, spec, conversion in string.Formatter().parse(pending.pop()):
            if field is not None:
                fields.append(field)
                if conversion not in _CONVERSIONS:
                    raise ValueError(
                        f"unknown conversion !{conversion} in {{{field}!{conversion}}}; "
                        "accepted: !r, !s, !a and !h (a digest of the value)"
                    )
            if spec:
                pending.append(spec)
    return fields


def _field_root(field: str) -> str:
    for i, char in enumerate(field):
        if char in ".[":
            return field[:i]
    return field


def _compile_template(template: str, signature: inspect.Signature, task_name: str) -> KeyBuilder:
    names, open_ended = _parameter_names(signature)
    what = f"lock_key {template!r}"
    try:
        fields = _template_fields(template)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"{what} of task {task_name!r} is not a valid format string: {exc}"
        ) from exc
    for field in fields:
        root = _field_root(field)
        if root == "" or root.isdigit():
            raise ImproperlyConfigured(
                f"{what} of task {task_name!r} has a positional field {{{field}}}; "
                f"name the argument instead, e.g. {{{names[0] if names else 'name'}}}"
            )
        if root not in names and not open_ended:
            raise _unknown_name(task_name, what, root, names)

    bind = _binder(signature)
    # str.format_map is several times faster; the formatter only where !h asks for it, or
    # a field reaches into a value (whose part may be a set: see _ShownSet). Otherwise the
    # fields' own values are made to show their sets in a fixed order.
    roots = sorted({_field_root(field) for field in fields})
    careful = "!h" in template or any(_field_root(field) != field for field in fields)
    formatter = _KeyFormatter(task_name)

    def build(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        arguments = bind(args, kwargs)
        try:
            if careful:
                key = formatter.vformat(template, (), arguments)
            else:
                for root in roots:
                    value = arguments.get(root)
                    shown = _shown(value)
                    if shown is not value:
                        arguments = {**arguments, root: shown}
                key = template.format_map(arguments)
        except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{what} of task {task_name!r} cannot be formatted with the call's arguments "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return _checked_key(key, task_name, what)

    return build


def _compile_callable(lock_key: Callable[..., object], task_name: str) -> KeyBuilder:
    def build(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return _checked_key(lock_key(*args, **kwargs), task_name, "lock_key callable")

    return build


def cap_key(key: str) -> str:
    """Return ``key`` if it has at most :data:`MAX_KEY_LENGTH` characters, else a key of
    exactly that length: its first characters, ``~sha256:`` and 32 hex digits of the
    SHA-256 of the whole key (UTF-8), so the same long key always gives the same short one
    and operators still read what it is about (``batch:[1, 2, 3, ...~sha256:9f86d0...``).
    """
    if len(key) <= MAX_KEY_LENGTH:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_CAP_DIGITS]
    return key[: MAX_KEY_LENGTH - len(_CAP_MARK) - _CAP_DIGITS] + _CAP_MARK + digest


def _checked_key(key: object, task_name: str, what: str) -> str:
    if not isinstance(key, str) or not key:
        raise ImproperlyConfigured(
            f"{what} of task {task_name!r} gave {key!r} ({type(key).__name__}); "
            "a lock key must be a non-empty str"
        )
    if key.startswith("}"):
        raise ImproperlyConfigured(
            f"{what} of task {task_name!r} gave {key!r}; a lock key must not start with '}}' "
            "(it would end the Redis Cluster hash tag before it began)"
        )
    return cap_key(key)


def _default_forms(value: object, task_name: str) -> frozenset[bytes]:
    """The canonical encodings a parameter's default may arrive in.

    An argument passed explicitly reaches the worker (and the publisher's key) in its wire
    form: a tuple default passed as such comes back a list from json, a ``(str, Enum)``
    member its value. The default itself is applied by binding, unserialized. So an
    argument is "at its default" when its canonical encoding (which already makes ``1`` and
    ``1.0``, lists and tuples alike) matches the default's, or the default's after a json
    or msgpack round trip (pickle keeps it as it is). A default that cannot be encoded
    has no form: an argument is then at its default only when it is that very object.
    """
    forms: set[bytes] = set()
    candidates: list[object] = [value]
    for serializer in ("json", "msgpack"):
        with contextlib.suppress(Exception):
            content_type, encoding, data = dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
            candidates.append(loads(data, content_type, encoding, force=True))  # type: ignore[no-untyped-call]
    for candidate in candidates:
        with contextlib.suppress(Exception):
            forms.add(canonical_bytes(candidate, task_name=task_name))
    return frozenset(forms)


def _at_default(value: object, default: object, forms: frozenset[bytes], task_name: str) -> bool:
    if value is default:
        return True
    if not forms:
        return False
    try:
        return canonical_bytes(value, task_name=task_name) in forms
    except Exception:  # noqa: BLE001 - an argument that cannot be encoded is not the default
        return False


def _compile_default(
    signature: inspect.Signature, task_name: str, unique_on: tuple[str, ...] | None
) -> KeyBuilder:
    names, open_ended = _parameter_names(signature)
    if unique_on is not None:
        for name in unique_on:
            if name not in names and not open_ended:
                raise _unknown_name(task_name, "unique_on", name, names)
    if unique_on == ():
        return lambda args, kwargs: task_name
    bind = _binder(signature)
    defaults = {
        p.name: (p.default, _default_forms(p.default, task_name))
        for p in signature.parameters.values()
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }

    def build(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        arguments = bind(args, kwargs)
        if defaults:
            # An argument left at its parameter's default is not part of the key, so adding
            # an optional parameter to a task keeps the keys of calls that do not pass it
            # (old and new workers of a rolling deploy then exclude each other), and
            # passing the default explicitly is the same job as leaving it out.
            arguments = {
                name: value
                for name, value in arguments.items()
                if name not in defaults or not _at_default(value, *defaults[name], task_name)
            }
        if unique_on is not None:
            # A name only a **kwargs catch-all could supply may be absent from a call;
            # leaving it out distinguishes that call from one passing None.
            arguments = {name: arguments[name] for name in unique_on if name in arguments}
        if not arguments:
            return task_name
        return f"{task_name}:{arguments_digest(arguments, task_name=task_name)}"

    return build


def compile_lock_key(
    lock_key: str | Callable[..., object] | None,
    func: Callable[..., object],
    task_name: str,
    *,
    unique_on: Iterable[str] | None = None,
) -> KeyBuilder:
    """Check a task's key options once, at registration, and return its key builder.

    :param lock_key: ``None`` for the default key, a format string over argument
        names (``"report:{account_id}"``, ``"{account.id}"``, ``"{d[x]}"``), or a
        callable taking the task's arguments (not ``self``) and returning a non-empty str.
    :param func: the function the task runs, ``task.run`` on the task instance
        (see :func:`bind_arguments`).
    :param task_name: the task's registered name, used in the default key and errors.
    :param unique_on: with the default key, the argument names it is built from;
        ``[]`` makes the key the task name alone. Not allowed with ``lock_key``.
    :returns: ``build(args, kwargs) -> key``. The default key is ``"<task>:<digest>"``,
        or the task name alone when no argument is selected; a format string gives
        the formatted text verbatim, up to :data:`MAX_KEY_LENGTH` characters (a longer
        one is shortened by :func:`cap_key`, as is a callable's).
    :raises ImproperlyConfigured: at compile time, for a field or ``unique_on`` name
        that is not an argument (the message lists the valid names), a positional
        field, a malformed template or ``unique_on`` given with ``lock_key``; from
        ``build``, when a template cannot be formatted or a callable returns
        something other than a non-empty str.
    :raises KeyArgumentError: from ``build``, when a default-key argument
        has a type that cannot be encoded.
    :raises TypeError: from ``build``, when the arguments do not fit the signature.
    """
    if not task_name:
        raise ImproperlyConfigured(f"a task name must be a non-empty str, got {task_name!r}")
    selected: tuple[str, ...] | None = None
    if unique_on is not None:
        if isinstance(unique_on, (str, bytes)):
            raise ImproperlyConfigured(
                f"unique_on of task {task_name!r} must be a list of argument names, "
                f"not the string {unique_on!r}; write unique_on=[{unique_on!r}]"
            )
        selected = tuple(unique_on)
        if not all(isinstance(name, str) for name in selected):
            raise ImproperlyConfigured(
                f"unique_on of task {task_name!r} must be a list of argument names (str), "
                f"got {list(selected)!r}"
            )
    signature = _read_signature(func, task_name)
    if lock_key is None:
        return _compile_default(signature, task_name, selected)
    if selected is not None:
        raise ImproperlyConfigured(
            f"task {task_name!r} sets both lock_key and unique_on; unique_on only selects the "
            "arguments of the default key, so drop one of them"
        )
    if isinstance(lock_key, str):
        if not lock_key:
            raise ImproperlyConfigured(
                f"lock_key of task {task_name!r} is empty; give a format string such as "
                "'report:{account_id}', a callable, or None for the default key"
            )
        return _compile_template(lock_key, signature, task_name)
    if callable(lock_key):
        return _compile_callable(lock_key, task_name)
    raise ImproperlyConfigured(
        f"lock_key of task {task_name!r} must be a format string, a callable returning a str, "
        f"or None; got {type(lock_key).__name__}"
    )


# -- Redis key names -----------------------------------------------------------------------


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it can start Redis key names.

    :raises ImproperlyConfigured: it is not a non-empty str, or holds ``{``, ``}``
        (which would break the hash tag) or whitespace.
    """
    if (
        not isinstance(prefix, str)
        or not prefix
        or "{" in prefix
        or "}" in prefix
        or any(char.isspace() for char in prefix)
    ):
        raise ImproperlyConfigured(
            f"the key prefix must be a non-empty str without '{{', '}}' or whitespace, "
            f"got {prefix!r}"
        )
    return prefix


def redis_key(prefix: str, key: str, suffix: str | None = None) -> str:
    """Return the Redis key name ``<prefix>:{<key>}`` or ``<prefix>:{<key>}:<suffix>``.

    The braces are a Redis Cluster hash tag: every name built for one ``key`` hashes
    to the same slot, whatever the suffix.

    :raises ImproperlyConfigured: ``prefix`` is not valid (see :func:`validate_prefix`).
    :raises ValueError: ``key`` or ``suffix`` is empty, or ``key`` starts with ``}``.
    """
    validate_prefix(prefix)
    validate_key(key)
    if suffix is None:
        return f"{prefix}:{{{key}}}"
    return f"{prefix}:{{{key}}}:{validate_suffix(suffix)}"


def validate_key(key: str) -> str:
    """Return ``key`` if it can stand inside the hash tag; raise ValueError otherwise."""
    if not key or key[0] == "}":
        raise ValueError(f"a lock key must be a non-empty str not starting with '}}', got {key!r}")
    return key


def validate_suffix(suffix: str) -> str:
    """Return ``suffix`` if it can end a key name (no braces); raise ValueError otherwise."""
    if not suffix or "{" in suffix or "}" in suffix:
        raise ValueError(f"a key suffix must be a non-empty str without braces, got {suffix!r}")
    return suffix


def split_redis_key(prefix: str, name: str) -> tuple[str, str | None] | None:
    """Invert :func:`redis_key`: return ``(key, suffix)``, or ``None`` if ``name`` is not ours.

    A key that itself contains ``"}:"`` is ambiguous; the last such split wins,
    as suffixes never contain braces.
    """
    start = f"{prefix}:{{"
    if not name.startswith(start) or len(name) <= len(start) + 1:
        return None
    body = name[len(start) :]
    if body.endswith("}"):
        return body[:-1], None
    key, sep, suffix = body.rpartition("}:")
    if not sep or not key or not suffix:
        return None
    return key, suffix


def occurrence_key(entry_name: str, due: dt.datetime | float) -> str:
    """Return the claim key of one beat occurrence: ``"beat:<entry>@<UTC time>"``.

    ``due`` is a timezone-aware datetime or a POSIX timestamp in seconds; it is
    rounded to the millisecond and written as ``2024-05-01T03:00:00.000Z``, so
    beats in different time zones (or with different float noise below a
    millisecond) compute the same key.

    :raises ValueError: ``entry_name`` is empty or ``due`` is a naive datetime.
    :raises TypeError: ``due`` is neither a datetime nor a number.
    """
    if not entry_name:
        raise ValueError(f"a beat entry name must be a non-empty str, got {entry_name!r}")
    if isinstance(due, dt.datetime):
        if due.utcoffset() is None:
            raise ValueError(
                f"beat occurrence {entry_name!r}: due time {due.isoformat()} is naive; "
                "pass an aware datetime (two beats could read it in different zones)"
            )
        micros = (due - _EPOCH) // dt.timedelta(microseconds=1)
        millis = (micros + 500) // 1000
    elif isinstance(due, bool):
        raise TypeError("due must be an aware datetime or a timestamp, got a bool")
    else:
        millis = round(due * 1000)
    stamp = (_EPOCH + dt.timedelta(milliseconds=millis)).replace(tzinfo=None)
    return f"beat:{entry_name}@{stamp.isoformat(timespec='milliseconds')}Z"
