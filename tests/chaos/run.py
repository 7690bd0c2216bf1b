"""One chaos run: masters, the protected resource, proxies, agents, the fault injector.

A :class:`Run` starts everything for one scenario and variant, hands the scenario an
:class:`Injector` (every fault it applies is recorded in the history before and after),
then stops the agents, appends the fenced store's own log and the counters' final values
to the history, and checks it (:func:`tests.chaos.checker.check`).

Variants (the negative controls run the same scenario, same faults):

``correct``   the real lock, fencing on
``nofence``   the real lock, the store accepting stale fences (fencing off)
``broken``    :class:`~tests.chaos.instrument.BrokenRedlock` (plain DEL, no validity
              check, no renewal) and fencing off
``broken+fence`` the broken lock, fencing on: the store must still refuse every stale write
``noquarantine`` the real lock with ``restart_quarantine=0`` (for the restart scenario)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from celery_redlock.testing import Masters, RedisServer, start_masters, wait_for

from . import checker
from .history import History, load
from .netns import Namespace
from .proxy import ProxyProcess
from .resource import counters, read_log

__all__ = ["VARIANTS", "Config", "Injector", "Run"]

REPO = Path(__file__).resolve().parents[2]

VARIANTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "correct": ("correct", "on", ()),
    "nofence": ("correct", "off", ()),
    "broken": ("broken", "off", ()),
    "broken+fence": ("broken", "on", ()),
    "noquarantine": ("correct", "on", ("--quarantine", "0")),
}


@dataclasses.dataclass
class Config:
    masters: int = 3
    agents: int = 3
    keys: Sequence[str] = ("hot",)
    ttl: float = 1.0
    node_timeout: float = 0.1
    #: agents stop when the scenario is over (stop file); this is only a safety net
    duration: float = 120.0
    cs_ms: str = "5,40"
    gap_ms: str = "0,20"
    long_cs: float = 0.15
    blocking: float = 2.0
    persistence: str = "none"
    proxies: bool = False
    #: per agent index, extra command-line arguments
    agent_args: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    #: slack on every time gate (ms): a loaded 2-core machine delays wake-ups
    slack_ms: float = 150.0
    #: how many agents start with the run (the rest can be started by the scenario)
    start_agents: int | None = None
    #: master URLs per agent (netns runs); default: direct, or through the proxies
    agent_urls: Callable[[Run, int], list[str]] | None = None
    #: prefix for agent command lines (``ip netns exec ns``)
    agent_prefix: Callable[[Run, int], list[str]] | None = None
    resource_url: Callable[[Run], str] | None = None
    master_args: Sequence[str] = ()
    #: agents that run in a network namespace of their own (root only, see netns.py)
    netns_agents: Sequence[int] = ()


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid`` (a worker and its pool children)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


class Agent:
    """A child process in its own process group (a lock client, a worker, a beat)."""

    def __init__(
        self,
        index: int,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        self.name = name
        self.log_path = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env={
                    **os.environ,
                    "PYTHONWARNINGS": "ignore",
                    "PYTHONUNBUFFERED": "1",
                    **(env or {}),
                },
            )
        self.pid = self.popen.pid
        self.stopped = False

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int, *, group: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)


class Tail:
    """Reads the history file incrementally (for faults triggered by what agents do)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = []
        for raw in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                new.append(json.loads(raw))
        self.events.extend(new)
        return new


class Injector:
    """The fault injector: every fault is recorded (``fault_start``/``fault_end``, ``kill``)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.h = History(run.history_path, "injector")
        self.tail = Tail(run.history_path)
        self._threads: list[threading.Thread] = []

    # -- waiting on the history --

    def wait_event(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 20.0,
        what: str = "",
        *,
        new_only: bool = True,
    ) -> dict[str, Any]:
        """The first history event matching ``predicate`` (written from now on, by default)."""
        self.tail.poll()
        seen = len(self.tail.events) if new_only else 0
        deadline = time.monotonic() + timeout
        while True:
            for e in self.tail.events[seen:]:
                if predicate(e):
                    return e
            seen = len(self.tail.events)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no history event {what or predicate} within {timeout:g}s")
            time.sleep(0.005)
            self.tail.poll()

    def holder_in_cs(
        self, timeout: float = 20.0, among: Sequence[int] | None = None, min_ms: int = 5
    ) -> tuple[Agent, dict[str, Any]]:
        """Wait until an agent (of ``among``) starts working in a critical section for at
        least ``min_ms``; return it and its ``work`` event."""
        names = {a.name: a for a in self.run.agents if among is None or a.index in among}
        e = self.wait_event(
            lambda e: e["ev"] == "work" and e["proc"] in names and e.get("ms", 0) >= min_ms,
            timeout,
            f"work >= {min_ms} ms by {sorted(names)}",
        )
        return names[e["proc"]], e

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    # -- processes --

    def kill_agent(self, agent: Agent) -> None:
        self.h.write("kill", target=agent.name, target_pid=agent.pid)
        agent.signal(signal.SIGKILL)
        agent.popen.wait(timeout=10)

    def pause_agent(self, agent: Agent, seconds: float) -> None:
        self.h.write("fault_start", fault="sigstop", target=agent.name)
        agent.signal(signal.SIGSTOP)
        agent.stopped = True
        time.sleep(seconds)
        agent.signal(signal.SIGCONT)
        agent.stopped = False
        self.h.write("fault_end", fault="sigstop", target=agent.name)

    def resume_agent(self, agent: Agent) -> None:
        agent.signal(signal.SIGCONT)
        agent.stopped = False
        self.h.write("fault_end", fault="sigstop", target=agent.name)

    # -- masters --

    def master(self, i: int) -> RedisServer:
        return self.run.masters[i]

    def start_fault(self, fault: str, target: str, **detail: Any) -> None:
        self.h.write("fault_start", fault=fault, target=target, **detail)

    def end_fault(self, fault: str, target: str, **detail: Any) -> None:
        self.h.write("fault_end", fault=fault, target=target, **detail)

    def kill_master(self, i: int) -> None:
        self.h.write("fault_start", fault="kill_master", target=f"m{i}")
        self.master(i).kill()

    def restart_master(self, i: int, *, keep_data: bool) -> None:
        server = self.master(i)
        if server.alive:
            server.kill()
        if not keep_data:
            server.wipe_data()
        server.start()
        self.h.write("fault_end", fault="kill_master", target=f"m{i}", keep_data=keep_data)

    def pause_master(self, i: int) -> None:
        self.h.write("fault_start", fault="sigstop_master", target=f"m{i}")
        self.master(i).pause()

    def resume_master(self, i: int) -> None:
        self.master(i).resume()
        self.h.write("fault_end", fault="sigstop_master", target=f"m{i}")

    def quorum_lost(self) -> None:
        self.h.write("quorum_lost")

    def quorum_back(self) -> None:
        self.h.write("quorum_back")

    def client(self, i: int, timeout: float = 5.0) -> redis.Redis:
        return self.master(i).client(socket_timeout=timeout, socket_connect_timeout=timeout)

    def client_pause(self, i: int, seconds: float) -> None:
        self.h.write("fault_start", fault="client_pause", target=f"m{i}", ms=int(seconds * 1000))
        with self.client(i) as c:
            c.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        time.sleep(seconds)
        self.h.write("fault_end", fault="client_pause", target=f"m{i}")

    def debug_sleep(self, i: int, seconds: float) -> None:
        """``DEBUG SLEEP`` blocks the master's only thread; sent from a helper thread."""
        self.h.write("fault_start", fault="debug_sleep", target=f"m{i}", s=seconds)
        with self.client(i, timeout=seconds + 5) as c:
            c.execute_command("DEBUG", "SLEEP", f"{seconds:g}")
        self.h.write("fault_end", fault="debug_sleep", target=f"m{i}")

    def in_background(self, fn: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=60)

    # -- network namespaces (root) --

    def cut(self, masters: Sequence[int]) -> None:
        """Blackhole routes from the namespaced client to ``masters`` (kernel drops)."""
        assert self.run.netns is not None
        self.h.write(
            "fault_start", fault="netns_blackhole", target=f"ns->m{','.join(map(str, masters))}"
        )
        self.run.netns.cut(masters)

    def heal(self) -> None:
        assert self.run.netns is not None
        self.run.netns.heal()
        self.h.write("fault_end", fault="netns_blackhole", target="ns")

    # -- proxies --

    def proxy(
        self, agent: int | None, master: int | Sequence[int], mode: str, *params: float
    ) -> None:
        """Set the mode of agent ``agent``'s proxies to ``master`` (``None``: every agent)."""
        masters = [master] if isinstance(master, int) else list(master)
        n = self.run.config.masters
        agents = range(len(self.run.agent_names)) if agent is None else [agent]
        indices = [a * n + m for a in agents for m in masters]
        who = "*" if agent is None else self.run.agent_names[agent]
        label = f"{who}->m{','.join(map(str, masters))}"
        if mode == "pass":
            self.h.write("fault_end", fault="proxy", target=label)
        else:
            self.h.write("fault_start", fault=f"proxy_{mode}", target=label, params=list(params))
        assert self.run.proxy is not None
        self.run.proxy.set(indices, mode, *params)


class Run:
    """Everything of one scenario run; use as a context manager."""

    def __init__(self, workdir: Path, config: Config, variant: str = "correct") -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.variant = variant
        self.mode, self.fencing, self.variant_args = VARIANTS[variant]
        self.history_path = workdir / "history.jsonl"
        self.history_path.touch()
        self.stop_file = workdir / "stop"
        self.masters: Masters = Masters()
        self.resource: RedisServer | None = None
        self.proxy: ProxyProcess | None = None
        self.agents: list[Agent] = []
        self.agent_names = [f"a{i}" for i in range(config.agents)]
        self.injector: Injector | None = None
        self.events: list[dict[str, Any]] = []
        self.netns: Namespace | None = None

    def __enter__(self) -> Run:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        c = self.config
        if c.netns_agents:
            self.netns = Namespace(c.masters).__enter__()
            ns = self.netns
            self.masters = Masters()
            for i in range(c.masters):
                self.masters.append(
                    RedisServer(
                        persistence=c.persistence,  # type: ignore[arg-type]
                        extra_args=[*c.master_args, *ns.server_args(i)],
                    )
                )
            self.resource = RedisServer(extra_args=[*c.master_args, *ns.server_args(None)])
        else:
            self.masters = start_masters(
                c.masters,
                persistence=c.persistence,
                extra_args=c.master_args,  # type: ignore[arg-type]
            )
            self.resource = RedisServer(extra_args=c.master_args)
        if c.proxies:
            upstreams = [(m.host, m.port) for _ in range(c.agents) for m in self.masters]
            self.proxy = ProxyProcess(upstreams, log=self.workdir / "proxy.log")
        self.injector = Injector(self)
        for i in range(c.agents if c.start_agents is None else c.start_agents):
            self.spawn(i)

    def master_urls(self, agent: int) -> list[str]:
        c = self.config
        if c.agent_urls is not None:
            return c.agent_urls(self, agent)
        if self.netns is not None and agent in c.netns_agents:
            return [
                f"redis://{ip}:{m.port}/0"
                for ip, m in zip(self.netns.master_ips, self.masters, strict=True)
            ]
        if self.proxy is not None:
            n = c.masters
            return self.proxy.urls()[agent * n : (agent + 1) * n]
        return self.masters.urls

    def spawn(self, index: int, *, extra: Sequence[str] = ()) -> Agent:
        c = self.config
        name = self.agent_names[index]
        assert self.resource is not None
        resource = c.resource_url(self) if c.resource_url else self.resource.url
        if self.netns is not None and index in c.netns_agents:
            resource = f"redis://{self.netns.host_ip}:{self.resource.port}/0"
        argv = [
            sys.executable,
            "-m",
            "tests.chaos.agent",
            "--name",
            name,
            "--history",
            str(self.history_path),
            "--masters",
            ",".join(self.master_urls(index)),
            "--resource",
            resource,
            "--keys",
            ",".join(c.keys),
            "--ttl",
            f"{c.ttl:g}",
            "--node-timeout",
            f"{c.node_timeout:g}",
            "--blocking",
            f"{c.blocking:g}",
            "--duration",
            f"{c.duration:g}",
            "--stop-file",
            str(self.stop_file),
            "--cs-ms",
            c.cs_ms,
            "--gap-ms",
            c.gap_ms,
            "--long-cs",
            f"{c.long_cs:g}",
            "--mode",
            self.mode,
            "--fencing",
            self.fencing,
            "--seed",
            str(1000 + index),
            *self.variant_args,
            *c.agent_args.get(index, []),
            *extra,
        ]
        if c.agent_prefix is not None:
            argv = [*c.agent_prefix(self, index), *argv]
        if self.netns is not None and index in c.netns_agents:
            argv = [*self.netns.prefix(), *argv]
        agent = Agent(index, name, argv, self.workdir / f"{name}.log")
        assert self.injector is not None
        self.injector.h.write("spawn", target=name, target_pid=agent.pid)
        self.agents = [a for a in self.agents if a.index != index] + [agent]
        return agent

    def agent(self, index: int) -> Agent:
        return next(a for a in self.agents if a.index == index)

    def stop_agents(self, timeout: float = 30.0) -> None:
        self.stop_file.touch()
        for agent in self.agents:
            if agent.stopped:
                agent.signal(signal.SIGCONT)
                agent.stopped = False
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for agent in self.agents:
            if agent.alive:
                assert self.injector is not None
                self.injector.h.write("hung", target=agent.name)
                agent.signal(signal.SIGKILL)
                agent.popen.wait(timeout=10)

    def wait_agents_done(self, timeout: float) -> None:
        """Let the agents run out their ``duration`` (then they exit by themselves)."""
        wait_for(
            lambda: not any(a.alive for a in self.agents),
            timeout=timeout,
            interval=0.1,
            message="agents did not finish",
        )

    def collect(self) -> list[dict[str, Any]]:
        """Append the store's log and the counters' final values; load the history."""
        assert self.resource is not None
        assert self.injector is not None
        h = History(self.history_path, "store")
        with self.resource.client() as conn:
            t = time.monotonic_ns()
            for entry in read_log(conn):
                h.write_at(entry.pop("t"), "store", **entry)
            for key, value in counters(conn).items():
                h.write_at(t, "counter_final", key=key, value=value)
        h.close()
        self.events = load(self.history_path)
        return self.events

    def check(self, **kwargs: Any) -> checker.Report:
        if not self.events:
            self.collect()
        report = checker.check(self.events, **kwargs)
        (self.workdir / "report.txt").write_text(report.format())
        return report

    def exit_codes(self) -> dict[str, int | None]:
        return {a.name: a.popen.returncode for a in self.agents}

    def logs(self) -> str:
        out = []
        for agent in self.agents:
            with contextlib.suppress(FileNotFoundError):
                text = agent.log_path.read_text(errors="replace").strip()
                if text:
                    out.append(f"--- {agent.name} (exit {agent.popen.returncode}):\n{text[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for agent in self.agents:
            if agent.alive:
                agent.signal(signal.SIGCONT)
                agent.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.popen.wait(timeout=10)
        if self.injector is not None:
            self.injector.join()
            self.injector.h.close()
        if self.proxy is not None:
            self.proxy.close()
        for server in self.masters:
            if server.paused:
                server.resume()
        self.masters.stop_all()
        if self.resource is not None:
            self.resource.close()
        if self.netns is not None:
            self.netns.close()
