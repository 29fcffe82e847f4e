"""A restart fences the sequence ids from before it: a worker naming its sequence
after the daemon restarted is told so (FAILED_PRECONDITION, x-kvstore-instance)
before the call runs, and never appends to or attends over a sequence another
worker of its tenant allocated under that id since. Told once, it goes on."""
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
    sock = str(tmp_path / "kv.sock")
    target = f"unix://{sock}"
    server, _, _ = create_server(socket_path=sock)
    a = worker(target, lane)
    b = None
    try:
        a.create_cache("c", "m", **GEOM)
        a.allocate("c", "s", list(range(8)))
        k = torch.randn(2, 8, 2, 16).half()
        a.append("c", ["s"], k, k)
        step(a, "s")
        old = a.instance
        server.stop(None)
        server, _, _ = create_server(socket_path=sock)
        b = worker(target, lane)
        b.create_cache("c", "m", **GEOM)
        b.allocate("c", "s", list(range(8)))
        kb = torch.randn(2, 8, 2, 16).half()
        b.append("c", ["s"], kb, kb)
        assert b.instance not in ("", old)

        for call in (lambda: step(a, "s"), lambda: step(a, "s", tokens=64), lambda: a.retrieve("c", "s")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            if lane == "stream" and e.value.code() == grpc.StatusCode.UNAVAILABLE:
                with pytest.raises(grpc.RpcError) as e:     # that was the old daemon's stream ending
                    call()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(f"{INSTANCE_KEY}: ") and repr(old) in e.value.details()
            # b's sequence is as b left it
            assert b.sequence_info("c", "s").length == 8
            got_k, got_v = b.retrieve("c", "s")
            assert torch.equal(got_k, kb) and torch.equal(got_v, kb)
            # Told once, a goes on: its next call is of the new instance.
            assert a.instance == b.instance
            a.allocate("c", "s2", [1, 2, 3])
            a.free("c", ["s2"])
            old = a.instance
            server.stop(None)          # and again, for the next call
            server, _, _ = create_server(socket_path=sock)
            b.close()
            b = worker(target, lane)
            b.create_cache("c", "m", **GEOM)
            b.allocate("c", "s", list(range(8)))
            b.append("c", ["s"], kb, kb)
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
