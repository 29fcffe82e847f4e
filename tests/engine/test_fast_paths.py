"""The per-call fast paths (bench/bench_rpc.py) give the same
numbers and the same errors as the general ones: CPU decode attention vs the
reference, the slot-by-slot decode write vs the scatter, the finiteness check
vs isfinite, and cached buffer views that never outlive their buffer."""
from __future__ import annotations

import math
import mmap
import os
import secrets

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.checks import check_values
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument, NotFound
from kvstore.kernels import cpu_decode
from kvstore.kernels import reference as ref
from kvstore.service.buffers import BufferRegistry
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from tests.helpers import config, kv as kv_data


# ------------------------------------------------------------- kernels
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("n", [1, 17, 54])
def test_cpu_decode_matches_reference_fp16(hq, hkv, n):
    g = torch.Generator().manual_seed(n)
    nb, bs, d = 16, 8, 64
    kp = torch.randn(nb, hkv, bs, d, generator=g).half()
    vp = torch.randn(nb, hkv, bs, d, generator=g).half()
    blocks = torch.randperm(nb, generator=g)[:math.ceil(n / bs)].tolist()
    q = torch.randn(hq, d, generator=g).half()
    want, _ = ref.paged_decode_attention(q[None], kp, vp, torch.tensor([blocks], dtype=torch.int32), [n], 0.125)
    k = cpu_decode.gather_tokens(kp, torch.tensor(blocks), n)
    v = cpu_decode.gather_tokens(vp, torch.tensor(blocks), n)
    assert k.shape == (hkv, n, d) and k.dtype == torch.float32
    out = cpu_decode.attend_one(q, k, v, 0.125)
    assert (out.half().float() - want[0].float()).abs().max().item() < 2e-3


@pytest.mark.parametrize("sealed,tail", [(1, 1), (3, 17), (2, 0)])
def test_cpu_decode_matches_reference_pq(sealed, tail):
    g = torch.Generator().manual_seed(sealed * 100 + tail)
    nb, hq, hkv, bs, d, m = 12, 4, 2, 16, 64, 32
    kc = torch.randint(0, 256, (nb, hkv, bs, m), dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 256, (nb, hkv, m, bs), dtype=torch.uint8, generator=g)
    kcb, vcb = torch.randn(hkv, m, 256, d // m, generator=g), torch.randn(hkv, m, 256, d // m, generator=g)
    tk, tv = torch.randn(nb, hkv, bs, d, generator=g).half(), torch.randn(nb, hkv, bs, d, generator=g).half()
    sb, tb = [5, 2, 9][:sealed], [7, 1][:max(1, math.ceil(tail / bs))]
    q = torch.randn(1, hq, d, generator=g).half()
    want, _ = ref.pq_decode_attention(q, kc, vc, kcb, vcb, torch.tensor([sb], dtype=torch.int32), [sealed * bs],
                                      tk, tv, torch.tensor([tb], dtype=torch.int32), [tail], 0.125)
    ks, vs = cpu_decode.dequantize_tokens(kc, vc, kcb, vcb, sb)
    rk, rv = ref.gather_pq_blocks(kc, vc, kcb, vcb, torch.tensor(sb))
    assert torch.equal(ks, rk.transpose(0, 1)) and torch.equal(vs, rv.transpose(0, 1))
    k = torch.cat([ks, cpu_decode.gather_tokens(tk, torch.tensor(tb), tail)], dim=1)
    v = torch.cat([vs, cpu_decode.gather_tokens(tv, torch.tensor(tb), tail)], dim=1)
    out = cpu_decode.attend_one(q[0], k, v, 0.125)
    assert (out.half().float() - want[0].float()).abs().max().item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_value_check_is_exact(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((4096,), big, dtype=dtype)       # a sum that overflows the input dtype: still finite
    for ok in (x, -x, torch.empty(0, dtype=dtype)):
        check_values(ok, "k", big, converted=False)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[17] = bad
        with pytest.raises(InvalidArgument, match="^k: contains"):
            check_values(y, "k", big, converted=False)
    y = x.clone()
    y[0], y[1] = float("inf"), -float("inf")          # inf - inf: the sum is NaN, still caught
    with pytest.raises(InvalidArgument):
        check_values(y, "k", big, converted=False)
    with pytest.raises(InvalidArgument, match="holds"):     # finite, past a tighter limit
        check_values(x, "q", big / 2, converted=False)


def test_decode_write_slot_by_slot_equals_scatter():
    """Per-layer appends of few tokens (slot by slot) and of many (one scatter)
    put every token where Retrieve finds it, across block boundaries and seals."""
    from kvstore.engine.write_path import SMALL_WRITE
    steps = 20
    for n in (1, 3, SMALL_WRITE + 1):
        for codec in ("fp16", "pq"):
            e = Engine()
            e.create_cache(config(codec, block_size=8, residual=8))
            if codec == "pq":
                from kvstore.codec.codebooks import Codebooks
                g = torch.Generator().manual_seed(0)
                e.set_codebooks("c", Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g),
                                               v=torch.randn(2, 2, 8, 256, 2, generator=g)))
            ids = [f"s{i}" for i in range(n)]
            for sid in ids:
                e.allocate("c", "t", sid, [])
            k, v = kv_data(2, steps * n, 2, 16, seed=3)
            for step in range(steps):
                for layer in range(2):
                    rows = slice(step * n, (step + 1) * n)
                    e.append("c", "t", ids, k[layer, rows], v[layer, rows], [1] * n, layer=layer)
            c = e.cache("c")
            for i, sid in enumerate(ids):
                s = c.seq("t", sid)
                assert s.length == steps
                start = len(s.sealed) * c.bs           # tail tokens are exact in both codecs
                gk, gv = c.retrieve(s, start, steps, slice(0, 2))
                assert torch.equal(gk, k[:, i::n][:, start:steps]) and torch.equal(gv, v[:, i::n][:, start:steps])
                if codec == "fp16":
                    gk, _ = c.retrieve(s, 0, steps, slice(0, 2))
                    assert torch.equal(gk, k[:, i::n][:, :steps])


# ------------------------------------------------------------- buffer views
def _shm(size: int) -> tuple[str, mmap.mmap]:
    name = f"kvtest-{secrets.token_hex(6)}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    os.close(fd)
    return name, mm


def test_registry_views_are_dropped_with_their_buffer():
    reg = BufferRegistry()
    name, mm = _shm(4096)
    try:
        bid = reg.register_shm(name, 4096)
        mm[64:66] = torch.tensor([1.5], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
        v = reg.view(bid, 64, (1,), torch.float16)
        assert reg.view(bid, 64, (1,), torch.float16) is v and v.item() == 1.5     # cached, live data
        mm[64:66] = torch.tensor([-2.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
        assert reg.view(bid, 64, (1,), torch.float16).item() == -2.0
        reg.unregister(bid)
        assert not reg._views
        with pytest.raises(NotFound):
            reg.view(bid, 64, (1,), torch.float16)
        bid2 = reg.register_shm(name, 4096)
        assert bid2 != bid and reg.view(bid2, 64, (1,), torch.float16).item() == -2.0
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def live(tmp_path):
    engine = Engine()
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(engine, socket_path=sock)
    kv = KVStoreClient(f"unix://{sock}", transport="inline")
    kv.create_cache("c", "m", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16",
                    block_size=8, num_blocks=64)
    kv.allocate("c", "s", [])
    k, v = kv_data(2, 5, 2, 16, seed=1)
    kv.append("c", ["s"], k, v)
    yield engine, server, kv, sock
    kv.close()
    server.stop(0)


def _put(mm, off: int, t: torch.Tensor) -> pb.Tensor:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    mm[off:off + len(raw)] = raw
    return raw


def test_released_buffer_serves_no_stale_view(live):
    """An AppendAttend through a buffer caches its views; after UnregisterBuffer
    the same request is NOT_FOUND on buffer_id and changes nothing, and a new
    buffer holding other numbers gives the answer for those numbers."""
    engine, server, kv, sock = live
    md = (("x-kvstore-session", kv.session_id),)
    stub = pb_grpc.KVStoreStub(kv.channel)
    name, mm = _shm(8192)
    try:
        g = torch.Generator().manual_seed(7)
        k1 = torch.randn(1, 2, 16, generator=g).half()
        q = torch.randn(1, 4, 16, generator=g).half()

        def request(bid, layer):
            def ref_(off, t):
                return pb.Tensor(shape=list(t.shape), dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id=bid, offset=off))
            return pb.AppendAttendRequest(cache="c", layer=layer, sequence_ids=["s"], k=ref_(0, k1), v=ref_(64, k1),
                                          q=ref_(128, q), out=pb.OutputRef(buffer_id=bid, offset=256))

        def out_of(mm_):
            return torch.frombuffer(bytearray(mm_[256:256 + q.numel() * 2]), dtype=torch.float16).view(q.shape)

        bid = stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=name, size=8192), metadata=md).buffer_id
        for off, t in ((0, k1), (64, k1), (128, q)):
            _put(mm, off, t)
        stub.AppendAttend(request(bid, 0), metadata=md)
        first = out_of(mm)
        want = kv.attend("c", 0, ["s"], q)           # inline path: no views at all
        assert torch.equal(first, want)
        stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=bid), metadata=md)
        before = kv.sequence_info("c", "s")
        with pytest.raises(grpc.RpcError) as e:
            stub.AppendAttend(request(bid, 1), metadata=md)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("out.buffer_id: ")
        assert kv.sequence_info("c", "s") == before
        # Same shared memory, new registration, new numbers: the answer is for the new numbers.
        q2 = -q
        _put(mm, 128, q2)
        bid2 = stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=name, size=8192), metadata=md).buffer_id
        stub.AppendAttend(request(bid2, 1), metadata=md)
        assert torch.equal(out_of(mm), kv.attend("c", 1, ["s"], q2))
        assert not torch.equal(out_of(mm), first)
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_cached_view_is_not_served_to_another_tenant(tmp_path):
    """A buffer's views are cached by one tenant's calls; another tenant naming
    the same buffer id still gets NOT_FOUND."""
    from kvstore.service.auth import Authenticator
    tokens = {"a" * 16: "ta", "b" * 16: "tb"}
    engine = Engine()
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(engine, socket_path=sock, auth=Authenticator(tokens, unix_tenant=None))
    try:
        a = KVStoreClient(f"unix://{sock}", token="a" * 16)
        b = KVStoreClient(f"unix://{sock}", token="b" * 16)
        for c, tenant in ((a, "a"), (b, "b")):
            c.create_cache("c", "m", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16",
                           block_size=8, num_blocks=64, exist_ok=True)
            c.allocate("c", tenant, [])
        k1 = torch.randn(1, 2, 16).half()
        q = torch.randn(1, 4, 16).half()
        a.append_attend("c", 0, ["a"], k1, k1, q)       # through a's shm arena: views cached
        bid = a._arena.buffer_id
        req = pb.AttendRequest(cache="c", layer=0, sequence_ids=["b"],
                               q=pb.Tensor(shape=[1, 4, 16], dtype=pb.FLOAT16, ref=pb.BufferRef(buffer_id=bid)))
        b.append_attend("c", 0, ["b"], k1, k1, q)
        with pytest.raises(grpc.RpcError) as e:
            b.stub.Attend(req)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("q.ref.buffer_id: ")
        a.close()
        b.close()
    finally:
        server.stop(0)


# ------------------------------------------------------------- CUDA call scope (fakes: runs on CPU)
@pytest.mark.parametrize("busy", [True, False], ids=["default-busy", "default-idle"])
def test_cuda_scope_orders_through_a_reused_fence(monkeypatch, busy):
    """The call scope's device-side ordering, step by step, with stand-ins for
    torch.cuda (the GPU tests run it for real): after the daemon's default
    stream (when it has work left) and the client's ready event, then done,
    then back to default, which waits for done; the fence event is made once
    per thread and device and reused."""
    import threading

    from kvstore.cuda import scope as call_scope

    log = []

    class Ev:
        made = 0

        def __init__(self, name=None):
            Ev.made += 1
            self.name = name or f"fence{Ev.made}"

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    class St:
        def __init__(self, name):
            self.name, self.device = name, "cuda:0"

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.name))

        def query(self):
            log.append(("query", self.name))
            return not busy

    class Ctx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(("enter", self.stream.name))

        def __exit__(self, *exc):
            log.append(("exit", self.stream.name))

    class Dev:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    default, mine = St("default"), St("daemon")
    monkeypatch.setattr(torch.cuda, "Event", lambda: Ev())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    monkeypatch.setattr(torch.cuda, "device", Dev)
    fences = call_scope.Fences()
    f = fences.get(mine.device)
    assert fences.get(mine.device) is f
    other = []
    th = threading.Thread(target=lambda: other.append(fences.get(mine.device)))
    th.start()
    th.join()
    assert other[0] is not f                     # per thread: concurrent calls never share a fence
    made = Ev.made
    for _ in range(2):                           # a second call makes no new event
        log.clear()
        with call_scope.CudaScope(mine, Ev("ready"), Ev("done"), f):
            log.append(("work",))
        fence = [("record", f.name, "default"), ("wait", "daemon", f.name)] if busy else []
        assert log == [("query", "default"), *fence, ("wait", "daemon", "ready"),
                       ("enter", "daemon"), ("work",), ("record", "done", "daemon"), ("exit", "daemon"),
                       ("wait", "default", "done")]
    assert Ev.made == made + 4                   # only the ready/done stand-ins of the two calls


@pytest.mark.parametrize("busy", [True, False], ids=["default-busy", "default-idle"])
def test_cuda_scope_through_the_runtime_makes_the_same_calls(monkeypatch, busy):
    """On the current device the scope's CUDA calls go through cupy's runtime
    on raw handles (a stand-in here): the same calls in the same order as
    torch's, and torch's own for an event torch has not created yet."""
    from kvstore.cuda import scope as call_scope, runtime as cuda_rt

    log = []

    class Rt:
        def streamQuery(self, s):
            log.append(("query", s))
            return 600 if busy else 0       # cudaErrorNotReady

        def eventRecord(self, e, s):
            log.append(("record", e, s))

        def streamWaitEvent(self, s, e, flags):
            log.append(("wait", s, e))

    class Ev:
        def __init__(self, handle):
            self.cuda_event = handle

        def record(self, stream):           # torch's call: makes the event
            log.append(("torch record", stream.cuda_stream))
            self.cuda_event = 99

    class St:
        device, device_index = "cuda:0", 0

        def __init__(self, handle):
            self.cuda_stream = handle

    default, mine = St(0), St(7)
    monkeypatch.setattr(cuda_rt, "runtime", lambda: Rt())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("set", s.cuda_stream)))
    fence = Ev(0)
    for first in (True, False):
        log.clear()
        with call_scope.CudaScope(mine, Ev(11), Ev(12), fence):
            log.append(("work",))
        rec = [("torch record", 0) if first else ("record", 99, 0), ("wait", 7, 99)] if busy else []
        assert log == [("query", 0), *rec, ("wait", 7, 11), ("set", 7), ("work",), ("record", 12, 7),
                       ("set", 0), ("wait", 0, 12)]
