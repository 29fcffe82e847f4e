"""Bad input to every RPC of a live daemon (docs/design.md, RPCs): the exact status code,
a message that starts with the offending field, no state change (Stats,
ListSequences, SequenceInfo, GetCache and the K/V of every sequence are
byte-identical before and after), and the daemon keeps answering.

One in-process daemon serves the whole table; a second one with a 1 MiB
message limit covers oversized messages. Requests are built with the raw
generated stub, so nothing in the client can mask a server-side check.
"""
from __future__ import annotations

import math
import os
import re
import secrets
from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save as safetensors_save

from kvstore.client import KVStoreClient
from kvstore.codec.codebooks import Codebooks
from kvstore.protocol import wire
from kvstore.protocol.channel import SERVICE
from kvstore.service.auth import Authenticator
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
M = D // 2
C = grpc.StatusCode
INVALID, NOT_FOUND, PRECOND = C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION
EXHAUSTED, EXISTS = C.RESOURCE_EXHAUSTED, C.ALREADY_EXISTS
SHM_BYTES = 4096
GEN = torch.Generator().manual_seed(0)


# ------------------------------------------------------------------ builders
def rnd(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def t(x: torch.Tensor) -> pb.Tensor:
    return wire.to_proto(x)


def raw(shape, dtype=pb.FLOAT16, nbytes: int | None = None) -> pb.Tensor:
    """An inline tensor with a chosen dtype tag and byte count (default: the right size for fp16)."""
    n = math.prod(shape) * 2 if nbytes is None else nbytes
    return pb.Tensor(shape=list(shape), dtype=dtype, inline=bytes(max(0, n)))


def ref(buffer_id: str, offset: int, shape, dtype=pb.FLOAT16) -> pb.Tensor:
    return pb.Tensor(shape=list(shape), dtype=dtype, ref=pb.BufferRef(buffer_id=buffer_id, offset=offset))


def poisoned(x: torch.Tensor, value: float) -> pb.Tensor:
    x = x.clone()
    x.view(-1)[x.numel() // 2] = value
    return t(x)


def spiked(*shape, value: float) -> torch.Tensor:
    """Random fp32 with one element set to value (finite in fp32; it may overflow the cache dtype)."""
    x = rnd(*shape, dtype=torch.float32)
    x.view(-1)[x.numel() // 2] = value
    return x


def f32(*shape, value: float) -> pb.Tensor:
    return t(spiked(*shape, value=value))


def spec(name: str, codec: str = "pq", num_blocks: int = 64, max_sequences: int = 16, residual: int = R,
         block_size: int = BS, model_id: str = "test-model", sink_tokens: int = 0, **geom) -> pb.CacheSpec:
    g = dict(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="float16")
    g.update(geom)
    return pb.CacheSpec(name=name, model_id=model_id, geometry=pb.Geometry(**g), codec=codec, block_size=block_size,
                        residual=residual, num_blocks=num_blocks, max_sequences=max_sequences, sink_tokens=sink_tokens)


def with_fields(s: pb.CacheSpec, **fields) -> pb.CacheSpec:
    for name, value in fields.items():
        getattr(s, name).extend(value)
    return s


def codebooks(k=None, v=None) -> bytes:
    k = rnd(L, HKV, M, 256, D // M, dtype=torch.float32) if k is None else k
    v = rnd(L, HKV, M, 256, D // M, dtype=torch.float32) if v is None else v
    return Codebooks(k=k, v=v).to_bytes()


def append(cache="f16", seqs=("b",), counts=(2,), k=None, v=None, layer=None, token_ids=None) -> pb.AppendRequest:
    n = sum(counts)
    shape = (L, n, HKV, D) if layer is None else (n, HKV, D)
    r = pb.AppendRequest(cache=cache, sequence_ids=list(seqs), counts=list(counts),
                         k=k if k is not None else t(rnd(*shape)), v=v if v is not None else t(rnd(*shape)),
                         token_ids=[pb.TokenIds(ids=i) for i in token_ids or []])
    if layer is not None:
        r.layer = layer
    return r


def attend(cache="f16", seqs=("b",), layer=0, q=None, scale=0.0, out=None) -> pb.AttendRequest:
    return pb.AttendRequest(cache=cache, layer=layer, sequence_ids=list(seqs), scale=scale, out=out,
                            q=q if q is not None else t(rnd(len(seqs), HQ, D)))


def append_attend(cache="f16", seqs=("b",), layer=0, k=None, v=None, q=None, scale=0.0,
                  out=None, token_ids=(), query_tokens=0) -> pb.AppendAttendRequest:
    b = len(seqs) * max(1, query_tokens)
    return pb.AppendAttendRequest(cache=cache, layer=layer, sequence_ids=list(seqs), scale=scale, out=out,
                                  token_ids=list(token_ids), query_tokens=query_tokens,
                                  k=k if k is not None else t(rnd(b, HKV, D)),
                                  v=v if v is not None else t(rnd(b, HKV, D)),
                                  q=q if q is not None else t(rnd(b, HQ, D)))


def retrieve(cache="f16", seq="b", start=0, end=5, layer_start=0, layer_end=0, k_out=None, v_out=None):
    return pb.RetrieveRequest(cache=cache, sequence_id=seq, start=start, end=end, layer_start=layer_start,
                              layer_end=layer_end, k_out=k_out, v_out=v_out)


def train(cache="raw", k=None, v=None, niter=2) -> pb.TrainCodebooksRequest:
    return pb.TrainCodebooksRequest(cache=cache, niter=niter,
                                    k_samples=k if k is not None else t(rnd(L, 256, HKV, D, dtype=torch.float32)),
                                    v_samples=v if v is not None else t(rnd(L, 256, HKV, D, dtype=torch.float32)))


# ------------------------------------------------------------------- daemon
@dataclass
class Live:
    stub: pb_grpc.KVStoreStub
    channel: grpc.Channel
    buf: str            # a registered SHM buffer of SHM_BYTES bytes
    shm_name: str


def _ok(stub, rpc: str, req):
    return getattr(stub, rpc)(req, timeout=30)


def _populate(stub, engine, cache: str) -> None:
    """a: 40 prompt tokens appended with ids (PQ: 3 sealed blocks); b: 5 tokens;
    w: a 12-id prompt, nothing appended; p: 3 tokens + 1 pending at layer 0;
    r: 2 tokens + 2 reserved (through the engine: the Reserve RPC is for mapped
    clients of a CUDA pool); e: empty."""
    prompt = list(range(100, 140))
    _ok(stub, "Allocate", pb.AllocateRequest(cache=cache, sequence_id="a", prompt_token_ids=prompt))
    _ok(stub, "Append", append(cache, ["a"], [40], token_ids=[prompt]))
    for sid, n in (("b", 5), ("p", 3), ("r", 2)):
        _ok(stub, "Allocate", pb.AllocateRequest(cache=cache, sequence_id=sid))
        _ok(stub, "Append", append(cache, [sid], [n]))
    _ok(stub, "Allocate", pb.AllocateRequest(cache=cache, sequence_id="w", prompt_token_ids=list(range(500, 512))))
    _ok(stub, "Allocate", pb.AllocateRequest(cache=cache, sequence_id="e"))
    _ok(stub, "Append", append(cache, ["p"], [1], layer=0))
    engine.reserve(cache, "default", "r", 2)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("bad") / "kv.sock")
    # The servicer also asserts the pool invariants after every call (INTERNAL if broken).
    old = os.environ.get("KVSTORE_DEBUG_INVARIANTS")
    os.environ["KVSTORE_DEBUG_INVARIANTS"] = "1"
    try:
        server, _, _ = create_server(socket_path=sock)
    finally:
        if old is None:
            del os.environ["KVSTORE_DEBUG_INVARIANTS"]
        else:
            os.environ["KVSTORE_DEBUG_INVARIANTS"] = old
    channel = grpc.insecure_channel(f"unix://{sock}")
    stub = pb_grpc.KVStoreStub(channel)
    # pq: trained online; f16: the fp16 codec; raw: PQ without codebooks.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("pq", "pq", num_blocks=64, max_sequences=8)))
    _ok(stub, "TrainCodebooks", train("pq"))
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("f16", "fp16")))
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("raw", "pq")))
    engine = server.kvstore_engine
    for name in ("pq", "f16"):
        _populate(stub, engine, name)
    # tiny: fp16, 3 blocks, all held by "full" (20 tokens: the last block has 4 free slots); t2 empty.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("tiny", "fp16", num_blocks=3, max_sequences=3)))
    for sid in ("full", "t2"):
        _ok(stub, "Allocate", pb.AllocateRequest(cache="tiny", sequence_id=sid))
    _ok(stub, "Append", append("tiny", ["full"], [20]))
    # one: max_sequences=1, already used.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("one", "fp16", num_blocks=8, max_sequences=1)))
    _ok(stub, "Allocate", pb.AllocateRequest(cache="one", sequence_id="only"))
    _ok(stub, "Append", append("one", ["only"], [3]))
    # tinypq: PQ with one main block, taken by s (16 tokens, R=0: 1 sealed); r empty.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("tinypq", "pq", num_blocks=1, max_sequences=2,
                                                             residual=0)))
    _ok(stub, "SetCodebooks", pb.SetCodebooksRequest(cache="tinypq", safetensors=codebooks()))
    for sid in ("s", "r"):
        _ok(stub, "Allocate", pb.AllocateRequest(cache="tinypq", sequence_id=sid))
    _ok(stub, "Append", append("tinypq", ["s"], [16]))
    # sinkpq: PQ with 16 sink tokens and one main block, taken by s (32 tokens, R=0: 16 sinks, 1 sealed,
    # 8 in the tail); r empty.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("sinkpq", "pq", num_blocks=1, max_sequences=2,
                                                             residual=0, sink_tokens=16)))
    _ok(stub, "SetCodebooks", pb.SetCodebooksRequest(cache="sinkpq", safetensors=codebooks()))
    for sid in ("s", "r"):
        _ok(stub, "Allocate", pb.AllocateRequest(cache="sinkpq", sequence_id=sid))
    _ok(stub, "Append", append("sinkpq", ["s"], [32]))
    # bf: the fp16 codec in bfloat16, b holding 5 tokens.
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("bf", "fp16", dtype="bfloat16")))
    _ok(stub, "Allocate", pb.AllocateRequest(cache="bf", sequence_id="b"))
    _ok(stub, "Append", append("bf", ["b"], [5]))
    # A registered shared-memory buffer for buffer-reference cases.
    shm_name = f"kvstore-test-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join("/dev/shm", shm_name)
    with open(path, "wb") as f:
        f.write(bytes(SHM_BYTES))
    buf = _ok(stub, "RegisterBuffer", pb.RegisterBufferRequest(kind=pb.SHM, name=shm_name, size=SHM_BYTES)).buffer_id
    yield Live(stub, channel, buf, shm_name)
    channel.close()
    server.stop(0)
    os.unlink(path)


def snapshot(stub) -> dict[str, bytes]:
    """Everything a client can observe: Stats of every cache, GetCache, ListSequences,
    SequenceInfo of every sequence and the committed K/V of every sequence."""
    det = dict(deterministic=True)
    stats = stub.Stats(pb.StatsRequest(), timeout=30)
    snap = {"Stats": stats.SerializeToString(**det)}
    for c in stats.caches:
        name = c.cache
        snap[f"GetCache {name}"] = stub.GetCache(pb.GetCacheRequest(cache=name), timeout=30).SerializeToString(**det)
        seqs = stub.ListSequences(pb.ListSequencesRequest(cache=name), timeout=30)
        snap[f"ListSequences {name}"] = seqs.SerializeToString(**det)
        for s in seqs.sequences:
            sid = s.sequence_id
            info = stub.SequenceInfo(pb.SequenceInfoRequest(cache=name, sequence_id=sid), timeout=30)
            snap[f"SequenceInfo {name}/{sid}"] = info.SerializeToString(**det)
            for start in range(0, s.length, 128):   # windows keep replies under any message limit
                kv = stub.Retrieve(pb.RetrieveRequest(cache=name, sequence_id=sid, start=start,
                                                      end=min(s.length, start + 128)), timeout=30)
                snap[f"Retrieve {name}/{sid}@{start}"] = kv.SerializeToString(**det)
    return snap


def assert_unchanged(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"a rejected call changed state: {changed}"


def assert_serving(channel) -> None:
    r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


# -------------------------------------------------------------------- table
def names(message: str, field: str) -> bool:
    """The message starts with the field's whole name (sequence_id is not sequence_ids)."""
    return re.match(re.escape(field) + r"(?![A-Za-z0-9_])", message) is not None


def case(rpc: str, what: str, build, code: grpc.StatusCode, field: str, metadata=(), marks=()):
    """build(live) -> request, sent with `metadata`. `field`: the message must start with it."""
    return pytest.param(rpc, build, code, field, metadata, id=f"{rpc}-{what}", marks=marks)


GOOD_SHM = lambda lv: lv.buf  # noqa: E731
CASES = [
    # ---------------------------------------------------------------- CreateCache
    case("CreateCache", "zero-layers", lambda lv: pb.CreateCacheRequest(spec=spec("n1", num_layers=0)),
         INVALID, "spec.geometry.num_layers"),
    case("CreateCache", "layers-past-any-model", lambda lv: pb.CreateCacheRequest(spec=spec("n1", num_layers=2**32 - 1)),
         INVALID, "spec.geometry.num_layers"),       # refused at once (it was minutes of validation)
    case("CreateCache", "kv-heads-past-any-model", lambda lv: pb.CreateCacheRequest(
        spec=spec("n1", num_q_heads=2**17, num_kv_heads=2**17)), INVALID, "spec.geometry.num_q_heads"),
    case("CreateCache", "host-tier-below-one-block-pair", lambda lv: pb.CreateCacheRequest(
        spec=pb.CacheSpec(name="n1", model_id="m", geometry=spec("x").geometry, num_blocks=8, host_bytes=100)),
         INVALID, "spec.host_bytes"),
    case("CreateCache", "no-geometry", lambda lv: pb.CreateCacheRequest(
        spec=pb.CacheSpec(name="n2", model_id="m", num_blocks=8)), INVALID, "spec.geometry.num_layers"),
    case("CreateCache", "gqa-not-multiple", lambda lv: pb.CreateCacheRequest(spec=spec("n3", num_q_heads=3)),
         INVALID, "spec.geometry.num_q_heads"),
    case("CreateCache", "head-dim", lambda lv: pb.CreateCacheRequest(spec=spec("n4", head_dim=18)),
         INVALID, "spec.geometry.head_dim"),
    case("CreateCache", "dtype-unknown", lambda lv: pb.CreateCacheRequest(spec=spec("n5", dtype="int8")),
         INVALID, "spec.geometry.dtype"),
    case("CreateCache", "dtype-fp32", lambda lv: pb.CreateCacheRequest(spec=spec("n6", dtype="float32")),
         INVALID, "spec.geometry.dtype"),
    case("CreateCache", "codec", lambda lv: pb.CreateCacheRequest(spec=spec("n7", codec="zip")), INVALID, "spec.codec"),
    case("CreateCache", "subvectors", lambda lv: pb.CreateCacheRequest(
        spec=pb.CacheSpec(name="n8", model_id="m", geometry=spec("x").geometry, codec="pq", num_subvectors=3,
                          num_blocks=8)), INVALID, "spec.num_subvectors"),
    case("CreateCache", "block-size", lambda lv: pb.CreateCacheRequest(spec=spec("n9", block_size=12)),
         INVALID, "spec.block_size"),
    case("CreateCache", "no-pool-size", lambda lv: pb.CreateCacheRequest(spec=spec("n10", num_blocks=0)),
         INVALID, "spec.num_blocks"),
    case("CreateCache", "two-pool-sizes", lambda lv: pb.CreateCacheRequest(
        spec=pb.CacheSpec(name="n11", model_id="m", geometry=spec("x").geometry, num_blocks=8, pool_bytes=1 << 20)),
         INVALID, "spec.num_blocks"),
    case("CreateCache", "pool-bytes-too-small", lambda lv: pb.CreateCacheRequest(
        spec=pb.CacheSpec(name="n12", model_id="m", geometry=spec("x").geometry, pool_bytes=10)),
         INVALID, "spec.pool_bytes"),
    case("CreateCache", "bad-name", lambda lv: pb.CreateCacheRequest(spec=spec("a/b")), INVALID, "spec.name"),
    case("CreateCache", "empty-name", lambda lv: pb.CreateCacheRequest(spec=spec("")), INVALID, "spec.name"),
    case("CreateCache", "empty-model-id", lambda lv: pb.CreateCacheRequest(spec=spec("n13", model_id="")),
         INVALID, "spec.model_id"),
    case("CreateCache", "sink-tokens-not-whole-blocks", lambda lv: pb.CreateCacheRequest(
        spec=spec("n14", sink_tokens=BS + 4)), INVALID, "spec.sink_tokens"),
    case("CreateCache", "sink-tokens-too-many", lambda lv: pb.CreateCacheRequest(
        spec=spec("n15", sink_tokens=65536 + BS)), INVALID, "spec.sink_tokens"),
    case("CreateCache", "sink-tokens-uint32-max-fp16", lambda lv: pb.CreateCacheRequest(
        spec=spec("n16", "fp16", sink_tokens=2**32 - 1)), INVALID, "spec.sink_tokens"),
    case("CreateCache", "exists", lambda lv: pb.CreateCacheRequest(spec=spec("f16", "fp16")), EXISTS, "spec.name"),
    case("CreateCache", "exists-other-spec", lambda lv: pb.CreateCacheRequest(
        spec=spec("f16", "fp16", num_blocks=65), exist_ok=True), EXISTS, "spec.name"),
    case("CreateCache", "exists-other-sinks", lambda lv: pb.CreateCacheRequest(
        spec=spec("sinkpq", "pq", num_blocks=1, max_sequences=2, residual=0, sink_tokens=8), exist_ok=True),
         EXISTS, "spec.name"),
    case("CreateCache", "sink-logits-count", lambda lv: pb.CreateCacheRequest(
        spec=with_fields(spec("n17", "fp16"), sink_logits=[0.5] * (L * HQ - 1))), INVALID, "spec.sink_logits"),
    case("CreateCache", "sink-logits-nan", lambda lv: pb.CreateCacheRequest(
        spec=with_fields(spec("n18", "fp16"), sink_logits=[float("nan")] * (L * HQ))), INVALID, "spec.sink_logits"),
    case("CreateCache", "exists-other-sink-logits", lambda lv: pb.CreateCacheRequest(
        spec=with_fields(spec("f16", "fp16"), sink_logits=[0.5] * (L * HQ)), exist_ok=True), EXISTS, "spec.name"),
    # ------------------------------------------------------------------- GetCache
    case("GetCache", "unknown-cache", lambda lv: pb.GetCacheRequest(cache="nope"), NOT_FOUND, "cache"),
    case("GetCache", "empty-name", lambda lv: pb.GetCacheRequest(), NOT_FOUND, "cache"),
    # --------------------------------------------------------------- GetCodebooks
    case("GetCodebooks", "unknown-cache", lambda lv: pb.GetCodebooksRequest(cache="nope"), NOT_FOUND, "cache"),
    case("GetCodebooks", "fp16-cache", lambda lv: pb.GetCodebooksRequest(cache="f16"), PRECOND, "codebooks"),
    case("GetCodebooks", "none-yet", lambda lv: pb.GetCodebooksRequest(cache="raw"), PRECOND, "codebooks"),
    # --------------------------------------------------------------- SetCodebooks
    case("SetCodebooks", "unknown-cache", lambda lv: pb.SetCodebooksRequest(cache="nope", safetensors=codebooks()),
         NOT_FOUND, "cache"),
    case("SetCodebooks", "garbage-bytes", lambda lv: pb.SetCodebooksRequest(cache="raw", safetensors=b"\x07garbage" * 9),
         INVALID, "codebooks"),
    case("SetCodebooks", "empty-bytes", lambda lv: pb.SetCodebooksRequest(cache="raw"), INVALID, "codebooks"),
    case("SetCodebooks", "missing-v", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=safetensors_save({"k": rnd(L, HKV, M, 256, 2, dtype=torch.float32)})),
         INVALID, "codebooks"),
    case("SetCodebooks", "wrong-shape", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=codebooks(k=rnd(L, HKV, M // 2, 256, 4, dtype=torch.float32),
                                           v=rnd(L, HKV, M // 2, 256, 4, dtype=torch.float32))),
         INVALID, "codebooks.k"),
    case("SetCodebooks", "wrong-layers", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=codebooks(v=rnd(L + 1, HKV, M, 256, 2, dtype=torch.float32))),
         INVALID, "codebooks.v"),
    case("SetCodebooks", "nan", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=codebooks(v=torch.full((L, HKV, M, 256, 2), float("nan")))),
         INVALID, "codebooks.v"),
    # Finite in fp32, out of the cache's float16: Inf once converted.
    case("SetCodebooks", "k-overflows-fp16", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=codebooks(k=spiked(L, HKV, M, 256, 2, value=1e5))), INVALID, "codebooks.k"),
    case("SetCodebooks", "v-overflows-fp16", lambda lv: pb.SetCodebooksRequest(
        cache="raw", safetensors=codebooks(v=torch.full((L, HKV, M, 256, 2), -7e4))), INVALID, "codebooks.v"),
    case("SetCodebooks", "fp16-cache", lambda lv: pb.SetCodebooksRequest(cache="f16", safetensors=codebooks()),
         PRECOND, "codebooks"),
    # An fp16 cache takes no codebooks whatever the bytes hold: that is the answer first.
    case("SetCodebooks", "fp16-cache-garbage", lambda lv: pb.SetCodebooksRequest(cache="f16", safetensors=b"\x07" * 9),
         PRECOND, "codebooks"),
    case("TrainCodebooks", "fp16-cache-wrong-rank", lambda lv: train(
        "f16", k=t(rnd(L, 256, HKV * D, dtype=torch.float32))), PRECOND, "codebooks"),
    case("SetCodebooks", "live-sequences", lambda lv: pb.SetCodebooksRequest(cache="pq", safetensors=codebooks()),
         PRECOND, "codebooks"),
    # ------------------------------------------------------------- TrainCodebooks
    case("TrainCodebooks", "unknown-cache", lambda lv: train("nope"), NOT_FOUND, "cache"),
    case("TrainCodebooks", "wrong-rank", lambda lv: train(k=t(rnd(L, 256, HKV * D, dtype=torch.float32))),
         INVALID, "k_samples"),
    case("TrainCodebooks", "wrong-heads", lambda lv: train(v=t(rnd(L, 256, HKV + 1, D, dtype=torch.float32))),
         INVALID, "v_samples"),
    case("TrainCodebooks", "too-few-samples", lambda lv: train(k=t(rnd(L, 100, HKV, D, dtype=torch.float32))),
         INVALID, "k_samples"),
    case("TrainCodebooks", "nan", lambda lv: train(v=poisoned(rnd(L, 256, HKV, D, dtype=torch.float32), math.nan)),
         INVALID, "v_samples"),
    case("TrainCodebooks", "k-overflows-fp16", lambda lv: train(k=f32(L, 256, HKV, D, value=1e5)),
         INVALID, "k_samples"),
    case("TrainCodebooks", "v-overflows-fp16", lambda lv: train(v=f32(L, 256, HKV, D, value=-65520.0)),
         INVALID, "v_samples"),
    case("TrainCodebooks", "dtype-missing", lambda lv: train(k=raw((L, 256, HKV, D), pb.DTYPE_UNSPECIFIED)),
         INVALID, "k_samples"),
    case("TrainCodebooks", "dtype-integer", lambda lv: train(k=t(torch.randint(0, 255, (L, 256, HKV, D),
                                                                               dtype=torch.uint8))),
         INVALID, "k_samples"),
    case("TrainCodebooks", "byte-length", lambda lv: train(k=raw((L, 256, HKV, D), pb.FLOAT32, nbytes=100)),
         INVALID, "k_samples"),
    case("TrainCodebooks", "unknown-buffer", lambda lv: train(k=ref("shm-nope", 0, (L, 256, HKV, D))),
         NOT_FOUND, "k_samples.ref.buffer_id"),
    case("TrainCodebooks", "fp16-cache", lambda lv: train("f16"), PRECOND, "codebooks"),
    case("TrainCodebooks", "live-sequences", lambda lv: train("pq"), PRECOND, "codebooks"),
    # ------------------------------------------------------------------- Allocate
    case("Allocate", "unknown-cache", lambda lv: pb.AllocateRequest(cache="nope", sequence_id="x"), NOT_FOUND, "cache"),
    case("Allocate", "empty-id", lambda lv: pb.AllocateRequest(cache="f16", sequence_id=""), INVALID, "sequence_id"),
    case("Allocate", "long-id", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="x" * 257),
         INVALID, "sequence_id"),
    case("Allocate", "exists", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="b"), EXISTS, "sequence_id"),
    case("Allocate", "exists-pq", lambda lv: pb.AllocateRequest(cache="pq", sequence_id="a",
                                                                prompt_token_ids=list(range(100, 140))),
         EXISTS, "sequence_id"),
    case("Allocate", "negative-token", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="x",
                                                                     prompt_token_ids=[1, 2, -1]),
         INVALID, "prompt_token_ids"),
    case("Allocate", "token-overflow", lambda lv: pb.AllocateRequest(cache="pq", sequence_id="x",
                                                                     prompt_token_ids=list(range(100, 140)) + [2**31]),
         INVALID, "prompt_token_ids"),
    case("Allocate", "no-codebooks", lambda lv: pb.AllocateRequest(cache="raw", sequence_id="x"),
         PRECOND, "codebooks"),
    case("Allocate", "max-sequences", lambda lv: pb.AllocateRequest(cache="one", sequence_id="x"),
         EXHAUSTED, "sequence_id"),
    case("Allocate", "persist-without-disk-tier", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="x",
                                                                               persist=True), PRECOND, "persist"),
    # -------------------------------------------------------------------- Reserve
    # Slots are for mapped clients of a CUDA pool (tests/service/test_reserve_admission.py); the
    # engine's own refusals (sequence, num_tokens, pending, room) are in tests/engine/test_reserve_refusals.py.
    case("Reserve", "unknown-cache", lambda lv: pb.ReserveRequest(cache="nope", sequence_id="b", num_tokens=1),
         NOT_FOUND, "cache"),
    case("Reserve", "cpu-pool", lambda lv: pb.ReserveRequest(cache="f16", sequence_id="b", num_tokens=1),
         PRECOND, "cache"),
    case("Reserve", "cpu-pool-batch", lambda lv: pb.ReserveRequest(cache="pq", sequence_ids=["b", "e"], num_tokens=1),
         PRECOND, "cache"),
    case("Reserve", "known-epochs-count", lambda lv: pb.ReserveRequest(cache="f16", sequence_id="b", num_tokens=1,
                                                                       known_sealed=[0], known_epochs=[]),
         INVALID, "known_epochs"),
    case("Reserve", "known-batch-count", lambda lv: pb.ReserveRequest(cache="f16", sequence_ids=["b"], num_tokens=1,
                                                                      known_sealed=[0, 0], known_epochs=[0, 0]),
         INVALID, "known_sealed"),
    case("Reserve", "known-single-count", lambda lv: pb.ReserveRequest(cache="pq", sequence_id="b", num_tokens=1,
                                                                       known_sealed=[0, 0], known_epochs=[1, 1]),
         INVALID, "known_sealed"),
    # --------------------------------------------------------------------- Append
    case("Append", "unknown-cache", lambda lv: append(cache="nope"), NOT_FOUND, "cache"),
    case("Append", "unknown-sequence", lambda lv: append(seqs=["zz"]), NOT_FOUND, "sequence_ids"),
    case("Append", "unknown-second-sequence", lambda lv: append(seqs=["b", "zz"], counts=[1, 1]),
         NOT_FOUND, "sequence_ids"),
    case("Append", "empty-batch", lambda lv: append(seqs=[], counts=[]), INVALID, "sequence_ids"),
    case("Append", "duplicate-ids", lambda lv: append(seqs=["b", "b"], counts=[1, 1]), INVALID, "sequence_ids"),
    case("Append", "counts-length", lambda lv: append(seqs=["b"], counts=[1, 1]), INVALID, "counts"),
    case("Append", "count-zero", lambda lv: append(seqs=["b", "e"], counts=[2, 0]), INVALID, "counts"),
    case("Append", "count-uint32-max", lambda lv: append(counts=[2**32 - 1], k=t(rnd(L, 2, HKV, D)),
                                                         v=t(rnd(L, 2, HKV, D))), INVALID, "k"),
    case("Append", "k-tokens", lambda lv: append(k=t(rnd(L, 3, HKV, D))), INVALID, "k"),
    case("Append", "k-heads", lambda lv: append(k=t(rnd(L, 2, HQ, D))), INVALID, "k"),
    case("Append", "k-rank", lambda lv: append(k=t(rnd(2, HKV, D))), INVALID, "k"),
    case("Append", "v-head-dim", lambda lv: append(v=t(rnd(L, 2, HKV, D + 4))), INVALID, "v"),
    case("Append", "layer-k-rank", lambda lv: append(layer=0, k=t(rnd(L, 2, HKV, D))), INVALID, "k"),
    case("Append", "dtype-missing", lambda lv: append(k=raw((L, 2, HKV, D), pb.DTYPE_UNSPECIFIED)), INVALID, "k"),
    case("Append", "dtype-unknown-enum", lambda lv: append(k=raw((L, 2, HKV, D), 99)), INVALID, "k"),
    case("Append", "dtype-int32", lambda lv: append(v=raw((L, 2, HKV, D), pb.INT32, nbytes=L * 2 * HKV * D * 4)),
         INVALID, "v"),
    case("Append", "dtype-uint8-pq", lambda lv: append("pq", k=t(torch.ones(L, 2, HKV, D, dtype=torch.uint8))),
         INVALID, "k"),
    case("Append", "byte-length-short", lambda lv: append(k=raw((L, 2, HKV, D), nbytes=L * 2 * HKV * D * 2 - 1)),
         INVALID, "k"),
    case("Append", "byte-length-long", lambda lv: append(v=raw((L, 2, HKV, D), nbytes=L * 2 * HKV * D * 2 + 2)),
         INVALID, "v"),
    case("Append", "negative-dim", lambda lv: append(k=pb.Tensor(shape=[L, -2, HKV, D], dtype=pb.FLOAT16)),
         INVALID, "k"),
    case("Append", "too-many-dims", lambda lv: append(k=raw([1] * 9)), INVALID, "k"),
    case("Append", "empty-with-huge-dims", lambda lv: append(k=raw([0] + [1 << 31] * 7)), INVALID, "k"),
    case("Attend", "empty-with-huge-dims", lambda lv: attend(q=raw([1 << 31, 1 << 31, 1 << 31, 0])), INVALID, "q"),
    case("Append", "no-data", lambda lv: append(k=pb.Tensor(shape=[L, 2, HKV, D], dtype=pb.FLOAT16)), INVALID, "k"),
    case("Append", "missing-tensor", lambda lv: pb.AppendRequest(cache="f16", sequence_ids=["b"], counts=[2],
                                                                 v=t(rnd(L, 2, HKV, D))), INVALID, "k"),
    case("Append", "nan-k", lambda lv: append(k=poisoned(rnd(L, 2, HKV, D), math.nan)), INVALID, "k"),
    case("Append", "inf-v-pq", lambda lv: append("pq", v=poisoned(rnd(L, 2, HKV, D), math.inf)), INVALID, "v"),
    case("Append", "nan-k-layer", lambda lv: append(layer=1, k=poisoned(rnd(2, HKV, D), math.nan)), INVALID, "k"),
    case("Append", "k-overflows-fp16", lambda lv: append(k=f32(L, 2, HKV, D, value=1e5)), INVALID, "k"),
    case("Append", "v-overflows-fp16-pq", lambda lv: append("pq", v=f32(L, 2, HKV, D, value=7e4)), INVALID, "v"),
    case("Append", "k-overflows-fp16-layer", lambda lv: append(layer=0, k=f32(2, HKV, D, value=-65520.0)),
         INVALID, "k"),
    case("Append", "k-overflows-bf16", lambda lv: append("bf", k=f32(L, 2, HKV, D, value=3.4e38)), INVALID, "k"),
    case("Append", "v-overflows-bf16", lambda lv: append("bf", v=f32(L, 2, HKV, D, value=-3.4e38)), INVALID, "v"),
    # Finite in bfloat16, but q.k of two such would overflow the fp32 scores.
    case("Append", "k-past-qk-limit-bf16", lambda lv: append("bf", k=f32(L, 2, HKV, D, value=1e10)), INVALID, "k"),
    case("Append", "layer-out-of-range", lambda lv: append(layer=L), INVALID, "layer"),
    case("Append", "layer-negative", lambda lv: append("pq", layer=-1), INVALID, "layer"),
    case("Append", "token-ids-with-layer-length", lambda lv: append(layer=0, token_ids=[[1, 2, 3]]), INVALID,
         "token_ids"),
    case("Append", "token-ids-lists", lambda lv: append(token_ids=[[1, 2], [3, 4]]), INVALID, "token_ids"),
    case("Append", "token-ids-length", lambda lv: append(token_ids=[[1, 2, 3]]), INVALID, "token_ids"),
    case("Append", "token-id-negative", lambda lv: append(token_ids=[[1, -2]]), INVALID, "token_ids"),
    case("Append", "token-id-overflow", lambda lv: append("pq", token_ids=[[1, 2**31]]), INVALID, "token_ids"),
    case("Append", "token-ids-differ-from-prompt", lambda lv: append(seqs=["w"], token_ids=[[500, 999]]),
         INVALID, "token_ids"),
    case("Append", "pending-all-layers", lambda lv: append(seqs=["p"], counts=[1]), PRECOND, "sequence_ids"),
    case("Append", "reserved-all-layers", lambda lv: append("pq", seqs=["r"], counts=[1]), PRECOND, "sequence_ids"),
    case("Append", "reserved-one-layer", lambda lv: append(seqs=["r"], counts=[1], layer=0), PRECOND, "sequence_ids"),
    case("Append", "batch-pending", lambda lv: append(seqs=["b", "p"], counts=[1, 1]), PRECOND, "sequence_ids"),
    # A batch is checked whole: the first sequence must not be written when a later one is refused.
    case("Append", "batch-second-token-id-bad", lambda lv: append(seqs=["b", "e"], counts=[2, 2],
                                                                  token_ids=[[1, 2], [3, -1]]), INVALID, "token_ids"),
    case("Append", "batch-second-token-ids-differ", lambda lv: append("pq", seqs=["b", "w"], counts=[1, 2],
                                                                      token_ids=[[], [500, 7]]),
         INVALID, "token_ids"),
    case("Append", "batch-second-reserved-one-layer", lambda lv: append(seqs=["b", "r"], counts=[1, 1], layer=0),
         PRECOND, "sequence_ids"),
    case("Append", "batch-second-reserved-pq", lambda lv: append("pq", seqs=["e", "r"], counts=[1, 1], layer=1),
         PRECOND, "sequence_ids"),
    case("Append", "pool-exhausted", lambda lv: append("tiny", seqs=["t2"], counts=[1]), EXHAUSTED, "k"),
    case("Append", "pool-exhausted-batch", lambda lv: append("tiny", seqs=["full", "t2"], counts=[4, 1]),
         EXHAUSTED, "k"),
    case("Append", "pool-exhausted-one-layer", lambda lv: append("tiny", seqs=["full"], counts=[5], layer=1),
         EXHAUSTED, "k"),
    # Past what its pools can ever hold (tinypq: 1 block + R=0 + a block of tail = 16 tokens; sinkpq: 16 sinks
    # more) a sequence never fits, whatever else is freed: misuse, not a lack of room.
    case("Append", "beyond-capacity-pq", lambda lv: append("tinypq", seqs=["s"], counts=[8]), INVALID, "counts"),
    case("Append", "beyond-capacity-sinks", lambda lv: append("sinkpq", seqs=["s"], counts=[1]), INVALID, "counts"),
    case("Append", "unknown-buffer", lambda lv: append(k=ref("shm-nope", 0, (L, 2, HKV, D))),
         NOT_FOUND, "k.ref.buffer_id"),
    case("Append", "buffer-offset-out-of-range", lambda lv: append(k=ref(lv.buf, SHM_BYTES - 64, (L, 2, HKV, D))),
         INVALID, "k"),
    case("Append", "buffer-offset-huge", lambda lv: append(v=ref(lv.buf, 2**63, (L, 2, HKV, D))), INVALID, "v"),
    case("Append", "buffer-offset-misaligned", lambda lv: append(k=ref(lv.buf, 1, (L, 2, HKV, D))), INVALID, "k"),
    # --------------------------------------------------------------------- Attend
    case("Attend", "unknown-cache", lambda lv: attend(cache="nope"), NOT_FOUND, "cache"),
    case("Attend", "unknown-sequence", lambda lv: attend(seqs=["b", "zz"]), NOT_FOUND, "sequence_ids"),
    case("Attend", "unknown-sequence-pq", lambda lv: attend("pq", seqs=["zz"]), NOT_FOUND, "sequence_ids"),
    case("Attend", "empty-batch", lambda lv: attend(seqs=[]), INVALID, "sequence_ids"),
    # repeats allowed, but no more rows than the cache's max_sequences (16): 17 names of one sequence
    case("Attend", "repeats-past-max-sequences", lambda lv: attend(seqs=["b"] * 17), INVALID, "sequence_ids"),
    case("Attend", "layer-out-of-range", lambda lv: attend(layer=L), INVALID, "layer"),
    case("Attend", "layer-negative-pq", lambda lv: attend("pq", layer=-1), INVALID, "layer"),
    case("Attend", "q-batch", lambda lv: attend(seqs=["a", "b"], q=t(rnd(1, HQ, D))), INVALID, "q"),
    case("Attend", "q-heads", lambda lv: attend("pq", q=t(rnd(1, HKV, D))), INVALID, "q"),
    case("Attend", "q-rank", lambda lv: attend(q=t(rnd(HQ, D))), INVALID, "q"),
    case("Attend", "q-dtype-int64", lambda lv: attend(q=raw((1, HQ, D), pb.INT64, nbytes=HQ * D * 8)), INVALID, "q"),
    case("Attend", "q-byte-length", lambda lv: attend(q=raw((1, HQ, D), nbytes=10)), INVALID, "q"),
    case("Attend", "q-nan", lambda lv: attend("pq", q=poisoned(rnd(1, HQ, D), math.nan)), INVALID, "q"),
    case("Attend", "q-overflows-fp16", lambda lv: attend(q=f32(1, HQ, D, value=1e5)), INVALID, "q"),
    case("Attend", "q-overflows-bf16", lambda lv: attend("bf", q=f32(1, HQ, D, value=3.4e38)), INVALID, "q"),
    case("Attend", "q-past-qk-limit-bf16", lambda lv: attend("bf", q=t(rnd(1, HQ, D, dtype=torch.bfloat16) * 1e12)),
         INVALID, "q"),
    # Past ModelGeometry.max_scale, scores of in-range q and k could overflow fp32.
    case("Attend", "scale-overflows-scores", lambda lv: attend(scale=3e38), INVALID, "scale"),
    case("Attend", "scale-overflows-scores-pq", lambda lv: attend("pq", scale=1e30), INVALID, "scale"),
    case("Attend", "scale-overflows-scores-bf16", lambda lv: attend("bf", scale=1e20), INVALID, "scale"),
    case("Attend", "scale-negative", lambda lv: attend(scale=-1.0), INVALID, "scale"),
    case("Attend", "scale-nan", lambda lv: attend(scale=math.nan), INVALID, "scale"),
    case("Attend", "scale-inf-pq", lambda lv: attend("pq", scale=math.inf), INVALID, "scale"),
    case("Attend", "no-tokens", lambda lv: attend(seqs=["b", "e"]), INVALID, "sequence_ids"),
    case("Attend", "no-tokens-pq", lambda lv: attend("pq", seqs=["e"]), INVALID, "sequence_ids"),
    case("Attend", "out-unknown-buffer", lambda lv: attend(out=pb.OutputRef(buffer_id="shm-nope")),
         NOT_FOUND, "out.buffer_id"),
    case("Attend", "out-out-of-range", lambda lv: attend(out=pb.OutputRef(buffer_id=lv.buf, offset=SHM_BYTES - 64)),
         INVALID, "out"),
    case("Attend", "out-misaligned-pq", lambda lv: attend("pq", out=pb.OutputRef(buffer_id=lv.buf, offset=3)),
         INVALID, "out"),
    # --------------------------------------------------------------- AppendAttend
    case("AppendAttend", "unknown-cache", lambda lv: append_attend(cache="nope"), NOT_FOUND, "cache"),
    case("AppendAttend", "unknown-sequence", lambda lv: append_attend(seqs=["b", "zz"]), NOT_FOUND, "sequence_ids"),
    case("AppendAttend", "empty-batch", lambda lv: append_attend(seqs=[]), INVALID, "sequence_ids"),
    case("AppendAttend", "duplicate-ids", lambda lv: append_attend("pq", seqs=["b", "b"]), INVALID, "sequence_ids"),
    case("AppendAttend", "layer-out-of-range", lambda lv: append_attend(layer=L), INVALID, "layer"),
    case("AppendAttend", "token-ids-count", lambda lv: append_attend(token_ids=[1, 2]), INVALID, "token_ids"),
    case("AppendAttend", "token-id-negative", lambda lv: append_attend(token_ids=[-1]), INVALID, "token_ids"),
    case("AppendAttend", "layer-negative", lambda lv: append_attend("pq", layer=-3), INVALID, "layer"),
    case("AppendAttend", "k-heads", lambda lv: append_attend(k=t(rnd(1, HQ, D))), INVALID, "k"),
    case("AppendAttend", "k-two-tokens", lambda lv: append_attend(k=t(rnd(2, HKV, D)), v=t(rnd(2, HKV, D))),
         INVALID, "k"),
    case("AppendAttend", "v-dtype-missing", lambda lv: append_attend(v=raw((1, HKV, D), pb.DTYPE_UNSPECIFIED)),
         INVALID, "v"),
    case("AppendAttend", "v-byte-length", lambda lv: append_attend("pq", v=raw((1, HKV, D), nbytes=3)),
         INVALID, "v"),
    case("AppendAttend", "q-heads", lambda lv: append_attend(q=t(rnd(1, HKV, D))), INVALID, "q"),
    case("AppendAttend", "k-nan", lambda lv: append_attend("pq", k=poisoned(rnd(1, HKV, D), math.nan)),
         INVALID, "k"),
    case("AppendAttend", "q-inf", lambda lv: append_attend(q=poisoned(rnd(1, HQ, D), -math.inf)), INVALID, "q"),
    case("AppendAttend", "scale-negative", lambda lv: append_attend(scale=-0.5), INVALID, "scale"),
    case("AppendAttend", "query-tokens-129", lambda lv: append_attend(query_tokens=129), INVALID, "query_tokens"),
    case("AppendAttend", "query-tokens-past-residual", lambda lv: append_attend("pq", query_tokens=R + 2),
         INVALID, "query_tokens"),
    case("AppendAttend", "query-tokens-q-rows", lambda lv: append_attend("pq", query_tokens=3, q=t(rnd(1, HQ, D))),
         INVALID, "q"),
    case("AppendAttend", "query-tokens-k-rows", lambda lv: append_attend(query_tokens=2, k=t(rnd(1, HKV, D))),
         INVALID, "k"),
    case("AppendAttend", "query-tokens-ids", lambda lv: append_attend(query_tokens=2, token_ids=[4]),
         INVALID, "token_ids"),
    case("AppendAttend", "scale-overflows-scores", lambda lv: append_attend("pq", scale=3e38), INVALID, "scale"),
    case("AppendAttend", "k-overflows-fp16", lambda lv: append_attend(k=f32(1, HKV, D, value=1e5)), INVALID, "k"),
    case("AppendAttend", "v-overflows-fp16-pq", lambda lv: append_attend("pq", v=f32(1, HKV, D, value=7e4)),
         INVALID, "v"),
    case("AppendAttend", "q-overflows-fp16", lambda lv: append_attend(q=f32(1, HQ, D, value=-1e5)), INVALID, "q"),
    case("AppendAttend", "k-overflows-bf16", lambda lv: append_attend("bf", k=f32(1, HKV, D, value=3.4e38)),
         INVALID, "k"),
    case("AppendAttend", "reserved", lambda lv: append_attend(seqs=["r"]), PRECOND, "sequence_ids"),
    case("AppendAttend", "batch-second-reserved", lambda lv: append_attend(seqs=["b", "r"]), PRECOND, "sequence_ids"),
    case("AppendAttend", "batch-second-reserved-pq", lambda lv: append_attend("pq", seqs=["a", "r"], layer=1),
         PRECOND, "sequence_ids"),
    case("AppendAttend", "pool-exhausted", lambda lv: append_attend("tiny", seqs=["t2"]), EXHAUSTED, "k"),
    case("AppendAttend", "unknown-buffer", lambda lv: append_attend(q=ref("shm-nope", 0, (1, HQ, D))),
         NOT_FOUND, "q.ref.buffer_id"),
    case("AppendAttend", "out-out-of-range", lambda lv: append_attend(
        out=pb.OutputRef(buffer_id=lv.buf, offset=SHM_BYTES)), INVALID, "out"),
    case("AppendAttend", "out-unknown-buffer-pq", lambda lv: append_attend("pq", out=pb.OutputRef(buffer_id="x")),
         NOT_FOUND, "out.buffer_id"),
    # ---------------------------------------------------------------- DeleteCache
    case("DeleteCache", "unknown-cache", lambda lv: pb.DeleteCacheRequest(cache="nope"), NOT_FOUND, "cache"),
    case("DeleteCache", "no-name", lambda lv: pb.DeleteCacheRequest(), NOT_FOUND, "cache"),
    # ------------------------------------------------------------------- Retrieve
    case("Retrieve", "unknown-cache", lambda lv: retrieve(cache="nope"), NOT_FOUND, "cache"),
    case("Retrieve", "unknown-sequence", lambda lv: retrieve(seq="zz"), NOT_FOUND, "sequence_id"),
    case("Retrieve", "end-beyond-length", lambda lv: retrieve(end=6), INVALID, "end"),
    case("Retrieve", "end-beyond-length-pq", lambda lv: retrieve("pq", seq="a", start=30, end=41), INVALID, "end"),
    case("Retrieve", "end-uint64-max", lambda lv: retrieve(end=2**64 - 1), INVALID, "end"),
    case("Retrieve", "empty-range", lambda lv: retrieve(start=3, end=3), INVALID, "start"),
    case("Retrieve", "reversed-range", lambda lv: retrieve("pq", start=4, end=2), INVALID, "start"),
    case("Retrieve", "pending-not-committed", lambda lv: retrieve(seq="p", end=4), INVALID, "end"),
    case("Retrieve", "reserved-not-committed", lambda lv: retrieve("pq", seq="r", end=3), INVALID, "end"),
    case("Retrieve", "empty-sequence", lambda lv: retrieve(seq="e", end=1), INVALID, "sequence_id"),
    case("Retrieve", "to-the-end-of-an-empty-sequence", lambda lv: retrieve(seq="e", end=0), INVALID,
         "sequence_id"),
    case("Retrieve", "to-the-end-start-past-length", lambda lv: retrieve(start=5, end=0), INVALID, "start"),
    case("Retrieve", "bad-range-named-before-bad-output", lambda lv: retrieve(
        start=4, end=2, k_out=pb.OutputRef(buffer_id=lv.buf, offset=SHM_BYTES + 64)), INVALID, "start"),
    case("Retrieve", "layer-end-out-of-range", lambda lv: retrieve(layer_end=L + 1), INVALID, "layer_end"),
    case("Retrieve", "layer-start-out-of-range", lambda lv: retrieve("pq", layer_start=L), INVALID, "layer_start"),
    case("Retrieve", "layer-range-empty", lambda lv: retrieve(layer_start=1, layer_end=1), INVALID, "layer_start"),
    case("Retrieve", "k-out-unknown-buffer", lambda lv: retrieve(k_out=pb.OutputRef(buffer_id="shm-nope")),
         NOT_FOUND, "k_out.buffer_id"),
    case("Retrieve", "k-out-out-of-range", lambda lv: retrieve(k_out=pb.OutputRef(buffer_id=lv.buf, offset=4000)),
         INVALID, "k_out"),
    case("Retrieve", "v-out-misaligned", lambda lv: retrieve("pq", v_out=pb.OutputRef(buffer_id=lv.buf, offset=1)),
         INVALID, "v_out"),
    # ----------------------------------------------------------------------- Fork
    case("Fork", "unknown-cache", lambda lv: pb.ForkRequest(cache="nope", sequence_id="b", new_sequence_id="x"),
         NOT_FOUND, "cache"),
    case("Fork", "unknown-source", lambda lv: pb.ForkRequest(cache="f16", sequence_id="zz", new_sequence_id="x"),
         NOT_FOUND, "sequence_id"),
    case("Fork", "target-exists", lambda lv: pb.ForkRequest(cache="f16", sequence_id="b", new_sequence_id="a"),
         EXISTS, "new_sequence_id"),
    case("Fork", "target-is-source", lambda lv: pb.ForkRequest(cache="pq", sequence_id="b", new_sequence_id="b"),
         EXISTS, "new_sequence_id"),
    case("Fork", "target-empty", lambda lv: pb.ForkRequest(cache="f16", sequence_id="b"), INVALID, "new_sequence_id"),
    case("Fork", "target-too-long", lambda lv: pb.ForkRequest(cache="pq", sequence_id="b", new_sequence_id="y" * 300),
         INVALID, "new_sequence_id"),
    case("Fork", "target-not-a-name", lambda lv: pb.ForkRequest(cache="pq", sequence_id="b", new_sequence_id="caché٣"),
         INVALID, "new_sequence_id"),
    case("Fork", "source-pending", lambda lv: pb.ForkRequest(cache="f16", sequence_id="p", new_sequence_id="x"),
         PRECOND, "sequence_id"),
    case("Fork", "source-reserved-pq", lambda lv: pb.ForkRequest(cache="pq", sequence_id="r", new_sequence_id="x"),
         PRECOND, "sequence_id"),
    case("Fork", "pool-exhausted", lambda lv: pb.ForkRequest(cache="tiny", sequence_id="full", new_sequence_id="x"),
         EXHAUSTED, "new_sequence_id"),
    case("Fork", "max-sequences", lambda lv: pb.ForkRequest(cache="one", sequence_id="only", new_sequence_id="x"),
         EXHAUSTED, "new_sequence_id"),
    # ----------------------------------------------------------------------- Free
    case("Free", "unknown-cache", lambda lv: pb.FreeRequest(cache="nope", sequence_ids=["b"]), NOT_FOUND, "cache"),
    case("Free", "empty-batch", lambda lv: pb.FreeRequest(cache="f16"), INVALID, "sequence_ids"),
    case("Free", "duplicate-ids", lambda lv: pb.FreeRequest(cache="pq", sequence_ids=["b", "a", "b"]),
         INVALID, "sequence_ids"),
    case("Free", "unknown-second-sequence", lambda lv: pb.FreeRequest(cache="f16", sequence_ids=["b", "zz"]),
         NOT_FOUND, "sequence_ids"),
    # --------------------------------------------------------- Offload / Prefetch
    case("Offload", "unknown-cache", lambda lv: pb.OffloadRequest(cache="nope", sequence_ids=["b"]),
         NOT_FOUND, "cache"),
    case("Offload", "empty-batch", lambda lv: pb.OffloadRequest(cache="f16"), INVALID, "sequence_ids"),
    case("Offload", "duplicate-ids", lambda lv: pb.OffloadRequest(cache="pq", sequence_ids=["a", "a"]),
         INVALID, "sequence_ids"),
    case("Offload", "unknown-sequence", lambda lv: pb.OffloadRequest(cache="f16", sequence_ids=["b", "zz"]),
         NOT_FOUND, "sequence_ids"),
    case("Offload", "no-disk-tier", lambda lv: pb.OffloadRequest(cache="f16", sequence_ids=["b"]),
         PRECOND, "sequence_ids"),
    case("Prefetch", "unknown-cache", lambda lv: pb.PrefetchRequest(cache="nope", sequence_ids=["b"]),
         NOT_FOUND, "cache"),
    case("Prefetch", "empty-batch", lambda lv: pb.PrefetchRequest(cache="pq"), INVALID, "sequence_ids"),
    case("Prefetch", "duplicate-ids", lambda lv: pb.PrefetchRequest(cache="f16", sequence_ids=["b", "a", "b"]),
         INVALID, "sequence_ids"),
    case("Prefetch", "unknown-sequence", lambda lv: pb.PrefetchRequest(cache="pq", sequence_ids=["zz"]),
         NOT_FOUND, "sequence_ids"),
    # ------------------------------------------------------------------- MapPool
    case("MapPool", "unknown-cache", lambda lv: pb.MapPoolRequest(cache="nope"), NOT_FOUND, "cache"),
    case("MapPool", "cpu-pool", lambda lv: pb.MapPoolRequest(cache="pq"), PRECOND, "cache"),
    # ------------------------------------------------------------ RegisterBuffer
    case("RegisterBuffer", "kind-missing", lambda lv: pb.RegisterBufferRequest(name=lv.shm_name, size=64),
         INVALID, "kind"),
    case("RegisterBuffer", "cuda-ipc-size-zero", lambda lv: pb.RegisterBufferRequest(kind=pb.CUDA_IPC, ipc_handle=b"x"),
         INVALID, "size"),
    case("RegisterBuffer", "cuda-ipc-without-cuda", lambda lv: pb.RegisterBufferRequest(
        kind=pb.CUDA_IPC, ipc_handle=b"x" * 64, size=64), PRECOND, "kind",
         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the daemon has CUDA here")),
    case("RegisterBuffer", "name-with-slash", lambda lv: pb.RegisterBufferRequest(kind=pb.SHM, name="../etc/passwd",
                                                                                  size=64), INVALID, "name"),
    case("RegisterBuffer", "name-empty", lambda lv: pb.RegisterBufferRequest(kind=pb.SHM, size=64), INVALID, "name"),
    case("RegisterBuffer", "name-dot", lambda lv: pb.RegisterBufferRequest(kind=pb.SHM, name=".", size=64),
         INVALID, "name"),
    case("RegisterBuffer", "name-dotdot", lambda lv: pb.RegisterBufferRequest(kind=pb.SHM, name="..", size=64),
         INVALID, "name"),
    case("RegisterBuffer", "name-missing", lambda lv: pb.RegisterBufferRequest(
        kind=pb.SHM, name=f"kvstore-test-missing-{secrets.token_hex(4)}", size=64), NOT_FOUND, "name"),
    case("RegisterBuffer", "size-zero", lambda lv: pb.RegisterBufferRequest(kind=pb.SHM, name=lv.shm_name),
         INVALID, "size"),
    case("RegisterBuffer", "size-beyond-file", lambda lv: pb.RegisterBufferRequest(
        kind=pb.SHM, name=lv.shm_name, size=SHM_BYTES + 1), INVALID, "size"),
    # ---------------------------------------------------------- UnregisterBuffer
    case("UnregisterBuffer", "unknown", lambda lv: pb.UnregisterBufferRequest(buffer_id="shm-0000"),
         NOT_FOUND, "buffer_id"),
    case("UnregisterBuffer", "empty", lambda lv: pb.UnregisterBufferRequest(), NOT_FOUND, "buffer_id"),
    # ------------------------------------------------------------- introspection
    case("Stats", "unknown-cache", lambda lv: pb.StatsRequest(cache="nope"), NOT_FOUND, "cache"),
    case("ListSequences", "unknown-cache", lambda lv: pb.ListSequencesRequest(cache="nope"), NOT_FOUND, "cache"),
    case("ListSequences", "empty-name", lambda lv: pb.ListSequencesRequest(), NOT_FOUND, "cache"),
    case("SequenceInfo", "unknown-cache", lambda lv: pb.SequenceInfoRequest(cache="nope", sequence_id="b"),
         NOT_FOUND, "cache"),
    case("SequenceInfo", "unknown-sequence", lambda lv: pb.SequenceInfoRequest(cache="pq", sequence_id="zz"),
         NOT_FOUND, "sequence_id"),
    case("SequenceInfo", "empty-id", lambda lv: pb.SequenceInfoRequest(cache="f16"), NOT_FOUND, "sequence_id"),
    # ------------------------------------------------------------ session leases
    case("Heartbeat", "no-session", lambda lv: pb.HeartbeatRequest(), INVALID, "x-kvstore-session"),
    case("Heartbeat", "bad-session-id", lambda lv: pb.HeartbeatRequest(), INVALID, "x-kvstore-session",
         metadata=(("x-kvstore-session", "no spaces/allowed"),)),
    case("Allocate", "bad-session-id", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="x"),
         INVALID, "x-kvstore-session", metadata=(("x-kvstore-session", "x" * 65),)),
    case("Allocate", "two-session-ids", lambda lv: pb.AllocateRequest(cache="f16", sequence_id="x"),
         INVALID, "x-kvstore-session", metadata=(("x-kvstore-session", "w1"), ("x-kvstore-session", "w2"))),
]


# AppendAttendStream answers every bad AppendAttend with the same status, which ends the stream.
CASES += [case("AppendAttendStream", p.id.split("-", 1)[1], *p.values[1:4], p.values[4], marks=p.marks)
          for p in list(CASES) if p.values[0] == "AppendAttend"]


def call(stub, rpc: str, request, metadata=()):
    if rpc == "AppendAttendStream":      # one request on a fresh stream; the status ends it
        return list(stub.AppendAttendStream(iter([request]), timeout=30, metadata=metadata))
    return getattr(stub, rpc)(request, timeout=30, metadata=metadata)


def test_every_rpc_has_bad_input_cases():
    rpcs = set(pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name)
    covered = {p.values[0] for p in CASES}
    assert rpcs - covered == set(), "RPCs without a bad-input case"
    assert covered - rpcs == set()


@pytest.mark.parametrize("rpc, build, code, field, metadata", CASES)
def test_bad_request(live, rpc, build, code, field, metadata):
    request = build(live)
    before = snapshot(live.stub)
    with pytest.raises(grpc.RpcError) as info:
        call(live.stub, rpc, request, metadata)
    err = info.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    assert names(err.details(), field), f"message does not name {field!r}: {err.details()!r}"
    assert_unchanged(before, snapshot(live.stub))
    assert_serving(live.channel)


def test_fixture_state_is_what_the_cases_assume(live):
    """Guards the table: the sequences are in the states the cases rely on."""
    def info(cache, sid):
        return live.stub.SequenceInfo(pb.SequenceInfoRequest(cache=cache, sequence_id=sid), timeout=30)
    for cache in ("pq", "f16"):
        assert info(cache, "a").length == 40 and info(cache, "b").length == 5 and info(cache, "e").length == 0
        assert list(info(cache, "p").pending) == [1, 0] and info(cache, "r").reserved == 2
        assert info(cache, "w").known_token_ids == 12 and info(cache, "w").length == 0
    assert len(info("pq", "a").sealed_blocks) == 3
    stats = {c.cache: c for c in live.stub.Stats(pb.StatsRequest(), timeout=30).caches}
    assert stats["tiny"].main.free + stats["tiny"].main.cached == 0
    assert stats["tinypq"].main.free + stats["tinypq"].main.cached == 0
    assert stats["sinkpq"].main.free + stats["sinkpq"].main.cached == 0 and stats["sinkpq"].sink_tokens == 16
    s = info("sinkpq", "s")
    assert s.sink_blocks == 2 and len(s.sealed_blocks) == 1 and len(s.tail_blocks) == 3
    assert not live.stub.GetCache(pb.GetCacheRequest(cache="raw"), timeout=30).has_codebooks


# -------------------------------------------------------------- message size
@pytest.fixture
def small_daemon(tmp_path):
    sock = str(tmp_path / "small.sock")
    server, _, _ = create_server(socket_path=sock, max_message_mb=1)
    channel = grpc.insecure_channel(f"unix://{sock}")
    client = KVStoreClient(f"unix://{sock}", transport="shm")
    yield pb_grpc.KVStoreStub(channel), channel, client
    client.close()
    channel.close()
    server.stop(0)


def test_oversized_messages_are_refused_without_state_change(small_daemon):
    stub, channel, client = small_daemon
    hd, n = 128, 600          # k and v of 600 tokens: 2 x 600 KiB inline, over the 1 MiB limit
    client.create_cache("big", "m", num_layers=L, num_q_heads=HKV, num_kv_heads=HKV, head_dim=hd, codec="fp16",
                        block_size=16, num_blocks=128)
    client.allocate("big", "s", [])
    k = rnd(L, n, HKV, hd)
    client.append("big", ["s"], k, k)          # through shared memory: the request itself is tiny
    before = snapshot(stub)
    with pytest.raises(grpc.RpcError) as info:
        stub.Append(append("big", ["s"], [n], k=t(k), v=t(k)), timeout=30)
    assert info.value.code() == EXHAUSTED, info.value.details()
    assert "larger than max" in info.value.details()
    assert_unchanged(before, snapshot(stub))
    # A reply over the limit (inline Retrieve of 2 x 600 KiB) is refused the same way.
    with pytest.raises(grpc.RpcError) as info:
        stub.Retrieve(retrieve("big", "s", 0, n), timeout=30)
    assert info.value.code() == EXHAUSTED, info.value.details()
    assert_unchanged(before, snapshot(stub))
    assert_serving(channel)
    # ... and the same data still goes through shared memory.
    k2, _ = client.retrieve("big", "s", 0, n)
    assert torch.equal(k2, k)


# ------------------------------------------------- remote callers, raw bytes
TOKEN = "bad-input-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A daemon on a Unix socket and on TCP (bearer token); one sequence in it."""
    sock = str(tmp_path_factory.mktemp("remote") / "kv.sock")
    server, port, _ = create_server(socket_path=sock, port=0, auth=Authenticator({TOKEN: "default"}))
    unix = grpc.insecure_channel(f"unix://{sock}")
    tcp = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.KVStoreStub(unix)
    _ok(stub, "CreateCache", pb.CreateCacheRequest(spec=spec("f16", "fp16")))
    _ok(stub, "Allocate", pb.AllocateRequest(cache="f16", sequence_id="b"))
    _ok(stub, "Append", append("f16", ["b"], [5]))
    yield unix, tcp
    unix.close()
    tcp.close()
    server.stop(0)


@pytest.mark.parametrize("rpc, request_, metadata, code, field", [
    pytest.param("Stats", pb.StatsRequest(), (), C.UNAUTHENTICATED, "authorization", id="no-token"),
    pytest.param("Allocate", pb.AllocateRequest(cache="f16", sequence_id="x"),
                 (("authorization", "Bearer wrong-token-0123456789"),), C.UNAUTHENTICATED, "authorization",
                 id="wrong-token"),
    pytest.param("Free", pb.FreeRequest(cache="f16", sequence_ids=["b"]), (("authorization", TOKEN),),
                 C.UNAUTHENTICATED, "authorization", id="token-without-bearer"),
    pytest.param("RegisterBuffer", pb.RegisterBufferRequest(kind=pb.SHM, name="x", size=64), AUTH,
                 C.PERMISSION_DENIED, "kind", id="register-buffer-remote"),
    pytest.param("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id="shm-0"), AUTH,
                 C.PERMISSION_DENIED, "buffer_id", id="unregister-buffer-remote"),
    pytest.param("MapPool", pb.MapPoolRequest(cache="f16"), AUTH, C.PERMISSION_DENIED, "cache",
                 id="map-pool-remote"),
    pytest.param("Reserve", pb.ReserveRequest(cache="f16", sequence_id="b", num_tokens=1), AUTH, C.PERMISSION_DENIED,
                 "cache", id="reserve-remote"),
    pytest.param("Append", append("f16", ["b"], [2], k=ref("shm-0", 0, (L, 2, HKV, D))), AUTH, INVALID, "k",
                 id="buffer-ref-remote"),
    pytest.param("Attend", attend("f16", ["b"], out=pb.OutputRef(buffer_id="shm-0")), AUTH, INVALID, "out",
                 id="output-ref-remote"),
])
def test_bad_remote_request(remote, rpc, request_, metadata, code, field):
    """TCP callers: no or unknown token, and the IPC-only RPCs and buffer references."""
    unix, tcp = remote
    before = snapshot(pb_grpc.KVStoreStub(unix))
    with pytest.raises(grpc.RpcError) as info:
        getattr(pb_grpc.KVStoreStub(tcp), rpc)(request_, timeout=30, metadata=metadata)
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    assert names(info.value.details(), field), info.value.details()
    assert_unchanged(before, snapshot(pb_grpc.KVStoreStub(unix)))
    assert_serving(tcp)


@pytest.mark.parametrize("method", ["Append", "Allocate", "CreateCache", "Free"])
def test_malformed_request_bytes(remote, method):
    """Bytes that are not a protobuf message: INVALID_ARGUMENT, not grpc's INTERNAL."""
    unix, _ = remote
    before = snapshot(pb_grpc.KVStoreStub(unix))
    call = unix.unary_unary(f"/kvstore.v1.KVStore/{method}")          # raw bytes in and out
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a\xff\xff\xff\xff\x0f garbage", timeout=30)
    assert info.value.code() == INVALID, f"{info.value.code()}: {info.value.details()}"
    assert info.value.details().startswith("request")
    assert_unchanged(before, snapshot(pb_grpc.KVStoreStub(unix)))
    assert_serving(unix)
