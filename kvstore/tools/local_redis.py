"""A local Redis Cluster of N redis-server processes on free ports, for the Redis
tier's tests and benchmarks (docs/scale.md, What Redis Cluster shards): each
node gets an equal range of the 16384 slots (CLUSTER ADDSLOTSRANGE), a config
epoch of its own, and meets the first node (CLUSTER MEET); the cluster is up
when every node reports cluster_state:ok and knows all N. No redis-cli needed.

python -m kvstore.tools.local_redis [--nodes 3]    # starts one, prints its URL, Ctrl-C stops it

The nodes keep serving their slots while another node is down
(cluster-require-full-coverage no, cluster-allow-reads-when-down yes): what
docs/scale.md advises for the shared tier, where losing a shard without a
replica should lose only its share of the blocks.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

SLOTS = 16384


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port: int, *args: str, timeout: float = 5.0) -> str:
    """One command to a node, its reply as text (redis-py: any RESP reply)."""
    import redis
    with redis.Redis(port=port, socket_timeout=timeout, decode_responses=True) as r:
        return r.execute_command(*args)


class LocalCluster:
    """N primaries on 127.0.0.1, no replicas, no persistence. url: the first
    node's (any node's URL reaches the whole cluster)."""

    def __init__(self, directory: str, nodes: int = 3, binary: str | None = None, maxmemory: str = "256mb",
                 extra: tuple = ()):
        if not 1 <= nodes <= 64:
            raise ValueError(f"nodes must be in [1, 64], got {nodes}")
        self.binary = binary or shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.dir, self.ports = directory, [free_port() for _ in range(nodes)]
        self.bus_ports = [free_port() for _ in range(nodes)]      # not port + 10000: that may pass 65535
        self.procs: list[subprocess.Popen | None] = [None] * nodes
        self.maxmemory, self.extra = maxmemory, extra
        try:
            for i in range(nodes):
                self.start(i)
            self._form()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, i: int) -> None:
        port = self.ports[i]
        self.procs[i] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-port", str(self.bus_ports[i]),
             "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no",
             "--cluster-allow-reads-when-down", "yes", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait(lambda: _call(port, "PING", timeout=0.5), f"node {i} (port {port}) to answer PING", i)

    def _form(self) -> None:
        n = len(self.ports)
        for i, port in enumerate(self.ports):
            _call(port, "CLUSTER", "SET-CONFIG-EPOCH", str(i + 1))     # distinct: no epoch collisions to settle
            _call(port, "CLUSTER", "ADDSLOTSRANGE", str(i * SLOTS // n), str((i + 1) * SLOTS // n - 1))
        for port, bus in zip(self.ports[1:], self.bus_ports[1:]):
            _call(self.ports[0], "CLUSTER", "MEET", "127.0.0.1", str(port), str(bus))

        def ok() -> bool:
            for port in self.ports:
                info = dict(line.split(":", 1) for line in _call(port, "CLUSTER", "INFO").split()
                            if ":" in line)
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != n \
                        or int(info.get("cluster_slots_ok", 0)) != SLOTS:
                    return False
            return True
        self._wait(ok, f"the {n} nodes to form a cluster")

    def _wait(self, cond, what: str, i: int | None = None, timeout: float = 30.0) -> None:
        import redis
        deadline = time.monotonic() + timeout
        while True:
            try:
                if cond():
                    return
            except (redis.RedisError, OSError):
                pass
            if i is not None and self.procs[i].poll() is not None:
                raise RuntimeError(f"redis-server exited waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def client(self, i: int):
        import redis
        return redis.Redis(port=self.ports[i], socket_timeout=5)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--redis-server", default=None, metavar="PATH")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-") as d:
        c = LocalCluster(d, args.nodes, args.redis_server)
        print(f"{args.nodes}-node Redis Cluster: {c.url} (ports {' '.join(map(str, c.ports))}); Ctrl-C stops it")
        try:
            while all(x.poll() is None for x in c.procs):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            c.stop()


if __name__ == "__main__":
    main()
