"""Reserve's refusals at the engine (the service admits Reserve only for
mapped clients of a CUDA pool, tests/service/test_reserve_admission.py, so on CPU the
engine is where they run): the error, the field it names, and no state change."""
import pytest
import torch

from helpers import config
from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

L, HKV, D = 2, 2, 16
T = "default"


def _codebooks() -> Codebooks:
    g = torch.Generator().manual_seed(0)
    return Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g), v=torch.randn(L, HKV, D // 2, 256, 2, generator=g))


def _append(e: Engine, cache: str, sid: str, n: int, layer: int | None = None) -> None:
    shape = (L, n, HKV, D) if layer is None else (n, HKV, D)
    e.append(cache, T, [sid], torch.randn(shape).half(), torch.randn(shape).half(), [n], layer=layer)


@pytest.fixture(scope="module")
def engine():
    """pq, f16: b 5 tokens, p 3 + 1 pending at layer 0, r 2 + 2 reserved;
    tiny: fp16, 3 blocks all held by full; tinypq: one main block, taken by s,
    so r cannot reserve the 16 tokens whose commit would seal a block; sinkpq: the
    same with 16 sink tokens (32 tokens for r); raw: no codebooks."""
    e = Engine()
    e.create_cache(config("pq", "pq", num_blocks=64, max_sequences=8))
    e.set_codebooks("pq", _codebooks())
    e.create_cache(config("fp16", "f16"))
    for cache in ("pq", "f16"):
        for sid, n in (("b", 5), ("p", 3), ("r", 2)):
            e.allocate(cache, T, sid, [])
            _append(e, cache, sid, n)
        _append(e, cache, "p", 1, layer=0)
        e.reserve(cache, T, "r", 2)
    e.create_cache(config("fp16", "tiny", num_blocks=3, max_sequences=3))
    for sid in ("full", "t2"):
        e.allocate("tiny", T, sid, [])
    _append(e, "tiny", "full", 20)
    for name, sinks in (("tinypq", 0), ("sinkpq", 16)):
        e.create_cache(config("pq", name, num_blocks=1, max_sequences=2, residual=0, sink_tokens=sinks))
        e.set_codebooks(name, _codebooks())
        for sid in ("s", "r"):
            e.allocate(name, T, sid, [])
        _append(e, name, "s", 16 + sinks)
    e.create_cache(config("pq", "raw"))
    return e


def _state(e: Engine) -> dict:
    out = {}
    for name, c in e.caches.items():
        s = c.stats()
        out[name] = (s["main"], s["tail"], s["tokens"], s["sequences"])
        for info in e.list_sequences(name, T):
            out[(name, info.seq_id)] = info
            if info.length:
                out[(name, info.seq_id, "kv")] = e.retrieve(name, T, info.seq_id, 0, info.length)
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            if not all(torch.equal(p, q) for p, q in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


CASES = [
    ("unknown-sequence", lambda e: e.reserve("f16", T, "zz", 1), NotFound, "sequence_id"),
    ("over-2^20", lambda e: e.reserve("f16", T, "b", (1 << 20) + 1), InvalidArgument, "num_tokens"),
    ("uint32-max", lambda e: e.reserve("pq", T, "b", 2**32 - 1), InvalidArgument, "num_tokens"),
    ("pending", lambda e: e.reserve("f16", T, "p", 1), FailedPrecondition, "sequence_id"),
    ("pending-pq", lambda e: e.reserve("pq", T, "p", 1), FailedPrecondition, "sequence_id"),
    ("pending-batch", lambda e: e.reserve_batch("pq", T, ["b", "p"], 1), FailedPrecondition, "sequence_ids"),
    ("pool-exhausted", lambda e: e.reserve("f16", T, "b", 1 << 20), ResourceExhausted, "num_tokens"),
    ("pool-exhausted-tiny", lambda e: e.reserve("tiny", T, "t2", 1), ResourceExhausted, "num_tokens"),
    ("seal-exhausted-pq", lambda e: e.reserve("tinypq", T, "r", 16), ResourceExhausted, "num_tokens"),
    ("seal-exhausted-sinks", lambda e: e.reserve("sinkpq", T, "r", 32), ResourceExhausted, "num_tokens"),
    ("seal-exhausted-batch", lambda e: e.reserve_batch("sinkpq", T, ["r", "s"], 16), ResourceExhausted,
     "num_tokens"),
    ("known-batch-count", lambda e: e.reserve_batch("f16", T, ["b"], 1, known=[(0, 0), (0, 0)]),
     InvalidArgument, "known_sealed"),
    ("map-no-codebooks", lambda e: e.map_pool("raw"), FailedPrecondition, "codebooks"),
]


@pytest.mark.parametrize("call, error, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reserve_refusals_change_nothing(engine, call, error, field):
    before = _state(engine)
    with pytest.raises(error) as info:
        call(engine)
    assert info.value.field == field, str(info.value)
    assert _same(before, _state(engine)), "a rejected Reserve changed state"
    engine.check_invariants()


def test_fixture_state_is_what_the_cases_assume(engine):
    for cache in ("pq", "f16"):
        b, p, r = (engine.sequence_info(cache, T, s) for s in ("b", "p", "r"))
        assert b.length == 5 and p.pending == [1, 0] and r.reserved == 2
    assert engine.cache("tiny").main_pool.num_allocatable() == 0
    for name in ("tinypq", "sinkpq"):
        assert engine.cache(name).main_pool.num_allocatable() == 0
    assert engine.sequence_info("sinkpq", T, "r").reserved == 0


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_reserve_that_publishes_the_clients_writes_waits_for_them(codec):
    """A mapped client writes its reserved slots on its own stream; the next Reserve
    commits them. Where that commit makes them readable to others (a prompt block it
    completes gets its hash: another sequence's prefix hit shares or encodes it on
    another stream; a Reserve of none leaves the sequence free to move, fork or
    offload) the Reserve enters the client's CUDA scope (it waits for the writes),
    with no Redis tier too; a step that completes nothing does not."""
    import contextlib
    e = Engine()
    e.create_cache(config(codec, "c", block_size=8, residual=8, num_blocks=64, max_sequences=8))
    if codec == "pq":
        e.set_codebooks("c", _codebooks())
    prompt = list(range(100, 120))                  # 20 tokens: two full blocks, hashed at their commit
    e.allocate("c", T, "a", prompt)
    e.reserve("c", T, "a", len(prompt))             # the client writes the prompt's slots
    entered = []

    def scope():
        entered.append(True)
        return contextlib.nullcontext()
    e.reserve_batch("c", T, ["a"], 1, gpu_scope=scope)
    assert len(entered) == 1, "the commit hashed the prompt's blocks: in the client's order"
    assert e.cache("c").seq(T, "a").hashed_upto == 2
    e.reserve_batch("c", T, ["a"], 1, gpu_scope=scope)      # completes nothing, hashes nothing
    assert len(entered) == 1
    e.reserve_batch("c", T, ["a"], 0, gpu_scope=scope)      # the last step: the sequence is free to move
    assert len(entered) == 2
