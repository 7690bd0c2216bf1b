"""The validated celery-redlock settings of one Celery app, and a task's resolved options.

Settings are read once per app from ``app.conf`` (lower case, ``redlock_ttl``; with
Django and ``namespace="CELERY"``, ``CELERY_REDLOCK_TTL``, which Celery maps by
itself). Every problem is reported at once, in an :class:`ImproperlyConfigured`
naming the setting in both spellings and the accepted values, and a
``redlock_*`` name that is no setting (or a spelling Celery never reads) is an
error with the closest known name.

Numbers are ints or floats. Strings such as ``"30"`` (from an environment
variable) are refused rather than converted, so that ``"30s"`` or ``"0,5"`` can
never be half-understood: convert them where you read the environment. Bools
are not numbers here, and only bools are bools.

Passwords, TLS key passwords and key file paths of the masters never appear in a message:
they are masked as ``***`` (see :mod:`celery_redlock.redact`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import math
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeAlias, cast
from urllib.parse import urlsplit

import redis
from redis import connection as redis_connection

from .backoff import Backoff, parse_backoff
from .exceptions import ImproperlyConfigured
from .keys import KeyBuilder, compile_lock_key, validate_prefix
from .lock import limits
from .lock.master import client_identity, sentinel_identity
from .redact import guard, mask_url, remember_secrets_of, scrub

logger = guard(logging.getLogger("celery_redlock.settings"))  # see celery_redlock.redact

__all__ = [
    "CALL_OPTIONS",
    "DEFAULTS",
    "MIN_TTL",
    "UNSET",
    "DedupeMode",
    "MasterSpec",
    "OnContention",
    "OnLockLost",
    "RedlockSettings",
    "SettingProblem",
    "SupportsConf",
    "TaskOptions",
    "check_values",
    "default_redis_url",
    "describe_master",
    "find_unknown_settings",
    "find_unread_settings",
    "get_settings",
    "mask_url",
    "reset_settings",
    "run_function",
    "setting_names",
    "settings_from_conf",
    "validate_call_options",
    "validate_task_options",
    "with_call_options",
]

MasterSpec: TypeAlias = "str | Mapping[str, Any] | redis.Redis"
OnContention: TypeAlias = Literal["retry", "skip", "raise"]
DedupeMode: TypeAlias = Literal["queued", "active"]
OnLockLost: TypeAlias = Literal["log", "interrupt"]
SkipResult: TypeAlias = Literal["failure", "ignored"]
BeatCatchUp: TypeAlias = Literal["one", "all", "none"]

#: Shortest ``ttl`` accepted: Redis keeps milliseconds, and validity loses 2 ms plus drift.
MIN_TTL: Final = limits.MIN_TTL
_LOCALHOST: Final = "redis://localhost:6379/0"
_CONTENTION_BACKOFF: Final = Backoff(1, 60)
_OUTAGE_BACKOFF: Final = Backoff(1, 10)

#: Every setting by its short name (``ttl`` is ``redlock_ttl`` / ``CELERY_REDLOCK_TTL``),
#: with its default. ``redis_urls`` defaults to the broker when it is Redis.
DEFAULTS: Final[Mapping[str, object]] = types.MappingProxyType(
    {
        "redis_urls": None,
        "key_prefix": "redlock",
        "node_timeout": 0.25,
        "ttl": 30,
        "renew_every": None,
        "clock_drift_factor": 0.01,
        "on_contention": "retry",
        "contention_backoff": (1, 60),
        "max_contention_retries": None,
        "dedupe": "queued",
        "dedupe_ttl": 3600,
        "raise_on_duplicate": False,
        "on_lock_lost": "log",
        "skip_result": "failure",
        "outage_backoff": (1, 10),
        "beat_leader": True,
        "beat_lease_ttl": 10,
        "backend": "redis",
        "backend_force": False,
        "beat_catch_up": "one",
    }
)


class _Unset:
    """The type of :data:`UNSET`."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"


#: A task option left at ``UNSET`` (or absent) takes the app-wide setting. Options whose
#: ``None`` means something (``dedupe=None`` is "off", ``max_contention_retries=None`` is
#: "no limit") must default to ``UNSET`` on the task class, not ``None``.
UNSET: Final = _Unset()


def setting_names(name: str) -> tuple[str, str]:
    """``("redlock_<name>", "CELERY_REDLOCK_<NAME>")``: the app.conf and Django spellings."""
    return f"redlock_{name}", f"CELERY_REDLOCK_{name.upper()}"


def _label(name: str) -> str:
    lower, django = setting_names(name)
    return f"{lower} (Django: {django})"


# -- messages and masking ------------------------------------------------------------------


def describe_master(spec: object) -> str:
    """A passwordless, human readable description of one master spec."""
    if isinstance(spec, str):
        return mask_url(spec)
    if isinstance(spec, redis.Redis):
        kwargs = spec.connection_pool.connection_kwargs
        if kwargs.get("path"):
            return f"redis.Redis(unix://{kwargs['path']}?db={kwargs.get('db', 0)})"
        host, port, db = kwargs.get("host"), kwargs.get("port"), kwargs.get("db", 0)
        return f"redis.Redis({host}:{port}/{db})"
    if isinstance(spec, Mapping):
        if "sentinels" in spec:
            sentinels = spec.get("sentinels")
            listed = (
                ",".join(_show_pair(s) for s in sentinels)
                if isinstance(sentinels, (list, tuple))
                else "?"
            )
            return f"sentinel://{listed}/{spec.get('service_name')}"
        if spec.get("unix_socket_path"):
            return f"{{unix_socket_path: {spec['unix_socket_path']!r}, db: {spec.get('db', 0)}}}"
        host, port = spec.get("host", "localhost"), spec.get("port", 6379)
        return f"{{host: {host!r}, port: {port!r}, db: {spec.get('db', 0)!r}}}"
    return f"a {type(spec).__name__}"


def _show_pair(pair: object) -> str:
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        return f"{pair[0]}:{pair[1]}"
    return repr(pair)


def _show_masters(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe_master(spec) for spec in value) + "]"
    return describe_master(value)


def _show(value: object) -> str:
    if isinstance(value, str) and "://" in value:
        value = mask_url(value)
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if isinstance(value, str):
        return f"{text} (a str)"
    return text


class _RejectedError(Exception):
    """Internal: a value is out of its accepted set; ``args[0]`` says what is accepted.

    ``names_value`` is true when that text already shows the offending value.
    """

    def __init__(self, reason: str, *, names_value: bool = False) -> None:
        super().__init__(reason)
        self.names_value = names_value


@dataclass(frozen=True)
class SettingProblem:
    """One thing wrong with the settings.

    :ivar setting: the short name (``"ttl"``), or the name as written for unknown ones.
    :ivar kind: ``"invalid"`` (a value is not accepted), ``"conflict"`` (values that are
        each fine do not fit together) or ``"unknown"`` (a name that is never read).
    :ivar message: a complete sentence naming the setting in both spellings.
    """

    setting: str
    kind: Literal["invalid", "conflict", "unknown"]
    message: str


def _raise_problems(problems: Sequence[SettingProblem], what: str) -> None:
    if len(problems) == 1:
        raise ImproperlyConfigured(problems[0].message)
    if problems:
        listing = "\n".join(f"- {p.message}" for p in problems)
        raise ImproperlyConfigured(f"{len(problems)} problems in {what}:\n{listing}")


# -- value checkers: return the clean value or raise _RejectedError ------------------------


def _number(value: object, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ", not a str (strings are not converted)" if isinstance(value, str) else ""
        raise _RejectedError(f"must be {accepted}{hint}")
    if not math.isfinite(value):
        raise _RejectedError(f"must be {accepted}")
    return value


def _seconds(value: object, minimum: float = 0.0, maximum: float = limits.MAX_TTL) -> float:
    if minimum:
        accepted = (
            f"a number of seconds in [{limits.show(minimum)}, {limits.show(maximum)}]"
            " (int or float)"
        )
    else:
        accepted = f"a number of seconds in (0, {limits.show(maximum)}] (int or float)"
    number = _number(value, accepted)
    if number < minimum or number <= 0 or number > maximum:
        raise _RejectedError(f"must be {accepted}")
    return number


def _choice(value: object, choices: Sequence[object]) -> Any:
    if isinstance(value, bool) or value not in choices:
        raise _RejectedError("must be one of " + ", ".join(repr(c) for c in choices))
    return value


def _drift(value: object) -> float:
    accepted = "a number in [0, 0.5) (int or float)"
    number = _number(value, accepted)
    if not 0 <= number < 0.5:
        raise _RejectedError(f"must be {accepted}")
    return number


def _retries(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _RejectedError("must be None (no limit) or an int >= 0")
    return value


def _backoff(value: object) -> Backoff:
    try:
        return parse_backoff(value)
    except (TypeError, ValueError) as exc:
        raise _RejectedError(
            f"must be a pair (base, cap) of seconds with 0 < base <= cap ({exc})"
        ) from None


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _RejectedError("must be True or False")
    return value


def _prefix(value: object) -> str:
    try:
        return validate_prefix(value)
    except ImproperlyConfigured:
        raise _RejectedError("must be a non-empty str without '{', '}' or whitespace") from None


_MASTER_FORMS = (
    "accepted: redis://[[user]:password@]host[:port][/db], rediss://..., "
    "unix://[[user]:password@]/path/to/socket[?db=N], a dict of redis.Redis keyword "
    "arguments, a redis.Redis client, or a Sentinel spec "
    "{'sentinels': [('host', 26379), ...], 'service_name': 'mymaster'}"
)
# redis-py's URL parser (the one Redis.from_url uses) carries no annotations.
_parse_url = cast("Callable[[str], dict[str, Any]]", redis_connection.parse_url)
_CLIENT_ARGS: Final = frozenset(
    name for name in inspect.signature(redis.Redis.__init__).parameters if name != "self"
)
_SENTINEL_ARGS: Final = frozenset(
    {"sentinels", "service_name", "sentinel_kwargs", "min_other_sentinels", "force_master_ip"}
)


def _check_url(url: str) -> tuple[object, ...]:
    shown = repr(mask_url(url))
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise _RejectedError(f"{shown} has no redis://, rediss:// or unix:// scheme")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unescaped '[' or ']'
        raise _RejectedError(
            f"{shown} is not a valid URL ({exc}); percent-encode special characters of "
            "the password (urllib.parse.quote(password, safe=''))"
        ) from None
    try:
        port = parts.port
    except ValueError:
        raise _RejectedError(f"{shown} has a port that is not a number in 0-65535") from None
    try:
        kwargs = _parse_url(url)
    except ValueError:
        raise _RejectedError(f"{shown} has a query argument redis-py cannot parse") from None
    db = kwargs.get("db", 0)
    if scheme == "unix":
        if not parts.path:
            raise _RejectedError(f"{shown} names no socket path, e.g. unix:///run/redis.sock")
        return ("unix", parts.path, db)
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise _RejectedError(f"{shown} has {parts.path!r} where a database number belongs")
    return ("tcp", (parts.hostname or "localhost").lower(), port or 6379, db)


def _unknown_args(spec: Mapping[str, Any], allowed: frozenset[str]) -> list[str]:
    return sorted(str(name) for name in spec if name not in allowed)


def _check_mapping(spec: Mapping[str, Any]) -> tuple[object, ...]:
    shown = describe_master(spec)
    if "sentinels" in spec or "service_name" in spec:
        sentinels = spec.get("sentinels")
        if (
            not isinstance(sentinels, (list, tuple))
            or not sentinels
            or not all(
                isinstance(s, (list, tuple))
                and len(s) == 2
                and isinstance(s[0], str)
                and isinstance(s[1], int)
                for s in sentinels
            )
        ):
            raise _RejectedError(
                f"Sentinel spec {shown}: 'sentinels' must be a non-empty list of (host, port) pairs"
            )
        service = spec.get("service_name")
        if not isinstance(service, str) or not service:
            raise _RejectedError(f"Sentinel spec {shown}: 'service_name' must be a non-empty str")
        allowed = _CLIENT_ARGS | _SENTINEL_ARGS
        identity: tuple[object, ...] = sentinel_identity(sentinels, service, spec.get("db", 0))
    else:
        allowed = _CLIENT_ARGS
        if spec.get("unix_socket_path"):
            identity = ("unix", spec["unix_socket_path"], spec.get("db", 0))
        else:
            host = spec.get("host", "localhost")
            identity = ("tcp", str(host).lower(), spec.get("port", 6379), spec.get("db", 0))
    unknown = _unknown_args(spec, allowed)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _RejectedError(
            f"{shown} has keys redis.Redis does not take: {', '.join(unknown)}{hint}"
        )
    return identity


def _check_client(spec: redis.Redis) -> tuple[object, ...]:
    return client_identity(spec)


def _masters(value: object) -> tuple[MasterSpec, ...]:
    if isinstance(value, (str, Mapping, redis.Redis)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise _RejectedError(f"must be a non-empty list of masters; {_MASTER_FORMS}")
    masters: list[MasterSpec] = []
    seen: dict[tuple[object, ...], int] = {}
    for number, spec in enumerate(value, start=1):
        try:
            if isinstance(spec, str):
                identity = _check_url(spec)
            elif isinstance(spec, redis.Redis):
                identity = _check_client(spec)
            elif isinstance(spec, Mapping):
                identity = _check_mapping(spec)
            else:
                raise _RejectedError(f"a {type(spec).__name__} is no master")
        except _RejectedError as exc:
            raise _RejectedError(
                f"has an invalid master #{number}: {exc.args[0]}; {_MASTER_FORMS}",
                names_value=True,
            ) from None
        if identity in seen:
            raise _RejectedError(
                f"lists the same master twice (#{seen[identity]} and #{number}: "
                f"{describe_master(spec)}); a master counted twice breaks the quorum",
                names_value=True,
            )
        seen[identity] = number
        masters.append(cast("MasterSpec", spec))
    return tuple(masters)


def default_redis_url(broker_url: object) -> str:
    """The master used when ``redlock_redis_urls`` is not set: the broker, if it is Redis.

    A failover list or ``;``-separated broker URL gives its first URL (one master).
    kombu's ``socket://`` and ``redis+socket://`` unix socket URLs become ``unix://``.
    Any other broker (AMQP, Sentinel, SQS...) gives ``redis://localhost:6379/0``.
    """
    if isinstance(broker_url, (list, tuple)):
        broker_url = broker_url[0] if broker_url else None
    if not isinstance(broker_url, str):
        return _LOCALHOST
    first = broker_url.split(";", 1)[0].strip()
    scheme, sep, rest = first.partition("://")
    if not sep:
        return _LOCALHOST
    if scheme in ("redis", "rediss", "unix"):
        return first
    if scheme in ("socket", "redis+socket"):
        return f"unix://{rest}"
    return _LOCALHOST


def _first_broker(broker_url: object) -> object:
    if isinstance(broker_url, (list, tuple)):
        return broker_url[0] if broker_url else None
    return broker_url.split(";", 1)[0].strip() if isinstance(broker_url, str) else broker_url


def _other_broker(broker_url: object) -> bool:
    """Whether ``broker_url`` names a broker that is not Redis (AMQP, SQS, Sentinel...).

    Then ``redlock_redis_urls`` has no default: a silent ``localhost:6379`` would gate
    every beat entry on a server nobody configured. No broker URL at all keeps the
    default (unit tests, the standalone API).
    """
    first = _first_broker(broker_url)
    if not isinstance(first, str) or "://" not in first:
        return False
    return first.partition("://")[0] not in ("redis", "rediss", "unix", "socket", "redis+socket")


# -- the settings object -------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class RedlockSettings:
    """The celery-redlock settings of one app, validated, with defaults applied.

    Build it with :func:`get_settings` (Celery) or :meth:`from_values`; the
    constructor itself does not validate.
    """

    redis_urls: tuple[MasterSpec, ...] = (_LOCALHOST,)
    key_prefix: str = "redlock"
    node_timeout: float = 0.25
    ttl: float = 30
    #: ``None``: a third of each lease's TTL.
    renew_every: float | None = None
    clock_drift_factor: float = 0.01
    on_contention: OnContention = "retry"
    contention_backoff: Backoff = _CONTENTION_BACKOFF
    max_contention_retries: int | None = None
    dedupe: DedupeMode | None = "queued"
    dedupe_ttl: float = 3600
    raise_on_duplicate: bool = False
    on_lock_lost: OnLockLost = "log"
    #: What a job skipped on contention stores: ``"failure"`` (a ready state, ``.get()``
    #: raises LockContended) or ``"ignored"`` (IGNORED, ``.get()`` waits until its timeout).
    skip_result: SkipResult = "failure"
    outage_backoff: Backoff = _OUTAGE_BACKOFF
    beat_leader: bool = True
    beat_lease_ttl: float = 10
    #: ``"memory"``: the in-process backend for unit tests (:mod:`celery_redlock.memory`)
    backend: Literal["redis", "memory"] = "redis"
    #: let ``celery worker`` and beat use the memory backend (one process only)
    backend_force: bool = False
    #: missed occurrences of an entry after a failover or an outage: ``"one"`` late send
    #: standing for all of them, ``"all"`` of them (at most ``beat.MAX_CATCH_UP``), ``"none"``
    beat_catch_up: BeatCatchUp = "one"

    def __repr__(self) -> str:
        # Masters are described without their passwords: this repr may well be logged.
        values = [
            f"{f.name}={_show_masters(self.redis_urls)}"
            if f.name == "redis_urls"
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
        ]
        return f"RedlockSettings({', '.join(values)})"

    def renew_interval(self, ttl: float) -> float:
        """Seconds between renewals of a lease of ``ttl`` seconds: ``renew_every`` or ttl/3."""
        return self.renew_every if self.renew_every is not None else ttl / 3

    @classmethod
    def from_values(
        cls, values: Mapping[str, object], *, broker_url: object = None
    ) -> RedlockSettings:
        """Validate settings given by short name (``{"ttl": 10}``); absent ones default.

        :raises ImproperlyConfigured: listing every problem (see :func:`check_values`).
        """
        settings, problems = check_values(values, broker_url=broker_url)
        _raise_problems(problems, "the celery-redlock settings")
        assert settings is not None
        return settings


_CHECKERS: Final[Mapping[str, Callable[[object], object]]] = {
    "redis_urls": _masters,
    "key_prefix": _prefix,
    "node_timeout": lambda v: _seconds(v, 0.0, limits.MAX_NODE_TIMEOUT),
    "ttl": lambda v: _seconds(v, MIN_TTL),
    "renew_every": lambda v: None if v is None else _seconds(v, limits.MIN_RENEW_EVERY),
    "clock_drift_factor": _drift,
    "on_contention": lambda v: _choice(v, ("retry", "skip", "raise")),
    "contention_backoff": _backoff,
    "max_contention_retries": _retries,
    "dedupe": lambda v: _choice(v, ("queued", "active", None)),
    "dedupe_ttl": lambda v: _seconds(v, 0.0, limits.MAX_DEDUPE_TTL),
    "raise_on_duplicate": _bool,
    "on_lock_lost": lambda v: _choice(v, ("log", "interrupt")),
    "skip_result": lambda v: _choice(v, ("failure", "ignored")),
    "outage_backoff": _backoff,
    "beat_leader": _bool,
    "beat_lease_ttl": lambda v: _seconds(v, MIN_TTL),
    "backend": lambda v: _choice(v, ("redis", "memory")),
    "backend_force": _bool,
    "beat_catch_up": lambda v: _choice(v, ("one", "all", "none")),
}


def _node_timeout_fits(node_timeout: float, ttl: float) -> bool:
    # A third of the TTL leaves room for the round trip and two more renewal tries.
    return node_timeout < ttl / 3


def _renewal_limit(ttl: float, node_timeout: float, clock_drift_factor: float) -> float:
    """The longest renewal interval whose renewals still land within the validity of a
    lease of ``ttl`` (``ttl`` less its drift allowance), with rounds as slow as
    ``node_timeout``: a renewal is due that interval after the reply to the round before
    it, while the validity it must land in counts from that round's send, so two rounds
    fit in besides the interval. Past it, leases are lost at a renewal while their keys
    live on."""
    return ttl - limits.drift(ttl, clock_drift_factor) - 2 * node_timeout


def _renewal_text(ttl: float, node_timeout: float, clock_drift_factor: float) -> str:
    return (
        f"< {_renewal_limit(ttl, node_timeout, clock_drift_factor):g}: ttl {ttl:g} less its "
        f"clock drift allowance ({limits.drift(ttl, clock_drift_factor):g}) less two "
        f"node_timeouts ({2 * node_timeout:g})"
    )


def _renewal_problem(
    ttl: float, renew_every: float | None, node_timeout: float, clock_drift_factor: float
) -> str | None:
    """Why renewals every ``renew_every`` (None: the default, a third of ``ttl``) cannot
    keep a lease of ``ttl``, or None."""
    renew = renew_every if renew_every is not None else max(ttl / 3, limits.MIN_RENEW_EVERY)
    if renew < _renewal_limit(ttl, node_timeout, clock_drift_factor):
        return None
    every = (
        f"{_label('renew_every')} ({renew:g})"
        if renew_every is not None
        else f"a third of it, the default ({renew:g})"
    )
    return (
        f"is too short for a renewal every {every} to land within the lease's validity "
        f"(the interval must be {_renewal_text(ttl, node_timeout, clock_drift_factor)})"
    )


def check_values(
    values: Mapping[str, object], *, broker_url: object = None
) -> tuple[RedlockSettings | None, list[SettingProblem]]:
    """Validate settings given by short name; return the settings or the problems.

    Absent names take their defaults (``redis_urls``: :func:`default_redis_url` of
    ``broker_url``). Names that are not settings are ignored here: see
    :func:`find_unknown_settings`. Returns ``(settings, [])`` or ``(None, problems)``.
    """
    clean: dict[str, Any] = {}
    problems: list[SettingProblem] = []
    for name, check in _CHECKERS.items():
        if name in values:
            raw = values[name]
        elif name == "redis_urls":
            # The in-process backend for unit tests needs no master (its tests often run
            # on the memory:// broker).
            if _other_broker(broker_url) and values.get("backend") != "memory":
                problems.append(
                    SettingProblem(
                        name,
                        "invalid",
                        f"{_label(name)} must be set when the broker is not Redis (the "
                        "masters would default to redis://localhost:6379/0, which may be "
                        "nobody's lock service); accepted: a list of Redis master URLs, "
                        "dicts, clients or Sentinel specs; broker: "
                        f"{mask_url(str(_first_broker(broker_url)))}",
                    )
                )
                continue
            raw = default_redis_url(broker_url)
        else:
            raw = DEFAULTS[name]
        try:
            clean[name] = check(raw)
        except _RejectedError as exc:
            message = f"{_label(name)} {exc.args[0]}"
            if not exc.names_value:
                shown = _show_masters(raw) if name == "redis_urls" else _show(raw)
                message += f"; got {shown}"
            if name == "redis_urls" and name not in values:
                message += " (from the broker URL, used while the setting is not set)"
            problems.append(SettingProblem(name, "invalid", message))

    def conflict(name: str, message: str) -> None:
        problems.append(SettingProblem(name, "conflict", f"{_label(name)} {message}"))

    timeout = clean.get("node_timeout")
    for ttl_name in ("ttl", "beat_lease_ttl"):
        ttl = clean.get(ttl_name)
        if timeout is not None and ttl is not None and not _node_timeout_fits(timeout, ttl):
            conflict(
                "node_timeout",
                f"must be well below {_label(ttl_name)}: less than a third of it "
                f"(< {ttl / 3:g}); got node_timeout={timeout:g}, {ttl_name}={ttl:g}",
            )
    renew, ttl, drift = clean.get("renew_every"), clean.get("ttl"), clean.get("clock_drift_factor")
    if (
        ttl is not None
        and timeout is not None
        and drift is not None
        and "renew_every" in clean
        and _node_timeout_fits(timeout, ttl)
    ):
        problem = _renewal_problem(ttl, renew, timeout, drift)
        if problem is not None:
            conflict("ttl", f"({ttl:g}) {problem}")
    if problems:
        # Belt and braces: no message shows a password of the masters given, whatever
        # part of a spec it quotes (mask_url and describe_master already hide them).
        for spec in [*_as_list(values.get("redis_urls")), *_as_list(broker_url)]:
            remember_secrets_of(spec)
        return None, [dataclasses.replace(p, message=scrub(p.message)) for p in problems]
    return RedlockSettings(**clean), []


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# -- unknown names -------------------------------------------------------------------------


def _redlock_name(key: str) -> str | None:
    lower = key.lower()
    if lower.startswith("celery_"):
        lower = lower[len("celery_") :]
    if not lower.startswith("redlock_"):
        return None
    return lower[len("redlock_") :]


def _read_spellings(name: str, namespace: str | None) -> list[str]:
    """The names under which Celery finds setting ``name``, as ``ConfigurationView`` does."""
    spellings = [f"redlock_{name}"]
    if namespace:
        prefix = namespace.rstrip("_") + "_"
        spelled = f"{prefix}redlock_{name}"
        spellings.insert(0, spelled.upper() if prefix.isupper() else spelled.lower())
    return spellings


def _in_namespace(key: str, namespace: str | None) -> bool:
    """Whether ``key`` is in the app's namespace: with ``namespace="CELERY"`` only
    ``CELERY_*`` names (any case) are; the rest of a Django settings module belongs to
    Django and other libraries (``REDLOCK_RETRY_COUNT`` is another library's)."""
    if not namespace:
        return True
    return key.lower().startswith(namespace.rstrip("_").lower() + "_")


def _keys_and_namespace(
    keys: Iterable[str], namespace: str | _Unset | None
) -> tuple[list[str], str | None]:
    if hasattr(keys, "maps"):
        _finalize(keys)
        if isinstance(namespace, _Unset):
            found = getattr(keys, "prefix", None)
            namespace = found if isinstance(found, str) else None
        keys = _conf_keys(keys)
    if isinstance(namespace, _Unset):
        namespace = None
    return sorted(set(keys)), namespace


def find_unknown_settings(
    keys: Iterable[str], *, namespace: str | _Unset | None = UNSET
) -> list[SettingProblem]:
    """Find configuration keys in the app's namespace that look like ours but are never read.

    ``keys`` are the names present in the configuration, or a Celery ``app.conf``
    itself, whose namespace is then used unless ``namespace`` is given.

    A key counts as ours when it starts with ``redlock_`` or ``celery_redlock_`` in
    any case and lies in ``namespace`` (the prefix given to ``config_from_object``,
    e.g. ``"CELERY"``: then only ``CELERY_*`` names are judged, so another library's
    ``REDLOCK_RETRY_COUNT`` in a Django settings module is left alone; see
    :func:`find_unread_settings` for our own names written outside it). It is a
    problem when the rest is no setting (the message suggests the closest one, by
    :mod:`difflib`), or when Celery would not read it under ``namespace``:
    ``celery_redlock_ttl`` with ``namespace="CELERY"``, or ``CELERY_REDLOCK_TTL``
    without a namespace.
    """
    keys, namespace = _keys_and_namespace(keys, namespace)
    problems: list[SettingProblem] = []
    for key in keys:
        name = _redlock_name(key)
        if name is None or not _in_namespace(key, namespace):
            continue
        if name in DEFAULTS:
            spellings = _read_spellings(name, namespace)
            if key in spellings:
                continue
            same_case = [s for s in spellings if s.isupper() == key.isupper()]
            use = (same_case or spellings)[0]
            message = f"setting {key} is never read"
            where = (
                f" with namespace={namespace.rstrip('_')!r}"
                if namespace
                else " without a namespace"
            )
            problems.append(
                SettingProblem(key, "unknown", f"{message} by this app{where}; write {use}")
            )
            continue
        close = difflib.get_close_matches(name, list(DEFAULTS), n=1, cutoff=0.6)
        if close:
            suggestion = _read_spellings(close[0], namespace)
            same_case = [s for s in suggestion if s.isupper() == key.isupper()]
            hint = f"did you mean {(same_case or suggestion)[0]}?"
        else:
            hint = "known settings: " + ", ".join(f"redlock_{n}" for n in DEFAULTS)
        problems.append(
            SettingProblem(key, "unknown", f"unknown celery-redlock setting {key}; {hint}")
        )
    return problems


def find_unread_settings(
    keys: Iterable[str], *, namespace: str | _Unset | None = UNSET
) -> list[tuple[str, str]]:
    """Our exact setting names written outside the app's namespace, as warnings.

    ``REDLOCK_TTL`` in a Django settings module read with ``namespace="CELERY"`` is
    never read (Celery reads ``CELERY_REDLOCK_TTL``), but the name may as well be
    another library's: it is not an error, only worth a log line (and a Django
    check warning). Returns ``(name, sentence)`` per such name.
    """
    keys, namespace = _keys_and_namespace(keys, namespace)
    found: list[tuple[str, str]] = []
    for key in keys:
        name = _redlock_name(key)
        if (
            namespace
            and name is not None
            and name in DEFAULTS
            and not _in_namespace(key, namespace)
        ):
            use = _read_spellings(name, namespace)[0]
            message = (
                f"setting {key} is outside namespace {namespace.rstrip('_')!r} and never read by "
                f"celery-redlock; write {use} if it is meant for celery-redlock"
            )
            found.append((key, message))
    return found


# -- reading app.conf ----------------------------------------------------------------------


class SupportsConf(Protocol):
    """What :func:`get_settings` needs of a Celery app: its ``conf``."""

    @property
    def conf(self) -> Any: ...


_NOT_SET: Final = object()


def _finalize(conf: Any) -> None:
    # A pending app.conf learns its namespace and config object only when finalized.
    finalize = getattr(conf, "finalize", None)
    if callable(finalize):
        finalize()


def _conf_keys(conf: Any) -> list[str]:
    keys: list[str] = []
    for mapping in getattr(conf, "maps", [conf]):
        keys.extend(key for key in mapping if isinstance(key, str))
    return keys


def settings_from_conf(conf: Any) -> RedlockSettings:
    """Read and validate the settings from a Celery ``app.conf`` (or any mapping).

    :raises ImproperlyConfigured: listing every invalid value, conflict and unknown name.
    """
    _finalize(conf)
    values: dict[str, object] = {}
    for name in DEFAULTS:
        value = conf.get(f"redlock_{name}", _NOT_SET)
        if value is not _NOT_SET:
            values[name] = value
    # Celery's conf.broker_url is a property that also reads $CELERY_BROKER_URL.
    broker_url = getattr(conf, "broker_url", None) or conf.get("broker_url")
    settings, problems = check_values(values, broker_url=broker_url)
    namespace = getattr(conf, "prefix", None)
    keys = _conf_keys(conf)
    problems += find_unknown_settings(keys, namespace=namespace)
    for _, warning in find_unread_settings(keys, namespace=namespace):
        logger.warning("%s", warning)
    _raise_problems(problems, "the celery-redlock settings")
    assert settings is not None
    return settings


_cache: weakref.WeakKeyDictionary[Any, tuple[Any, RedlockSettings]] = weakref.WeakKeyDictionary()


def _gone() -> None:
    return None


_NO_LAST: Final[
    tuple[Callable[[], Any], Callable[[], Any], Callable[[], RedlockSettings | None]]
] = (
    _gone,
    _gone,
    _gone,
)
#: the app last asked about, its conf and its settings, held weakly: get_settings' answer
#: without a WeakKeyDictionary lookup (which makes a weak reference per call)
_last: tuple[Callable[[], Any], Callable[[], Any], Callable[[], RedlockSettings | None]] = _NO_LAST
#: counts reset_settings calls: an answer looked up before one is not kept as _last
_generation = 0
_last_lock = threading.Lock()


def get_settings(app: SupportsConf) -> RedlockSettings:
    """Return the validated settings of ``app``, read from ``app.conf`` on first call.

    Cached per app (held weakly); the cache is dropped when ``app.conf`` is replaced
    (``config_from_object`` after configuration), not when a value inside it changes:
    call it once the configuration is complete (it finalizes a pending ``app.conf``),
    and use :func:`reset_settings` after changing values, as tests do.

    :raises ImproperlyConfigured: see :func:`settings_from_conf`.
    """
    global _last
    conf = app.conf
    last_app, last_conf, last_settings = _last
    if last_app() is app and last_conf() is conf:
        found: RedlockSettings | None = last_settings()
        if found is not None:
            return found  # the usual case: one app, asked on every publish and run
    generation = _generation
    cached = _cache.get(app)
    if cached is not None and cached[0] is conf:
        settings, fresh = cached[1], False
    else:
        settings, fresh = settings_from_conf(conf), True
    with _last_lock:
        # Not when a reset came since this call looked: its answer may predate the reset
        # (values read before a change that the reset stands for), and kept it would
        # outlive the reset for good.
        if generation == _generation:
            if fresh:
                _cache[app] = (conf, settings)
            try:
                _last = (weakref.ref(app), weakref.ref(conf), weakref.ref(settings))
            except TypeError:  # an app or conf that takes no weak reference
                _last = _NO_LAST
    return settings


def reset_settings(app: SupportsConf | None = None) -> None:
    """Forget the cached settings of ``app``, or of every app."""
    global _last, _generation
    with _last_lock:
        _generation += 1
        _last = _NO_LAST
        if app is None:
            _cache.clear()
        else:
            _cache.pop(app, None)


# -- task options --------------------------------------------------------------------------

#: Task option -> the setting giving its default.
_TASK_OPTIONS: Final[Mapping[str, str | None]] = {
    "lock_key": None,
    "unique_on": None,
    "lock_ttl": "ttl",
    "on_contention": "on_contention",
    "contention_backoff": "contention_backoff",
    "max_contention_retries": "max_contention_retries",
    "dedupe": "dedupe",
    "on_lock_lost": "on_lock_lost",
    "raise_on_duplicate": "raise_on_duplicate",
    "skip_result": "skip_result",
}
#: Options whose None means "not set"; for the others None is a value of its own.
_NONE_IS_UNSET: Final = frozenset(
    {"lock_ttl", "on_contention", "contention_backoff", "on_lock_lost", "skip_result"}
)


@dataclass(frozen=True)
class TaskOptions:
    """A task's lock options, resolved (task option, then app.conf, then default) and valid."""

    task_name: str
    lock_ttl: float
    renew_every: float
    on_contention: OnContention
    contention_backoff: Backoff
    max_contention_retries: int | None
    dedupe: DedupeMode | None
    on_lock_lost: OnLockLost
    skip_result: SkipResult
    build_key: KeyBuilder = field(repr=False, compare=False)
    raise_on_duplicate: bool = False
    #: ``redlock_renew_every`` is set: the run's lease is given ``renew_every``, else the
    #: lease's own default applies (and follows the TTL when the body extends it)
    renew_every_set: bool = False

    def lock_key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lock key of one call; raises as the key builder does (see
        :func:`~celery_redlock.keys.compile_lock_key`)."""
        return self.build_key(args, kwargs)


def run_function(task: Any) -> Callable[..., object]:
    """The function a task runs, with the signature its callers use (no ``self``).

    For an instance, ``task.run`` (a bound method when ``bind=True``). For a class,
    its ``run`` with ``self`` dropped unless it is a staticmethod, as the task
    decorator makes it for tasks without ``bind=True``.

    :raises ImproperlyConfigured: the class has no ``run``.
    """
    if not isinstance(task, type):
        return cast("Callable[..., object]", task.run)
    raw = inspect.getattr_static(task, "run", None)
    if isinstance(raw, staticmethod):
        return cast("Callable[..., object]", raw.__func__)
    if callable(raw):
        # Bound to the class only to drop ``self`` from the signature; never called.
        return types.MethodType(raw, task)
    raise ImproperlyConfigured(f"task class {task.__qualname__} has no run function")


def _misspelled_options(cls: type, task_name: str) -> list[str]:
    inherited = {name for base in cls.__mro__[1:] for name in vars(base)}
    problems = []
    for name, value in vars(cls).items():
        if name in _TASK_OPTIONS or name.startswith("_") or name in inherited:
            continue
        if inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod)):
            continue
        close = difflib.get_close_matches(name, list(_TASK_OPTIONS), n=1, cutoff=0.8)
        if close or name.startswith("lock_"):
            hint = f"did you mean {close[0]}?" if close else "options: " + ", ".join(_TASK_OPTIONS)
            problems.append(f"task {task_name!r}: unknown lock option {name}; {hint}")
    return problems


def validate_task_options(task: Any, settings: RedlockSettings) -> TaskOptions:
    """Resolve and validate a SingletonTask's options, and compile its lock key.

    Each option comes from the task (a class attribute, as ``@app.task(**options)``
    sets them) unless it is absent or :data:`UNSET` (or ``None``, for ``lock_ttl``,
    ``on_contention``, ``contention_backoff``, ``on_lock_lost`` and ``skip_result``), then from
    ``settings`` (app.conf or default). ``task`` is a task instance (preferred) or
    class; see :func:`~celery_redlock.keys.compile_lock_key` for the key.

    :raises ImproperlyConfigured: naming the task and every bad option and the
        accepted values: out-of-range values, a ``lock_ttl`` too short for the
        node timeout or renewal period, unknown names in ``lock_key`` or
        ``unique_on``, and misspelled options (``lock_tll``).
    """
    cls = task if isinstance(task, type) else task.__class__
    task_name = getattr(task, "name", None) or f"{cls.__module__}.{cls.__qualname__}"
    messages = _misspelled_options(cls, task_name)
    invalid: set[str] = set()
    resolved: dict[str, Any] = {}
    for option, setting in _TASK_OPTIONS.items():
        raw = getattr(task, option, UNSET)
        if setting is None:
            resolved[option] = None if raw is UNSET else raw
            continue
        if raw is UNSET or (raw is None and option in _NONE_IS_UNSET):
            resolved[option] = getattr(settings, setting)
            continue
        check = _CHECKERS["ttl" if option == "lock_ttl" else option]
        try:
            resolved[option] = check(raw)
        except _RejectedError as exc:
            invalid.add(option)
            got = "" if exc.names_value else f"; got {_show(raw)}"
            messages.append(f"task {task_name!r}: option {option} {exc.args[0]}{got}")
    if "lock_ttl" not in invalid:
        ttl: float = resolved["lock_ttl"]
        if not _node_timeout_fits(settings.node_timeout, ttl):
            messages.append(
                f"task {task_name!r}: option lock_ttl ({ttl:g}) must be more than three times "
                f"{_label('node_timeout')} ({settings.node_timeout:g})"
            )
        else:
            problem = _renewal_problem(
                ttl, settings.renew_every, settings.node_timeout, settings.clock_drift_factor
            )
            if problem is not None:
                messages.append(f"task {task_name!r}: option lock_ttl ({ttl:g}) {problem}")
    build_key: KeyBuilder | None = None
    try:
        build_key = compile_lock_key(
            resolved["lock_key"], run_function(task), task_name, unique_on=resolved["unique_on"]
        )
    except ImproperlyConfigured as exc:
        messages.append(str(exc))
    if messages:
        problems = [SettingProblem(task_name, "invalid", m) for m in messages]
        _raise_problems(problems, f"the lock options of task {task_name!r}")
    assert build_key is not None
    return TaskOptions(
        task_name=task_name,
        lock_ttl=resolved["lock_ttl"],
        renew_every=settings.renew_interval(resolved["lock_ttl"]),
        renew_every_set=settings.renew_every is not None,
        on_contention=resolved["on_contention"],
        contention_backoff=resolved["contention_backoff"],
        max_contention_retries=resolved["max_contention_retries"],
        dedupe=resolved["dedupe"],
        on_lock_lost=resolved["on_lock_lost"],
        skip_result=resolved["skip_result"],
        build_key=build_key,
        raise_on_duplicate=resolved["raise_on_duplicate"],
    )


# task.py imported the helper under its first, private name.
_run_function = run_function


#: Task options a single publish may override: ``apply_async(..., redlock={...})``.
CALL_OPTIONS: Final = ("dedupe", "lock_ttl", "on_contention", "raise_on_duplicate")


def validate_call_options(
    overrides: object, task_name: str, settings: RedlockSettings
) -> dict[str, Any]:
    """Check the per-call overrides of one publish (``apply_async(..., redlock={...})``).

    Each value is checked as the task option of that name is (same accepted values,
    same messages), ``lock_ttl`` also against ``redlock_node_timeout`` and
    ``redlock_renew_every``; ``None`` is a value for ``dedupe`` only ("off").

    :returns: the clean values, by option name.
    :raises ImproperlyConfigured: naming the task and every unknown or bad entry, with
        the accepted names or values.
    """
    accepted = ", ".join(CALL_OPTIONS)
    if not isinstance(overrides, Mapping):
        raise ImproperlyConfigured(
            f"task {task_name!r}: the redlock= publish option must be a dict with keys "
            f"among {accepted}; got {_show(overrides)}"
        )
    messages: list[str] = []
    clean: dict[str, Any] = {}
    unknown = sorted(str(name) for name in overrides if name not in CALL_OPTIONS)
    if unknown:
        messages.append(
            f"task {task_name!r}: redlock= publish option has unknown "
            f"key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; accepted: {accepted}"
        )
    for option in CALL_OPTIONS:
        if option not in overrides:
            continue
        raw = overrides[option]
        check = _CHECKERS["ttl" if option == "lock_ttl" else option]
        try:
            if raw is None and option != "dedupe":
                raise _RejectedError("must not be None (None turns off dedupe only)")
            clean[option] = check(raw)
        except _RejectedError as exc:
            got = "" if exc.names_value else f"; got {_show(raw)}"
            messages.append(f"task {task_name!r}: redlock= option {option} {exc.args[0]}{got}")
    ttl = clean.get("lock_ttl")
    if ttl is not None and not _node_timeout_fits(settings.node_timeout, ttl):
        messages.append(
            f"task {task_name!r}: redlock= option lock_ttl ({ttl:g}) must be more than three "
            f"times {_label('node_timeout')} ({settings.node_timeout:g})"
        )
    elif ttl is not None:
        problem = _renewal_problem(
            ttl, settings.renew_every, settings.node_timeout, settings.clock_drift_factor
        )
        if problem is not None:
            messages.append(f"task {task_name!r}: redlock= option lock_ttl ({ttl:g}) {problem}")
    if messages:
        problems = [SettingProblem(task_name, "invalid", m) for m in messages]
        _raise_problems(problems, f"the redlock= publish options of task {task_name!r}")
    return clean


def with_call_options(
    options: TaskOptions, overrides: Mapping[str, Any], settings: RedlockSettings
) -> TaskOptions:
    """``options`` with clean per-call overrides (see :func:`validate_call_options`) applied."""
    if not overrides:
        return options
    changes = dict(overrides)
    if "lock_ttl" in changes:
        changes["renew_every"] = settings.renew_interval(changes["lock_ttl"])
    return dataclasses.replace(options, **changes)
