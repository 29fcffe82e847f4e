"""A real redis-server for the Redis tier's tests: a free local port, its
files in a temp directory, started, killed and restarted on the same port.

`make test` installs redis-server (apt) where it is missing. Without it the
tests that need one skip, saying so, except under CI=true, where they fail:
CI must run them. KVSTORE_TEST_REDIS_SERVER names another server binary to run
them against, e.g. a valkey-server (scripts/valkey_for_device.sh)."""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def server_binary() -> str:
    """The server the tests run: KVSTORE_TEST_REDIS_SERVER, or redis-server on PATH
    (skips, or fails under CI=true, where there is none)."""
    binary = os.environ.get("KVSTORE_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        why = "redis-server is not installed (make test installs it: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why + "; CI must run the Redis tier tests")
        pytest.skip(why)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """run_in: a command prefix that runs the server elsewhere (another network
    namespace, tests/tiers/netns.py), listening on the addresses in `bind`.
    Wherever it runs, it also listens on a Unix socket in `directory`, through
    which this process checks that it is up and talks to it (client())."""

    def __init__(self, directory: str, appendonly: bool, extra: tuple = (), run_in: tuple = (),
                 bind: tuple = ("127.0.0.1",), password: str | None = None):
        self.binary = server_binary()
        # A namespace of its own has every port free.
        self.dir, self.port, self.bind = directory, free_port() if not run_in else 6379, bind
        self.sock, self.password = os.path.join(directory, "redis.sock"), password
        if password:     # the default user's, and a user "kv" that may touch kvstore keys only
            extra = ("--requirepass", password, "--user", "kv", "on", ">" + password, "~kvstore:*", "+@all", *extra)
        # fsync every write: a kill -9 then loses nothing of what was acknowledged.
        self.args = [*run_in, self.binary, "--port", str(self.port), "--bind", *bind, "--save", "",
                     "--unixsocket", self.sock, "--unixsocketperm", "700",
                     "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
                     "--dir", directory, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", *extra]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return self.url_at(self.bind[0])

    def url_at(self, address: str) -> str:
        """Its URL for a client that reaches it at `address`."""
        return f"redis://{'kv:' + self.password + '@' if self.password else ''}{address}:{self.port}/0"

    def client(self):
        import redis
        return redis.Redis(unix_socket_path=self.sock, password=self.password, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(0.5)
                    s.connect(self.sock)
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):     # up (NOAUTH: with a password)
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not answer PING: " + self.proc.stdout.read().decode(errors="replace"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """Stopped but listening: calls hang until their timeout (a slow Redis)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def stop(srv: RedisServer) -> None:
    if srv.proc.poll() is None:
        srv.resume()        # a paused server dies of SIGKILL too, but its socket answers nothing until then
    srv.kill()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server with AOF (data survives a restart) on a free port."""
    d = tmp_path / "redis"
    d.mkdir()
    srv = RedisServer(str(d), appendonly=True)
    yield srv
    stop(srv)


@pytest.fixture(params=["processes", "namespaces"])
def two_hosts(request, tmp_path):
    """-> (a redis-server with AOF, {"a" | "b": (command prefix, Redis URL)}) for
    two daemons: separate processes of this machine's namespace, or each on a
    host of its own (tests/tiers/netns.py), Redis on a third."""
    d = tmp_path / "redis"
    d.mkdir()
    if request.param == "processes":
        srv = RedisServer(str(d), appendonly=True)
        yield srv, {n: ((), srv.url) for n in "ab"}
    else:
        hosts = request.getfixturevalue("hosts")
        # Reached from other hosts, Redis wants a password (its protected mode refuses them otherwise).
        srv = RedisServer(str(d), appendonly=True, run_in=hosts.run_in("r"),
                          bind=tuple(hosts.redis_address(n) for n in "ab"), password="kv-" + os.urandom(8).hex())
        yield srv, {n: (hosts.run_in(n), srv.url_at(hosts.redis_address(n))) for n in "ab"}
    stop(srv)


@pytest.fixture
def redis_cluster(tmp_path):
    """A 3-node Redis Cluster (kvstore/tools/local_redis.py) on free ports."""
    from kvstore.tools.local_redis import LocalCluster
    binary = server_binary()
    d = tmp_path / "cluster"
    d.mkdir()
    c = LocalCluster(str(d), nodes=3, binary=binary)
    yield c
    c.stop()
