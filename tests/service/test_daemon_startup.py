"""Starting and stopping `python server.py` as users do:
- a wrong argument or a busy port is one line on stderr and a non-zero exit,
  with nothing bound and no socket file left behind;
- the socket's directory is one only our uid can write (ours made 0700,
  another user's refused; sticky shared ones like /tmp used as they are);
- a live daemon's socket (gRPC or SOCKET.bell) is never taken over, a stale
  one is, and at exit a daemon removes a socket only while it is still its own;
- the demos start their daemon on a socket of their own, never the default one."""
import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from test_daemon_process import start_daemon, stop_daemon
from helpers import ROOT
from kvstore.service.sockets import identity

TOKEN = "startup-test-token-0123456789"


def run_server(sock: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """server.py expected to refuse to start: it must exit on its own."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, *args],
                          capture_output=True, text=True, timeout=timeout)


def assert_refused(r: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0, r.stdout + r.stderr
    assert len(lines) == 1, f"expected one line, got:\n{r.stderr}"
    assert lines[0].startswith("kvstore-server: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "serving" not in r.stdout


def socket_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if stat.S_ISSOCK(os.lstat(os.path.join(d, n)).st_mode))


def listening(path: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(path)
    s.listen(4)
    return s


def serving(sock: str) -> bool:
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def sock(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return str(d / "kv.sock")


# ------------------------------------------------------------ arguments
BAD_ARGS = [
    (["--device", "bogus"], "--device: must be cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device: must be cpu, cuda or cuda:N"),
    (["--log-level", "loud"], "--log-level"),
    (["--port", "70000", "--auth-token", TOKEN], "--port must be in [0, 65535]"),
    (["--port", "0"], "--port needs --auth-token or --token-file"),
    (["--workers", "0"], "--workers must be in"),
    # checked without --redis too: a config file's bad value is found before --redis is added
    (["--redis-timeout", "0"], "--redis-timeout: must be in (0, 60] seconds, got 0.0"),
    (["--redis-ttl", "-1"], "--redis-ttl: must be >= 0, got -1"),
    (["--redis-backoff", "0"], "--redis-backoff: must be in (0, 3600] seconds"),
    (["--redis-read-connections", "99"], "--redis-read-connections: must be 0 (by the server) or in [1, 64]"),
    (["--lease-timeout", "0"], "--lease-timeout must be a finite number of seconds >= 1"),
    (["--lease-timeout", "0.3"], "--lease-timeout must be a finite number of seconds >= 1 (clients heartbeat"),
    (["--lease-timeout", "inf"], "--lease-timeout must be a finite number of seconds >= 1"),
    (["--token-file", "/nonexistent/tokens"], "--token-file"),
    (["--port", "0", "--auth-token", "short"], "--auth-token: token shorter than 16 characters"),
    (["--port", "0", "--auth-token", " " + TOKEN], "--auth-token: a token has no whitespace"),
    (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem", "--port", "0", "--auth-token", TOKEN],
     "/nonexistent/c.pem"),
]


@pytest.mark.parametrize("args, fragment", BAD_ARGS, ids=[" ".join(a[0]) for a in BAD_ARGS])
def test_a_bad_argument_is_one_line_and_binds_nothing(sock, args, fragment):
    r = run_server(sock, *args)
    assert_refused(r, fragment)
    assert socket_files(os.path.dirname(sock)) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here")
def test_cuda_without_a_gpu_is_one_line(sock):
    assert_refused(run_server(sock, "--device", "cuda"), "--device cuda: no CUDA device here; use --device cpu")
    assert_refused(run_server(sock, "--device", "cuda:1"), "--device cuda:1: no CUDA device here")
    assert socket_files(os.path.dirname(sock)) == []


def test_log_level_in_any_case(sock):
    p, _ = start_daemon(sock, extra=("--log-level", "debug"))
    stop_daemon(p)
    assert not os.path.exists(sock)


@pytest.mark.parametrize("flag", ["--metrics-port", "--port"])
def test_a_port_in_use_is_one_line_and_leaves_no_socket(sock, flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run_server(sock, "--device", "cpu", flag, str(port), "--auth-token", TOKEN)
    assert_refused(r, f"{flag} {port}", "Address already in use")
    assert socket_files(os.path.dirname(sock)) == []


@pytest.mark.parametrize("host, why", [("999.1.1.1", "cannot resolve it"),
                                       ("192.0.2.1", "Cannot assign requested address")])
@pytest.mark.parametrize("flags", [("--host", "--port"), ("--metrics-host", "--metrics-port")])
def test_a_host_that_cannot_be_bound_is_one_line_naming_it(sock, host, why, flags):
    r = run_server(sock, "--device", "cpu", flags[0], host, flags[1], "0", "--auth-token", TOKEN)
    assert_refused(r, f"{flags[0]} {host}: ", why)
    assert socket_files(os.path.dirname(sock)) == []


def test_credentials_redis_refuses_are_one_line_naming_redis(sock, tmp_path):
    """Redis down at the start is served through (it may come up); credentials it refuses
    never mend by retrying, so they stop the start, the password not shown."""
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=False, password="right-password")
    try:
        no_password = "wants credentials the URL does not give (ReplyError: CLUSTER: NOAUTH"
        for url, says in ((f"redis://127.0.0.1:{srv.port}/0", no_password),
                          (f"redis://kv:wrong-password@127.0.0.1:{srv.port}/0", "refused the URL's credentials")):
            r = run_server(sock, "--device", "cpu", "--redis", url)
            assert_refused(r, "--redis: ", says)
            assert "wrong-password" not in r.stderr
            assert socket_files(os.path.dirname(sock)) == []
    finally:
        srv.kill()


# ------------------------------------------------------------ directory
def test_a_directory_of_ours_that_others_can_write_is_made_0700(sock):
    d = os.path.dirname(sock)
    os.chmod(d, 0o777)
    p, _ = start_daemon(sock)
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    finally:
        stop_daemon(p)


def _foreign(d: str, monkeypatch) -> int:
    """Make d look like another user's: chown it when we are root, else make
    this process believe it runs as another uid. -> that other uid."""
    from kvstore.service import sockets
    if os.getuid() == 0:
        os.chown(d, 54321, 54321)
        return 54321
    monkeypatch.setattr(sockets.os, "getuid", lambda: 54321)
    return os.stat(d).st_uid


def test_another_users_directory_is_refused(sock, monkeypatch):
    from kvstore.service import sockets
    d = os.path.dirname(sock)
    owner = _foreign(d, monkeypatch)
    with pytest.raises(sockets.SocketError, match=f"socket directory {d} belongs to uid {owner}"):
        sockets.claim(sock)
    assert not os.path.exists(sock)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the directory to another uid")
def test_the_daemon_refuses_another_users_directory_in_one_line(sock):
    os.chown(os.path.dirname(sock), 54321, 54321)
    assert_refused(run_server(sock, "--device", "cpu"), "belongs to uid 54321")
    assert socket_files(os.path.dirname(sock)) == []


def test_a_shared_sticky_directory_is_used_as_it_is(tmp_path):
    from kvstore.service import sockets
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    sockets.claim(str(d / "kv.sock"))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777


# --------------------------------------------------- live and stale sockets
def test_a_second_daemon_refuses_a_live_ones_socket(sock):
    p, _ = start_daemon(sock)
    try:
        before = [identity(x) for x in (sock, sock + ".bell")]
        assert_refused(run_server(sock, "--device", "cpu"), f"a daemon is already serving on {sock}")
        assert [identity(x) for x in (sock, sock + ".bell")] == before
        assert serving(sock)
    finally:
        stop_daemon(p)
    assert socket_files(os.path.dirname(sock)) == []


def test_a_live_doorbell_socket_is_refused(sock):
    bell = listening(sock + ".bell", socket.SOCK_SEQPACKET)
    try:
        ident = identity(sock + ".bell")
        assert_refused(run_server(sock, "--device", "cpu"), f"a daemon is already serving on {sock}.bell")
        assert identity(sock + ".bell") == ident
        assert socket_files(os.path.dirname(sock)) == ["kv.sock.bell"]
    finally:
        bell.close()


def test_stale_sockets_are_taken_over_and_only_our_own_removed_at_exit(sock):
    for path, kind in ((sock, socket.SOCK_STREAM), (sock + ".bell", socket.SOCK_SEQPACKET)):
        listening(path, kind).close()           # a daemon that died: the files stay, nobody listens
    p, _ = start_daemon(sock)
    # Someone takes both paths over while we run (e.g. after removing our files by hand).
    others = []
    for path, kind in ((sock, socket.SOCK_STREAM), (sock + ".bell", socket.SOCK_SEQPACKET)):
        os.unlink(path)
        others.append((path, listening(path, kind), identity(path)))
    try:
        stop_daemon(p)
        for path, _, ident in others:
            assert identity(path) == ident, f"{path}: the stopping daemon removed a socket not its own"
    finally:
        for _, s, _ in others:
            s.close()


# ---------------------------------------------------------------- demos
def test_demos_start_their_daemon_on_a_socket_of_their_own(sock, monkeypatch):
    from kvstore.protocol.channel import default_socket
    from kvstore.service.daemon import create_server
    from kvstore.tools.demo import spawn_daemon
    monkeypatch.setenv("KVSTORE_SOCKET", sock)        # "the default socket", served by a live daemon
    assert default_socket() == sock
    server, _, _ = create_server(socket_path=sock)
    try:
        ident = identity(sock)
        with spawn_daemon() as target:
            own = target.removeprefix("unix://")
            assert own != sock and os.path.dirname(own) != os.path.dirname(sock)
            assert serving(own)
        assert not os.path.exists(os.path.dirname(own)), "the demo's temporary directory is left behind"
        assert identity(sock) == ident and serving(sock)
    finally:
        server.stop(0)
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipes = [line for line in f if "kvstore.tools.demo" in line]
    assert len(recipes) == 2 and not any("--socket" in line for line in recipes), recipes


def test_kvstore_socket_written_as_a_target_is_its_path(sock, monkeypatch):
    """KVSTORE_SOCKET=unix:///path (the form --target takes) names /path for the client
    and the daemon alike, rather than a target of unix://unix:///path no daemon serves."""
    from kvstore.client import KVStoreClient
    from kvstore.protocol.channel import default_socket
    from kvstore.service.daemon import create_server
    monkeypatch.setenv("KVSTORE_SOCKET", f"unix://{sock}")
    assert default_socket() == sock
    server, _, _ = create_server(socket_path=default_socket())
    try:
        with KVStoreClient(heartbeat=False) as kv:
            assert kv.target == f"unix://{sock}" and kv.stats() is not None
    finally:
        server.stop(0)
