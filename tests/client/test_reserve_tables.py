"""Incremental block tables in Reserve: a client that says which sealed blocks it
holds gets only the rest, and rebuilds exactly the daemon's table; a table that
was rebuilt (a tier move) or a client that never saw it gets the whole table.

The Reserve RPC admits only mapped clients of a CUDA pool, so on CPU the steps
reserve through the engine (what the servicer calls) and the client's tables
read the same Reservation messages the servicer would send."""
import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.client.tables import SealedTables
from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
T = "default"


@pytest.fixture(params=["pq", "fp16"])
def setup(request, tmp_path):
    engine = Engine(lmdb_path=str(tmp_path / "lmdb"))
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(engine, socket_path=sock)
    kv = KVStoreClient(f"unix://{sock}", transport="inline")
    kv.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=request.param,
                    block_size=BS, residual=R, num_blocks=256, host_bytes=1 << 22)
    if request.param == "pq":
        g = torch.Generator().manual_seed(0)
        kv.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                                        v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)).to_bytes())
    yield engine, kv
    kv.close()
    server.stop(0)


def _reserve_engine(engine, ids, n=1, counts=(), epochs=()):
    """A batch Reserve as the servicer runs it -> ReserveReply."""
    known = list(zip(counts, epochs)) or None
    rs = engine.reserve_batch("c", T, list(ids), n, known=known)
    return pb.ReserveReply(reservations=[
        pb.Reservation(sequence_id=sid, slot_mapping=r.slot_mapping, sealed_blocks=r.sealed_blocks,
                       tail_blocks=r.tail_blocks, length=r.length, sealed_start=r.sealed_start,
                       table_epoch=r.table_epoch) for sid, r in zip(ids, rs)])


def _reserve(engine, tables, ids, n=1):
    counts, epochs = tables.known(ids)
    r = _reserve_engine(engine, ids, n, counts, epochs)
    return r, [tables.update(sid, x) for sid, x in zip(ids, r.reservations)]


def _sealed(engine, sid):
    return engine.cache("c").seq(T, sid).sealed


def test_steps_send_only_new_blocks_and_tables_match(setup):
    engine, kv = setup
    ids = ["a", "b", "c"]
    for i, sid in enumerate(ids):
        kv.allocate("c", sid, [])
        n = 5 + 7 * i
        kv.append("c", [sid], torch.randn(L, n, HKV, D).half(), torch.randn(L, n, HKV, D).half())
    tables = SealedTables()
    sent = []
    for step in range(100):
        r, full = _reserve(engine, tables, ids)
        for sid, t, x in zip(ids, full, r.reservations):
            assert t.tolist() == _sealed(engine, sid), (step, sid)
            assert x.table_epoch == engine.cache("c").seq(T, sid).table_epoch
        sent.append(sum(len(x.sealed_blocks) for x in r.reservations))
    # the first step sends whole tables, later ones only the block sealed that step
    assert sent[0] == sum(len(_sealed(engine, s)) for s in ids) - sum(sent[1:])
    assert max(sent[1:]) <= len(ids) and sum(sent[1:]) > 0
    assert len(_sealed(engine, "c")) > 10


def test_rebuilt_or_unknown_tables_come_whole(setup):
    engine, kv = setup
    kv.allocate("c", "a", [])
    kv.append("c", ["a"], torch.randn(L, 40, HKV, D).half(), torch.randn(L, 40, HKV, D).half())
    tables = SealedTables()
    r, _ = _reserve(engine, tables, ["a"])
    assert r.reservations[0].sealed_start == 0 and len(r.reservations[0].sealed_blocks) > 0
    r, _ = _reserve(engine, tables, ["a"])
    assert r.reservations[0].sealed_start == len(_sealed(engine, "a")) - len(r.reservations[0].sealed_blocks)
    assert r.reservations[0].sealed_start > 0
    # a tier move rebuilds the table under a new epoch: the whole table again
    epoch = engine.cache("c").seq(T, "a").table_epoch
    r, _ = _reserve(engine, tables, ["a"], n=0)      # commit, reserve nothing: nothing in flight
    kv.offload("c", ["a"])
    kv.prefetch("c", ["a"])
    assert engine.cache("c").seq(T, "a").table_epoch != epoch
    r, (full,) = _reserve(engine, tables, ["a"])
    assert r.reservations[0].sealed_start == 0 and full.tolist() == _sealed(engine, "a")
    # a client that claims more than the table, or another epoch, gets it whole
    for counts, epochs in (([10 ** 6], [r.reservations[0].table_epoch]), ([1], [12345])):
        x = _reserve_engine(engine, ["a"], 1, counts, epochs).reservations[0]
        assert x.sealed_start == 0 and list(x.sealed_blocks) == _sealed(engine, "a")
    # no known fields (older clients): whole tables
    x = _reserve_engine(engine, ["a"], 1).reservations[0]
    assert x.sealed_start == 0 and list(x.sealed_blocks) == _sealed(engine, "a")


def test_known_fields_must_match_the_sequences(setup):
    engine, kv = setup
    for sid in ("a", "b"):
        kv.allocate("c", sid, [])
    before = [(s.length, s.reserved) for s in (engine.cache("c").seq(T, x) for x in ("a", "b"))]
    bad = [dict(sequence_ids=["a", "b"], known_sealed=[0], known_epochs=[0]),
           dict(sequence_ids=["a", "b"], known_sealed=[0, 0], known_epochs=[0]),
           dict(sequence_id="a", known_sealed=[0, 0], known_epochs=[0, 0])]
    for kw in bad:
        with pytest.raises(grpc.RpcError) as e:
            kv.stub.Reserve(pb.ReserveRequest(cache="c", num_tokens=1, **kw))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("known_")
    assert before == [(s.length, s.reserved) for s in (engine.cache("c").seq(T, x) for x in ("a", "b"))]


def test_client_tables_refuse_a_continuation_they_do_not_hold():
    tables = SealedTables()
    first = pb.Reservation(sealed_blocks=[3, 4], sealed_start=0, table_epoch=7)
    assert tables.update("a", first).tolist() == [3, 4]
    assert tables.known(["a", "b"]) == ([2, 0], [7, 0])
    assert tables.update("a", pb.Reservation(sealed_blocks=[9], sealed_start=2, table_epoch=7)).tolist() == [3, 4, 9]
    with pytest.raises(RuntimeError, match="continued the table"):
        tables.update("a", pb.Reservation(sealed_blocks=[1], sealed_start=2, table_epoch=7))
    with pytest.raises(RuntimeError, match="continued the table"):
        tables.update("b", pb.Reservation(sealed_blocks=[1], sealed_start=1, table_epoch=8))
    tables.keep(["b"])
    assert tables.known(["a"]) == ([0], [0])
