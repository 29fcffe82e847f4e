"""Learned attention-sink logits (CacheConfig.sink_logits, gpt-oss's `sinks`): each head's
softmax takes one more score with a zero value. Checked on CPU against an fp64 reference
that appends the sink as a key column (as transformers' eager gpt-oss attention does), for
decode steps, Attend and multi-token AppendAttend, fp16 and PQ, with a sliding layer; on
CUDA (kernels, decode graphs) against the CPU engine; the config's checks."""
import dataclasses

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import AlreadyExists, InvalidArgument
from kvstore.kernels import reference as ref
from tests.engine.test_sinks import BS, D, HKV, HQ, L, M, R, SCALE, T, TOL, expected
from tests.helpers import config, kv, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOWS = (13, 0)
# per layer and head: large, small, none (-inf) and negative logits
SINKS = (2.5, -1.0, float("-inf"), 0.5, 0.0, 4.0, -3.0, 1.5)


def engine(codec: str, sinks=SINKS, windows=WINDOWS, sink_tokens: int = 0, device: str = "cpu", **geom) -> Engine:
    e = Engine(device)
    cfg = config(codec, block_size=BS, residual=R, sink_tokens=sink_tokens, **geom)
    e.create_cache(dataclasses.replace(cfg, layer_windows=windows, sink_logits=sinks, device=device))
    if codec == "pq":
        g = cfg.geometry
        m = cfg.m
        gen = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, g.num_kv_heads, m, 256, g.head_dim // m, generator=gen),
                                       v=torch.randn(L, g.num_kv_heads, m, 256, g.head_dim // m, generator=gen)))
    return e


def with_sinks(q, k, v, sinks, window: int = 0, scale: float = SCALE) -> torch.Tensor:
    """q [T, Hq, d] (the T newest positions), k/v [n, Hkv, d], sinks [Hq]: gpt-oss's eager
    attention (scores, the mask, the sink as one more column, softmax, the column
    dropped) -> fp64 [T, Hq, d]."""
    n, t = k.shape[0], q.shape[0]
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)              # [n, Hq, d]
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,nhd->thn", q.double(), kk) * scale
    pos = torch.arange(n - t, n)[:, None]                    # each query's position
    j = torch.arange(n)[None, :]
    keep = (j <= pos) & ((j > pos - window) if window else True)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    z = torch.tensor(sinks, dtype=torch.float64).view(1, -1, 1).expand(t, -1, 1)
    p = torch.softmax(torch.cat([s, z], dim=-1), dim=-1)[..., :n]
    return torch.einsum("thn,nhd->thd", p, vv)


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("sinks,message", [
    ((1.0,) * 7, "num_layers \\* num_q_heads = 8"),
    ((1.0,) * 9, "got 9"),
    ([1.0] * 8, "got \\[1.0"),                        # a list: the frozen config compares by value
    ((1.0,) * 7 + (float("nan"),), "entry 7"),
    ((float("inf"),) + (1.0,) * 7, "entry 0"),
    (("1",) + (1.0,) * 7, "entry 0"),
])
def test_config_refuses_bad_sink_logits(sinks, message):
    with pytest.raises(InvalidArgument, match=message) as err:
        dataclasses.replace(config("fp16"), sink_logits=sinks)
    assert err.value.field == "sink_logits"


def test_config_takes_minus_infinity_for_a_head_without_a_sink():
    """-inf (no sink for that head) is taken, and the engine's table holds each
    layer's row with float32's lowest in its place (a row of no keys stays 0)."""
    cfg = dataclasses.replace(config("fp16"), sink_logits=SINKS)
    rows = ref.sink_table(cfg.sink_logits, cfg.geometry.num_layers)
    want = torch.tensor(SINKS, dtype=torch.float32).view(2, HQ)
    none = torch.isinf(want)
    assert none.any(), "SINKS must hold a head without a sink"
    assert torch.equal(rows[~none], want[~none])
    assert (rows[none] == torch.finfo(torch.float32).min).all()


def test_a_spec_differing_in_thousands_of_sink_logits_is_named_briefly():
    """CreateCache of a taken name names the differing field with its values cut short:
    a model's sink logits (4,096 here) would pass gRPC's 16 KiB status limit whole."""
    e = Engine()
    e.create_cache(config("fp16", num_layers=64, num_q_heads=64, num_kv_heads=8))
    big = dataclasses.replace(config("fp16", num_layers=64, num_q_heads=64, num_kv_heads=8),
                              sink_logits=(0.25,) * 4096)
    with pytest.raises(AlreadyExists, match="sink_logits \\(\\) \\(existing\\) vs \\(0.25, ") as err:
        e.create_cache(big, exist_ok=True)
    assert len(str(err.value)) < 400


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("codec,sink_tokens", [("fp16", 0), ("pq", 0), ("pq", 16)])
def test_attention_with_sink_logits_matches_the_eager_reference(codec, sink_tokens):
    """A ragged batch around the window, the sink tokens and the first seal: Attend, then
    an AppendAttend step, then (global layer) a 3-token AppendAttend, each against the
    reference; and the sinks change the output (the test could not tell otherwise)."""
    e = engine(codec, sink_tokens=sink_tokens)
    lens = [1, 12, 14, sink_tokens + 5, sink_tokens + R + BS + 1, sink_tokens + 60]
    data = {}
    for i, n in enumerate(lens):
        k, v = kv(L, n + 4, HKV, D, seed=30 + i)
        e.allocate("c", T, f"s{i}", [])
        e.append("c", T, [f"s{i}"], k[:, :n], v[:, :n], [n])
        data[f"s{i}"] = (k, v)
    q = (torch.randn(len(lens), 3, HQ, D, generator=torch.Generator().manual_seed(3)) * 2).half()

    def check(out, layer, upto, t=1):
        for b, (sid, (k, v)) in enumerate(data.items()):
            n = lens[b] + upto
            ek, ev = expected(e, sid, k[:, :n], v[:, :n]) if codec == "pq" else (k[:, :n], v[:, :n])
            want = with_sinks(q[b, :t], ek[layer], ev[layer], SINKS[layer * HQ:(layer + 1) * HQ], WINDOWS[layer])
            got = out[b * t:(b + 1) * t].double()
            assert torch.allclose(got, want, rtol=TOL, atol=TOL), (sid, n, layer, (got - want).abs().max())
    for layer in range(L):
        check(e.attend("c", T, layer, list(data), q[:, 0]), layer, 0)
    for layer in range(L):
        k1 = torch.stack([k[layer, lens[b]] for b, (k, _) in enumerate(data.values())])
        v1 = torch.stack([v[layer, lens[b]] for b, (_, v) in enumerate(data.values())])
        check(e.append_attend("c", T, layer, list(data), k1, v1, q[:, 0]), layer, 1)
    plain = engine(codec, sinks=(), sink_tokens=sink_tokens)
    for sid, (k, v) in data.items():
        plain.allocate("c", T, sid, [])
        plain.append("c", T, [sid], k[:, :lens[int(sid[1:])] + 1], v[:, :lens[int(sid[1:])] + 1],
                     [lens[int(sid[1:])] + 1])
    differ = (e.attend("c", T, 1, list(data), q[:, 0]).float()
              - plain.attend("c", T, 1, list(data), q[:, 0]).float()).abs().max()
    assert differ > 1e-2
    # multi-token: only a layer without a window takes it; every layer is appended first
    e2 = engine(codec, windows=(), sink_tokens=sink_tokens)
    for sid, (k, v) in data.items():
        n = lens[int(sid[1:])]
        e2.allocate("c", T, sid, [])
        e2.append("c", T, [sid], k[:, :n], v[:, :n], [n])
    data_t = 3
    for layer in range(L):
        k3 = torch.cat([k[layer, lens[b]:lens[b] + data_t] for b, (k, _) in enumerate(data.values())])
        v3 = torch.cat([v[layer, lens[b]:lens[b] + data_t] for b, (_, v) in enumerate(data.values())])
        out = e2.append_attend("c", T, layer, list(data), k3, v3, q.reshape(-1, HQ, D), query_tokens=data_t)
        for b, (sid, (k, v)) in enumerate(data.items()):
            n = lens[b] + data_t
            ek, ev = expected(e2, sid, k[:, :n], v[:, :n]) if codec == "pq" else (k[:, :n], v[:, :n])
            want = with_sinks(q[b], ek[layer], ev[layer], SINKS[layer * HQ:(layer + 1) * HQ])
            assert torch.allclose(out[b * data_t:(b + 1) * data_t].double(), want, rtol=TOL, atol=TOL), (sid, layer)
    for x in (e, e2):
        x.check_invariants()


def test_fold_sink_logits_handles_rows_without_keys():
    """A row with no keys (lse -inf) stays 0 with or without a sink; a head without a sink
    (-inf, as sink_table hands it over) keeps its output."""
    out = torch.ones(2, 2, 4, dtype=torch.float16)
    out[0] = 0                                       # what the kernels write for a row without keys
    lse = torch.tensor([[float("-inf"), float("-inf")], [0.0, 0.0]])
    sinks = ref.sink_table([float("-inf"), 0.0], 1)
    assert torch.isfinite(sinks).all() and sinks.shape == (1, 2)
    ref.fold_sink_logits(out, lse, sinks[0])
    assert torch.isfinite(out).all() and out[0].eq(0).all()
    assert out[1, 0].eq(1).all() and torch.allclose(out[1, 1].float(), torch.full((4,), 0.5))


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("codec,sink_tokens", [("fp16", 0), ("pq", 16)])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_sink_logits_match_the_eager_reference(codec, sink_tokens, graphs):
    """On CUDA (the kernels' lse folded after them; with graphs on, the q and out buffers
    keep their addresses, so steps replay a captured graph that folds too): decode steps
    with a sliding and a global layer, then a multi-token AppendAttend on a cache without
    windows, against the fp64 reference over the K/V the cache holds (Retrieve: sealed
    tokens as their codes decode)."""
    d, hq, hkv, steps = 64, 4, 2, 6
    lens = (100, 58)
    geom = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, num_blocks=128)
    k, v = kv(L, max(lens) + steps + 4, hkv, d, seed=13)
    gen = torch.Generator().manual_seed(14)

    def make(windows):
        e = engine(codec, windows=windows, sink_tokens=sink_tokens, device="cuda", **geom)
        e.cache("c").graphs.enabled = graphs
        for i, sid in enumerate(("a", "b")):
            e.allocate("c", T, sid, [])
            e.append("c", T, [sid], k[:, :lens[i]].cuda(), v[:, :lens[i]].cuda(), [lens[i]])
        return e

    def check(before, after, outs, windows, upto, t=1):
        """before / after: each sequence's K/V (Retrieve) before and after the step, outs:
        per layer (q, out, the step's new k, v). The step's tokens commit, and a block may
        seal, when the last layer appends them, before it attends: the layers before it
        read the earlier tokens as they were, and the new ones exact."""
        for b in range(2):
            for layer, (qq, out, nk, nv) in enumerate(outs):
                if layer == L - 1:
                    ek1, ev1 = (x[layer].cpu() for x in after[b])
                else:
                    ek1 = torch.cat([before[b][0][layer].cpu(), nk[b * t:(b + 1) * t].cpu()])
                    ev1 = torch.cat([before[b][1][layer].cpu(), nv[b * t:(b + 1) * t].cpu()])
                want = with_sinks(qq[b * t:(b + 1) * t].cpu(), ek1, ev1,
                                  SINKS[layer * hq:(layer + 1) * hq], windows[layer] if windows else 0, d ** -0.5)
                got = out[b * t:(b + 1) * t].double().cpu()
                err = ((got - want).norm() / want.norm()).item()
                assert err < 1e-2, (b, layer, upto, err)
    e = make((40, 0))
    q = torch.empty(2, hq, d, dtype=torch.float16, device="cuda")       # fixed addresses: graphs replay
    out = torch.empty(2, hq, d, dtype=torch.float16, device="cuda")
    def held(e):
        return [e.retrieve("c", T, sid, 0, 0) for sid in ("a", "b")]
    for t in range(steps):
        outs, before = [], held(e)
        for layer in range(L):
            q.copy_(torch.randn(2, hq, d, generator=gen).half())
            new_k = torch.stack([k[layer, n + t] for n in lens]).cuda()
            new_v = torch.stack([v[layer, n + t] for n in lens]).cuda()
            e.append_attend("c", T, layer, ["a", "b"], new_k, new_v, q, out=out)
            outs.append((q.clone(), out.clone(), new_k, new_v))
        check(before, held(e), outs, (40, 0), t)
    assert (e.cache("c").graphs.hits > 0) == graphs
    e2 = make(())
    outs, before = [], held(e2)
    for layer in range(L):
        q3 = torch.randn(2 * 3, hq, d, generator=gen).half().cuda()
        k3 = torch.cat([k[layer, n:n + 3] for n in lens]).cuda()
        v3 = torch.cat([v[layer, n:n + 3] for n in lens]).cuda()
        outs.append((q3, e2.append_attend("c", T, layer, ["a", "b"], k3, v3, q3, query_tokens=3), k3, v3))
    check(before, held(e2), outs, (), "multi", t=3)
    for x in (e, e2):
        x.check_invariants()
