"""Sliding-window layers and logit soft-capping in the engine (CacheConfig.layer_windows,
logit_softcap): attention at each layer reads only its window, sink tokens included,
checked on CPU against an fp64 reference over the tokens in position order for lengths
around the window, the sinks and the sealing threshold; the config's checks; a GPU
cache with a head_dim the kernels cannot run refused at creation."""
import dataclasses
import math

import pytest
import torch

from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument
from kvstore.kernels import reference as ref
from kvstore.kernels.cuda import attention as cuda_attention, images
from kvstore.codec.codebooks import Codebooks
from tests.engine.test_sinks import BS, D, HKV, HQ, L, M, R, SCALE, T, TOL, expected
from tests.helpers import config, kv, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOWS = (13, 0)          # layer 0 slides (a window that is no multiple of the block), layer 1 is global


def engine(sinks: int, codec: str = "pq", windows=WINDOWS, softcap: float = 0.0, chunks=()) -> Engine:
    e = Engine()
    cfg = config(codec, block_size=BS, residual=R, sink_tokens=sinks)
    e.create_cache(dataclasses.replace(cfg, layer_windows=windows, logit_softcap=softcap, layer_chunks=chunks))
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, M, 256, D // M, generator=g),
                                       v=torch.randn(L, HKV, M, 256, D // M, generator=g)))
    return e


def windowed(q, k, v, window: int, softcap: float, chunk: int = 0) -> torch.Tensor:
    """q [Hq, d], k/v [n, Hkv, d]: the decode query at position n - 1 with transformers'
    mask (kv_idx > q_idx - window; chunks: kv_idx // chunk == q_idx // chunk),
    soft-capped scores -> fp64 [Hq, d]."""
    n = k.shape[0]
    keep = torch.arange(n) > (n - 1 - window) if window else torch.ones(n, dtype=torch.bool)
    if chunk:
        keep = torch.arange(n) // chunk == (n - 1) // chunk
    return ref.attention_dense(q.double(), k[keep].double(), v[keep].double(), SCALE, softcap)[0]


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("windows,softcap,field", [
    ((4,), 0.0, "layer_windows"),             # one entry for two layers
    ((4, -1), 0.0, "layer_windows"),
    ([4, 4], 0.0, "layer_windows"),           # a list, not a tuple: the frozen config compares by value
    ((), -1.0, "logit_softcap"),
    ((), float("nan"), "logit_softcap"),
    ((), float("inf"), "logit_softcap"),
])
def test_config_refuses_bad_windows_and_softcap(windows, softcap, field):
    with pytest.raises(InvalidArgument) as err:
        dataclasses.replace(config("fp16"), layer_windows=windows, logit_softcap=softcap)
    assert err.value.field == field


@pytest.mark.parametrize("windows,chunks,message", [
    ((), (8,), "one chunk per layer"),
    ((), (8, -1), "integers"),
    ((13, 0), (8, 0), "layer 0 has both a window and a chunk"),
])
def test_config_refuses_bad_chunks(windows, chunks, message):
    with pytest.raises(InvalidArgument, match=message) as err:
        dataclasses.replace(config("fp16"), layer_windows=windows, layer_chunks=chunks)
    assert err.value.field == "layer_chunks"


def test_gpu_cache_with_unsupported_head_dim_is_refused_at_creation():
    """The GPU decode kernels take head_dim 64, 128, 256: a CUDA cache of another is refused
    before anything is allocated, naming the field (a CPU cache takes it)."""
    e = Engine()
    cfg = dataclasses.replace(config("fp16", head_dim=96, num_q_heads=4, num_kv_heads=2), device="cuda")
    with pytest.raises(InvalidArgument) as err:
        e.create_cache(cfg)
    assert err.value.field == "geometry.head_dim" and "64, 128, 256" in str(err.value)
    assert not e.caches
    e.create_cache(dataclasses.replace(cfg, device="cpu"))
    assert "c" in e.caches


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("codec,sinks", [("fp16", 0), ("pq", 0), ("pq", 16)])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_windowed_attention_matches_positional_reference(codec, sinks, softcap):
    """Ragged batch: inside the window, exactly it, just past it, past the sinks and the
    first seal, long. Every layer after a prefill, then an AppendAttend step."""
    e = engine(sinks, codec, softcap=softcap)
    c = e.cache("c")
    lens = [1, 12, 13, 14, sinks + 5, sinks + R + BS + 1, sinks + 97]
    data = {}
    for i, n in enumerate(lens):
        sid = f"s{i}"
        k, v = kv(L, n + 1, HKV, D, seed=20 + i)
        e.allocate("c", T, sid, [])
        e.append("c", T, [sid], k[:, :n], v[:, :n], [n])
        data[sid] = (k, v)
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(len(lens), HQ, D, generator=g) * 3).half()     # scores large enough for the cap

    def check(out, layer, upto):
        for b, (sid, (k, v)) in enumerate(data.items()):
            n = lens[b] + upto
            ek, ev = expected(e, sid, k[:, :n], v[:, :n]) if codec == "pq" else (k[:, :n], v[:, :n])
            want = windowed(q[b], ek[layer], ev[layer], WINDOWS[layer], softcap)
            assert torch.allclose(out[b].double(), want, rtol=TOL, atol=TOL), (sid, n, layer)
    for layer in range(L):
        check(e.attend("c", T, layer, list(data), q), layer, 0)
    for layer in range(L):
        k1 = torch.stack([k[layer, -1] for k, _ in data.values()])
        v1 = torch.stack([v[layer, -1] for _, v in data.values()])
        check(e.append_attend("c", T, layer, list(data), k1, v1, q), layer, 1)
    if sinks:       # the window really excluded sinks somewhere: sealed blocks exist behind them
        assert any(c.seq(T, sid).sealed for sid in data)
    e.check_invariants()


CHUNKS = (0, 12)            # layer 0 global, layer 1 in chunks of 12 (no multiple of the block)


@pytest.mark.parametrize("codec,sinks", [("fp16", 0), ("pq", 0), ("pq", 16)])
def test_chunked_attention_matches_positional_reference(codec, sinks):
    """Llama 4's chunked layers: the decode query reads its own chunk so far. Lengths
    just before, at and just past chunk edges, past the sinks and the first seal; every
    layer after a prefill, then AppendAttend steps across a chunk edge."""
    e = engine(sinks, codec, windows=(), chunks=CHUNKS)
    lens = [1, 11, 12, 13, 24, sinks + 5, sinks + R + BS + 1, sinks + 95]
    steps = 3
    data = {}
    for i, n in enumerate(lens):
        sid = f"s{i}"
        k, v = kv(L, n + steps, HKV, D, seed=40 + i)
        e.allocate("c", T, sid, [])
        e.append("c", T, [sid], k[:, :n], v[:, :n], [n])
        data[sid] = (k, v)
    q = (torch.randn(len(lens), HQ, D, generator=torch.Generator().manual_seed(7)) * 3).half()

    def check(out, layer, upto):
        for b, (sid, (k, v)) in enumerate(data.items()):
            n = lens[b] + upto
            ek, ev = expected(e, sid, k[:, :n], v[:, :n]) if codec == "pq" else (k[:, :n], v[:, :n])
            want = windowed(q[b], ek[layer], ev[layer], 0, 0.0, CHUNKS[layer])
            assert torch.allclose(out[b].double(), want, rtol=TOL, atol=TOL), (sid, n, layer)
    for layer in range(L):
        check(e.attend("c", T, layer, list(data), q), layer, 0)
    for t in range(steps):
        for layer in range(L):
            k1 = torch.stack([k[layer, lens[b] + t] for b, (k, _) in enumerate(data.values())])
            v1 = torch.stack([v[layer, lens[b] + t] for b, (_, v) in enumerate(data.values())])
            check(e.append_attend("c", T, layer, list(data), k1, v1, q), layer, t + 1)
    with pytest.raises(InvalidArgument, match="chunks"):
        e.append_attend("c", T, 1, ["s0"], torch.zeros(1, 2, HKV, D).half(), torch.zeros(1, 2, HKV, D).half(),
                        torch.zeros(1, 2, HQ, D).half(), query_tokens=2)
    e.check_invariants()


def test_window_leaves_out_what_global_attention_reads():
    """Same tokens, a windowed and a global cache: the outputs differ past the window
    (the test above could not tell a window that is never applied otherwise)."""
    outs = []
    for windows in ((13, 13), (0, 0)):
        e = engine(0, "fp16", windows=windows)
        k, v = kv(L, 40, HKV, D, seed=2)
        e.allocate("c", T, "a", [])
        e.append("c", T, ["a"], k, v, [40])
        q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(1)).half()
        outs.append(e.attend("c", T, 0, ["a"], q))
    assert (outs[0].float() - outs[1].float()).abs().max() > 1e-2
    assert math.isfinite(outs[0].float().sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("codec,sinks", [("fp16", 0), ("pq", 16)])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_chunked_attention_equals_the_cpu_engine(codec, sinks, graphs):
    """On CUDA (the kernels' windowed plans, started at each chunk; decode graphs that
    replay with the start moving to the next chunk): decode steps across chunk edges
    equal the CPU engine's over the same tokens (head_dim 64: the CUDA build for pq)."""
    d, hq, hkv, chunks = 64, 4, 2, (0, 40)

    def make(device):
        e = Engine(device)
        cfg = dataclasses.replace(config(codec, block_size=16, residual=16, sink_tokens=sinks, num_blocks=128,
                                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                                  layer_chunks=chunks, device=device)
        e.create_cache(cfg)
        if codec == "pq":
            g = torch.Generator().manual_seed(0)
            e.set_codebooks("c", Codebooks(k=torch.randn(L, hkv, d // 2, 256, 2, generator=g),
                                           v=torch.randn(L, hkv, d // 2, 256, 2, generator=g)))
        e.cache("c").graphs.enabled = graphs
        return e
    engines = [make("cuda"), make("cpu")]
    lens, steps = (100, 58), 30         # "a" crosses 120, "b" crosses 80
    k, v = kv(L, max(lens) + steps, hkv, d, seed=13)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(14)).half()
    for t, layer, outs in lockstep(engines, k, v, lens, steps, q):
        assert torch.isfinite(outs[0]).all()
        # the CPU engine computes in fp32; the CUDA build rounds P and the codebooks to fp16
        err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
        assert err < (1e-2 if codec == "pq" else 2e-3), (t, layer, err)
    for e in engines:
        e.check_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("dsub", [2, 4])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_head_dim_256_pq_equals_the_triton_kernels_and_the_cpu_engine(dsub, graphs, monkeypatch):
    """head_dim 256, Gemma's, through the engine on CUDA: the kernels' cluster builds, which
    on sm_90 take each layer's codebooks from the engine's image by bulk copies (a d 256
    head's image is its two halves'), a sliding layer and a global one, with and without
    decode graphs. Against the same engine on the Triton kernels (the same codes: only the
    attention differs) and against the CPU engine, whose fp32 encoder picks another of two
    near-equal centroids here and there (0.3-2.8 % apart on these tokens, measured)."""
    d, hq, hkv, m = 256, 4, 1, 256 // dsub

    def make(device):
        e = Engine(device)
        cfg = dataclasses.replace(config("pq", block_size=16, residual=16, num_blocks=128, m=m,
                                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                                  layer_windows=(40, 0), device=device)
        e.create_cache(cfg)
        g = torch.Generator().manual_seed(dsub)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, hkv, m, 256, dsub, generator=g),
                                       v=torch.randn(L, hkv, m, 256, dsub, generator=g)))
        e.cache("c").graphs.enabled = graphs
        return e

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    lens, steps = (100, 58), 12
    k, v = kv(L, max(lens) + steps, hkv, d, seed=5)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(6)).half()
    gpu = make("cuda")
    if gpu.cache("c").main.cb_words is not None:       # sm_90: the image the kernels copy
        assert gpu.cache("c").main.cb_words.shape[1:] == (hkv, 2 * images.IMG_WORDS)
    first = [(outs[0], outs[1]) for _, _, outs in lockstep([gpu, make("cpu")], k, v, lens, steps, q)]
    monkeypatch.setattr(cuda_attention, "supports", lambda **kw: False)     # the router's Triton
    triton = [outs[0] for _, _, outs in lockstep([make("cuda")], k, v, lens, steps, q)]
    assert len(first) == len(triton) == steps * L
    for i, ((cu, cpu), tr) in enumerate(zip(first, triton)):
        assert torch.isfinite(cu).all()
        assert rel(cu, tr) < 1e-2, (i, rel(cu, tr))
        assert rel(cu, cpu) < 8e-2, (i, rel(cu, cpu))
    gpu.check_invariants()


def lockstep(engines, k, v, lens, steps, q):
    """Sequences "a" and "b" of lens[0] and lens[1] tokens of k, v [L, n, Hkv, d] in every
    engine's cache "c", then `steps` decode steps: AppendAttend of each layer with each
    sequence's next token, q [2, Hq, d], into an output buffer on the engine's device.
    Yields (step, layer, the engines' outputs as fp32 on the CPU)."""
    sids = ["a", "b"]
    for e in engines:
        dev = e.cache("c").cfg.device
        for sid in sids:
            e.allocate("c", T, sid, [])
        e.append("c", T, sids, torch.cat([k[:, :n] for n in lens], 1).to(dev),
                 torch.cat([v[:, :n] for n in lens], 1).to(dev), list(lens))
    for t in range(steps):
        for layer in range(L):
            new_k = torch.stack([k[layer, n + t] for n in lens])
            new_v = torch.stack([v[layer, n + t] for n in lens])
            outs = []
            for e in engines:
                dev = e.cache("c").cfg.device
                out = torch.empty(q.shape, dtype=torch.float16, device=dev)
                outs.append(e.append_attend("c", T, layer, sids, new_k.to(dev), new_v.to(dev), q.to(dev),
                                            out=out).float().cpu())
            yield t, layer, outs
