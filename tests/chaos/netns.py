"""A network namespace for one lock client, with real kernel partitions (root only).

Layout (one namespace per run; names carry the runner's pid, so concurrent runs do not
collide)::

    host namespace                         namespace rlc<pid>
    masters listen on 127.0.0.1 and        the client's view: redis://10.201.1.<i+1>:port
    10.201.1.<i+1> (one /32 each, on the
    host end of the veth); the resource     default route via 10.201.0.1
    on 10.201.0.1
    veth h<pid> 10.201.0.1/24  <=========>  veth n<pid> 10.201.0.2/24

:meth:`Namespace.cut` adds a ``blackhole`` route to a master's address inside the
namespace: the client's packets to it are dropped by its own kernel (established
connections retransmit into the void and time out; new connects fail), while every other
process keeps talking to that master. :meth:`Namespace.heal` removes the routes.

Needs root and ``ip`` (iproute2); :func:`available` says whether this machine can.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["Namespace", "available"]

NET = "10.201"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def available() -> str | None:
    """None when namespaces can be used here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"rlcprobe{os.getpid() % 100000}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Namespace:
    """The namespace, its veth pair and one host address per master."""

    def __init__(self, masters: int) -> None:
        tag = os.getpid() % 100000
        self.name = f"rlc{tag}"
        self.host_if, self.ns_if = f"rlch{tag}", f"rlcn{tag}"
        self.host_ip, self.ns_ip = f"{NET}.0.1", f"{NET}.0.2"
        self.master_ips = [f"{NET}.1.{i + 1}" for i in range(masters)]
        self.cut_ips: set[str] = set()
        self._up = False

    def __enter__(self) -> Namespace:
        self.close()  # a namespace left behind by a crashed run with the same pid
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            for address in self.master_ips:
                _ip("addr", "add", f"{address}/32", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
            _ip("-n", self.name, "route", "add", "default", "via", self.host_ip)
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            _ip("link", "del", self.host_if, check=False)
        with contextlib.suppress(Exception):
            _ip("netns", "del", self.name, check=False)
        self._up = False

    def server_args(self, i: int | None) -> list[str]:
        """redis-server arguments so master ``i`` (None: the resource) is reachable from
        the namespace too."""
        address = self.host_ip if i is None else self.master_ips[i]
        return ["--bind", "127.0.0.1", address, "--protected-mode", "no"]

    def prefix(self) -> list[str]:
        """Command prefix running a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, masters: Sequence[int]) -> None:
        for i in masters:
            address = self.master_ips[i]
            _ip("-n", self.name, "route", "add", "blackhole", f"{address}/32")
            self.cut_ips.add(address)

    def heal(self) -> None:
        for address in sorted(self.cut_ips):
            _ip("-n", self.name, "route", "del", "blackhole", f"{address}/32", check=False)
        self.cut_ips.clear()
