"""Long user values in errors: a message quotes at most 64 characters of any
value (errors.quote), and the servicer sends no status message past
MAX_STATUS_BYTES, far under gRPC's 16 KiB metadata limit. Past that limit the
client would get RESOURCE_EXHAUSTED "Stream removed", not the daemon's status."""
import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.v1 import kvstore_pb2 as pb

BIG = "n" * 100_000          # 100 KB
SHOWN = 64                   # characters of a value a message quotes (errors.QUOTE_CHARS)
STATUS_BYTES = 1024          # servicer.MAX_STATUS_BYTES


def test_quote_keeps_short_values_whole_and_cuts_long_ones():
    from kvstore.errors import QUOTE_CHARS, quote
    assert QUOTE_CHARS == SHOWN
    assert quote("abc") == "'abc'"
    assert quote("x" * QUOTE_CHARS) == repr("x" * QUOTE_CHARS)
    q = quote("é" * 1000)
    assert q.startswith(repr("é" * QUOTE_CHARS)) and q.endswith("(1000 characters)") and len(q) < 100
    assert quote(["a"] * 1000).endswith("characters)") and len(quote(["a"] * 1000)) < 100
    assert quote(7) == "7"


def test_status_message_is_capped_in_bytes():
    from kvstore.service import servicer as servicer_module
    assert servicer_module.MAX_STATUS_BYTES == STATUS_BYTES
    assert servicer_module.status_message("short") == "short"
    capped = servicer_module.status_message("é" * 5000)       # 10,000 bytes of UTF-8
    assert len(capped.encode()) <= servicer_module.MAX_STATUS_BYTES
    assert capped.endswith("(10000 bytes)")


def _spec(name="c", model_id="m", dtype="float16", codec="fp16") -> pb.CacheSpec:
    return pb.CacheSpec(name=name, model_id=model_id, codec=codec, block_size=8, num_blocks=8,
                        geometry=pb.Geometry(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=16, dtype=dtype))


REQUESTS = [
    ("CreateCache", lambda: pb.CreateCacheRequest(spec=_spec(name=BIG)), "INVALID_ARGUMENT", "spec.name"),
    ("CreateCache", lambda: pb.CreateCacheRequest(spec=_spec(model_id=BIG)), "INVALID_ARGUMENT", "spec.model_id"),
    ("CreateCache", lambda: pb.CreateCacheRequest(spec=_spec(name="c2", dtype=BIG)), "INVALID_ARGUMENT",
     "spec.geometry.dtype"),
    ("CreateCache", lambda: pb.CreateCacheRequest(spec=_spec(name="c2", codec=BIG)), "INVALID_ARGUMENT", "spec.codec"),
    ("GetCache", lambda: pb.GetCacheRequest(cache=BIG), "NOT_FOUND", "cache"),
    ("Allocate", lambda: pb.AllocateRequest(cache="c", sequence_id=BIG), "INVALID_ARGUMENT", "sequence_id"),
    ("Fork", lambda: pb.ForkRequest(cache="c", sequence_id=BIG, new_sequence_id="x"), "NOT_FOUND", "sequence_id"),
    ("Fork", lambda: pb.ForkRequest(cache="c", sequence_id="s", new_sequence_id=BIG), "INVALID_ARGUMENT",
     "new_sequence_id"),
    ("SequenceInfo", lambda: pb.SequenceInfoRequest(cache="c", sequence_id=BIG), "NOT_FOUND", "sequence_id"),
    ("Free", lambda: pb.FreeRequest(cache="c", sequence_ids=[BIG]), "NOT_FOUND", "sequence_ids"),
    ("RegisterBuffer", lambda: pb.RegisterBufferRequest(kind=pb.SHM, name=BIG, size=64), "INVALID_ARGUMENT", "name"),
    ("UnregisterBuffer", lambda: pb.UnregisterBufferRequest(buffer_id=BIG), "NOT_FOUND", "buffer_id"),
]


@pytest.fixture
def kv(daemon):
    """A client of a daemon with cache c holding sequence s."""
    kv = KVStoreClient(daemon, heartbeat=False)
    kv.stub.CreateCache(pb.CreateCacheRequest(spec=_spec()), timeout=10)
    kv.stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="s"), timeout=10)
    yield kv
    kv.close()


@pytest.mark.parametrize("rpc, build, code, field", REQUESTS, ids=[f"{r[0]}-{r[3]}" for r in REQUESTS])
def test_a_100kb_value_gets_the_daemons_status_with_a_short_quote(kv, rpc, build, code, field):
    with pytest.raises(grpc.RpcError) as e:
        getattr(kv.stub, rpc)(build(), timeout=10)
    assert e.value.code().name == code, e.value.details()[:300]
    details = e.value.details()
    assert details.startswith(field + ": ") and len(details) < 300, details[:300]
    assert "n" * SHOWN in details and "n" * (SHOWN + 1) not in details
    assert "(100000 characters)" in details


def test_any_long_status_message_is_cut_under_the_metadata_limit(tmp_path):
    """An error whose text is not a quoted value (here: an exception deep in
    the engine) still comes back as the daemon's status, cut short."""
    from kvstore.service.daemon import create_server
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    engine = server.kvstore_engine

    def broken_stats(name=None):
        raise RuntimeError("state: " + "z" * 100_000)
    engine.stats = broken_stats
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False)
    with pytest.raises(grpc.RpcError) as e:
        kv.stub.Stats(pb.StatsRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()[:300]
    assert e.value.details().startswith("RuntimeError: state: zzz")
    assert len(e.value.details().encode()) <= STATUS_BYTES
    kv.close()
    server.stop(0)
