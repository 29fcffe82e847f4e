"""A real redis-server for the Redis tier's tests: a free local port, its
files in a temp directory, started, killed and restarted on the same port.

`make test` installs redis-server (apt) where it is missing. Without it the
tests that need one skip, saying so, except under CI=true, where they fail:
CI must run them."""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: str, appendonly: bool, extra: tuple = ()):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            why = "redis-server is not installed (make test installs it: apt-get install redis-server)"
            if os.environ.get("CI"):
                pytest.fail(why + "; CI must run the Redis tier tests")
            pytest.skip(why)
        self.dir, self.port = directory, free_port()
        # fsync every write: a kill -9 then loses nothing of what was acknowledged.
        self.args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
                     "--dir", directory, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", *extra]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
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


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server with AOF (data survives a restart) on a free port."""
    d = tmp_path / "redis"
    d.mkdir()
    srv = RedisServer(str(d), appendonly=True)
    yield srv
    if srv.proc.poll() is None:
        srv.resume()        # a paused server dies of SIGKILL too, but its socket answers nothing until then
    srv.kill()


@pytest.fixture
def redis_cluster(tmp_path):
    """A 3-node Redis Cluster (kvstore/tools/local_redis.py) on free ports."""
    from kvstore.tools.local_redis import LocalCluster
    if shutil.which("redis-server") is None:
        why = "redis-server is not installed (make test installs it: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why + "; CI must run the Redis tier tests")
        pytest.skip(why)
    d = tmp_path / "cluster"
    d.mkdir()
    c = LocalCluster(str(d), nodes=3)
    yield c
    c.stop()
