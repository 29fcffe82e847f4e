"""Hosts for the multi-host tests, made of Linux network namespaces on this machine.

One namespace holds Redis ("r"); every daemon host has a namespace of its own,
linked to r by a veth pair of its own and to nothing else: host i is
198.18.i.2 and reaches Redis at 198.18.i.1. The daemons share no network
with each other or with this machine's own namespace, to which nothing is
added (no address, no route): what crosses between them crosses through
Redis. 198.18.0.0/15 is the range set aside for benchmarking network
equipment (RFC 2544); here it exists only inside these namespaces. The test
process reaches the daemons and Redis through Unix sockets, which are files
and so cross namespaces.

Making namespaces needs root (CAP_SYS_ADMIN) and iproute2's `ip`; where they
cannot be made, `hosts` skips, saying why, and the same tests run on separate
processes of one namespace instead.
"""
from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest

NET = "198.18"


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


class Hosts:
    """Namespaces "r" (Redis) and one per name in `names`, each linked to r."""

    def __init__(self, names: list[str]):
        tag = uuid.uuid4().hex[:6]
        self.ns = {n: f"kvstore-{tag}-{n}" for n in ["r", *names]}
        self.index = {n: i for i, n in enumerate(names, 1)}
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for n, i in self.index.items():
                h, r = f"kv{tag}{i}h", f"kv{tag}{i}r"      # made inside the namespaces: never in ours
                _ip("-n", self.ns[n], "link", "add", h, "type", "veth", "peer", "name", r, "netns", self.ns["r"])
                _ip("-n", self.ns[n], "addr", "add", f"{NET}.{i}.2/24", "dev", h)
                _ip("-n", self.ns["r"], "addr", "add", f"{NET}.{i}.1/24", "dev", r)
                _ip("-n", self.ns[n], "link", "set", h, "up")
                _ip("-n", self.ns["r"], "link", "set", r, "up")
        except BaseException:
            self.remove()
            raise

    def redis_address(self, name: str) -> str:
        """The address at which host `name` reaches Redis."""
        return f"{NET}.{self.index[name]}.1"

    def run_in(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a program on host `name`."""
        return "ip", "netns", "exec", self.ns[name]

    def remove(self) -> None:
        """Every namespace made (their veth pairs go with them)."""
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    """Hosts "a" and "b" beside the Redis namespace "r"; skips where namespaces cannot be made."""
    if shutil.which("ip") is None:
        pytest.skip("no iproute2 `ip` here: the daemons run as separate processes of one namespace instead")
    try:
        h = Hosts(["a", "b"])
    except OSError as e:
        pytest.skip(f"network namespaces cannot be made here ({e}): the daemons run as separate processes "
                    "of one namespace instead")
    yield h
    h.remove()
