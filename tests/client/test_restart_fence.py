"""A restart fences the sequence ids from before it: a worker naming its sequence
after the daemon restarted is told so (FAILED_PRECONDITION, x-kvstore-instance)
before the call runs, and never appends to or attends over a sequence another
worker of its tenant allocated under that id since. Told once, it goes on."""
import threading
import time

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.protocol.channel import INSTANCE_KEY, SESSION_KEY
from kvstore.service.auth import Authenticator
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16", block_size=8, num_blocks=64)
TOKEN = "fence-token-" + "f" * 16


def worker(target: str, lane: str) -> KVStoreClient:
    """A client whose append_attend goes by `lane`, in a small buffer (a larger call
    registers a new one)."""
    return KVStoreClient(target, heartbeat=False, doorbell=lane == "doorbell", stream=lane == "stream",
                         shm_bytes=4096)


def step(kv: KVStoreClient, seq: str, tokens: int = 1) -> None:
    """A decode step of seq at layer 0 (the lane the client was made for); tokens > 1:
    a multi-token one, which needs a larger buffer than the client has."""
    kv.append_attend("c", 0, [seq], torch.randn(tokens, 2, 16).half(), torch.randn(tokens, 2, 16).half(),
                     torch.randn(tokens, 4, 16).half(), query_tokens=tokens)


@pytest.mark.parametrize("lane", ["doorbell", "stream", "unary"])
def test_an_id_from_before_a_restart_never_reaches_a_sequence_allocated_since(tmp_path, lane):
    """Each call first after a restart, by each lane: a decode step, one that needs a
    larger buffer (registered anew: the doorbell's door), a Retrieve."""
    sock = str(tmp_path / "kv.sock")
    target = f"unix://{sock}"
    server, _, _ = create_server(socket_path=sock)
    a = worker(target, lane)
    b = None
    try:
        a.create_cache("c", "m", **GEOM)
        for n, call in enumerate((lambda s: step(a, s), lambda s: step(a, s, tokens=64),
                                  lambda s: a.retrieve("c", s))):
            sid = f"s{n}"
            a.allocate("c", sid, list(range(8)))
            k = torch.randn(2, 8, 2, 16).half()
            a.append("c", [sid], k, k)
            try:
                step(a, sid)
            except grpc.RpcError as e:     # the stream a restart ended, unused since: it reports that once
                assert lane == "stream" and e.code() == grpc.StatusCode.UNAVAILABLE
                step(a, sid)
            old = a.instance
            server.stop(None)
            server, _, _ = create_server(socket_path=sock)
            if b is not None:
                b.close()
            b = worker(target, lane)
            b.create_cache("c", "m", **GEOM)
            b.allocate("c", sid, list(range(8)))
            kb = torch.randn(2, 8, 2, 16).half()
            b.append("c", [sid], kb, kb)
            assert b.instance not in ("", old)
            with pytest.raises(grpc.RpcError) as e:
                call(sid)
            if lane == "stream" and e.value.code() == grpc.StatusCode.UNAVAILABLE:
                with pytest.raises(grpc.RpcError) as e:     # that was the old daemon's stream ending
                    call(sid)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(f"{INSTANCE_KEY}: ") and repr(old) in e.value.details()
            # b's sequence is as b left it
            assert b.sequence_info("c", sid).length == 8
            got_k, got_v = b.retrieve("c", sid)
            assert torch.equal(got_k, kb) and torch.equal(got_v, kb)
            # a knows the new instance: its new sequences go
            assert a.instance == b.instance
            a.allocate("c", "new", [1, 2, 3])
            a.free("c", ["new"])
    finally:
        a.close()
        if b is not None:
            b.close()
        server.stop(None)


def test_the_fence_for_a_client_written_from_the_proto(tmp_path):
    """Raw gRPC: Heartbeat tells the instance; an RPC naming sequences with another is
    refused before it runs, the current one in the trailing metadata; without the
    header, or for an RPC that names no sequence, nothing is checked; a token is
    checked first."""
    sock = str(tmp_path / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0, auth=Authenticator({TOKEN: "t"}))
    channel = grpc.insecure_channel(f"unix://{sock}")
    stub = pb_grpc.KVStoreStub(channel)
    try:
        md = ((SESSION_KEY, "w1"),)
        instance = stub.Heartbeat(pb.HeartbeatRequest(), metadata=md).instance
        assert len(instance) == 16 and int(instance, 16) >= 0
        stub.CreateCache(pb.CreateCacheRequest(spec=pb.CacheSpec(
            name="c", model_id="m", codec="fp16", block_size=8, num_blocks=64,
            geometry=pb.Geometry(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16))))
        stale = md + ((INSTANCE_KEY, "0123456789abcdef"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="s", prompt_token_ids=[1, 2]), metadata=stale)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith(f"{INSTANCE_KEY}: ") and "'0123456789abcdef'" in e.value.details()
        assert dict(e.value.trailing_metadata())[INSTANCE_KEY] == instance
        assert not stub.ListSequences(pb.ListSequencesRequest(cache="c"), metadata=stale).sequences
        assert stub.Stats(pb.StatsRequest(cache="c"), metadata=stale).caches   # names no sequence
        stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="s", prompt_token_ids=[1, 2]), metadata=md)
        now = md + ((INSTANCE_KEY, instance),)
        assert stub.SequenceInfo(pb.SequenceInfoRequest(cache="c", sequence_id="s"), metadata=now).length == 0
        # The stream is refused as it opens, before it reads a request.
        req = pb.AppendAttendRequest(cache="c", layer=0, sequence_ids=["s"])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.AppendAttendStream(iter([req]), metadata=stale))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith(f"{INSTANCE_KEY}: ")
        assert stub.SequenceInfo(pb.SequenceInfoRequest(cache="c", sequence_id="s"), metadata=now).length == 0
        # TCP without a token: UNAUTHENTICATED, and the instance is not told.
        tcp = pb_grpc.KVStoreStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as e:
            tcp.Free(pb.FreeRequest(cache="c", sequence_ids=["s"]), metadata=stale)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert INSTANCE_KEY not in dict(e.value.trailing_metadata() or ())
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("heartbeat", [False, True])
def test_every_sequence_named_before_a_restart_raises_once(tmp_path, heartbeat):
    """Told of the restart by one call (or by its heartbeat), the client still refuses
    each other sequence it named before, once, in whichever thread names it: a worker
    serving several requests is told of each, none reaches another worker's sequence.
    A sequence it forked is fenced as one it allocated."""
    sock = str(tmp_path / "kv.sock")
    target = f"unix://{sock}"
    server, _, _ = create_server(socket_path=sock)
    a = KVStoreClient(target, heartbeat=heartbeat)
    b = None
    try:
        a.create_cache("c", "m", **GEOM)
        with KVStoreClient(target, heartbeat=False) as coordinator:
            coordinator.allocate("c", "prefix", list(range(8)), pinned=True)
        a.fork("c", "prefix", "r1")
        for sid in ("s1", "s2"):
            a.allocate("c", sid, list(range(8)))
        old = a.instance
        server.stop(None)
        server, _, _ = create_server(socket_path=sock)
        b = worker(target, "unary")
        b.create_cache("c", "m", **GEOM)
        kb = torch.randn(2, 4, 2, 16).half()
        for sid in ("r1", "s1", "s2"):
            b.allocate("c", sid, [])
            b.append("c", [sid], kb, kb)
        if heartbeat:          # its heartbeat learns of the restart: no call has to find it
            deadline = time.monotonic() + 30
            while a.session.instance == old and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.session.instance == b.instance
        told = []

        def names(sid):
            with pytest.raises(grpc.RpcError) as e:
                a.append("c", [sid], kb, kb)
            told.append((sid, e.value.code(), e.value.details()))
        threads = [threading.Thread(target=names, args=(sid,)) for sid in ("r1", "s1", "s2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {sid for sid, *_ in told} == {"r1", "s1", "s2"}
        for sid, code, details in told:
            assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(f"{INSTANCE_KEY}: ")
        for sid in ("r1", "s1", "s2"):
            assert b.sequence_info("c", sid).length == 4
        # each was told once: a's calls from then on are its own business (a persist
        # sequence it goes on with; here, b's), and a new id goes at once
        a.allocate("c", "s3", [1, 2])
        a.free("c", ["s3"])
    finally:
        a.close()
        if b is not None:
            b.close()
        server.stop(None)


def test_a_call_naming_only_sequences_this_client_never_named_goes_after_a_restart(tmp_path, monkeypatch):
    """Not told of the restart yet (no heartbeat), a client allocating a new id, or
    reading a sequence another client allocated since, is refused the old instance by
    the daemon and sends the call again under the new one: nothing of its own to fence.
    The ids it remembers are the least recently named: one named again stays fenced."""
    monkeypatch.setattr("kvstore.client.session.NAMED_MAX", 3)
    sock = str(tmp_path / "kv.sock")
    target = f"unix://{sock}"
    server, _, _ = create_server(socket_path=sock)
    a = KVStoreClient(target, heartbeat=False)
    try:
        a.create_cache("c", "m", **GEOM)
        for sid in ("live", "x1", "x2", "x3"):
            a.allocate("c", sid, [1, 2])
            a.sequence_info("c", "live")          # named again: the most recently named
        old = a.instance
        server.stop(None)
        server, _, _ = create_server(socket_path=sock)
        with KVStoreClient(target, heartbeat=False) as b:
            b.create_cache("c", "m", **GEOM)
            b.allocate("c", "theirs", [5])
            b.allocate("c", "live", [5])
            assert a.allocate("c", "fresh", [1, 2, 3]) == 0           # no error: sent again
            assert a.instance == b.instance != old
            assert a.sequence_info("c", "theirs").length == 0
            with pytest.raises(grpc.RpcError) as e:
                a.sequence_info("c", "live")
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'live'" in e.value.details()
    finally:
        a.close()
        server.stop(None)


def test_a_late_reply_from_a_replaced_daemon_is_not_a_restart():
    """A reply the stopped daemon sent before it stopped can arrive after the new
    daemon's (a heartbeat in flight across two quick restarts): its instance is one the
    session saw replaced, so it is not taken, and the ids named under the new one stay
    usable rather than raising as if the daemon had restarted again."""
    from kvstore.client.session import Session
    s = Session("sess", None)
    s.replied(pb.HeartbeatReply(instance="first"))
    s.naming("c", ["a"])
    s.replied(pb.HeartbeatReply(instance="second"))
    with pytest.raises(grpc.RpcError) as e:
        s.naming("c", ["a"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    s.naming("c", ["b"])
    s.replied(pb.HeartbeatReply(instance="first"))          # late, from the daemon replaced
    assert s.instance == "second" and (INSTANCE_KEY, "second") in s.metadata
    md, fresh = s.naming("c", ["b"])                               # no second restart: b goes
    assert (INSTANCE_KEY, "second") in md and not fresh
    s.replied(pb.HeartbeatReply(instance="third"))           # a real one still is
    with pytest.raises(grpc.RpcError):
        s.naming("c", ["b"])


def test_one_id_in_two_caches_is_two_sequences_to_fence(tmp_path):
    """Ids are a cache's own, and a worker may name one id in several caches (the HF
    adapter's layer groups, a draft and a target model): told of the restart by one of
    them, it is still told of the other; freeing the id in one cache before the restart
    leaves the other's fenced."""
    sock = str(tmp_path / "kv.sock")
    target = f"unix://{sock}"
    server, _, _ = create_server(socket_path=sock)
    a = worker(target, "unary")
    b = None
    try:
        for cache in ("c", "d", "e"):
            a.create_cache(cache, "m", **GEOM)
            a.allocate(cache, "req", list(range(8)))
        a.free("e", ["req"])
        server.stop(None)
        server, _, _ = create_server(socket_path=sock)
        b = worker(target, "unary")
        kb = torch.randn(2, 4, 2, 16).half()
        for cache in ("c", "d", "e"):
            b.create_cache(cache, "m", **GEOM)
            b.allocate(cache, "req", [])
            b.append(cache, ["req"], kb, kb)
        for cache in ("c", "d"):
            with pytest.raises(grpc.RpcError) as e:
                a.append(cache, ["req"], kb, kb)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(f"{INSTANCE_KEY}: ")
            # the first told by the daemon, the second by the client, which knows of the restart
            assert (f"sequence 'req' of cache '{cache}'" in e.value.details()) == (cache == "d")
        for cache in ("c", "d", "e"):
            assert b.sequence_info(cache, "req").length == 4
        a.append("e", ["req"], kb, kb)       # freed before the restart: no longer a's to be told of
        assert b.sequence_info("e", "req").length == 8
    finally:
        a.close()
        if b is not None:
            b.close()
        server.stop(None)
