"""The doorbell (kvstore/service/doorbell.py, client/doorbell.py): AppendAttend by a
SOCK_SEQPACKET descriptor gives the gRPC call's results and errors, bad
descriptors change nothing, and clients that lose it fall back to gRPC."""
from __future__ import annotations

import contextlib
import os
import socket
import time

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.codec.codebooks import Codebooks
from kvstore.protocol import bell
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb

G = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


@contextlib.contextmanager
def _daemon(sock: str, **kw):
    server, _, _ = create_server(socket_path=sock, **kw)
    try:
        yield server
    finally:
        server.stop(0)


@pytest.fixture
def served(tmp_path):
    sock = str(tmp_path / "kv.sock")
    with _daemon(sock) as server:
        yield sock, server


def _cache(kv: KVStoreClient, name: str, codec: str) -> None:
    kv.create_cache(name, "m", codec=codec, block_size=8, residual=8, num_blocks=64, max_sequences=8, **G)
    if codec == "pq":
        gen = torch.Generator().manual_seed(0)
        m = G["head_dim"] // 2
        kv.set_codebooks(name, Codebooks(k=torch.randn(2, 2, m, 256, 2, generator=gen),
                                         v=torch.randn(2, 2, m, 256, 2, generator=gen)).to_bytes())


def _steps(kv: KVStoreClient, name: str, sid: str, n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    kv.allocate(name, sid, [])
    pre = torch.randn(2, 12, 2, 16, generator=gen).half()
    kv.append(name, [sid], pre, pre)
    outs = []
    for i in range(n):
        k = torch.randn(1, 2, 16, generator=gen).half()
        q = torch.randn(1, 4, 16, generator=gen).half()
        outs.append(kv.append_attend(name, i % 2, [sid], k, -k, q))
    return torch.stack(outs)


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_doorbell_matches_grpc(served, codec):
    sock, server = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False) as a, \
            KVStoreClient(f"unix://{sock}", heartbeat=False) as b:
        _cache(a, "c", codec)
        want = _steps(a, "c", "s1", 40)
        got = _steps(b, "c", "s2", 40)
        assert b._bell is not None and b.doorbell_handler_us > 0
        assert a._bell is None
        assert torch.equal(want, got)
        i1, i2 = a.sequence_info("c", "s1"), b.sequence_info("c", "s2")
        assert (i1.length, len(i1.sealed_blocks)) == (i2.length, len(i2.sealed_blocks)) == (32, len(i1.sealed_blocks))
    assert server.kvstore_engine.caches["c"].counters["attend_calls"] == 80


def _chunks(kv: KVStoreClient, name: str, sid: str, n: int, t: int) -> tuple[torch.Tensor, list[int]]:
    """n calls of t new tokens a layer, with their ids on layer 0's call -> (outputs, ids)."""
    gen = torch.Generator().manual_seed(5)
    kv.allocate(name, sid, [])
    outs, ids = [], []
    for i in range(n):
        chunk = [100 + t * i + j for j in range(t)]
        ids += chunk
        for layer in range(2):
            k = torch.randn(t, 2, 16, generator=gen).half()
            q = torch.randn(t, 4, 16, generator=gen).half()
            outs.append(kv.append_attend(name, layer, [sid], k, -k, q, token_ids=chunk if layer == 0 else None,
                                         query_tokens=t))
    return torch.stack(outs), ids


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_multi_token_calls_and_token_ids_take_the_doorbell(served, codec):
    """query_tokens > 1 and token ids by the doorbell (op 2) give gRPC's outputs,
    and the ids seal into the same prefix hashes: a later prompt hits alike."""
    sock, server = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False) as a, \
            KVStoreClient(f"unix://{sock}", heartbeat=False) as b:
        _cache(a, "c", codec)
        calls = server.kvstore_doorbell.counters["calls"]
        want, ids = _chunks(a, "c", "s1", 10, 4)
        assert server.kvstore_doorbell.counters["calls"] == calls
        got, _ = _chunks(b, "c", "s2", 10, 4)
        assert server.kvstore_doorbell.counters["calls"] == calls + 20 and b._bell.takes_tokens
        assert torch.equal(want, got)
        hits = [kv.allocate("c", f"h{i}", ids + [7]) for i, kv in enumerate((a, b))]
        assert hits[0] == hits[1] >= 16, hits
        # one token with ids is op 2 as well
        k, q = torch.zeros(1, 2, 16).half(), torch.ones(1, 4, 16).half()
        b.append_attend("c", 0, ["s2"], k, k, q, token_ids=[9])
        b.append_attend("c", 1, ["s2"], k, k, q)
        assert server.kvstore_doorbell.counters["calls"] == calls + 22
        assert b.sequence_info("c", "s2").length == 41


def test_client_sends_by_grpc_to_a_doorbell_without_op_2(served, monkeypatch):
    """A daemon whose doorbell serves op 1 only refuses op 2 (UNIMPLEMENTED naming op,
    nothing done): the client sends those calls by gRPC for as long as that connection
    lasts, one-token calls still by the doorbell."""
    from kvstore.errors import Unimplemented
    from kvstore.service import doorbell as daemon_bell
    decode = daemon_bell._decode

    def op1_only(mv, n):
        if int.from_bytes(mv[4:6], "little") != bell.OP_APPEND_ATTEND:
            raise Unimplemented("op", "2: the doorbell serves AppendAttend (op 1) only")
        return decode(mv, n)
    monkeypatch.setattr(daemon_bell, "_decode", op1_only)
    sock, server = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False) as a, \
            KVStoreClient(f"unix://{sock}", heartbeat=False) as b:
        _cache(a, "c", "pq")
        want, _ = _chunks(a, "c", "s1", 3, 4)
        calls = server.kvstore_doorbell.counters["calls"]
        got, _ = _chunks(b, "c", "s2", 3, 4)
        assert torch.equal(want, got) and not b._bell.takes_tokens
        assert server.kvstore_doorbell.counters["calls"] == calls + 1     # the refused one
        b.append_attend("c", 0, ["s2"], torch.zeros(1, 2, 16).half(), torch.zeros(1, 2, 16).half(),
                        torch.ones(1, 4, 16).half())
        assert server.kvstore_doorbell.counters["calls"] == calls + 2
        assert b.sequence_info("c", "s2").length == 12


def test_client_errors_are_the_unary_ones(served):
    sock, _ = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False, stream=False, doorbell=False) as a, \
            KVStoreClient(f"unix://{sock}", heartbeat=False) as b:
        _cache(a, "c", "pq")
        _steps(b, "c", "s", 2)
        k, q = torch.zeros(1, 2, 16).half(), torch.zeros(1, 4, 16).half()
        for bad in (dict(layer=7), dict(seq_ids=["nope"]), dict(q=torch.zeros(1, 3, 16).half())):
            args = dict(cache="c", layer=0, seq_ids=["s"], k=k, v=k, q=q) | bad
            errs = []
            for kv in (a, b):
                before = kv.sequence_info("c", "s")
                with pytest.raises(grpc.RpcError) as e:
                    kv.append_attend(**args)
                errs.append((e.value.code(), e.value.details()))
                assert kv.sequence_info("c", "s") == before
            assert errs[0] == errs[1], bad
        assert b._bell is not None          # errors keep the connection


# ------------------------------------------------------------- raw descriptors
def _registered(sock: str):
    """A client with a registered shm buffer and a sequence 's' of cache 'c';
    -> (client, buffer id, doorbell path, token)."""
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False)
    _cache(kv, "c", "pq")
    _steps(kv, "c", "s", 2)
    arena = kv._arena_for(1 << 16)
    path, token = kv._bell_addr
    return kv, arena.buffer_id, path, token


def _connect(path: str, token: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    s.sendall(bell.HELLO.pack(bell.HELLO_MAGIC, token))
    return s


def _reply(s: socket.socket) -> tuple[int, str]:
    data = s.recv(bell.MAX_PACKET)
    _, code, _, _, n = bell.REPLY.unpack_from(data)
    return code, data[bell.REPLY.size:bell.REPLY.size + n].decode()


def _desc(bid: str, layer=0, seqs=("s",), dtype=pb.FLOAT16, offs=(0, 64, 128, 256), shapes=None, cache="c", call=1,
          t=1, ids=()):
    shapes = shapes or (t, 2, 16, t, 2, 16, t, 4, 16)
    return bell.pack_request(call, dtype, layer, 0.0, offs, shapes, bid.encode(), cache.encode(),
                             [x.encode() for x in seqs], t, ids)


def test_bad_descriptors_name_the_field_and_change_nothing(served):
    sock, _ = served
    kv, bid, path, token = _registered(sock)
    s = _connect(path, token)
    assert _reply(s)[0] == 0
    before = kv.sequence_info("c", "s")
    inv, nf = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0]
    good = _desc(bid)
    cases = [
        (_desc(bid, layer=5), inv, "layer"),
        (_desc(bid, layer=-1), inv, "layer"),
        (_desc(bid, seqs=("zz",)), nf, "sequence_ids: "),
        (_desc(bid, seqs=()), inv, "sequence_ids"),
        (_desc(bid, seqs=("s", "s")), inv, "sequence_ids"),
        (_desc(bid, cache="nope"), nf, "cache"),
        (_desc("shm-0000"), nf, "out.buffer_id: "),     # the request the packet stands for: out is checked first
        (_desc(bid, dtype=99), inv, "k: dtype"),
        (_desc(bid, offs=(1 << 40, 64, 128, 256)), inv, "k: bytes"),
        (_desc(bid, offs=(1, 64, 128, 256)), inv, "k: offset 1"),
        (_desc(bid, offs=(0, 64, 128, 1 << 40)), inv, "out: output needs"),
        (_desc(bid, shapes=(1, 3, 16, 1, 2, 16, 1, 4, 16)), inv, "k: shape"),
        (_desc(bid, shapes=(1, 2, 16, 1, 2, 16, 2, 4, 16)), inv, "q: shape"),
        (good[:-1], inv, "descriptor:"),
        (good + b"x", inv, "descriptor:"),
        (good[:10], inv, "descriptor:"),
        (good[:4] + (7).to_bytes(2, "little") + good[6:], grpc.StatusCode.UNIMPLEMENTED.value[0], "op:"),
        (good[:-1] + b"t", nf, "sequence_ids: "),
        (good[:-1] + b"\x80", inv, "sequence_ids: is not UTF-8"),
        (b"x" * (bell.MAX_PACKET + 10), inv, "descriptor:"),
        # op 2: query tokens and token ids at the packet's end
        (_desc(bid, t=17, offs=(0, 1024, 2048, 4096)), inv, "query_tokens"),
        (_desc(bid, t=2, ids=(5, 6, 7), offs=(0, 128, 256, 512)), inv, "token_ids"),
        (_desc(bid, t=2, offs=(0, 128, 256, 512))[:-1], inv, "descriptor:"),
        (_desc(bid, t=2, ids=(5, 6), offs=(0, 128, 256, 512))[:-7], inv, "descriptor:"),
        (good[:4] + (2).to_bytes(2, "little") + good[6:], inv, "descriptor:"),
        (_desc(bid, ids=(5,))[:-bell.TOKENS.size] + bell.TOKENS.pack(1, 1 << 20), inv, "descriptor:"),
    ]
    for data, code, field in cases:
        s.sendall(data)
        got = _reply(s)
        assert got[0] == code and got[1].startswith(field), (data[:40], got)
        assert kv.sequence_info("c", "s") == before
    s.sendall(good)                   # the connection still serves
    assert _reply(s) == (0, "")
    assert kv.sequence_info("c", "s").length == before.length or any(kv.sequence_info("c", "s").pending)
    s.close()
    kv.close()


def test_op_2_packet_built_from_the_proto_comment(served):
    """An op 2 request packed by hand as RegisterBufferReply's comment in the proto
    spells it (not by protocol/bell.py), as a client in another language would: its T
    tokens are attended on layer 0 and committed once layer 1 has them too."""
    import struct
    sock, _ = served
    kv, bid, path, token = _registered(sock)
    arena = kv._arena_for(1 << 16)
    t = 8
    k, q = torch.randn(t, 2, 16).half(), torch.randn(t, 4, 16).half()
    offs = (0, 1024, 2048, 4096)
    for x, off in zip((k, -k, q), offs):
        arena.view[off:off + x.numel() * 2].view(torch.float16).copy_(x.reshape(-1))
    seqs, cache, b = [b"s"], b"c", bid.encode()
    ids = list(range(500, 500 + t))
    pkt = struct.pack("<IHHifQQQQ9IHHH", 3, 2, pb.FLOAT16, 0, 0.0, *offs, t, 2, 16, t, 2, 16, t, 4, 16,
                      len(b), len(cache), len(seqs))
    pkt += struct.pack(f"<{len(seqs)}H", *map(len, seqs)) + b + cache + b"".join(seqs)
    pkt += struct.pack(f"<{len(ids)}q", *ids) + struct.pack("<HI", t, len(ids))
    before = kv.sequence_info("c", "s").length
    s = _connect(path, token)
    assert _reply(s)[0] == 0
    s.sendall(pkt)
    assert _reply(s) == (0, "")
    out = arena.view[offs[3]:offs[3] + q.numel() * 2].view(torch.float16).view(t, 4, 16)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    assert kv.sequence_info("c", "s").length == before      # layer 1 has not appended them yet
    s.sendall(pkt[:8] + (1).to_bytes(4, "little") + pkt[12:])    # layer 1, the same ids
    assert _reply(s) == (0, "")
    assert kv.sequence_info("c", "s").length == before + t
    s.close()
    kv.close()


def test_hello_needs_the_token(served):
    sock, _ = served
    kv, bid, path, token = _registered(sock)
    for hello in (bell.HELLO.pack(bell.HELLO_MAGIC, b"\0" * 32), b"KVB1", b"hello" * 20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(path)
        s.sendall(hello)
        code, msg = _reply(s)
        assert code in (grpc.StatusCode.UNAUTHENTICATED.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]), msg
        assert s.recv(100) == b""        # and closed
        s.close()
    kv.close()


def test_revoked_token_and_disconnects(served):
    sock, server = served
    kv, bid, path, token = _registered(sock)
    bell_srv = server.kvstore_doorbell
    # A client that sends a call and goes away without reading the reply.
    for _ in range(3):
        s = _connect(path, token)
        assert _reply(s)[0] == 0
        s.sendall(_desc(bid))
        s.close()
    s = _connect(path, token)
    assert _reply(s)[0] == 0
    s.sendall(_desc(bid, layer=1))
    assert _reply(s) == (0, "")
    deadline = time.time() + 5
    while len(bell_srv._conns) > 1 and time.time() < deadline:
        time.sleep(0.01)
    assert len(bell_srv._conns) == 1
    server.kvstore_engine.check_invariants()
    bell_srv.revoke("default", kv.session_id)
    s.sendall(_desc(bid))
    code, msg = _reply(s)
    assert code == grpc.StatusCode.UNAUTHENTICATED.value[0] and msg.startswith("doorbell_token")
    s.close()
    kv.close()


def test_falls_back_to_grpc(tmp_path):
    sock = str(tmp_path / "kv.sock")
    with _daemon(sock, doorbell=False), KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
        _cache(kv, "c", "fp16")
        _steps(kv, "c", "s", 4)
        assert kv._bell_addr is None and kv._bell is None
    sock = str(tmp_path / "kv2.sock")      # grpc unlinks the old path as it stops, asynchronously
    with _daemon(sock) as server:
        with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv, \
                KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False) as ref:
            _cache(kv, "c", "fp16")
            want = _steps(ref, "c", "r", 6)
            gen = torch.Generator().manual_seed(1)
            kv.allocate("c", "s", [])
            pre = torch.randn(2, 12, 2, 16, generator=gen).half()
            kv.append("c", ["s"], pre, pre)
            outs = []
            for i in range(6):
                if i == 3:      # the doorbell goes away mid-loop: the next calls go by gRPC
                    server.kvstore_doorbell.stop()
                k = torch.randn(1, 2, 16, generator=gen).half()
                q = torch.randn(1, 4, 16, generator=gen).half()
                outs.append(kv.append_attend("c", i % 2, ["s"], k, -k, q))
            assert torch.equal(torch.stack(outs), want)
            assert kv._bell is None


def test_step_buffers_cross_in_place(served):
    sock, _ = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False, doorbell=False) as a, \
            KVStoreClient(f"unix://{sock}", heartbeat=False) as b:
        _cache(a, "c", "pq")
        want = _steps(a, "c", "s1", 6)
        gen = torch.Generator().manual_seed(1)
        b.allocate("c", "s2", [])
        pre = torch.randn(2, 12, 2, 16, generator=gen).half()
        b.append("c", ["s2"], pre, pre)
        io = b.step_buffers("c", 1, "cpu" if torch.cuda.is_available() else None)   # None: the CPU here
        assert io.k.device.type == "cpu"
        arena = b._arena
        assert all(arena.offset_of(t) is not None for t in (io.k, io.v, io.q, io.out))
        outs = []
        for i in range(6):
            k = torch.randn(1, 2, 16, generator=gen).half()
            io.q.copy_(torch.randn(1, 4, 16, generator=gen).half())
            io.k.copy_(k)
            io.v.copy_(-k)
            got = b.append_attend("c", i % 2, ["s2"], io.k, io.v, io.q, out=io.out)
            assert got is io.out
            outs.append(got.clone())
        assert torch.equal(torch.stack(outs), want)
        with pytest.raises(TypeError, match="k: a torch.float64 tensor cannot be sent"):
            b.append_attend("c", 0, ["s2"], k.double(), k, io.q)
        info = b.sequence_info("c", "s2")                    # nothing was sent: 3 steps of 2 layers
        assert info.length == 12 + 3 and list(info.pending) == [0, 0]


def _kept(sock: str):
    """_registered's client, its buffer id, and a doorbell connection whose descriptor
    for that buffer was resolved and kept by one call."""
    kv, bid, path, token = _registered(sock)
    s = _connect(path, token)
    assert _reply(s)[0] == 0
    s.sendall(_desc(bid))
    assert _reply(s) == (0, "")            # resolved and kept for this descriptor
    return kv, bid, s


def test_unregistered_buffer_is_not_served_from_the_descriptor_cache(served):
    kv, bid, s = _kept(served[0])
    kv.stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=bid))
    kv._arena = None
    before = kv.sequence_info("c", "s")
    s.sendall(_desc(bid, layer=1))
    s.sendall(_desc(bid))
    for _ in range(2):
        code, msg = _reply(s)
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and msg.startswith("out.buffer_id: "), msg
    assert kv.sequence_info("c", "s") == before
    s.close()
    kv.close()


def test_a_buffer_shrunk_after_registration_is_refused_not_read(served):
    """A client shrinks its registered shared memory below the registered size: the
    daemon's next read or write of the pages past the end would fault (SIGBUS) and stop
    it for every tenant. A gRPC call and a doorbell call whose views were resolved
    before the shrink are FAILED_PRECONDITION naming buffer_id; nothing changes, and
    the daemon serves on."""
    kv, bid, s = _kept(served[0])
    before = kv.sequence_info("c", "s")
    # the client unlinked its file once registered: the daemon's descriptor (this process) reaches it
    fd = next(f for f in os.listdir("/proc/self/fd") if kv._arena.name in os.readlink(f"/proc/self/fd/{f}"))
    os.truncate(f"/proc/self/fd/{fd}", 4096)
    pre = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    s.sendall(_desc(bid, offs=(0, 64, 128, 8192)))
    code, msg = _reply(s)
    assert code == pre and msg.startswith("buffer_id: shared memory") and f"fewer than the {kv._arena.size}" in msg, msg
    ref = pb.Tensor(shape=[1, 2, 16], dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id=bid, offset=8192))
    with pytest.raises(grpc.RpcError) as e:
        kv.stub.Append(pb.AppendRequest(cache="c", sequence_ids=["s"], counts=[1], layer=0, k=ref, v=ref))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and e.value.details().startswith("buffer_id: ")
    assert kv.sequence_info("c", "s") == before
    s.close()
    kv.close()


def test_doorbell_calls_are_counted_in_metrics(tmp_path):
    from kvstore.service.metrics import Metrics
    metrics = Metrics()
    sock = str(tmp_path / "kv.sock")
    with _daemon(sock, metrics=metrics):
        with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
            _cache(kv, "c", "fp16")
            _steps(kv, "c", "s", 3)
            with pytest.raises(grpc.RpcError):
                kv.append_attend("c", 9, ["s"], torch.zeros(1, 2, 16).half(), torch.zeros(1, 2, 16).half(),
                                 torch.zeros(1, 4, 16).half())
            assert kv._bell is not None
        want = ['kvstore_rpc_total{code="OK",method="AppendAttendDoorbell"} 3.0',
                'kvstore_rpc_total{code="INVALID_ARGUMENT",method="AppendAttendDoorbell"} 1.0',
                'kvstore_attend_calls_total{cache="c"} 3.0']
        deadline = time.monotonic() + 10          # a call is counted just after its reply is sent
        while not all(w in (text := metrics.render()) for w in want) and time.monotonic() < deadline:
            time.sleep(0.01)
        for w in want:
            assert w in text


@pytest.mark.parametrize("message", ["", "k: shape [1, 2, 16], expected [1, 2, 8]"])
def test_client_reads_replies_with_and_without_a_message(message):
    """client/doorbell.py's reply parsing: an OK reply (no message, the per-step
    case) and an error's; a reply to another call is INTERNAL either way."""
    from kvstore.client.doorbell import Doorbell as ClientBell
    data = bell.pack_reply(7, 3 if message else 0, 42, message, pb.FLOAT16)
    assert ClientBell._reply(data, 7) == (3 if message else 0, pb.FLOAT16, 42, message)
    assert ClientBell._reply(data, 0)[3] == message         # the hello's reply: any call id
    with pytest.raises(grpc.RpcError) as e:
        ClientBell._reply(data, 8)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "reply to call 7, expected 8" in e.value.details()
    with pytest.raises(grpc.RpcError, match=""):
        ClientBell._reply(data[:bell.REPLY.size - 1], 7)


def test_a_call_interrupted_while_waiting_leaves_no_reply_for_the_next(served):
    """A signal handler raising (Ctrl-C, an alarm) while a doorbell call waits for its
    reply: the daemon runs the call, and its reply must not be read as the next call's
    (every later call would fail, having run): the connection goes, the next call opens
    another and gets its own answer."""
    import select
    sock, server = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
        _cache(kv, "c", "fp16")
        _steps(kv, "c", "s", 2)
        real, old = kv._bell._sock, kv._arena.buffer_id

        class Interrupted:
            def __getattr__(self, name):
                return getattr(real, name)

            raised = False

            def recv(self, n):
                if self.raised:
                    return real.recv(n)
                self.raised = True
                select.select([real], [], [], 10)       # the reply is there, unread
                raise KeyboardInterrupt
        kv._bell._sock = Interrupted()
        k, q = torch.randn(1, 2, 16).half(), torch.randn(1, 4, 16).half()
        with pytest.raises(KeyboardInterrupt):
            kv.append_attend("c", 0, ["s"], k, k, q)
        info = kv.sequence_info("c", "s")
        assert (info.length, list(info.pending)) == (13, [1, 0])       # it ran
        for n in range(3):                     # the step's layer 1, then whole steps
            for layer in ((1,) if n == 0 else (0, 1)):
                k, q = torch.randn(1, 2, 16).half(), torch.randn(1, 4, 16).half()
                out = kv.append_attend("c", layer, ["s"], k, k, q)
                assert torch.equal(out, kv.attend("c", layer, ["s"], q))
            assert kv.sequence_info("c", "s").length == 14 + n
        assert kv._bell is not None and not kv._bell.closed and kv._bell._sock is not real
        # its inputs' buffer is not written again (the call may still read it there): later
        # calls stage in a new one, and the old one is unregistered
        assert kv._arena.buffer_id != old
        assert old not in server.kvstore_doorbell.handlers.buffer_table.registry._bufs


def test_a_client_used_in_a_fork_child_is_refused_by_name(served):
    """After fork() the child's client would share the parent's doorbell connection and
    buffer (each process reading the other's replies and inputs): every call in the child
    is FAILED_PRECONDITION naming fork, nothing reaches the daemon, and closing it there
    leaves the parent's client working."""
    sock, _ = served
    with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
        _cache(kv, "c", "fp16")
        _steps(kv, "c", "s", 2)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                    # the child: report each call's outcome, then leave at once
            said = []
            k, q = torch.randn(1, 2, 16).half(), torch.randn(1, 4, 16).half()
            for call in (lambda: kv.append_attend("c", 0, ["s"], k, k, q), lambda: kv.stats(),
                         lambda: kv.sequence_info("c", "s"), lambda: kv.append("c", ["s"], k[None], k[None])):
                try:
                    call()
                    said.append("ran")
                except grpc.RpcError as e:
                    said.append(f"{e.code().name} {'fork()' in e.details()}")
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    said.append(repr(e))
            kv.close()
            os.write(w, "|".join(said).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        said = os.read(r, 4096).decode().split("|")
        os.close(r)
        assert said == ["FAILED_PRECONDITION True"] * 4, said
        info = kv.sequence_info("c", "s")
        assert (info.length, list(info.pending)) == (13, [0, 0])
        k, q = torch.randn(1, 2, 16).half(), torch.randn(1, 4, 16).half()
        assert torch.equal(kv.append_attend("c", 0, ["s"], k, k, q), kv.attend("c", 0, ["s"], q))


def test_connections_past_the_limit_are_told_so_and_closed_ones_free_their_slot(tmp_path):
    """Past the limit (--max-streams) a connection's hello is answered RESOURCE_EXHAUSTED
    and it closes, as the proto says, never reset before the reply is read; a connection
    a client closed frees its slot for the client's next at once."""
    sock = str(tmp_path / "kv.sock")
    with _daemon(sock, max_streams=2):
        kv, bid, path, token = _registered(sock)
        held = [_connect(path, token) for _ in range(2)]
        assert [_reply(s)[0] for s in held] == [0, 0]
        for _ in range(6):
            s = _connect(path, token)
            assert _reply(s) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                 "doorbell: all connections are taken; call AppendAttend")
            assert s.recv(100) == b""
            s.close()
        # A flood: past the connections that may wait for a slot, the daemon answers at
        # accept, with no thread to read the hello; the reply still comes before the reset.
        # (A hello sent after the daemon took and closed the connection fails at the send.)
        flood = []
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(10)
            s.connect(path)
            try:
                s.sendall(bell.HELLO.pack(bell.HELLO_MAGIC, token))
            except OSError:
                s.close()
                s = None
            flood.append(s)
        said = [_reply(s) if s is not None else "closed before the hello" for s in flood]
        for s in flood:
            if s is not None:
                s.close()
        taken = (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "doorbell: all connections are taken; call AppendAttend")
        assert set(said) <= {taken, "closed before the hello"} and taken in said, said
        for _ in range(20):         # one slot, taken and given back by the same client in turn
            held[0].close()
            held[0] = _connect(path, token)
            assert _reply(held[0])[0] == 0
        held[0].sendall(_desc(bid))
        assert _reply(held[0]) == (0, "")
        for s in held:
            s.close()
        kv.close()


def test_the_doorbell_outlives_an_accept_that_fails(served, monkeypatch, caplog):
    """An accept that fails (the daemon out of descriptors: EMFILE) is retried, logged
    once: the doorbell answers the next connections instead of ending for good."""
    import errno
    import logging
    sock, _ = served
    kv, bid, path, token = _registered(sock)
    first = _connect(path, token)
    assert _reply(first)[0] == 0         # the accept thread is waiting in the real accept again
    real, fails = socket.socket.accept, [3]

    def accept(self):
        if fails[0]:
            fails[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)
    monkeypatch.setattr(socket.socket, "accept", accept)
    with caplog.at_level(logging.WARNING, "kvstore.doorbell"):
        second = _connect(path, token)       # taken by the real accept, then three failures
        assert _reply(second)[0] == 0
        third = _connect(path, token)
        assert _reply(third)[0] == 0
    assert fails[0] == 0 and caplog.text.count("accept failed (Too many open files)") == 1
    for s in (first, second, third):
        s.close()
    kv.close()


def test_a_connection_waiting_for_a_slot_is_not_served_after_the_stop(tmp_path):
    """The doorbell's stop closes every connection it serves, the one that was waiting
    for a slot as the stop came included: it never gets a call served after it."""
    sock = str(tmp_path / "kv.sock")
    with _daemon(sock, max_streams=1) as server:
        kv, bid, path, token = _registered(sock)
        held = _connect(path, token)
        assert _reply(held)[0] == 0
        waiting = _connect(path, token)        # waits up to 0.5 s for the slot
        time.sleep(0.05)
        server.kvstore_doorbell.stop()
        held.close()                           # its slot comes free while the other waits
        waiting.settimeout(3)
        try:
            got = waiting.recv(bell.MAX_PACKET)
        except OSError:
            got = b""
        assert got == b"", "a connection was answered after the doorbell stopped"
        waiting.close()
        kv.close()
