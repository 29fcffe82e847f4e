"""Reserve commits slots whatever was written into them, so (docs/design.md, Control plane and data planes):
- it is for the callers that write the pool themselves, as MapPool is: local
  (Unix socket), the default tenant or a cache that shares prefixes across
  tenants, a CUDA pool; PERMISSION_DENIED over TCP or for another tenant,
  FAILED_PRECONDITION on a CPU pool, naming Append/AppendAttend instead;
- a block a sequence gets from the pool never shows its previous owner's
  bytes: what was reserved but never written reads as zeros, by Retrieve,
  Attend or a look at the pool itself."""
import grpc
import pytest
import torch

from helpers import config
from kvstore.client import KVStoreClient
from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.service.auth import Authenticator
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ALICE, BOB = "alice-token-" + "a" * 16, "bob-token-" + "b" * 16
L, HQ, HKV, D, BS = 2, 4, 2, 16, 8
N = 40          # tokens Alice writes, and Bob reserves


def _codebooks() -> Codebooks:
    g = torch.Generator().manual_seed(0)
    return Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g), v=torch.randn(L, HKV, D // 2, 256, 2, generator=g))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, HKV, D, generator=g).half() + 3, torch.randn(L, n, HKV, D, generator=g).half() + 3


@pytest.fixture
def live(tmp_path):
    """A daemon on a Unix socket and TCP; tenants alice and bob (tokens), and
    a local caller of tenant bob; caches f16 and pq, one sequence each at a time."""
    sock = str(tmp_path / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0, auth=Authenticator({ALICE: "alice", BOB: "bob"}))
    admin = KVStoreClient(f"unix://{sock}", heartbeat=False)
    for codec, blocks in (("fp16", N // BS), ("pq", 16)):
        admin.create_cache(codec, "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec,
                           block_size=BS, residual=32, num_blocks=blocks, max_sequences=1)
    admin.set_codebooks("pq", _codebooks().to_bytes())
    admin.create_cache("shared", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                       block_size=BS, num_blocks=16, share_prefixes_across_tenants=True)
    yield sock, port, admin
    admin.close()
    server.stop(0)


def _code(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as e:
        fn(*a, **kw)
    return e.value.code(), e.value.details()


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_a_tenant_over_tcp_cannot_reserve_and_reads_nothing_of_another(live, codec):
    """Alice frees a sequence; Bob, over TCP with his own token, reserves N
    slots and commits them (Reserve 0), then retrieves: refused at each step,
    and he never reads a value of Alice's."""
    _, port, _ = live
    alice = KVStoreClient(f"127.0.0.1:{port}", token=ALICE, heartbeat=False)
    bob = KVStoreClient(f"127.0.0.1:{port}", token=BOB, heartbeat=False)
    alice.allocate(codec, "a", [])
    k, v = _kv(N, 1)
    alice.append(codec, ["a"], k, v)
    alice.free(codec, ["a"])
    bob.allocate(codec, "b", [])
    for n in (N, 0):
        code, details = _code(bob.reserve, codec, "b", n)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert details.startswith("cache: Reserve") and "Append/AppendAttend" in details
    info = bob.sequence_info(codec, "b")
    assert (info.length, info.reserved) == (0, 0)
    code, _ = _code(bob.retrieve, codec, "b", 0, N)
    assert code == grpc.StatusCode.INVALID_ARGUMENT       # nothing committed: nothing to read
    alice.close()
    bob.close()


def test_reserve_admits_whom_map_pool_admits(live):
    """Same rule and order as MapPool: TCP, then another tenant on the socket,
    then a CPU pool, each naming what to use instead."""
    sock, port, admin = live
    admin.allocate("fp16", "x", [])
    remote = pb_grpc.KVStoreStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    local_bob = pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix://{sock}"))
    md = (("authorization", f"Bearer {BOB}"),)
    reserve = lambda cache: pb.ReserveRequest(cache=cache, sequence_id="x", num_tokens=1)  # noqa: E731
    for stub, metadata, cache, want, field in (
            (remote, md, "fp16", grpc.StatusCode.PERMISSION_DENIED, "cache: {rpc}"),
            (remote, md, "nope", grpc.StatusCode.PERMISSION_DENIED, "cache: {rpc}"),     # before any lookup
            (local_bob, md, "fp16", grpc.StatusCode.PERMISSION_DENIED, "cache: {rpc}"),
            (local_bob, md, "shared", grpc.StatusCode.FAILED_PRECONDITION, "cache"),
            (admin.stub, (), "fp16", grpc.StatusCode.FAILED_PRECONDITION, "cache"),
            (admin.stub, (), "nope", grpc.StatusCode.NOT_FOUND, "cache")):
        for rpc, req in (("Reserve", reserve(cache)), ("MapPool", pb.MapPoolRequest(cache=cache))):
            code, details = _code(getattr(stub, rpc), req, metadata=metadata, timeout=10)
            assert code == want, (rpc, cache, details)
            assert details.startswith(field.format(rpc=rpc)), details
            if code != grpc.StatusCode.NOT_FOUND:
                assert "Append/AppendAttend" in details, details
    assert admin.sequence_info("fp16", "x").reserved == 0


def _engine(codec: str, residual: int) -> Engine:
    """One sequence at a time, so a new one gets blocks the last one used."""
    e = Engine()
    e.create_cache(config(codec, "c", block_size=BS, residual=residual, num_blocks=N // BS if codec == "fp16" else 16,
                          max_sequences=1))
    if codec == "pq":
        e.set_codebooks("c", _codebooks())
    return e


def _dirty(c) -> set[int]:
    """fp16 blocks (tail pool) holding any nonzero byte."""
    return {b for b in range(c.tail.k.shape[1]) if c.tail.k[:, b].any() or c.tail.v[:, b].any()}


@pytest.mark.parametrize("codec, residual", [("fp16", 32), ("pq", 32), ("pq", 8)])
def test_reserved_slots_never_written_read_zeros_not_the_previous_owner(codec, residual):
    """The path a mapped client takes (Reserve through the engine): Bob's
    reserved-and-committed slots that nobody wrote read as zeros (R=8 on pq:
    sealed as encoded zeros), never Alice's freed tokens."""
    e = _engine(codec, residual)
    c = e.cache("c")
    e.allocate("c", "alice", "a", [])
    k, v = _kv(N, 1)
    for i in range(0, N, BS):              # step by step: sealing cycles her data through every tail block
        e.append("c", "alice", ["a"], k[:, i:i + BS], v[:, i:i + BS], [BS])
    e.free("c", "alice", ["a"])
    dirty = _dirty(c)
    e.allocate("c", "bob", "b", [])
    got = set()
    for _ in range(0, N, BS):              # reserve and commit, never writing a slot
        got |= set(e.reserve("c", "bob", "b", BS).tail_blocks)
    e.reserve("c", "bob", "b", 0)
    assert c.seq("bob", "b").length == N and got & dirty, "Bob's blocks must include ones Alice wrote"
    got_k, got_v = e.retrieve("c", "bob", "b", 0, N)
    out = e.attend("c", "bob", 0, ["b"], torch.randn(1, HQ, D).half())
    # What N written zeros read back as (PQ: the codes of zero vectors, where sealed).
    e.free("c", "bob", ["b"])
    e.allocate("c", "bob", "zeros", [])
    zk = torch.zeros(L, N, HKV, D, dtype=torch.float16)
    e.append("c", "bob", ["zeros"], zk, zk, [N])
    want_k, want_v = e.retrieve("c", "bob", "zeros", 0, N)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not (got_k == k).all(-1).any(), "a head vector of Alice's K came back"
    if codec == "fp16" or residual >= N:
        assert not got_k.any() and not got_v.any() and not out.any()


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_blocks_handed_out_hold_no_earlier_bytes_in_any_slot(codec):
    """Blocks written token by token (a decode step, a reservation, a bulk
    append that ends mid-block) are cleared when handed out: the slots not yet
    written hold zeros in every layer, for anyone who maps the pool."""
    e = _engine(codec, 32)
    c = e.cache("c")
    e.allocate("c", "alice", "a", [])
    k, v = _kv(N, 2)
    e.append("c", "alice", ["a"], k, v, [N])
    e.free("c", "alice", ["a"])
    e.allocate("c", "bob", "b", [])
    k1, v1 = _kv(1, 3)
    for layer in range(L):                # a decode step: one token, layer by layer, into a new block
        e.append("c", "bob", ["b"], k1[layer], v1[layer], [1], layer=layer)
    e.reserve("c", "bob", "b", 2 * BS)    # two more blocks by reservation
    blocks = c.seq("bob", "b").tail
    assert len(blocks) == 3 and c.seq("bob", "b").length == 1
    for i, b in enumerate(blocks):
        held = c.tail.k[:, b].abs().sum(-1) + c.tail.v[:, b].abs().sum(-1)     # [L, Hkv, bs]
        unwritten = held[:, :, 1:] if i == 0 else held                        # block 0: slot 0 is the token
        assert not unwritten.any(), f"block {b} holds earlier bytes"
    assert torch.equal(c.tail.k[:, blocks[0], :, 0], k1[:, 0])
