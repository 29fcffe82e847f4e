"""AppendAttendStream through the client : the same numbers, the
same errors and the same state as unary AppendAttend; replies in order, one
per request; a client shared by threads keeps its replies apart; interceptors
(auth, tenants, leases, metrics) apply; past the daemon's stream limit and
when the daemon is gone, the client behaves as with unary calls.

Each test runs the stream through grpc internals ("core", the default) and
through grpc's public API (the fallback, client/stream.py) where it matters.
"""
from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.client.stream import CallStream
from kvstore.codec.codebooks import Codebooks
from kvstore.protocol import wire
from kvstore.protocol.channel import SERVICE
from kvstore.service import leases as leases_mod
from kvstore.service.auth import Authenticator
from kvstore.service.daemon import create_server
from kvstore.service.metrics import Metrics
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

L, HQ, HKV, D = 2, 4, 2, 16
GEOM = dict(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
METHOD = f"/{SERVICE}/AppendAttendStream"
C = grpc.StatusCode


def client(target: str, core: bool = True, **kw) -> KVStoreClient:
    kv = KVStoreClient(target, heartbeat=False, **{"doorbell": False, **kw})    # the stream, not the doorbell
    if kv._stream is not None and not core:
        kv._stream = CallStream(kv.channel, METHOD, kv.session.md, core=False)
    return kv


def make_cache(kv: KVStoreClient, codec: str, name: str | None = None, **kw) -> str:
    name = name or codec
    kv.create_cache(name, "m", codec=codec, block_size=8, residual=8, num_blocks=kw.pop("num_blocks", 64),
                    max_sequences=8, **GEOM, **kw)
    if codec == "pq":
        g = torch.Generator().manual_seed(1)
        kv.set_codebooks(name, Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                                         v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)).to_bytes())
    return name


def steps(n: int, seed: int, b: int = 1) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n decode calls (layer, k, v, q), layers alternating so tokens commit."""
    g = torch.Generator().manual_seed(seed)
    return [(i % L, torch.randn(b, HKV, D, generator=g).half(), torch.randn(b, HKV, D, generator=g).half(),
             torch.randn(b, HQ, D, generator=g).half()) for i in range(n)]


def prefill(kv: KVStoreClient, cache: str, seq: str, n: int = 20, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.allocate(cache, seq, [])
    k, v = torch.randn(L, n, HKV, D, generator=g).half(), torch.randn(L, n, HKV, D, generator=g).half()
    kv.append(cache, [seq], k, v)


def state(kv: KVStoreClient, cache: str, seq: str) -> tuple:
    info = kv.sequence_info(cache, seq)
    k, v = kv.retrieve(cache, seq, 0, info.length) if info.length else (None, None)
    info.ClearField("sequence_id")
    info.ClearField("owner_session")
    info.ClearField("sealed_blocks")     # block ids differ between twin sequences; their contents do not
    info.ClearField("tail_blocks")
    return info.SerializeToString(deterministic=True), k, v


def same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[1] is None) == (b[1] is None) and (a[1] is None or (
        torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])))


# ------------------------------------------------------------------ numbers
@pytest.mark.parametrize("core", [True, False], ids=["core", "public"])
@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_stream_equals_unary_bit_for_bit(daemon, codec, transport, core):
    uni = client(daemon, transport=transport, stream=False)
    st = client(daemon, core, transport=transport)
    try:
        assert uni._stream is None and st._stream is not None and st.transport == transport
        make_cache(uni, codec)
        prefill(uni, codec, "u")
        prefill(st, codec, "s")
        for layer, k, v, q in steps(40, seed=2):        # 20 tokens: PQ seals blocks on the way
            want = uni.append_attend(codec, layer, ["u"], k, v, q)
            got = st.append_attend(codec, layer, ["s"], k, v, q)
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert st._stream.opened == 1
        su, ss = state(uni, codec, "u"), state(st, codec, "s")
        assert same_state(su, ss)
        if codec == "pq":
            assert len(st.sequence_info(codec, "s").sealed_blocks) >= 3
    finally:
        uni.close()
        st.close()


def test_batched_stream_equals_unary(daemon):
    uni, st = client(daemon, stream=False), client(daemon)
    try:
        make_cache(uni, "pq")
        for seq, seed in (("a", 0), ("b", 1)):
            prefill(uni, "pq", "u" + seq, seed=seed)
            prefill(st, "pq", "s" + seq, seed=seed)
        for layer, k, v, q in steps(12, seed=3, b=2):
            want = uni.append_attend("pq", layer, ["ua", "ub"], k, v, q)
            assert torch.equal(st.append_attend("pq", layer, ["sa", "sb"], k, v, q), want)
    finally:
        uni.close()
        st.close()


# ------------------------------------------------------------------- errors
NAN = torch.full((1, HKV, D), math.nan).half()
BAD = {
    "layer": (dict(layer=L), C.INVALID_ARGUMENT, "layer"),
    "sequence": (dict(seqs=["nope"]), C.NOT_FOUND, "sequence_ids"),
    "cache": (dict(cache="nope"), C.NOT_FOUND, "cache"),
    "k-nan": (dict(k=NAN), C.INVALID_ARGUMENT, "k"),
    "q-heads": (dict(q=torch.zeros(1, HKV, D).half()), C.INVALID_ARGUMENT, "q"),
    "scale": (dict(scale=-1.0), C.INVALID_ARGUMENT, "scale"),
}


@pytest.mark.parametrize("core", [True, False], ids=["core", "public"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_call_over_stream_is_the_unary_error_and_changes_nothing(daemon, bad, core):
    uni, st = client(daemon, stream=False), client(daemon, core)
    try:
        make_cache(uni, "pq")
        prefill(uni, "pq", "u")
        prefill(st, "pq", "s")
        calls = steps(4, seed=5)
        for layer, k, v, q in calls[:2]:
            assert torch.equal(st.append_attend("pq", layer, ["s"], k, v, q), uni.append_attend("pq", layer, ["u"], k, v, q))
        before = state(st, "pq", "s")
        kw, code, field = BAD[bad]
        errors = []
        for kv, seq in ((uni, "u"), (st, "s")):
            layer, k, v, q = calls[2]
            args = dict(cache="pq", layer=layer, seqs=[seq], k=k, v=v, q=q, scale=0.0)
            args.update(kw)
            with pytest.raises(grpc.RpcError) as info:
                kv.append_attend(args["cache"], args["layer"], args["seqs"], args["k"], args["v"], args["q"],
                                 args["scale"])
            errors.append(info.value)
        eu, es = errors
        assert type(es) is type(eu)
        assert (es.code(), es.details()) == (eu.code(), eu.details())
        assert es.code() == code and es.details().startswith(field), es.details()
        assert same_state(state(st, "pq", "s"), before)
        assert same_state(state(st, "pq", "s"), state(uni, "pq", "u"))
        # The next call opens a new stream and goes on as if nothing happened.
        for layer, k, v, q in calls[2:]:
            assert torch.equal(st.append_attend("pq", layer, ["s"], k, v, q), uni.append_attend("pq", layer, ["u"], k, v, q))
        assert st._stream.opened == 2 and st._stream_retry_at == 0.0
    finally:
        uni.close()
        st.close()


def test_pool_exhausted_over_stream_is_not_a_refused_stream(daemon):
    """RESOURCE_EXHAUSTED of a call (no room) is the call's error, not the
    daemon's stream limit: raised, and the client stays on its stream."""
    uni, st = client(daemon, stream=False), client(daemon)
    try:
        make_cache(uni, "fp16", "tiny", num_blocks=2)
        prefill(uni, "tiny", "full", n=16)             # both blocks
        uni.allocate("tiny", "e", [])
        layer, k, v, q = steps(1, seed=0)[0]
        before = state(uni, "tiny", "full"), state(uni, "tiny", "e")
        errs = []
        for kv in (uni, st):
            with pytest.raises(grpc.RpcError) as info:
                kv.append_attend("tiny", layer, ["e"], k, v, q)
            errs.append(info.value)
        assert errs[0].code() == errs[1].code() == C.RESOURCE_EXHAUSTED
        assert errs[0].details() == errs[1].details()
        assert same_state(before[0], state(uni, "tiny", "full")) and same_state(before[1], state(uni, "tiny", "e"))
        assert st._stream_retry_at == 0.0 and st._stream.opened == 1
    finally:
        uni.close()
        st.close()


def test_malformed_bytes_on_the_stream(daemon):
    ch = grpc.insecure_channel(daemon)
    try:
        call = ch.stream_stream(METHOD)         # raw bytes in and out
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\x0a\xff\xff\xff\xff\x0f garbage"]), timeout=30))
        assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("request")
    finally:
        ch.close()


def test_a_bad_session_id_ends_the_stream_before_any_message(daemon):
    """x-kvstore-session is checked when the stream opens, as a call's is: an
    empty stream with a bad one is INVALID_ARGUMENT naming it, not OK."""
    ch = grpc.insecure_channel(daemon)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.KVStoreStub(ch).AppendAttendStream(iter([]), timeout=30,
                                                            metadata=(("x-kvstore-session", "bad id"),)))
        assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("x-kvstore-session")
    finally:
        ch.close()


# ------------------------------------------------------------------- order
def test_pipelined_requests_get_one_reply_each_in_order(daemon):
    """Many requests written ahead of the replies (raw stub): one reply per
    request, each the one unary AppendAttend gives at that point."""
    uni = client(daemon, stream=False)
    ch = grpc.insecure_channel(daemon)
    try:
        make_cache(uni, "pq")
        prefill(uni, "pq", "u")
        prefill(uni, "pq", "s")
        calls = steps(64, seed=7)

        def req(seq, layer, k, v, q):
            return pb.AppendAttendRequest(cache="pq", layer=layer, sequence_ids=[seq], k=wire.to_proto(k),
                                          v=wire.to_proto(v), q=wire.to_proto(q))
        replies = list(pb_grpc.KVStoreStub(ch).AppendAttendStream(iter([req("s", *c) for c in calls]), timeout=60))
        assert len(replies) == len(calls)
        for (layer, k, v, q), r in zip(calls, replies):
            want = uni.append_attend("pq", layer, ["u"], k, v, q)
            assert torch.equal(wire.from_proto(r.out, None, "out"), want)
    finally:
        ch.close()
        uni.close()


@pytest.mark.parametrize("core", [True, False], ids=["core", "public"])
def test_threads_sharing_a_client_get_their_own_replies(daemon, core):
    st = client(daemon, core)
    uni = client(daemon, stream=False)
    try:
        make_cache(uni, "fp16")
        plans = {i: steps(30, seed=10 + i) for i in range(3)}
        for i in plans:
            prefill(st, "fp16", f"s{i}", seed=i)
            prefill(uni, "fp16", f"u{i}", seed=i)
        got: dict[int, list[torch.Tensor]] = {i: [] for i in plans}
        start = threading.Barrier(len(plans))
        errors = []

        def run(i):
            try:
                start.wait()
                for layer, k, v, q in plans[i]:
                    got[i].append(st.append_attend("fp16", layer, [f"s{i}"], k, v, q))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i, plan in plans.items():
            for (layer, k, v, q), out in zip(plan, got[i]):
                assert torch.equal(out, uni.append_attend("fp16", layer, [f"u{i}"], k, v, q))
        assert st._stream.opened == 1
    finally:
        st.close()
        uni.close()


# ------------------------------------------------- interceptors and daemon
def test_stream_calls_are_metered_and_renew_the_lease(tmp_path, monkeypatch):
    touched = []
    real = leases_mod.LeaseManager.enter          # each message renews the lease as a call begins
    monkeypatch.setattr(leases_mod.LeaseManager, "enter",
                        lambda self, tenant, session: (touched.append((tenant, session)), real(self, tenant, session)))
    metrics = Metrics()
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock, metrics=metrics)
    st = client(f"unix://{sock}")
    try:
        make_cache(st, "fp16")
        prefill(st, "fp16", "s")
        n0 = touched.count(("default", st.session_id))
        for layer, k, v, q in steps(5, seed=1):
            st.append_attend("fp16", layer, ["s"], k, v, q)
        assert touched.count(("default", st.session_id)) == n0 + 5
        with pytest.raises(grpc.RpcError):
            st.append_attend("fp16", L, ["s"], k, v, q)
        text = metrics.render()
        assert 'kvstore_rpc_total{code="OK",method="AppendAttendStream"} 5.0' in text
        assert 'kvstore_rpc_total{code="INVALID_ARGUMENT",method="AppendAttendStream"} 1.0' in text
        assert 'kvstore_rpc_duration_seconds_count{method="AppendAttendStream"} 6.0' in text
        assert 'method="AppendAttend"}' not in text
    finally:
        st.close()
        server.stop(0)


TOKEN_A, TOKEN_B = "stream-token-a-0123456789", "stream-token-b-0123456789"


def test_stream_over_tcp_needs_a_token_and_keeps_tenants_apart(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0,
                                    auth=Authenticator({TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}))
    tcp = f"127.0.0.1:{port}"
    a = client(tcp, token=TOKEN_A, stream=True)
    clients = [a]
    try:
        assert a.transport == "inline"
        make_cache(a, "fp16")
        prefill(a, "fp16", "s")
        layer, k, v, q = steps(1, seed=0)[0]
        a.append_attend("fp16", layer, ["s"], k, v, q)
        assert a._stream.opened == 1
        for token, code, field in ((None, C.UNAUTHENTICATED, "authorization"), (TOKEN_B, C.NOT_FOUND, "sequence_ids")):
            errs = []
            for stream in (True, False):
                kv = client(tcp, token=token, stream=stream)
                clients.append(kv)
                with pytest.raises(grpc.RpcError) as info:
                    kv.append_attend("fp16", 1, ["s"], k, v, q)
                errs.append(info.value)
            assert errs[0].code() == errs[1].code() == code and errs[0].details() == errs[1].details()
            assert errs[0].details().startswith(field)
        assert a.sequence_info("fp16", "s").pending == [1, 0]    # tenant b's call did not land
    finally:
        for kv in clients:
            kv.close()
        server.stop(0)


def test_past_the_stream_limit_the_client_calls_unary(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock, max_streams=1)
    target = f"unix://{sock}"
    a, b, uni = client(target), client(target), client(target, stream=False)
    try:
        make_cache(uni, "fp16")
        for kv, seq in ((a, "a"), (b, "b"), (uni, "u")):
            prefill(kv, "fp16", seq)
        calls = steps(4, seed=3)
        layer, k, v, q = calls[0]
        want = uni.append_attend("fp16", layer, ["u"], k, v, q)
        assert torch.equal(a.append_attend("fp16", layer, ["a"], k, v, q), want)     # a holds the one stream
        assert torch.equal(b.append_attend("fp16", layer, ["b"], k, v, q), want)     # refused: sent unary
        assert b._stream_retry_at > 0 and a._stream_retry_at == 0.0
        assert same_state(state(b, "fp16", "b"), state(uni, "fp16", "u"))           # sent once, not twice
        a._stream.close()                        # gives its stream back
        b._stream_retry_at = 0.0                 # as after STREAM_RETRY_S
        for layer, k, v, q in calls[1:]:
            want = uni.append_attend("fp16", layer, ["u"], k, v, q)
            assert torch.equal(b.append_attend("fp16", layer, ["b"], k, v, q), want)
        assert b._stream_retry_at == 0.0 and b._stream.opened == 2
    finally:
        for kv in (a, b, uni):
            kv.close()
        server.stop(0)


def test_daemon_gone_is_unavailable_then_a_new_daemon_is_reached(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    target = f"unix://{sock}"
    st, uni = client(target), client(target, stream=False)
    try:
        make_cache(st, "fp16")
        prefill(st, "fp16", "s")
        assert uni.instance == st.instance       # both name sequences of this daemon
        layer, k, v, q = steps(1, seed=0)[0]
        st.append_attend("fp16", layer, ["s"], k, v, q)
        server.stop(None).wait()
        for kv in (st, uni):
            with pytest.raises(grpc.RpcError) as info:
                kv.append_attend("fp16", layer, ["s"], k, v, q)
            assert info.value.code() == C.UNAVAILABLE, info.value
        server, _, _ = create_server(socket_path=sock)        # a restarted daemon: empty
        # Told of the restart first (the id may name a sequence allocated since), then the
        # same call finds no sequence: each the same on both lanes.
        for kv in (st, uni):
            grpc.channel_ready_future(kv.channel).result(timeout=30)    # past the channel's reconnect backoff
        for code in (C.FAILED_PRECONDITION, C.NOT_FOUND):
            errs = []
            for kv in (st, uni):
                with pytest.raises(grpc.RpcError) as info:
                    kv.append_attend("fp16", layer, ["s"], k, v, q)
                errs.append(info.value)
            assert errs[0].code() == errs[1].code() == code and errs[0].details() == errs[1].details()
    finally:
        st.close()
        uni.close()
        server.stop(0)


@pytest.mark.parametrize("core", [True, False], ids=["core", "public"])
def test_a_stuck_daemon_is_deadline_exceeded_then_the_stream_reopens(tmp_path, core):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    target = f"unix://{sock}"
    st, uni = client(target, core), client(target, stream=False)
    try:
        make_cache(st, "fp16")
        for kv, seq in ((st, "s"), (uni, "u")):
            prefill(kv, "fp16", seq)
        calls = steps(3, seed=0)
        layer, k, v, q = calls[0]
        st.append_attend("fp16", layer, ["s"], k, v, q)
        uni.append_attend("fp16", layer, ["u"], k, v, q)
        errs = []
        with server.kvstore_engine.cache("fp16").lock:     # every call on the cache waits
            for kv, seq in ((st, "s"), (uni, "u")):
                kv.timeout = 0.3
                with pytest.raises(grpc.RpcError) as info:
                    kv.append_attend("fp16", 1, [seq], k, v, q)
                errs.append(info.value)
                kv.timeout = 60
        assert type(errs[0]) is type(errs[1])
        assert errs[0].code() == errs[1].code() == C.DEADLINE_EXCEEDED
        # the calls given up on may still read their inputs in the daemon: not staged over
        old = st._abandoned[0]
        assert st._arena is None and uni._arena is None and len(uni._abandoned) == 1
        layer, k, v, q = calls[2]
        st.append_attend("fp16", 0, ["s"], k, v, q)
        assert st._stream.opened == 2
        assert st._arena.buffer_id != old and not st._abandoned
        # The watchdog firing just as a call came back cancels a stream with nothing in flight:
        # the next call must not inherit that deadline.
        s = st._stream
        with s._wlock:
            s._expired = True
            s._cancel_core(s._call) if s._core else s._cancel_public(s._call)
        st.append_attend("fp16", 1, ["s"], k, v, q)
        assert s.opened == 3
    finally:
        st.close()
        uni.close()
        server.stop(0)


class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("core", [True, False], ids=["core", "public"])
def test_a_signal_during_a_call_leaves_the_stream_in_order(tmp_path, core):
    """Ctrl-C while a call waits (a signal handler raises): the next call gets
    its own reply, on a new stream, not the interrupted call's."""
    import os
    import signal
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    target = f"unix://{sock}"
    st, uni = client(target, core), client(target, stream=False)

    def handler(signum, frame):
        raise _Interrupt
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        make_cache(st, "fp16")
        for kv, seq in ((st, "s"), (st, "s2"), (uni, "u2")):
            prefill(kv, "fp16", seq)
        layer, k, v, q = steps(1, seed=0)[0]
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        with server.kvstore_engine.cache("fp16").lock:   # the call waits for its reply until the signal
            timer.start()
            with pytest.raises(_Interrupt):
                st.append_attend("fp16", layer, ["s"], k, v, q)
        timer.join()
        for layer, k, v, q in steps(4, seed=9):
            assert torch.equal(st.append_attend("fp16", layer, ["s2"], k, v, q),
                               uni.append_attend("fp16", layer, ["u2"], k, v, q))
        assert st._stream.opened == 2
    finally:
        signal.signal(signal.SIGUSR1, old)
        st.close()
        uni.close()
        server.stop(0)


def test_at_a_stop_open_streams_between_messages_do_not_wait_out_the_grace(tmp_path):
    """A stop gives calls at work their grace; a worker's open stream waiting for its
    next message is none: once only such streams are left the server stops at once, and
    the stream's next message finds the daemon gone."""
    from kvstore.service.daemon import cut_idle_streams
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    st = client(f"unix://{sock}", True)
    try:
        make_cache(st, "fp16")
        prefill(st, "fp16", "s")
        layer, k, v, q = steps(1, seed=0)[0]
        st.append_attend("fp16", layer, ["s"], k, v, q)
        assert st._stream.opened == 1
        assert [m for m, _ in server.kvstore_calls.running()] == ["AppendAttendStream"]
        stopping = server.stop(grace=30)
        cut_idle_streams(server, time.monotonic() + 30)
        assert stopping.wait(10)                  # not the 30 s grace
        with pytest.raises(grpc.RpcError) as e:
            st.append_attend("fp16", 1, ["s"], k, v, q)
        assert e.value.code() in (C.UNAVAILABLE, C.CANCELLED)
    finally:
        st.close()
        server.stop(0)
