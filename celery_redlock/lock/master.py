"""Masters and the links (connections) we keep to them.

A :class:`Master` is one independent Redis master as the user described it; it
knows how to open a connection with our timeouts, which ``run_id`` it had when
we last connected, and whether it currently looks down. A :class:`Link` is one
connection to one master, owned by one lane of a :class:`~.redlock.Redlock`:
commands written on a link are executed by Redis in that order, which is what
keeps a late ``SET NX`` from landing after its own release.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..exceptions import ImproperlyConfigured
from ..redact import guard, remember_secrets_of, scrub
from . import events, process, resolve, summary, waiting, wire
from .scripts import ALL_SCRIPTS
from .wire import ReplyError

__all__ = [
    "DuplicateMaster",
    "Link",
    "Master",
    "MasterSpec",
    "MasterStatus",
    "describe_masters",
    "longest_granted_ttl",
    "make_master",
    "note_granted_ttl",
]

logger = guard(logging.getLogger("celery_redlock.lock"))  # see celery_redlock.redact

MasterSpec = str | Mapping[str, Any] | redis.Redis

#: A link with more unanswered replies than this is wedged: drop it and reconnect.
#: Generous on purpose: a master starved of CPU for a few milliseconds falls dozens of
#: replies behind a fast client (seen at 64 on a 2-core host running 3 masters), and
#: dropping the link breaks the per-master order of our commands that keeps a late
#: SET NX from outliving its release. Each slot is a few dozen bytes.
MAX_OUTSTANDING = 1024

_ALLOWED_SCHEMES = ("redis", "rediss", "unix")
_DROPPED_KWARGS = (
    "retry_on_error",
    "decode_responses",
    "maint_notifications_config",
    "maint_notifications_pool_handler",
    "oss_cluster_maint_notifications_handler",
    "orig_host_address",
    "orig_socket_timeout",
    "orig_socket_connect_timeout",
)

#: run_id per master address, shared by every Redlock in this process (and inherited
#: by forked children), so a fresh client object still notices a restart that an
#: earlier one saw the other side of.
_known_run_ids: dict[str, str] = {}
_known_lock = threading.Lock()
#: True once any master was seen to restart in this process: until then no round needs
#: to look for quarantined masters (a check that would otherwise run on every round).
restarts_seen = False
#: monotonic time a master (by address, as ``_known_run_ids``) was last seen to restart,
#: shared by every Redlock in this process: a client created after the restart keeps the
#: master out of its quorum as long as the one that saw it does
_restarted_at: dict[str, float] = {}
#: the same, by the restarted server's new run_id: a client that reaches that server under
#: another name (``localhost`` for ``127.0.0.1``) never saw its old run_id, and must keep
#: it out all the same
_restarted_run_ids: dict[str, float] = {}
#: the longest TTL of a lease or claim granted in this process (seconds): how long a
#: restarted master stays out of the quorum (see :func:`note_granted_ttl`)
_longest_granted = 0.0

#: At most one summary line per master per this many seconds (see Master.note_unreached).
LOG_PERIOD = summary.LOG_PERIOD


def note_granted_ttl(ttl: float) -> None:
    """Record that a lease or claim of ``ttl`` seconds was granted in this process.

    A master seen to restart is kept out of every quorum for the longest such TTL: a
    lock it forgot lives on the other masters at most that long.
    """
    global _longest_granted
    if ttl > _longest_granted:
        with _known_lock:
            _longest_granted = max(_longest_granted, ttl)


def longest_granted_ttl() -> float:
    """The longest TTL granted in this process so far (0.0 before the first grant)."""
    return _longest_granted


def forget_restarts() -> None:
    """Forget every master identity (run_id), restart and granted TTL this process saw.

    For a test harness that has just emptied or replaced all its masters (``FLUSHALL``,
    fresh servers on reused ports): no lock granted before can be on them, so keeping a
    restarted one out of the quorum protects nothing, and would fail every acquire of the
    next test for the longest TTL granted so far. Never for production masters.
    """
    global _longest_granted
    with _known_lock:
        _known_run_ids.clear()
        _restarted_at.clear()
        _restarted_run_ids.clear()
        _longest_granted = 0.0


class DuplicateMaster(ConnectionError):
    """A master answered with the run_id of another master of the same client."""


def _no_setinfo_kwargs() -> tuple[dict[str, Any], tuple[str, ...]]:
    """Connection arguments that stop redis-py from sending ``CLIENT SETINFO`` on connect.

    redis-py (>= 5) sends ``CLIENT SETINFO LIB-NAME`` and ``LIB-VER`` on every new
    connection, each a round trip of its own read timeout, before our handshake: on a slow
    master a connect cost three node timeouts instead of one. Returns the arguments to set
    and those to drop (``lib_name``/``lib_version`` warn on redis-py 8, where
    ``driver_info=None`` is the way).
    """
    params = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    if "driver_info" in params:
        return {"driver_info": None}, ("lib_name", "lib_version")
    if "lib_name" in params:  # pragma: no cover - redis-py 5-7
        return {"lib_name": None, "lib_version": None}, ()
    return {}, ()  # pragma: no cover - redis-py < 5 sends no SETINFO


_NO_SETINFO = _no_setinfo_kwargs()


class _Preconnected(redis.connection.Connection):
    """redis-py's TCP connection, finishing a connect started by :meth:`Master.start_connect`.

    Several masters' TCP connects run at once that way; redis-py then does the rest of
    its connect (``AUTH``, ``SELECT``) on the socket it is given.
    """

    given_sock: socket.socket | None = None
    #: the addresses left to try, in order (see :meth:`Master.start_connect`)
    addresses: list[tuple[Any, ...]] = []  # noqa: RUF012 - always replaced per object
    #: why the last address tried could not be connected to
    last_error: OSError | None = None
    #: what redis-py's connect would have sent and waited for one command at a time
    #: (``AUTH``, ``SELECT``, ``CLIENT SETNAME``): the link sends it ahead of its own
    #: handshake, in the same write (see :meth:`Master.start_connect`)
    handshake: tuple[tuple[str, ...], ...] = ()

    def _connect(self) -> socket.socket:
        sock, self.given_sock = self.given_sock, None
        if sock is None:  # connected again later: redis-py's own way
            return super()._connect()  # type: ignore[no-untyped-call,no-any-return]
        try:
            sock.settimeout(self.socket_timeout)
        except BaseException:
            sock.close()  # nobody else holds it now (a signal's exception, say)
            raise
        return sock


def _pipelined_handshake(
    kwargs: Mapping[str, Any],
) -> tuple[dict[str, Any], tuple[tuple[str, ...], ...]]:
    """Split redis-py's connect commands off connection ``kwargs``, to be sent pipelined.

    Returns the kwargs for a connection that sends nothing on connect, and the commands
    (``AUTH``, ``SELECT``, ``CLIENT SETNAME``) it would have sent. Credentials that are
    not a plain password (a ``credential_provider``, a username without a password) and a
    custom ``redis_connect_func`` stay with redis-py.
    """
    kwargs = dict(kwargs)
    password, username = kwargs.get("password"), kwargs.get("username")
    if (
        kwargs.get("credential_provider") is not None
        or kwargs.get("redis_connect_func") is not None
        or (username and not password)
    ):
        return kwargs, ()
    commands: list[tuple[str, ...]] = []
    if password:
        commands.append(("AUTH", username, password) if username else ("AUTH", password))
    db = int(kwargs.get("db") or 0)
    if db:
        commands.append(("SELECT", str(db)))
    if kwargs.get("client_name"):
        commands.append(("CLIENT", "SETNAME", kwargs["client_name"]))
    kwargs.update(password=None, username=None, db=0, client_name=None)
    return kwargs, tuple(commands)


def _after_fork_in_child() -> None:
    # A parent thread (the heartbeat, connecting) may hold the lock at fork time; the
    # child has no such thread and would wait forever on its first connect.
    global _known_lock
    _known_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _describe_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "localhost"
    port = parts.port or 6379
    path = parts.path if parts.path not in ("", "/") else "/0"
    return f"{parts.scheme}://{host}:{port}{path}"


def _describe_kwargs(kwargs: Mapping[str, Any]) -> str:
    if kwargs.get("unix_socket_path") or kwargs.get("path"):
        return f"unix://{kwargs.get('unix_socket_path') or kwargs.get('path')}"
    scheme = "rediss" if kwargs.get("ssl") or "ssl_keyfile" in kwargs else "redis"
    host = kwargs.get("host", "localhost")
    port = kwargs.get("port", 6379)
    return f"{scheme}://{host}:{port}/{kwargs.get('db', 0)}"


class Master:
    """One independent Redis master: how to connect, and what we know of it."""

    def __init__(
        self,
        name: str,
        connection_class: type[Any],
        connection_kwargs: Mapping[str, Any],
        node_timeout: float,
        identity: tuple[object, ...] | None = None,
    ) -> None:
        self.name = name
        #: which server this is, to refuse one listed twice (it would count twice)
        self.identity = identity or _server_identity(connection_kwargs)
        self._connection_class = connection_class
        self._connection_kwargs = dict(connection_kwargs)
        self._connection_kwargs.update(
            socket_timeout=node_timeout,
            socket_connect_timeout=node_timeout,
            # redis-py retries failed commands by default (seconds per call on a dead
            # master); every call here is bounded by node_timeout, once.
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            protocol=2,
        )
        # Our own reader speaks RESP2; redis-py 8's maintenance notifications need
        # RESP3 and would make every connect fail with protocol 2.
        for name in (*_DROPPED_KWARGS, *_NO_SETINFO[1]):
            self._connection_kwargs.pop(name, None)
        self._connection_kwargs.update(_NO_SETINFO[0])
        #: for start_connect: the connection kwargs without what redis-py would send on
        #: connect, and those commands, to go out with the handshake instead
        self._pipelined = (
            _pipelined_handshake(self._connection_kwargs)
            if connection_class is redis.connection.Connection
            else None
        )
        self.node_timeout = node_timeout
        # Error texts quote connection details (redis-py < 7.4 printed passwords in them):
        # last_error is scrubbed of every secret this process knows.
        remember_secrets_of(self._connection_kwargs)
        #: monotonic time until which we do not try to connect again after a failure
        self.connect_after = 0.0
        #: (pid, token) of the probe thread that tries this master instead of the rounds
        #: (see :mod:`.probe`), or None
        self.probe_ticket: tuple[int, object] | None = None
        #: (pid, thread) of the probe thread that runs for this master, or None
        self.probe_thread: tuple[int, threading.Thread] | None = None
        #: the address (of several the host name resolves to) that last answered a
        #: probe: connects try it first
        self.good_address: object | None = None
        #: set while the master failed to answer a round in time; rounds do not wait on it
        self.down = False
        self.last_error = ""
        self.run_id: str | None = None
        #: the masters of the same client (this one included) and this one's number
        #: among them (from 1), set by :func:`group`
        self.peers: Sequence[Master] = (self,)
        self.number = 1
        #: the master of the same client that turned out to be the same server (same
        #: run_id): this one is refused, never counted towards the quorum
        self.duplicate_of: Master | None = None
        # Log state (see mark_down, mark_up, note_unreached): one line per transition
        # and one summary per LOG_PERIOD at most, however many operations fail.
        self._said_down = False
        self._quiet_until = 0.0
        self._unreached = summary.Summary(LOG_PERIOD)

    def __repr__(self) -> str:
        return f"<Master {self.name}>"

    @property
    def probing(self) -> bool:
        """Whether a probe thread of this process tries the master: rounds do not connect
        to it meanwhile. In a forked child, the parent's watch does not count."""
        ticket = self.probe_ticket
        return ticket is not None and ticket[0] == process.pid()

    @property
    def restarted_at(self) -> float | None:
        """Monotonic time this master was last seen to restart in this process, or None."""
        by_name = _restarted_at.get(self.name)
        by_run_id = _restarted_run_ids.get(self.run_id) if self.run_id else None
        if by_name is None or by_run_id is None:
            return by_name if by_run_id is None else by_run_id
        return max(by_name, by_run_id)

    def new_connection(self) -> Any:
        return self._connection_class(**self._connection_kwargs)

    def prefetch_address(self) -> None:
        """Start looking this master's host name up, without waiting (see
        :func:`.resolve.prefetch`); nothing for masters redis-py connects itself."""
        if self._pipelined is not None:  # the caller skips masters being probed
            kwargs = self._pipelined[0]
            resolve.prefetch(
                kwargs.get("host", "localhost"),
                int(kwargs.get("port", 6379)),
                kwargs.get("socket_type", 0),
                socket.SOCK_STREAM,
            )

    def start_connect(self, timeout: float | None = None) -> tuple[Any, socket.socket] | None:
        """Start a non-blocking TCP connect to this master, for several to run at once.

        Only for plain TCP masters (redis-py's ``Connection``). Returns the socket to wait
        on (writable once connected; then ``SO_ERROR`` tells) and the redis-py connection
        object to finish the connect on once it is, with :meth:`Link.open`, which sends
        ``AUTH``, ``SELECT`` and ``CLIENT SETNAME`` in the same write as its handshake,
        where redis-py would wait for each in turn (so that masters which accept the
        connection but do not answer cost one ``node_timeout`` in all, password or not).
        The socket has the options redis-py would give it. Returns None for masters
        redis-py connects itself (TLS, unix sockets, Sentinel, other connection classes).

        The host name is resolved within ``timeout`` (default ``node_timeout``; see
        :mod:`.resolve`), or its last known addresses serve. The address a probe found
        answering comes first, then the others in the resolver's order: when a connect
        fails, :meth:`connect_next` starts the next one.

        :raises TimeoutError: the name did not resolve in time, and never did before.
        :raises ConnectionError: the name does not resolve, or no address could be
            connected to at once; worded as redis-py words it. Never handed to redis-py,
            whose connect would ask the same resolver again, with no deadline.
        """
        if self._pipelined is None:  # not a plain TCP master
            return None
        kwargs, handshake = self._pipelined
        conn = _Preconnected(**kwargs)  # type: ignore[no-untyped-call]
        conn.handshake = handshake
        try:
            infos = resolve.resolve(
                conn.host,
                conn.port,
                conn.socket_type,
                socket.SOCK_STREAM,
                self.node_timeout if timeout is None else timeout,
            )
        except TimeoutError as exc:
            raise TimeoutError(
                f"{conn.host} did not resolve within the connect's node_timeout "
                f"({self.node_timeout:g}s); the lookup goes on"
            ) from exc
        except socket.gaierror as exc:
            raise ConnectionError(
                f"Error {exc.errno} connecting to {conn.host}:{conn.port}. {exc.strerror}."
            ) from exc
        # A probe may have found an address answering that is not the first (the first
        # one dropping packets would never be connected otherwise).
        good = self.good_address
        conn.addresses = sorted(infos, key=lambda info: info[4] != good) if good else list(infos)
        return conn, self.connect_next(conn)

    def connect_next(self, conn: Any) -> socket.socket:
        """Start a non-blocking connect to the next address of ``conn`` (see
        :meth:`start_connect`) that takes one; raise ``ConnectionError`` when none is left."""
        last = conn.last_error
        while conn.addresses:
            family, socktype, proto, _, address = conn.addresses.pop(0)
            try:
                sock = socket.socket(family, socktype, proto)
            except OSError as exc:
                last = exc
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if conn.socket_keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in conn.socket_keepalive_options.items():
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
                sock.setblocking(False)
                error = sock.connect_ex(address)
            except BaseException:
                sock.close()
                raise
            if error in (0, errno.EINPROGRESS):
                conn.given_sock = sock
                return sock
            sock.close()
            last = OSError(error, os.strerror(error))
        resolve.distrust(conn.host, conn.port)  # the master may have moved
        why = f"Error {last.errno} connecting to" if last is not None else "No address for"
        reason = f" {last.strerror}." if last is not None else ""
        raise ConnectionError(f"{why} {conn.host}:{conn.port}.{reason}")

    def client(self) -> redis.Redis:
        """A plain redis-py client with our timeouts, for operator tools (not the hot path)."""
        kwargs = dict(self._connection_kwargs)
        pool = redis.ConnectionPool(
            connection_class=self._connection_class, max_connections=4, **kwargs
        )
        return redis.Redis(connection_pool=pool)

    def note_run_id(self, run_id: str, now: float, peer: str | None = None) -> None:
        """Record the run_id seen on a fresh connection; a change means a restart.

        ``peer`` is the address the connection reached (``ip:port``, or the socket path):
        the run_id last seen there counts too, so a client that names the server another
        way (``localhost`` for ``127.0.0.1``) still notices that it restarted.

        Raises :class:`DuplicateMaster` when another master of the same client has this
        run_id: both names lead to one server, which must count once. This one is then
        refused (never counted) until it answers with a run_id of its own.
        """
        with _known_lock:
            twin = next(
                (
                    m
                    for m in self.peers
                    if m is not self and m.duplicate_of is None and m.run_id == run_id
                ),
                None,
            )
            was = self.duplicate_of
            self.duplicate_of = twin
            if twin is None:
                previous = (
                    self.run_id
                    or _known_run_ids.get(self.name)
                    or (_known_run_ids.get(peer) if peer else None)
                )
                _known_run_ids[self.name] = run_id
                if peer:
                    _known_run_ids[peer] = run_id
                self.run_id = run_id
        if twin is not None:
            if was is not twin:
                logger.error(
                    "masters #%d (%s) and #%d (%s) are the same server (run_id %s): "
                    "#%d is not counted towards the quorum; list each server once",
                    twin.number,
                    twin.name,
                    self.number,
                    self.name,
                    run_id[:8],
                    self.number,
                )
            raise DuplicateMaster(
                f"the same server as master #{twin.number} ({twin.name}, run_id {run_id[:8]})"
            )
        if was is not None:
            logger.info("master %s is no longer the same server as %s", self.name, was.name)
        if previous is not None and previous != run_id:
            global restarts_seen
            restarts_seen = True
            _restarted_at[self.name] = now
            _restarted_run_ids[run_id] = now
            logger.warning(
                "master %s restarted (run_id %s -> %s): keeping it out of the quorum "
                "for the longest lock TTL in use",
                self.name,
                previous[:8],
                run_id[:8],
            )

    def mark_down(self, error: str) -> None:
        """Note that the master failed; logs a WARNING on the transition only.

        A master that fails again within :data:`LOG_PERIOD` of the last such line (one
        flapping, or refused at every reconnect) is not logged again: the summary of
        :meth:`note_unreached` speaks for it.
        """
        error = scrub(error)
        self.last_error = error
        if self.down:
            return
        self.down = True
        if events.listening("master_state"):
            events.emit("master_state", master=self.name, up=False, error=error)
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + LOG_PERIOD
            self._said_down = True
            logger.warning("master %s is not answering: %s", self.name, error)

    def mark_up(self) -> None:
        """Note that the master answered; logs an INFO line if its failure was logged."""
        if self.down:
            self.down = False
            self._unreached.reset()
            if self._said_down:
                self._said_down = False
                logger.info("master %s answers again", self.name)
            if events.listening("master_state"):
                events.emit("master_state", master=self.name, up=True, error="")
        self.last_error = ""

    def note_unreached(self, error: str) -> None:
        """Count an operation that could not reach this master (or got an error reply).

        Logs at most one WARNING per :data:`LOG_PERIOD`: the first failure, when
        :meth:`mark_down` did not already say it, then a summary of how many operations
        could not reach the master since. Never one line per operation.
        """
        verdict = self._unreached.note()
        if verdict is None:
            return
        first, count = verdict
        if first:
            if not self._said_down:
                logger.warning(
                    "master %s: an operation could not reach it: %s (further failures "
                    "are summarised every %.0f s)",
                    self.name,
                    error,
                    LOG_PERIOD,
                )
        else:
            logger.warning(
                "master %s still %s: %d operations could not reach it in the last %.0f s (%s)",
                self.name,
                "down" if self.down else "failing",
                count,
                LOG_PERIOD,
                error,
            )

    def status(self) -> MasterStatus:
        """What this client knows of the master now (see :meth:`.Redlock.check_masters`)."""
        twin = self.duplicate_of
        return MasterStatus(
            number=self.number,
            name=self.name,
            up=not self.down and twin is None,
            run_id=self.run_id if twin is None else twin.run_id,
            duplicate_of=None if twin is None else twin.number,
            error=self.last_error or None,
        )


@dataclass(frozen=True)
class MasterStatus:
    """One master as a client sees it (:meth:`.Redlock.check_masters`)."""

    #: its position in the client's list of masters, from 1
    number: int
    #: its URL, without password
    name: str
    #: it answered, and is not a duplicate
    up: bool
    run_id: str | None
    #: the number of the master it is the same server as (it is then never counted)
    duplicate_of: int | None
    #: why it is down (or refused), if it is
    error: str | None


def make_master(spec: MasterSpec, node_timeout: float) -> Master:
    """Build a :class:`Master` from a URL, client kwargs, client, or Sentinel spec.

    The spec's secrets (passwords, ``sentinel_kwargs`` passwords, TLS key passwords and
    key files) are remembered, so that no error text we pass on shows them (see
    :func:`celery_redlock.redact.scrub`).
    """
    remember_secrets_of(spec)
    if isinstance(spec, str):
        scheme = urlsplit(spec).scheme
        if scheme not in _ALLOWED_SCHEMES:
            raise ImproperlyConfigured(
                f"master URL {_describe_url(spec)!r} has scheme {scheme!r}; "
                f"accepted schemes: {', '.join(_ALLOWED_SCHEMES)}"
            )
        pool = redis.ConnectionPool.from_url(spec)
        return Master(
            _describe_url(spec), pool.connection_class, pool.connection_kwargs, node_timeout
        )
    if isinstance(spec, redis.Redis):
        pool = spec.connection_pool
        name = _describe_pool(pool)
        return Master(
            name, pool.connection_class, pool.connection_kwargs, node_timeout, client_identity(spec)
        )
    if isinstance(spec, Mapping):
        if "sentinels" in spec:
            return _sentinel_master(spec, node_timeout)
        try:
            client = redis.Redis(**spec)
        except TypeError as exc:
            raise ImproperlyConfigured(
                f"master {_describe_kwargs(spec)!r}: not valid redis.Redis arguments: {exc}"
            ) from None
        pool = client.connection_pool
        return Master(
            _describe_kwargs(spec), pool.connection_class, pool.connection_kwargs, node_timeout
        )
    raise ImproperlyConfigured(
        f"a master must be a redis://, rediss:// or unix:// URL, a dict of redis.Redis "
        f"arguments, a redis.Redis client or a Sentinel spec dict; got {type(spec).__name__}"
    )


def _describe_pool(pool: Any) -> str:
    service = getattr(pool, "service_name", None)
    if service:
        return f"sentinel://{service}"
    return _describe_kwargs(pool.connection_kwargs)


def _sentinel_master(spec: Mapping[str, Any], node_timeout: float) -> Master:
    from redis.sentinel import Sentinel

    kwargs = dict(spec)
    sentinels = [tuple(s) for s in kwargs.pop("sentinels")]
    service = kwargs.pop("service_name", None)
    if not service or not isinstance(service, str):
        raise ImproperlyConfigured(
            "a Sentinel master spec needs 'service_name' (a str) beside 'sentinels'"
        )
    sentinel_kwargs = dict(kwargs.pop("sentinel_kwargs", None) or {})
    sentinel_kwargs.setdefault("socket_timeout", node_timeout)
    sentinel_kwargs.setdefault("socket_connect_timeout", node_timeout)
    # As for the masters: no client-side retries (redis-py retries 3 times with backoff by
    # default, seconds per round with a sentinel down).
    sentinel_kwargs.setdefault("retry", Retry(NoBackoff(), 0))
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)  # type: ignore[no-untyped-call]
    client = sentinel.master_for(service, **kwargs)  # type: ignore[no-untyped-call]
    pool = client.connection_pool
    hosts = ",".join(f"{h}:{p}" for h, p in sentinels)
    name = f"sentinel://{hosts}/{service}"
    identity = sentinel_identity(sentinels, service, kwargs.get("db", 0))
    return Master(name, pool.connection_class, pool.connection_kwargs, node_timeout, identity)


def sentinel_identity(
    sentinels: Iterable[Sequence[object]], service: str, db: object
) -> tuple[object, ...]:
    """What a Sentinel-monitored master is known by before it is reached: its sentinels
    (a set, host names in lower case), its service name and its database. Two deployments
    may both call their master ``mymaster``; the same one listed twice, with its sentinels
    in any order, is refused."""
    addresses = frozenset((str(host).lower(), port) for host, port in sentinels)
    return ("sentinel", addresses, service, db or 0)


def client_identity(client: redis.Redis) -> tuple[object, ...]:
    """What a ``redis.Redis`` client's server is known by before it is reached; for one
    from ``Sentinel.master_for()`` (a pool with no host of its own), its sentinels and
    service (see :func:`sentinel_identity`)."""
    pool = client.connection_pool
    service = getattr(pool, "service_name", None)
    manager = getattr(pool, "sentinel_manager", None)
    if service and manager is not None:
        addresses = []
        for sentinel in getattr(manager, "sentinels", ()):
            kwargs = sentinel.connection_pool.connection_kwargs
            addresses.append((kwargs.get("host") or "localhost", kwargs.get("port") or 26379))
        return sentinel_identity(addresses, service, pool.connection_kwargs.get("db", 0))
    return _server_identity(pool.connection_kwargs)


def _server_identity(kwargs: Mapping[str, Any]) -> tuple[object, ...]:
    db = kwargs.get("db", 0) or 0
    if kwargs.get("path"):
        return ("unix", kwargs["path"], db)
    return ("tcp", str(kwargs.get("host") or "localhost").lower(), kwargs.get("port") or 6379, db)


def refuse_duplicates(masters: Sequence[Master]) -> None:
    """Raise ``ImproperlyConfigured`` when a server is listed twice: it would count twice
    towards the quorum."""
    seen: dict[tuple[object, ...], int] = {}
    for number, master in enumerate(masters, start=1):
        first = seen.setdefault(master.identity, number)
        if first != number:
            raise ImproperlyConfigured(
                f"masters: #{first} and #{number} are the same master ({master.name}); "
                "a master counted twice breaks the quorum"
            )


def group(masters: Sequence[Master]) -> None:
    """Make ``masters`` one client's set: each knows the others and its number among them,
    so that two that turn out to be one server (same run_id) are told apart on connect."""
    peers = tuple(masters)
    for number, master in enumerate(peers, start=1):
        master.peers = peers
        master.number = number


def describe_masters(masters: Sequence[Master]) -> list[str]:
    return [m.name for m in masters]


class Slot:
    """The replies one round expects from one link, filled as they arrive."""

    __slots__ = ("expected", "replies")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.replies: list[object] = []

    @property
    def done(self) -> bool:
        return len(self.replies) >= self.expected


class Link:
    """One connection to one master, used by one thread at a time.

    Replies are matched to requests in order (``outstanding``), so a round that
    gave up on a slow master leaves its slot behind and a later round reads past
    the late replies instead of reconnecting: the connection, and with it the
    order of our commands on that master, survives a slow reply.
    """

    __slots__ = (
        "_conn",
        "_nonblocking",
        "_prefix",
        "in_doubt",
        "master",
        "outstanding",
        "partial",
        "reader",
        "sock",
        "watcher",
    )

    def __init__(self, master: Master) -> None:
        self.master = master
        self._conn: Any = None
        self.sock: socket.socket | None = None
        #: plain TCP and unix sockets run non-blocking: a send or a read after
        #: ``select`` then costs one system call, where a socket with a timeout adds
        #: a ``poll`` before each (TLS sockets keep their timeout)
        self._nonblocking = False
        #: the socket registered with ``poll`` once (plain TCP and unix sockets; None for
        #: TLS, whose decrypted bytes ``poll`` does not see): see :class:`.waiting.Watcher`
        self.watcher: waiting.Watcher | None = None
        self.reader = wire.reader()
        self.outstanding: deque[Slot] = deque()
        #: True while a send or a hand-out of replies is under way: an exception raised in
        #: between (a signal's, asynchronously) leaves the order of replies in doubt (a
        #: command sent without a slot for its reply, a reply read and not handed out),
        #: and the link is closed before it is used again
        self.in_doubt = False
        #: True while a command may be partly written: a master drops a partial command
        #: when the connection closes, but anything written after it would be read as its
        #: arguments
        self.partial = False
        #: names of the connect commands sent ahead of the handshake (see open)
        self._prefix: tuple[str, ...] = ()

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self, now: float, clock: Callable[[], float] = time.monotonic) -> None:
        """Open the connection, read the master's run_id and load our scripts.

        Raises ``OSError`` or a redis error on failure (the caller records it).
        """
        slot = self.open()
        try:
            self.wait_for(slot, "handshake reply", clock)
        except BaseException:
            self.close()
            raise
        self.finish_handshake(slot, now)

    def wait_for(
        self, slot: Slot, what: str = "reply", clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Read until ``slot`` is filled, within the master's ``node_timeout``; raise
        ``TimeoutError`` (naming ``what``) after that, and what reading raises."""
        deadline = clock() + self.master.node_timeout
        while not slot.done:
            remaining = deadline - clock()
            if remaining <= 0 or not self.wait_readable(remaining):
                raise TimeoutError(f"no {what} within {self.master.node_timeout}s")
            self.read_available()

    def open(self, conn: Any = None) -> Slot:
        """Open the connection and send the handshake without waiting for its replies.

        The handshake reads the master's run_id (``INFO server``) and loads our scripts;
        its slot fills as :meth:`read_available` reads, and :meth:`finish_handshake`
        checks it. Several links can so wait on their handshakes together. ``conn`` is a
        connection whose TCP connect completed (:meth:`Master.start_connect`); without
        it, redis-py connects. Raises ``OSError`` or a redis error when the connection
        cannot be opened.
        """
        conn = conn if conn is not None else self.master.new_connection()
        try:
            conn.connect()
            sock = conn._sock
            if sock is None:  # pragma: no cover - redis-py contract
                raise ConnectionError("redis-py returned no socket")
            self._conn, self.sock = conn, sock
            self._nonblocking = not _is_tls(sock)
            if self._nonblocking:
                sock.setblocking(False)
                self.watcher = waiting.watcher(sock.fileno())
            self.reader = wire.reader()
            self.outstanding.clear()
            prefix: tuple[tuple[str, ...], ...] = getattr(conn, "handshake", ())
            self._prefix = tuple(" ".join(c[:2]) if c[0] == "CLIENT" else c[0] for c in prefix)
            commands: list[Sequence[str]] = [*prefix, ("INFO", "server")]
            commands += [("SCRIPT", "LOAD", s.source) for s in ALL_SCRIPTS]
            return self.send(wire.pack(*commands), len(commands))
        except BaseException:
            self.close()
            # Before self._conn is set (an exception inside redis-py's connect, a signal's
            # included), the socket of a connect started ahead is nobody else's to close.
            given = getattr(conn, "given_sock", None)
            if given is not None:
                conn.given_sock = None
                given.close()
            with contextlib.suppress(Exception):
                conn.disconnect()  # a socket redis-py's connect took before it failed
            raise

    def finish_handshake(self, slot: Slot, now: float) -> None:
        """Check the handshake replies of :meth:`open` and note the master's run_id.

        Closes the link and raises ``ConnectionError`` when a reply is an error or not
        what the command returns, and :class:`DuplicateMaster` when another master of
        the same client has this run_id.
        """
        try:
            # Connect commands first: a failed AUTH explains the errors that follow it.
            for name, reply in zip(self._prefix, slot.replies, strict=False):
                if isinstance(reply, ReplyError):
                    raise ConnectionError(f"{name} failed: {reply}")
            info = slot.replies[len(self._prefix)]
            if isinstance(info, ReplyError):
                raise ConnectionError(f"INFO failed: {info}")
            if not isinstance(info, bytes):
                raise ConnectionError(f"INFO answered {info!r:.80}, not a bulk string")
            for reply in slot.replies[len(self._prefix) + 1 :]:
                if isinstance(reply, ReplyError):
                    raise ConnectionError(f"SCRIPT LOAD failed: {reply}")
            run_id = _parse_run_id(info)
            if run_id:
                self.master.note_run_id(run_id, now, _peer_of(self.sock))
        except BaseException:
            self.close()
            raise
        self.master.mark_up()

    def close(self) -> None:
        conn, self._conn, self.sock = self._conn, None, None
        self.watcher = None
        self.in_doubt = self.partial = False
        self.outstanding.clear()
        self.reader = wire.reader()
        if conn is not None:
            # redis-py only shuts the socket down in the process that opened it,
            # so a forked child closing its copy never cuts off the parent.
            with contextlib.suppress(Exception):
                conn.disconnect()

    def forget(self) -> None:
        """Drop the connection without touching the socket (after fork, in the child)."""
        self._conn = None
        self.sock = None
        self.watcher = None
        self.in_doubt = self.partial = False
        self.outstanding.clear()
        self.reader = wire.reader()

    def send(self, payload: bytes, expected: int) -> Slot:
        """Write a payload that will produce ``expected`` replies; return their slot."""
        assert self.sock is not None
        if len(self.outstanding) > MAX_OUTSTANDING:
            raise ConnectionError(f"{len(self.outstanding)} replies overdue")
        self.in_doubt = self.partial = True
        if self._nonblocking:
            try:
                sent = self.sock.send(payload)
            except BlockingIOError:
                sent = 0
            if sent < len(payload):
                self._send_rest(memoryview(payload)[sent:])
        else:
            self.sock.sendall(payload)
        self.partial = False
        slot = Slot(expected)
        self.outstanding.append(slot)
        self.in_doubt = False
        return slot

    def _send_rest(self, rest: memoryview) -> None:
        """Finish a send the socket buffer could not take at once (a large renewal).

        Waits for room at most ``node_timeout`` in all; raises ``TimeoutError``
        then (the caller closes the link: part of a command may have gone out).
        """
        sock = self.sock
        assert sock is not None
        deadline = time.monotonic() + self.master.node_timeout
        while rest:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not waiting.writable([sock], remaining):
                raise TimeoutError(f"could not send within {self.master.node_timeout}s")
            try:
                rest = rest[sock.send(rest) :]
            except BlockingIOError:
                continue

    def buffered(self) -> bool:
        """True when a TLS socket holds decrypted bytes, which ``select`` does not see."""
        return not self._nonblocking and self.sock is not None and _pending(self.sock) > 0

    def wait_readable(self, timeout: float) -> bool:
        sock = self.sock
        if sock is None:
            return False
        if self.buffered():
            return True
        return bool(waiting.readable([sock], max(timeout, 0.0)))

    def read_available(self) -> None:
        """Read what the socket has and hand complete replies to their slots.

        Raises ``ConnectionError`` when the peer closed the connection, and
        ``hiredis.ProtocolError`` when it sent something that is not RESP (the caller
        closes the link: what follows in its buffer cannot be trusted).
        """
        sock = self.sock
        assert sock is not None
        outstanding = self.outstanding
        reader = self.reader
        self.in_doubt = True  # (bytes received and not yet fed in would be lost as well)
        try:
            data = sock.recv(262144)
        except BlockingIOError:
            # Woken for nothing, the reply is not there yet; replies read before a hand-out
            # that an exception interrupted still go to their slots below.
            pass
        else:
            if not data:
                raise ConnectionError("connection closed by the master")
            reader.feed(data)
            if not self._nonblocking:
                while _pending(sock):
                    reader.feed(sock.recv(262144))
        while outstanding:
            reply = reader.gets()
            if reply is False:  # incomplete (RESP2 has no boolean replies)
                break
            slot = outstanding[0]
            slot.replies.append(reply)
            if len(slot.replies) >= slot.expected:
                outstanding.popleft()
        self.in_doubt = False


def _is_tls(sock: socket.socket) -> bool:
    return getattr(sock, "pending", None) is not None


def _pending(sock: socket.socket) -> int:
    pending = getattr(sock, "pending", None)
    return int(pending()) if pending is not None else 0


def _peer_of(sock: socket.socket | None) -> str | None:
    """The address a connection reached, as a key for what we know of that server."""
    if sock is None:
        return None
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    if isinstance(peer, tuple):
        return f"peer:{peer[0]}:{peer[1]}"
    return f"peer:{peer}" if peer else None


def _parse_run_id(info: object) -> str | None:
    if not isinstance(info, bytes):
        return None
    for line in info.split(b"\r\n"):
        if line.startswith(b"run_id:"):
            return line[7:].decode()
    return None
