"""What celery-redlock shows of secrets and of user-derived text: nothing, and escaped.

Three guarantees, each in one place:

* :func:`mask_url` hides a Redis URL's password (in the user info or the query, also a
  ``?`` or ``@`` inside an unescaped password), ``ssl_password`` and the TLS file paths
  (``ssl_keyfile`` and friends) of one URL.
* :func:`scrub` removes every *known* secret from free text: the passwords, TLS key
  passwords and key file paths of every master this process configured (registered by
  :func:`remember_secrets_of` when a master is built), and any ``scheme://user:password@``
  user info. Error texts from redis-py (``str(exc)``) pass through it before they are
  logged, stored in :attr:`~celery_redlock.exceptions.RedlockError.errors` (result
  backends keep those) or printed by ``celery redlock``: redis-py before 7.4 printed a
  Sentinel's ``sentinel_kwargs`` password in its errors.
* :func:`printable` escapes control characters (newlines, ``ESC``, bidi overrides), so a
  key or argument can neither start a log line of its own nor move a terminal's cursor.
  Every ``celery_redlock`` logger carries :class:`LogGuard` (see :func:`guard`), which
  renders the arguments of each record through both.

Passwords shorter than :data:`MIN_SECRET` characters are not searched for in free text
(``"0"`` would be found in every address); they are still masked in URLs and never
shown in our own descriptions of a master.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote, unquote

import redis
from redis import connection as redis_connection

__all__ = [
    "MIN_SECRET",
    "LogGuard",
    "guard",
    "mask_url",
    "printable",
    "remember_secrets",
    "remember_secrets_of",
    "scrub",
    "secrets_of",
    "shown",
]

#: The shortest known secret searched for in free text.
MIN_SECRET: Final = 4
MASK: Final = "***"

#: Connection arguments whose values are secrets (also in a URL's query).
SECRET_ARGS: Final = frozenset({"password", "ssl_password", "ssl_keyfile"})
#: Query arguments shown masked: the secrets and the other TLS file locations.
_MASKED_QUERY = SECRET_ARGS | {"ssl_certfile", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data"}


def _masked_query_name(name: str) -> bool:
    lowered = unquote(name).lower()
    return lowered in _MASKED_QUERY or "password" in lowered or "secret" in lowered


# -- URLs ----------------------------------------------------------------------------------


def mask_url(url: str) -> str:
    """Return ``url`` with its secrets replaced by ``***``.

    Hidden: the password of the user info (everything from the first ``:`` after the
    scheme to the *last* ``@``, so an unescaped ``/``, ``?``, ``#`` or ``@`` in it is
    hidden too, at the cost of hiding more than the password when a query value holds
    an ``@``), and the values of ``password``, ``ssl_password``, ``ssl_keyfile``,
    ``ssl_certfile``, ``ssl_ca_certs``, ``ssl_ca_path``, ``ssl_ca_data`` and any query
    argument whose name says password or secret. A masked query value runs up to the next
    ``&`` that starts another query argument (``&name=``), so an unescaped ``&`` inside a
    password does not show the rest of it either. Text without ``://`` is returned as is.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # Every reading is taken on the original text and every span any of them calls
    # secret is masked: the user info's end (the last '@') may lie in the query (an
    # unescaped '@' in a query password), and the query's start (the first '?') in the
    # user info (an unescaped '?' in its password), so the query is read from the first
    # '?' and from the first one after that '@'.
    spans: list[tuple[int, int]] = []
    at = rest.rfind("@")
    colon = rest.find(":")
    if at >= 0 and 0 <= colon < at:
        spans.append((colon + 1, at))
    for question in {rest.find("?"), rest.find("?", max(at, 0))}:
        if question >= 0:
            start = question + 1
            spans += [(start + a, start + b) for a, b in _query_secrets(rest[start:])]
    out: list[str] = []
    end = 0
    for a, b in sorted(spans):
        if a >= end:
            out.append(rest[end:a])
            out.append(MASK)
            end = b
        elif b > end:
            end = b
    out.append(rest[end:])
    return f"{scheme}{sep}{''.join(out)}"


def _query_names() -> frozenset[str]:
    """Every argument name redis-py may read from a URL's query."""
    names = set(getattr(redis_connection, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for function in (redis.Redis.__init__, redis_connection.AbstractConnection.__init__):
        names.update(inspect.signature(function).parameters)
    return frozenset(names - {"self", "kwargs", "args"})


#: The names that start another query argument after a masked value.
_QUERY_NAMES: Final = _query_names()


_SECRET_QUERY = re.compile(r"[?&](?:password|ssl_password|ssl_keyfile)=", re.IGNORECASE)


def _query_secrets(query: str) -> list[tuple[int, int]]:
    """The (start, end) spans of the secret values in ``query`` (the text after '?')."""
    spans: list[tuple[int, int]] = []
    masking = False
    position = 0
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        if eq and _masked_query_name(name):
            spans.append((position + len(name) + 1, position + len(part)))
            masking = True
        elif masking and not (eq and unquote(name).lower() in _QUERY_NAMES):
            # An unescaped '&' inside the masked value: still the secret.
            spans[-1] = (spans[-1][0], position + len(part))
        else:
            masking = False
        position += len(part) + 1
    return spans


#: ``scheme://user:password@`` in free text: the password runs to the last ``@`` before
#: a space or a quote.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@'\"<>]*:)[^\s'\"<>]*@")
#: ``password=...`` / ``'password': '...'`` in free text (query strings, reprs).
_NAMED = re.compile(
    r"(?i)(\b(?:ssl_)?password['\"]?\s*[=:]\s*)(?!<REDACTED>)('[^']*'|\"[^\"]*\"|[^\s&,;)>'\"]+)"
)


# -- known secrets -------------------------------------------------------------------------

_known: set[str] = set()
_known_lock = threading.Lock()
_pattern: re.Pattern[str] | None = None


def _forms(secret: str) -> set[str]:
    """The ways ``secret`` may be written in an error text."""
    forms = {secret, unquote(secret), quote(secret, safe=""), repr(secret)[1:-1]}
    return {f for f in forms if len(f) >= MIN_SECRET}


def remember_secrets(values: Iterable[object]) -> None:
    """Add ``values`` (str secrets; others ignored) to what :func:`scrub` removes."""
    global _pattern
    new = set()
    for value in values:
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str):
            new |= _forms(value)
    if not new - _known:
        return
    with _known_lock:
        _known.update(new)
        ordered = sorted(_known, key=len, reverse=True)
        _pattern = re.compile("|".join(re.escape(s) for s in ordered))


def secrets_of(spec: object) -> list[str]:
    """The secrets in one master spec: a URL, a dict (Sentinel specs with their
    ``sentinel_kwargs``), a ``redis.Redis`` client, or connection kwargs."""
    found: list[str] = []
    if isinstance(spec, str):
        parts = spec.partition("://")[2]
        at = parts.rfind("@")
        colon = parts.find(":")
        if at >= 0 and 0 <= colon < at:
            found.append(parts[colon + 1 : at])
        # Wherever a query argument may start: the query begins at a '?' that may also
        # sit inside an unescaped password.
        for match in _SECRET_QUERY.finditer(parts):
            value = ""
            for piece in parts[match.end() :].split("&"):
                name, eq, _ = piece.partition("=")
                if value and eq and unquote(name).lower() in _QUERY_NAMES:
                    break
                value = f"{value}&{piece}" if value else piece
            found.append(value)
        return found
    pool = getattr(spec, "connection_pool", None)
    if pool is not None:
        spec = getattr(pool, "connection_kwargs", {})
    if isinstance(spec, Mapping):
        for name, item in spec.items():
            if name in SECRET_ARGS and isinstance(item, str | bytes):
                found.append(item.decode(errors="replace") if isinstance(item, bytes) else item)
            elif name == "sentinel_kwargs" and isinstance(item, Mapping):
                found += secrets_of(item)
    return found


def remember_secrets_of(spec: object) -> None:
    """Remember the secrets of one master spec (see :func:`secrets_of`)."""
    remember_secrets(secrets_of(spec))


def scrub(text: str) -> str:
    """``text`` without any known secret or URL/``password=`` password (each ``***``)."""
    pattern = _pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    if "://" in text:
        text = _USERINFO.sub(rf"\1{MASK}@", text)
    if "assword" in text or "ASSWORD" in text:
        text = _NAMED.sub(rf"\1{MASK}", text)
    return text


# -- control characters --------------------------------------------------------------------

_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]"
)
_NAMED_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED_ESCAPES.get(char)
    if named:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``, ``\\u202e``...).

    The result holds no line break, no terminal escape sequence and no bidi override:
    it cannot start a log line of its own, move a cursor or reorder what follows.
    """
    return _UNSAFE.sub(_escape, text)


def shown(value: object) -> str:
    """``str(value)`` as it may be logged or printed: scrubbed and :func:`printable`."""
    return printable(scrub(value if isinstance(value, str) else str(value)))


# -- logging -------------------------------------------------------------------------------


class _Shown:
    """A log argument rendered safely by ``%s`` and ``%r`` alike."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return shown(self.value)

    def __repr__(self) -> str:
        return printable(scrub(repr(self.value)))


def _safe(arg: object) -> object:
    # Numbers stay numbers (``%d``, ``%.3f``); everything else is rendered by _Shown.
    if arg is None or isinstance(arg, int | float):
        return arg
    return _Shown(arg)


class LogGuard(logging.Filter):
    """Renders each record's arguments through :func:`scrub` and :func:`printable`, and
    scrubs its traceback text: no secret and no control character reaches a handler
    through a ``celery_redlock`` logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _safe(v) for k, v in args.items()}
        if isinstance(record.msg, str):
            record.msg = scrub(record.msg)
        if record.exc_info and not record.exc_text:
            # Formatters keep a record's exc_text once set; scrub it before any does.
            record.exc_text = scrub("".join(traceback.format_exception(*record.exc_info)))
            record.exc_text = record.exc_text.rstrip("\n")
        return True


_GUARD: Final = LogGuard()


def guard(logger: Any) -> Any:
    """Attach the :class:`LogGuard` to ``logger`` (once) and return it."""
    if _GUARD not in logger.filters:
        logger.addFilter(_GUARD)
    return logger
