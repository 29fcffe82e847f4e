"""AppendAttend with T new tokens per sequence (query_tokens): the tokens are appended,
then each attends causally to the sequence's earlier tokens and the new tokens up to
itself, read from the PQ codes (sealed) and the fp16 sinks and tail. Checked on CPU (and
GPU, marked) against an fp64 attention over the tokens in position order, with each
layer's sealed tokens as the cache held them when it attended; refusals change nothing."""
import math

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument
from kvstore.kernels import cpu_decode
from kvstore.kernels import reference as ref
from kvstore.kernels.plan import MAX_QUERY_TOKENS
from tests.helpers import config, kv

T_ = "t"
L, HQ, HKV, BS, R = 2, 4, 2, 8, 8


def engine(codec: str, sinks: int = 0, device: str = "cpu", d: int = 16, windows=(), residual: int = R) -> Engine:
    import dataclasses
    e = Engine(device=device)
    cfg = config(codec, block_size=BS, residual=residual, sink_tokens=sinks, head_dim=d, num_blocks=128)
    e.create_cache(dataclasses.replace(cfg, layer_windows=windows, device=device))
    assert e.cache("c").main_device.type == torch.device(device).type     # the GPU tests run the GPU paths
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, d // 2, 256, 2, generator=g),
                                       v=torch.randn(L, HKV, d // 2, 256, 2, generator=g)))
    return e


def held(e: Engine, x: torch.Tensor, layer: int, which: str, s) -> torch.Tensor:
    """x [n, Hkv, d] fp16 as the cache holds it for sequence s: fp32, the sealed
    positions [S, S + sealed) encoded and decoded with the layer's codebook. A CUDA cache's
    encoder rounds distances in fp16 and may pick the other of two near-tied centroids:
    there the sealed positions are the codes the cache holds, which must agree with the
    reference encoder's for all but a few sub-vectors (a wrong token sealed would not)."""
    c = e.cache("c")
    out = x.float().clone()
    if c.is_pq and s.sealed:
        a, b = c.sinks, c.sinks + len(s.sealed) * BS
        cb = (c.codebooks.k if which == "k" else c.codebooks.v)[layer]
        codes = ref.pq_encode(x[a:b], cb)
        out[a:b] = ref.pq_dequantize(codes, cb)
        if c.main_device.type == "cuda":
            m = c.main
            kx, vx = cpu_decode.dequantize_tokens(m.k_codes[layer].cpu(), m.v_codes[layer].cpu(),
                                                  m.k_cb[layer].cpu(), m.v_cb[layer].cpu(), s.sealed)
            stored = (kx if which == "k" else vx).transpose(0, 1)          # [n, Hkv, d]
            sub = stored.shape[-1] // codes.shape[-1]
            same = (stored.view(*codes.shape, sub) == ref.pq_dequantize(codes, cb).half().float()
                    .view(*codes.shape, sub)).all(-1)
            assert same.float().mean() > 0.99, f"layer {layer} {which}: {same.float().mean():.3f} of codes agree"
            out[a:b] = stored
    return out


def causal(q, k, v, scale):
    """q [T, Hq, d]; k, v [n, Hkv, d] (the T new tokens last) -> fp64 [T, Hq, d]."""
    t, n = q.shape[0], k.shape[0]
    return torch.stack([ref.attention_dense(q[i].double(), k[:n - t + 1 + i].double(),
                                            v[:n - t + 1 + i].double(), scale)[0] for i in range(t)])


def run_case(codec, sinks, t, device="cpu", d=16, prompts=(40, 21), residual=R):
    e = engine(codec, sinks, device, d, residual=residual)
    scale = 1 / math.sqrt(d)
    ks, vs = [], []
    for j, n in enumerate(prompts):
        k, v = kv(L, n, HKV, d, seed=j)
        e.allocate("c", T_, f"s{j}", [])
        e.append("c", T_, [f"s{j}"], k, v, [n])
        ks.append(k)
        vs.append(v)
    nk, nv = kv(L, t * len(prompts), HKV, d, seed=9)
    q = torch.randn(L, t * len(prompts), HQ, d, generator=torch.Generator().manual_seed(3)).half()
    ids = [f"s{j}" for j in range(len(prompts))]
    for layer in range(L):
        out = e.append_attend("c", T_, layer, ids, nk[layer].to(device), nv[layer].to(device),
                              q[layer].to(device), query_tokens=t)
        assert out.shape == (t * len(prompts), HQ, d)
        for j in range(len(prompts)):
            s = e.cache("c").seq(T_, f"s{j}")
            rows = slice(j * t, (j + 1) * t)
            k = torch.cat([ks[j][layer], nk[layer, rows]])
            v = torch.cat([vs[j][layer], nv[layer, rows]])
            want = causal(q[layer, rows], held(e, k, layer, "k", s), held(e, v, layer, "v", s), scale)
            err = ((out[rows].cpu().double() - want).norm() / want.norm()).item()
            # the CPU engine computes in fp32; the GPU kernels round P to fp16
            assert err < (5e-3 if device == "cuda" else 2e-3), (layer, j, err)
    for j, n in enumerate(prompts):
        assert e.length("c", T_, f"s{j}") == n + t
    e.check_invariants()
    return e


@pytest.mark.parametrize("codec,sinks", [("pq", 0), ("pq", 8), ("fp16", 0)])
@pytest.mark.parametrize("t", [2, 5, 9])
def test_multi_attend_is_causal_over_codes_and_tail(codec, sinks, t):
    run_case(codec, sinks, t)


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_chunk_of_the_most_query_tokens(codec):
    # T = 128, a prefill chunk: with residual 127 every new token stays in fp16 until it is
    # attended, and the sealing after the call takes many blocks of the older tokens at once
    t = MAX_QUERY_TOKENS
    e = run_case(codec, 8, t, prompts=(300, 21), residual=t - 1)
    s = e.cache("c").seq(T_, "s0")
    if codec == "pq":
        assert len(s.sealed) * BS >= 300 + t - 8 - (t - 1) - BS
    k, v = kv(1, t + 1, HKV, 16, seed=1)
    with pytest.raises(InvalidArgument, match="query_tokens"):
        e.append_attend("c", T_, 0, ["s0"], k[0], v[0], torch.randn(t + 1, HQ, 16).half(), query_tokens=t + 1)
    assert e.length("c", T_, "s0") == 300 + t


def test_token_ids_are_recorded_per_sequence():
    e = engine("fp16")
    for j in range(2):
        e.allocate("c", T_, f"s{j}", [j + 1] * 16)     # distinct prompts: no prefix hit
        e.append("c", T_, [f"s{j}"], *kv(L, 16, HKV, 16, seed=j), [16])
    k, v = kv(1, 6, HKV, 16, seed=4)
    q = torch.randn(6, HQ, 16).half()
    e.append_attend("c", T_, 0, ["s0", "s1"], k[0], v[0], q, query_tokens=3, token_ids=[5, 6, 7, 8, 9, 10])
    assert list(e.cache("c").seq(T_, "s0").token_ids[16:]) == [5, 6, 7]
    assert list(e.cache("c").seq(T_, "s1").token_ids[16:]) == [8, 9, 10]


def _state(e):
    c = e.cache("c")
    return [(s.length, list(s.pending), list(s.sealed), list(s.tail), list(s.token_ids)) for s in c.seqs.values()], \
        dict(c.counters)


@pytest.mark.parametrize("kw,field", [
    (dict(query_tokens=MAX_QUERY_TOKENS + 1), "query_tokens"),
    (dict(query_tokens=R + 2), "query_tokens"),           # pq: some new tokens would be sealed first
    (dict(query_tokens=3, rows=5), "q"),                  # q / k rows not B x T
    (dict(query_tokens=3, krows=5), "k"),
    (dict(query_tokens=3, token_ids=[1, 2]), "token_ids"),
])
def test_bad_input_names_the_field_and_changes_nothing(kw, field):
    e = engine("pq")
    e.allocate("c", T_, "s0", [])
    e.append("c", T_, ["s0"], *kv(L, 30, HKV, 16), [30])
    before = _state(e)
    t = kw.get("query_tokens", 1)
    rows, krows = kw.get("rows", t), kw.get("krows", t)
    k, v = kv(1, krows, HKV, 16)
    with pytest.raises(InvalidArgument) as ei:
        e.append_attend("c", T_, 0, ["s0"], k[0], v[0], torch.randn(rows, HQ, 16).half(),
                        query_tokens=t, token_ids=kw.get("token_ids"))
    assert ei.value.field == field
    assert _state(e) == before


def test_windowed_layer_refused_by_name():
    e = engine("fp16", windows=(12, 0))
    e.allocate("c", T_, "s0", [])
    e.append("c", T_, ["s0"], *kv(L, 20, HKV, 16), [20])
    before = _state(e)
    k, v = kv(1, 2, HKV, 16)
    with pytest.raises(InvalidArgument, match="sliding window") as ei:
        e.append_attend("c", T_, 0, ["s0"], k[0], v[0], torch.randn(2, HQ, 16).half(), query_tokens=2)
    assert ei.value.field == "query_tokens" and _state(e) == before
    # the global layer takes it
    e.append_attend("c", T_, 1, ["s0"], k[0], v[0], torch.randn(2, HQ, 16).half(), query_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec,sinks", [("pq", 0), ("pq", 8), ("fp16", 0)])
@pytest.mark.parametrize("t", [2, 9])
def test_multi_attend_gpu(codec, sinks, t):
    run_case(codec, sinks, t, device="cuda", d=64, prompts=(200, 37))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_chunk_of_the_most_query_tokens_gpu(codec):
    run_case(codec, 8, MAX_QUERY_TOKENS, device="cuda", d=64, prompts=(300, 21), residual=MAX_QUERY_TOKENS - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["pq", "fp16"])
@pytest.mark.parametrize("t", [1, 4])
def test_a_steps_layers_share_one_plan_and_nothing_stale(codec, t, monkeypatch):
    """A call plans only when its sequences' block tables or lengths differ from the
    previous call's: the layers of a step share its first layer's plan (until the last
    layer's commit seals blocks). A call for another sequence of the same length plans
    again. Against an engine that plans every call, outputs are bit-equal (a stale plan
    would read the other sequence's blocks)."""
    from kvstore import kernels
    engines = [engine(codec, 8, "cuda", 64) for _ in range(2)]      # reusing, planning every call
    for e in engines:
        for j in range(2):
            e.allocate("c", T_, f"s{j}", [])
            e.append("c", T_, [f"s{j}"], *kv(L, 70, HKV, 64, seed=j), [70])
    plans = []
    real = kernels.plan_decode
    monkeypatch.setattr(kernels, "plan_decode", lambda *a, **kw: plans.append(1) or real(*a, **kw))

    def run(e, order):
        outs, changed, last = [], 0, None
        for layer, sid in order:
            c = e.cache("c")
            if e is engines[1]:
                c._kept_plan = None
            k, v = kv(1, t, HKV, 64, seed=layer)
            q = torch.randn(t, HQ, 64, generator=torch.Generator().manual_seed(layer)).half().cuda()
            outs.append(e.append_attend("c", T_, layer, [sid], k[0].cuda(), v[0].cuda(), q, query_tokens=t))
            s = c.seq(T_, sid)
            now = (sid, repr(c.decode_lens(layer, [s])), list(s.sealed), list(s.tail))
            changed += now != last
            last = now
        return outs, changed
    steps = [(layer, sid) for sid in ("s0", "s1") for layer in range(L)]     # one sequence's step, then the other's
    interleaved = [(layer, sid) for layer in range(L) for sid in ("s0", "s1")]
    reused = 0
    for order in (steps, interleaved, steps, steps):
        n = len(plans)
        got, changed = run(engines[0], order)
        assert len(plans) - n == changed
        reused += len(order) - changed
        for a, b in zip(got, run(engines[1], order)[0]):
            assert torch.equal(a, b)
    assert reused > 0 and e.length("c", T_, "s0") == 70 + 4 * t
