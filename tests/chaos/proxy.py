"""A small TCP fault proxy between lock clients and masters (asyncio, its own process).

``python -m tests.chaos.proxy`` reads one JSON line on stdin: a list of upstream
``[host, port]``; it listens on one free loopback port per upstream, prints the ports as a
JSON line, then obeys commands, one per line on stdin, answering ``ok``:

``<index|*> pass``                      forward both ways
``<index|*> delay <up_s> <down_s>``     hold each chunk that long (order is kept)
``<index|*> blackhole``                 forward nothing, either way; bytes are kept and
                                        delivered in order on heal (like TCP
                                        retransmitting across a partition that heals)
``<index|*> drop_replies``              requests reach the master (and run there); a reply
                                        is thrown away and the connection cut, as when a
                                        reply is lost and the connection dies with it
``<index|*> reset``                     close every connection now (mode unchanged)
``<index|*> garbage``                   nothing reaches the master; every request chunk is
                                        answered ``HTTP/1.1 400 Bad Request`` (a port that
                                        is not Redis, or a master behind a broken middlebox)
``<index|*> refuse``                    close every connection now and every new one at
                                        once (the master went away; nothing is delivered
                                        late, unlike ``blackhole``)

Per connection, named by the client's own port (``sock.getsockname()[1]`` on the client
side), so that one client connection can be slowed or stopped while the others flow and
commands on two connections to one master reorder:

``@<client_port> hold <up|down>``       keep that direction's bytes (in order) until ``flow``
``@<client_port> flow``                 deliver what ``hold`` kept (in one write), and flow
                                        from now on; answers once the master replied to
                                        it (at most 1 s)
``@<client_port> delay <up_s> <down_s>`` this connection's own delay (0 0: none)
``@<client_port> reset``                close it; bytes still held die with it

A command for a client port the proxy does not know is answered ``error unknown
connection``.

A proxy never *drops* bytes of a connection it keeps open: the client matches replies to
requests by order, so a silently dropped reply would hand it the wrong replies later, a
thing TCP never does.

:class:`ProxyProcess` starts and drives one from a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ProxyProcess"]

REPO = Path(__file__).resolve().parents[2]
#: What ``garbage`` mode answers instead of Redis.
GARBAGE = b"HTTP/1.1 400 Bad Request\r\n\r\n"


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: _Proxy, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.cr, self.cw = cr, cw
        self.ur: asyncio.StreamReader | None = None
        self.uw: asyncio.StreamWriter | None = None
        self.queues = {
            "up": asyncio.Queue[tuple[float, bytes]](),
            "down": asyncio.Queue[tuple[float, bytes]](),
        }
        self.last_due = {"up": 0.0, "down": 0.0}
        #: per-connection control (see the module docstring): ``flowing[d]`` is clear
        #: while direction ``d`` is held; ``delay`` overrides the listener's delay
        self.flowing = {"up": asyncio.Event(), "down": asyncio.Event()}
        for event in self.flowing.values():
            event.set()
        self.delay: dict[str, float] | None = None
        self.client_port = int(cw.get_extra_info("peername")[1])
        #: chunks read from the master, and that count when requests were last written to
        #: it: ``flow`` waits for the master's answer to what it delivers
        self.down_reads = 0
        self.down_reads_at_write = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        try:
            self.ur, self.uw = await asyncio.open_connection(*self.proxy.upstream)
        except OSError:
            self.close()
            return
        self.tasks = [
            asyncio.ensure_future(self._pump(self.cr, "up")),
            asyncio.ensure_future(self._pump(self.ur, "down")),
            asyncio.ensure_future(self._send("up", self.uw)),
            asyncio.ensure_future(self._send("down", self.cw)),
        ]
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, direction: str) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if direction == "down":
                    self.down_reads += 1
                mode = self.proxy.mode
                if direction == "down" and mode == "drop_replies":
                    break  # the reply is lost, and the connection with it
                now = time.monotonic()
                if self.delay is not None:
                    delay = self.delay[direction]
                else:
                    delay = self.proxy.delay[direction] if mode == "delay" else 0.0
                due = max(now + delay, self.last_due[direction])
                self.last_due[direction] = due
                if direction == "up" and mode == "garbage":
                    # Answered in the reply stream's order, behind replies still queued.
                    self.queues["down"].put_nowait((due, GARBAGE))
                    continue
                self.queues[direction].put_nowait((due, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        self.close()

    async def _send(self, direction: str, writer: asyncio.StreamWriter) -> None:
        queue = self.queues[direction]
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                while self.proxy.mode == "blackhole" or not self.flowing[direction].is_set():
                    await self.proxy.healed.wait()
                    await self.flowing[direction].wait()
                # What waited behind a hold goes out in one write, as one read for the
                # master, which then answers it all at once (see flushed()).
                now = time.monotonic()
                while not queue.empty() and queue._queue[0][0] <= now:  # type: ignore[attr-defined]
                    data += queue.get_nowait()[1]
                if direction == "up":
                    self.down_reads_at_write = self.down_reads
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            self.close()

    async def flushed(self, timeout: float = 1.0) -> None:
        """Return once what was held has been delivered and the master has answered it
        (or ``timeout`` passed: a stopped master answers nothing)."""
        end = time.monotonic() + timeout
        had_up = not self.queues["up"].empty()
        while time.monotonic() < end and not self.closed:
            drained = self.queues["up"].empty() and self.queues["down"].empty()
            if drained and (not had_up or self.down_reads > self.down_reads_at_write):
                return
            await asyncio.sleep(0.001)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.cw, self.uw):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
        for task in self.tasks:
            task.cancel()
        self.proxy.links.discard(self)


class _Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.delay = {"up": 0.0, "down": 0.0}
        self.healed = asyncio.Event()
        self.healed.set()
        self.links: set[_Link] = set()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "refuse":
            writer.transport.abort()
            return
        link = _Link(self, reader, writer)
        self.links.add(link)
        await link.run()

    def set_mode(self, mode: str, *params: str) -> None:
        if mode == "reset":
            for link in list(self.links):
                link.close()
            return
        if mode not in ("pass", "delay", "blackhole", "drop_replies", "garbage", "refuse"):
            raise ValueError(mode)
        if mode == "refuse":
            for link in list(self.links):
                link.close()
        self.mode = mode
        if mode == "delay":
            self.delay = {"up": float(params[0]), "down": float(params[1])}
        if mode == "blackhole":
            self.healed.clear()
        else:
            self.healed.set()


def _control_link(proxies: Sequence[_Proxy], port: int, mode: str, *params: str) -> _Link:
    """Apply a per-connection command to the connection whose client port is ``port``."""
    link = next((lk for p in proxies for lk in p.links if lk.client_port == port), None)
    if link is None:
        raise ValueError("unknown connection")
    if mode == "hold":
        if params[0] not in link.flowing:
            raise ValueError(f"direction {params[0]!r}")
        link.flowing[params[0]].clear()
    elif mode == "flow":
        for event in link.flowing.values():
            event.set()
    elif mode == "delay":
        up, down = float(params[0]), float(params[1])
        link.delay = None if up == down == 0 else {"up": up, "down": down}
    elif mode == "reset":
        link.close()
    else:
        raise ValueError(mode)
    return link


def _say(line: str) -> None:
    """One line to the test that drives this process (stdout is the control channel)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    upstreams = json.loads(await reader.readline())
    proxies = [_Proxy((h, int(p))) for h, p in upstreams]
    ports = [await p.start() for p in proxies]
    _say(json.dumps(ports))
    while True:
        line = (await reader.readline()).decode().strip()
        if not line:
            break
        target, mode, *params = line.split()
        try:
            if target.startswith("@"):
                link = _control_link(proxies, int(target[1:]), mode, *params)
                if mode == "flow":
                    await link.flushed()
                _say("ok")
                continue
            chosen = proxies if target == "*" else [proxies[int(i)] for i in target.split(",")]
            for proxy in chosen:
                proxy.set_mode(mode, *params)
        except (ValueError, IndexError) as exc:
            _say(f"error {exc}")
            continue
        _say("ok")
    for proxy in proxies:
        for link in list(proxy.links):
            link.close()
        if proxy.server is not None:
            proxy.server.close()


class ProxyProcess:
    """One proxy process in front of ``upstreams``; ``ports[i]`` leads to ``upstreams[i]``."""

    def __init__(self, upstreams: Sequence[tuple[str, int]], log: Path | None = None) -> None:
        self._log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.proxy"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write((json.dumps([list(u) for u in upstreams]) + "\n").encode())
        self.proc.stdin.flush()
        line = self._answer(timeout=30)
        if not line:
            self.close()
            raise RuntimeError("proxy process did not start")
        self.ports: list[int] = json.loads(line)

    def _answer(self, timeout: float = 10.0) -> str:
        """The proxy's next line, or "" when it says nothing within ``timeout``."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().decode().strip() if ready else ""

    def urls(self, db: int = 0) -> list[str]:
        return [f"redis://127.0.0.1:{port}/{db}" for port in self.ports]

    def set(self, target: int | str | Sequence[int], mode: str, *params: float) -> None:
        if isinstance(target, int):
            which = str(target)
        elif isinstance(target, str):
            which = target
        else:
            which = ",".join(str(i) for i in target)
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        line = " ".join([which, mode, *(f"{p:g}" for p in params)])
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        answer = self._answer()
        if answer != "ok":
            raise RuntimeError(f"proxy refused {line!r}: {answer!r}")

    def connection(self, client_port: int, mode: str, *params: str | float) -> bool:
        """Control one connection (``hold``/``flow``/``delay``/``reset``, see above).

        Returns False when the proxy does not know a connection from ``client_port``
        (closed, or never made).
        """
        assert self.proc.stdin is not None
        line = " ".join([f"@{client_port}", mode, *(str(p) for p in params)])
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        answer = self._answer()
        if answer == "error unknown connection":
            return False
        if answer != "ok":
            raise RuntimeError(f"proxy refused {line!r}: {answer!r}")
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]


if __name__ == "__main__":
    asyncio.run(_serve())
