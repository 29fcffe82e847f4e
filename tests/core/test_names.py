"""One rule for every name (kvstore/core/names.py): 1-128 ASCII characters of
[A-Za-z0-9._-] for cache names, sequence ids, tenants and shared-memory
buffer names; model_id is a label: up to 256 characters, no control characters."""
import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.service.auth import load_token_file
from kvstore.v1 import kvstore_pb2 as pb

GOOD = ["a", "A-z_0.9", "x" * 128, "..", "llama-3.1-8b_instruct"]
BAD = ["", "caché٣", "café", "٣", "ｆｕｌｌ", "a/b", "a b", "a\n", "\na", "x" * 129, "a\x00", "tab\t", "k:v"]


@pytest.mark.parametrize("value", GOOD)
def test_names_that_follow_the_rule(value):
    from kvstore.core import names
    assert names.is_name(value) and names.check_name("f", value) == value


@pytest.mark.parametrize("value", BAD)
def test_names_that_break_it(value):
    from kvstore.core import names
    assert not names.is_name(value)
    with pytest.raises(InvalidArgument) as e:
        names.check_name("sequence_id", value)
    assert str(e.value).startswith("sequence_id: must be 1-128 characters of [A-Za-z0-9._-]")


@pytest.mark.parametrize("value, ok", [("meta-llama/Llama-3-8B", True), ("m", True), ("Modèle ünïcode/ok", True),
                                       ("x" * 256, True), ("", False), ("x" * 257, False), ("m\x00", False),
                                       ("m\x1b[31m", False), ("a\nb", False), ("m\x7f", False), ("m\x85", False)])
def test_model_id_is_a_label(value, ok):
    from kvstore.core import names
    if ok:
        assert names.check_label("model_id", value) == value
    else:
        with pytest.raises(InvalidArgument, match="^model_id: "):
            names.check_label("model_id", value)


def _spec(name="c", model_id="m") -> pb.CacheSpec:
    return pb.CacheSpec(name=name, model_id=model_id, codec="fp16", block_size=8, num_blocks=8,
                        geometry=pb.Geometry(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=16))


def _code(call, request):
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=10)
    return e.value.code(), e.value.details()


def test_every_rpc_that_names_something_new_follows_the_rule(daemon):
    kv = KVStoreClient(daemon, heartbeat=False)
    stub = kv.stub
    for bad in ("caché٣", "a/b", "x" * 129):
        code, details = _code(stub.CreateCache, pb.CreateCacheRequest(spec=_spec(name=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("spec.name: "), details
    for bad in ("m\x00", "m\x1b[2J", "x" * 257):
        code, details = _code(stub.CreateCache, pb.CreateCacheRequest(spec=_spec(name="c2", model_id=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("spec.model_id: "), details
    stub.CreateCache(pb.CreateCacheRequest(spec=_spec(model_id="org/model-v1.5")), timeout=10)
    stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="s"), timeout=10)
    for bad in ("séq", "x" * 129, "a b"):
        code, details = _code(stub.Allocate, pb.AllocateRequest(cache="c", sequence_id=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sequence_id: "), details
        code, details = _code(stub.Fork, pb.ForkRequest(cache="c", sequence_id="s", new_sequence_id=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("new_sequence_id: "), details
        code, details = _code(stub.RegisterBuffer, pb.RegisterBufferRequest(kind=pb.SHM, name=bad, size=64))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("name: "), details
    stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="x" * 128), timeout=10)
    assert sorted(s.sequence_id for s in kv.list_sequences("c")) == ["s", "x" * 128]
    assert [c.cache for c in kv.stats().caches] == ["c"]
    kv.close()


@pytest.mark.parametrize("line", ["tok-0123456789abcdef caché", "tok-0123456789abcdef " + "t" * 129,
                                  "@unix ténant"])
def test_token_file_tenants_follow_the_rule(tmp_path, line):
    path = tmp_path / "tokens"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="must be 1-128 characters of"):
        load_token_file(str(path))


def test_token_file_accepts_names(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("tok-0123456789abcdef team-a.prod_1\n@unix local-1\n")
    assert load_token_file(str(path)) == ({"tok-0123456789abcdef": "team-a.prod_1"}, "local-1")
