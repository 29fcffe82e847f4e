"""Auth and tenants: bearer tokens on TCP, tenants namespacing sequences and
buffers (no existence leak), IPC only on the Unix socket, TLS, socket modes."""
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.core.config import CacheConfig
from kvstore.service.auth import Authenticator, load_token_file
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from helpers import ROOT

ALICE, BOB = "alice-token-" + "a" * 16, "bob-token-" + "b" * 16
L, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "run" / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0, auth=Authenticator({ALICE: "alice", BOB: "bob"}))
    admin = KVStoreClient(f"unix://{sock}", heartbeat=False)
    admin.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                       block_size=8, num_blocks=64)
    yield sock, port
    admin.close()
    server.stop(0)


def tcp(port, token=None, **kw):
    return KVStoreClient(f"127.0.0.1:{port}", token=token, heartbeat=False, **kw)


def code_of(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as e:
        fn(*a, **kw)
    return e.value.code(), e.value.details()


# ------------------------------------------------------------ authentication
@pytest.mark.parametrize("token", [None, "wrong-token-xxxxxxxxxxxxxxx"])
def test_tcp_without_a_valid_token_is_unauthenticated(live, token):
    _, port = live
    kv = tcp(port, token=token)
    for call in (lambda: kv.stats(), lambda: kv.allocate("c", "s", [1, 2]), lambda: kv.list_sequences("c"),
                 lambda: kv.heartbeat()):
        code, details = code_of(call)
        assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("authorization")
    # A raw "Basic" header is no bearer token either.
    stub = pb_grpc.KVStoreStub(kv.channel)
    code, _ = code_of(stub.Stats, pb.StatsRequest(), metadata=(("authorization", f"Basic {ALICE}"),))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    kv.close()


def test_an_empty_token_is_refused_not_sent_as_none(live, monkeypatch, capsys):
    """On the socket, a call with no token is tenant default: a token given empty
    (a blank secret, a file that held a newline) must not make it one."""
    from kvstore.tools import admin
    sock, _ = live
    for token in ("", "  \n"):
        with pytest.raises(ValueError, match="token: blank"):
            KVStoreClient(f"unix://{sock}", token=token, heartbeat=False)
    with pytest.raises(SystemExit, match="kvstore-admin: --token: blank"):
        admin.main(["--socket", sock, "--token", " ", "stats"])
    monkeypatch.setenv("KVSTORE_TOKEN", "\n")      # a secret file that held only its newline
    with pytest.raises(ValueError, match="token: blank"):
        KVStoreClient(f"unix://{sock}", heartbeat=False)
    monkeypatch.setenv("KVSTORE_TOKEN", "")        # an unset variable, as shells write it
    assert KVStoreClient(f"unix://{sock}", heartbeat=False).heartbeat().tenant == "default"
    monkeypatch.setenv("KVSTORE_TOKEN", ALICE + "\n")
    assert KVStoreClient(f"unix://{sock}", heartbeat=False).heartbeat().tenant == "alice"
    admin.main(["--socket", sock, "--json", "seqs", "--cache", "c"])
    capsys.readouterr()


def test_two_tokens_in_one_call_are_refused_not_one_picked(live):
    """Two `authorization` headers (two tenants' tokens) in a call: UNAUTHENTICATED,
    whichever comes first, and `Bearer` with no token says so."""
    _, port = live
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    for md, says in (((("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {BOB}")),
                      "authorization: sent 2 times: a call carries one token"),
                     ((("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {ALICE}")),
                      "authorization: sent 2 times"),
                     ((("authorization", "Bearer "),), "authorization: expected `Bearer <token>`")):
        code, details = code_of(stub.Stats, pb.StatsRequest(), metadata=md)
        assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith(says), details
    code, _ = code_of(stub.ListSequences, pb.ListSequencesRequest(cache="c"), metadata=md)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_callers_without_a_token_cannot_hold_the_servers_threads(tmp_path):
    """Calls over TCP that send their headers and no body (or a body too slowly),
    more of them than the server has threads, are refused UNAUTHENTICATED from their
    headers alone: a caller with a token is still served meanwhile."""
    import threading
    sock = str(tmp_path / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0, auth=Authenticator({ALICE: "alice"}), workers=2,
                                    max_streams=2)
    never = threading.Event()

    def no_body():
        never.wait(30)
        yield pb.HeartbeatRequest()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            heartbeat = ch.stream_unary(f"/{pb.DESCRIPTOR.services_by_name['KVStore'].full_name}/Heartbeat",
                                        request_serializer=pb.HeartbeatRequest.SerializeToString,
                                        response_deserializer=pb.HeartbeatReply.FromString)
            held = [heartbeat.future(no_body(), timeout=20) for _ in range(12)]
            with tcp(port, token=ALICE) as kv:
                assert kv.heartbeat().tenant == "alice"
            for f in held:
                assert f.exception(timeout=10).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        never.set()
        server.stop(0)


def test_health_answers_without_token_reflection_does_not(live):
    _, port = live
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unix_callers_are_default_unless_they_send_a_token(live):
    sock, _ = live
    assert KVStoreClient(f"unix://{sock}", heartbeat=False).heartbeat().tenant == "default"
    assert KVStoreClient(f"unix://{sock}", token=ALICE, heartbeat=False).heartbeat().tenant == "alice"
    code, _ = code_of(KVStoreClient(f"unix://{sock}", token="nope-" * 5, heartbeat=False).stats)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_tcp_needs_tokens_to_start(tmp_path):
    with pytest.raises(ValueError, match="bearer tokens"):
        create_server(socket_path=str(tmp_path / "kv.sock"), port=0)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), "--socket", str(tmp_path / "x.sock"),
                        "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "KVSTORE_AUTH_TOKEN"})
    assert r.returncode != 0 and "--port needs --auth-token or --token-file" in r.stderr


def test_token_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# ops\n{ALICE} alice\n\n{BOB} bob  # trailing comment\n@unix ops\n")
    tokens, unix = load_token_file(str(f))
    assert tokens == {ALICE: "alice", BOB: "bob"} and unix == "ops"
    f.write_text(f"{ALICE} alice\n@unix -\n")
    assert load_token_file(str(f))[1] is None
    f.write_text("short alice\n")
    with pytest.raises(ValueError, match="shorter than 16"):
        load_token_file(str(f))
    f.write_text(f"{ALICE} bad/tenant\n")
    with pytest.raises(ValueError, match="tenant"):
        load_token_file(str(f))
    f.write_text(f"{ALICE} alice\n{ALICE} alice\n")              # the same line twice: harmless
    assert load_token_file(str(f))[0] == {ALICE: "alice"}
    f.write_text(f"{ALICE} alice\n{ALICE} bob\n")
    with pytest.raises(ValueError, match=r":2: an earlier line gives this token to tenant 'alice'"):
        load_token_file(str(f))


def test_auth_token_cannot_take_a_token_files_token(tmp_path):
    """--auth-token names tenant default (which may delete any cache): a token the
    file gives another tenant is refused, not silently made the admin's."""
    f = tmp_path / "tokens"
    f.write_text(f"{ALICE} alice\n{BOB} default\n")
    with pytest.raises(ValueError, match=r"--auth-token: --token-file gives the same token to tenant 'alice'"):
        Authenticator.from_args(ALICE, str(f))
    assert Authenticator.from_args(BOB, str(f)).has_tokens      # the file says default too: no conflict
    with pytest.raises(ValueError, match=r"^--token-file: .*tokens:1"):
        f.write_text("short alice\n")
        Authenticator.from_args(None, str(f))


def test_token_file_can_require_tokens_on_the_socket(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"{ALICE} alice\n@unix -\n")
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock, auth=Authenticator.from_args(None, str(f)))
    try:
        assert code_of(KVStoreClient(f"unix://{sock}", heartbeat=False).stats)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert KVStoreClient(f"unix://{sock}", token=ALICE, heartbeat=False).heartbeat().tenant == "alice"
        # The health probe (Docker HEALTHCHECK) still works without a token.
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


# ------------------------------------------------------------------ tenants
def test_tenant_cannot_name_another_tenants_sequence(live):
    _, port = live
    alice, bob = tcp(port, ALICE), tcp(port, BOB)
    alice.allocate("c", "s", list(range(20)))
    k = torch.randn(L, 20, HKV, D).half()
    alice.append("c", ["s"], k, k)
    want = alice.retrieve("c", "s", 0, 20)
    q = torch.randn(1, HQ, D).half()
    calls = {
        "SequenceInfo": lambda kv, sid: kv.sequence_info("c", sid),
        "Retrieve": lambda kv, sid: kv.retrieve("c", sid, 0, 1, out_bytes=1),
        "Attend": lambda kv, sid: kv.attend("c", 0, [sid], q),
        "Append": lambda kv, sid: kv.append("c", [sid], k[:, :1], k[:, :1]),
        "Fork": lambda kv, sid: kv.fork("c", sid, "stolen"),
        "Free": lambda kv, sid: kv.free("c", [sid]),
    }
    for name, call in calls.items():
        theirs = code_of(call, bob, "s")
        absent = code_of(call, bob, "never-existed")
        assert theirs[0] == grpc.StatusCode.NOT_FOUND, name
        # Same answer as for an id that never existed: nothing leaks that "s" exists.
        assert theirs[1] == absent[1].replace("never-existed", "s"), name
    # Reserve (mapped clients only) is refused over TCP before any sequence is looked up.
    reserve = lambda kv, sid: kv.reserve("c", sid, 1)  # noqa: E731
    assert code_of(reserve, bob, "s") == code_of(reserve, bob, "never-existed")
    assert code_of(reserve, bob, "s")[0] == grpc.StatusCode.PERMISSION_DENIED
    assert bob.list_sequences("c") == []
    # Bob's own "s" is another sequence; Alice's is untouched.
    bob.allocate("c", "s", [7])
    assert [s.sequence_id for s in bob.list_sequences("c")] == ["s"]
    assert alice.sequence_info("c", "s").length == 20
    got = alice.retrieve("c", "s", 0, 20)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prefix_blocks_are_not_shared_across_tenants_by_default(live):
    if "share_prefixes_across_tenants" not in {f.name for f in dataclasses.fields(CacheConfig)}:
        pytest.xfail("needs the cache.py change: tenant-seeded block hashes (see README, Auth and tenants)")
    _, port = live
    alice, bob = tcp(port, ALICE), tcp(port, BOB)
    prompt = list(range(64))
    alice.allocate("c", "a", prompt)
    k = torch.randn(L, 64, HKV, D).half()
    alice.append("c", ["a"], k, k, token_ids=[prompt])
    assert alice.allocate("c", "a2", prompt) > 0        # the same tenant hits
    assert bob.allocate("c", "b", prompt) == 0          # another tenant does not


def test_only_the_default_tenant_replaces_a_caches_codebooks(live):
    """Codebooks a cache has change it for every tenant: another tenant may set the
    first ones and set the same again (nothing changes: prefix hits stay), not
    replace them, by SetCodebooks or TrainCodebooks (refused before training)."""
    from kvstore.codec.codebooks import Codebooks
    sock, port = live
    admin, alice, bob = KVStoreClient(f"unix://{sock}", heartbeat=False), tcp(port, ALICE), tcp(port, BOB)
    admin.create_cache("q", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="pq",
                       block_size=8, num_blocks=64)

    def books(seed):
        g = torch.Generator().manual_seed(seed)
        return Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                         v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)).to_bytes()
    first = alice.set_codebooks("q", books(0))
    prompt = list(range(40))
    alice.allocate("q", "a", prompt)
    k = torch.randn(L, 40, HKV, D).half()
    alice.append("q", ["a"], k, k, token_ids=[prompt])
    alice.free("q", ["a"])
    assert bob.set_codebooks("q", books(0)) == first               # the same again: nothing changes
    assert alice.allocate("q", "a2", prompt) > 0
    alice.free("q", ["a2"])
    for call in (lambda: bob.set_codebooks("q", books(1)),
                 lambda: bob.train_codebooks("q", torch.randn(L, 256, HKV, D).half(), torch.randn(L, 256, HKV, D).half())):
        code, details = code_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("codebooks: ")
        assert "only tenant 'default' may replace them, not 'bob'" in details
    assert admin.get_cache("q").codebooks_sha256 == first
    assert admin.set_codebooks("q", books(1)) != first                 # the default tenant may
    admin.close()


# ---------------------------------------------------------------------- IPC
def test_ipc_only_for_local_callers(live):
    _, port = live
    stub = pb_grpc.KVStoreStub(tcp(port, ALICE).channel)
    md = (("authorization", f"Bearer {ALICE}"),)
    for method, req, field in (("MapPool", pb.MapPoolRequest(cache="c"), "cache"),
                               ("RegisterBuffer", pb.RegisterBufferRequest(kind=pb.SHM, name="x", size=64), "kind"),
                               ("RegisterBuffer", pb.RegisterBufferRequest(kind=pb.CUDA_IPC, size=64), "kind"),
                               ("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id="shm-0"), "buffer_id")):
        code, details = code_of(getattr(stub, method), req, metadata=md, timeout=10)
        assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith(f"{field}: {method}"), details
    # A remote caller cannot name shared memory in a tensor either.
    tcp(port, ALICE).allocate("c", "s", [1])
    q = pb.Tensor(shape=[1, HQ, D], dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id="shm-0", offset=0))
    code, details = code_of(stub.Attend, pb.AttendRequest(cache="c", layer=0, sequence_ids=["s"], q=q), metadata=md)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("q")


def test_buffers_are_namespaced_by_tenant(live):
    sock, _ = live
    alice = KVStoreClient(f"unix://{sock}", token=ALICE, transport="shm", heartbeat=False)
    alice.allocate("c", "s", [1])
    alice.append("c", ["s"], torch.randn(L, 1, HKV, D).half(), torch.randn(L, 1, HKV, D).half())
    buf = alice._arena.buffer_id
    other = KVStoreClient(f"unix://{sock}", heartbeat=False)   # tenant default, same uid
    stub = pb_grpc.KVStoreStub(other.channel)
    other.allocate("c", "t", [1])
    other.append("c", ["t"], torch.randn(L, 1, HKV, D).half(), torch.randn(L, 1, HKV, D).half())
    q = pb.Tensor(shape=[1, HQ, D], dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id=buf, offset=0))
    for method, req in (("Attend", pb.AttendRequest(cache="c", layer=0, sequence_ids=["t"], q=q)),
                        ("Attend", pb.AttendRequest(cache="c", layer=0, sequence_ids=["t"],
                                                    q=pb.Tensor(shape=[1, HQ, D], dtype=pb.FLOAT16,
                                                                inline=bytes(HQ * D * 2)),
                                                    out=pb.OutputRef(buffer_id=buf))),
                        ("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id=buf))):
        code, details = code_of(getattr(stub, method), req, timeout=10)
        assert code == grpc.StatusCode.NOT_FOUND and f"no buffer {buf!r}" in details
    alice.attend("c", 0, ["s"], torch.randn(1, HQ, D).half())    # still Alice's, still works
    alice.close()
    other.close()


# ----------------------------------------------------------------- TLS, modes
def test_socket_is_0600_in_a_0700_directory(tmp_path):
    sock = str(tmp_path / "fresh" / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    try:
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        assert oct(os.stat(os.path.dirname(sock)).st_mode & 0o777) == "0o700"
    finally:
        server.stop(0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_with_token(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    token = secrets.token_hex(16)
    server, port, _ = create_server(socket_path=str(tmp_path / "kv.sock"), port=0, host="localhost",
                                    auth=Authenticator({token: "t"}), tls=(cert.read_bytes(), key.read_bytes()))
    try:
        kv = KVStoreClient(f"localhost:{port}", token=token, tls_ca=str(cert), heartbeat=False)
        assert kv.heartbeat().tenant == "t" and kv.stats().caches == []
        plain = KVStoreClient(f"localhost:{port}", token=token, heartbeat=False, timeout=3)
        assert code_of(plain.stats)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_only_the_operator_reads_the_redis_error_text(tmp_path):
    """Stats counts every tenant's caches, but the last Redis error names the Redis host:
    tenant default (the operator) reads it, another tenant an empty string."""
    from kvstore.engine.engine import Engine
    from kvstore.tiers.redis_store import RedisConfig
    from tests.tiers.redis_server import free_port
    engine = Engine(redis=RedisConfig(f"redis://127.0.0.1:{free_port()}/0"))      # nothing listens: down
    sock = str(tmp_path / "run" / "kv.sock")
    server, port, _ = create_server(engine, socket_path=sock, port=0, auth=Authenticator({BOB: "bob"}))
    try:
        with KVStoreClient(f"unix://{sock}", heartbeat=False) as admin, tcp(port, BOB) as bob:
            admin.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                               block_size=8, num_blocks=64)
            ours, theirs = admin.stats("c").caches[0], bob.stats("c").caches[0]
            assert ours.redis_state == theirs.redis_state == "down"
            assert "Connection refused" in ours.redis_last_error and theirs.redis_last_error == ""
    finally:
        server.stop(0)
        engine.close()
