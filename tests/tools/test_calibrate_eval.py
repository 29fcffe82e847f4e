"""kvstore.tools.calibrate and kvstore.tools.evaluate on a tiny random Llama: the masks
follow the daemon's sealing rule, the in-process codec simulation returns what
the daemon returns, the protocols reduce to exact attention where they should,
and calibration produces valid codebooks and an invertible transform."""
import math
import os

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from kvstore.codec.transform import Transform, transform_path  # noqa: E402
from kvstore.tools import calibrate as C  # noqa: E402
from kvstore.tools import evaluate as E  # noqa: E402
from kvstore.tools import hooks, models, text  # noqa: E402

from helpers import config  # noqa: E402


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128, max_position_embeddings=512, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def rand_codebooks(layers=2, hkv=2, m=8, dsub=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Codebooks(k=torch.randn(layers, hkv, m, 256, dsub, generator=g),
                     v=torch.randn(layers, hkv, m, 256, dsub, generator=g))


def rand_transform(layers=2, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.eye(d) + 0.1 * torch.randn(layers, hkv, d, d, generator=g)
    return Transform(k=a, v=a.flip(-1))


@pytest.mark.parametrize("residual,bs", [(128, 16), (8, 8), (0, 16)])
def test_sealed_boundary_is_the_daemons_rule(residual, bs):
    from kvstore.engine.cache import Cache
    cache = Cache(config(codec="fp16", block_size=bs, residual=residual, num_blocks=64))
    b = E.sealed_boundary(300, residual, bs)
    for t in range(300):
        assert b[t] == cache.sealed_count(t + 1) * bs
        assert residual < t + 1 - b[t] <= residual + bs or b[t] == 0


def test_mixed_mask():
    b = E.sealed_boundary(64, 8, 8)
    m = E.mixed_mask(64, b, sinks=4)
    deq, exact = m[:, :64], m[:, 64:]
    assert not (deq & exact).any()
    assert torch.equal(deq | exact, torch.ones(64, 64, dtype=torch.bool).tril())   # causal, each key once
    assert not deq[:, :4].any()                                                   # sinks exact
    assert deq[63].sum() == b[63] - 4


@pytest.mark.parametrize("transform", [False, True])
def test_sim_quantizer_matches_daemon(daemon, transform):
    model = tiny_llama()
    cb, tr = rand_codebooks(), (rand_transform() if transform else None)
    sim = E.SimQuantizer(cb, tr)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(100, 2, 16, generator=g), torch.randn(100, 2, 16, generator=g)
    with KVStoreClient(daemon) as kv:
        dq = E.DaemonQuantizer(kv, "t", model, cb, tr, window=128)
        for layer in range(2):
            a, b = sim(layer, k, v), dq(layer, k, v)
            for x, y in zip(a, b):
                close = torch.isclose(x, y, atol=2e-2, rtol=1e-2).all(-1)   # per token vector
                assert close.float().mean() > 0.99                          # rare ties may pick another centroid


def test_protocols_reduce_to_exact(daemon):
    model = tiny_llama()
    wins = [torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    exact = E.window_nll(model, wins, E.exact_attention_handler)
    sim = E.SimQuantizer(rand_codebooks())
    # A tail longer than the window: nothing is ever sealed, so attention is exact.
    long_tail = E.window_nll(model, wins, E.QuantizedAttention(sim, "i", residual=64))
    assert torch.allclose(long_tail, exact, atol=1e-4)
    with KVStoreClient(daemon) as kv:        # fp16 codec through the daemon: exact up to fp16 rounding
        fp16 = E.window_nll(model, wins, E.QuantizedAttention(E.DaemonQuantizer(kv, "f", model, None, window=64), "ii"))
        assert torch.allclose(fp16, exact, rtol=1e-3)
        pq = E.window_nll(model, wins, E.QuantizedAttention(E.DaemonQuantizer(kv, "p", model, rand_codebooks(),
                                                                              window=64), "ii"))
    assert (pq - exact).abs().max() > 1e-3     # random codebooks do change the outputs
    rows = [E.Row("fp16", None, "ii"), E.Row("sim", None, "ii")]
    res = E.run(model, wins, rows, "sim", log=lambda s: None)
    assert res[1][2] == pytest.approx(0.0, abs=1e-9)


def test_transform_is_attention_invariant():
    tr = rand_transform()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, 2, 16, generator=g) for _ in range(3))
    for layer in range(2):
        kt = tr.forward(k, layer, "k")
        qt = torch.einsum("nhd,hde->nhe", q, tr._inv["k"][layer])
        assert torch.allclose((qt * kt).sum(-1), (q * k).sum(-1), atol=1e-4)
        assert torch.allclose(tr.inverse(tr.forward(v, layer, "v"), layer, "v"), v, atol=1e-4)


def test_calibrate_tiny_model(tmp_path):
    pytest.importorskip("faiss")
    model = tiny_llama()
    geom = models.geometry_of(model)
    sampler = C.Sampler(geom, per_window=96, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(model, sampler):
        for s in range(3):
            model.model(input_ids=torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(s)))
    k, v = sampler.samples()
    assert k.shape == (2, 300, 2, 16)
    assert torch.equal(sampler._rows[:4], torch.arange(4))
    tr = C.qaware_transform(model, sampler.qq)
    for m in (8, 4):
        cb, _ = C.train(model, sampler, m, tr, niter=2)
        assert cb.k.shape == (2, 2, m, 256, 16 // m)
        path = str(tmp_path / f"cb{m}.safetensors")
        sha = cb.save(path)
        assert Codebooks.load(path).sha256() == sha
    tr.save(transform_path(path))
    back = Transform.load(transform_path(path))
    assert torch.allclose(back.k, tr.k) and not math.isnan(back.v.sum().item())


def test_data_sets_are_disjoint():
    assert not set(text.CALIB_DIRS) & set(text.EVAL_DIRS)
    evals = text.default_text(text.EVAL_DIRS)
    if not all(map(os.path.isdir, evals)):
        pytest.skip("python3.11-doc not fetched (make text)")
    assert len(text.read_text(evals)) > 200_000


def test_finetune_quantizer_encodes_as_the_sim():
    """The fine-tuning forward pass quantizes as the deployed codec does: same
    nearest centroid (from the fp16 value the daemon stores), same values back."""
    from kvstore.tools.finetune import STEQuantizer
    cb, tr = rand_codebooks(), rand_transform()
    cb = Codebooks(k=cb.k.half().float(), v=cb.v.half().float())        # centroids the daemon holds exactly
    ste, sim = STEQuantizer(cb, tr, torch.device("cpu")), E.SimQuantizer(cb, tr)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 2, 16, generator=g)
    for layer in range(2):
        for which in ("k", "v"):
            a, b = ste._q(x, layer, which).detach(), sim._roundtrip(x, layer, which)
            close = torch.isclose(a, b, atol=1e-4, rtol=1e-4).all(-1)
            assert close.float().mean() > 0.99                              # ties only


def test_finetune_lowers_held_out_kl_and_keeps_the_format():
    from kvstore.tools.finetune import FinetuneConfig, finetune
    model = tiny_llama()
    cb, tr = rand_codebooks(), rand_transform()
    wins = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(3))
    cfg = FinetuneConfig(steps=24, lr=0.3, val_windows=2, every=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, hist = finetune(model, cb, tr, wins, cfg, log=lambda s: None)
    assert len(hist) == 4
    assert hist[-1] < 0.8 * hist[0]                                         # held-out windows, not trained on
    assert out.k.shape == cb.k.shape and out.v.shape == cb.v.shape and out.k.dtype == torch.float32
    assert not torch.equal(out.k, cb.k) and not torch.equal(out.v, cb.v)
    # the model is the caller's: same weights, same flags, same device afterwards
    assert all(p.requires_grad and p.device.type == "cpu" and torch.equal(p, before[n])
               for n, p in model.named_parameters())
    k_only, _ = finetune(model, cb, tr, wins, FinetuneConfig(steps=2, val_windows=2, train_v=False), log=lambda s: None)
    assert torch.equal(k_only.v, cb.v) and not torch.equal(k_only.k, cb.k)


def test_finetune_refuses_bad_input():
    from kvstore.tools.finetune import FinetuneConfig, finetune
    for kw, field in ((dict(steps=0), "steps"), (dict(lr=-1.0), "lr"), (dict(lr=float("nan")), "lr"),
                      (dict(val_windows=0), "val_windows"), (dict(every=0), "every")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            FinetuneConfig(**kw)
    model, cb, tr = tiny_llama(), rand_codebooks(), rand_transform()
    with pytest.raises(ValueError, match="^wins:"):
        finetune(model, cb, tr, torch.zeros(4, 64, dtype=torch.long), FinetuneConfig(val_windows=4))
    with pytest.raises(ValueError, match="^transform:"):
        finetune(model, cb, rand_transform(layers=3), torch.zeros(8, 64, dtype=torch.long), FinetuneConfig())


def test_calibrate_finetune_step_without_a_transform(monkeypatch):
    """kvstore-calibrate --finetune-steps on codebooks trained with --transform none --opq none."""
    wins = torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(C, "token_windows", lambda tok, text, window: wins.tolist())
    cb = rand_codebooks()
    out = C.finetune_codebooks(tiny_llama(), None, "", cb, None, steps=3, lr=0.3, device="cpu")
    assert out.k.shape == cb.k.shape and not torch.equal(out.k, cb.k)
    with pytest.raises(SystemExit):
        C.main(["--finetune-steps", "-1"])


def test_finetune_cli_defaults_are_the_configs():
    from kvstore.tools.finetune import FinetuneConfig, parser
    a, d = parser().parse_args(["src.safetensors", "out.safetensors"]), FinetuneConfig()
    assert (a.steps, a.lr, a.every, a.val, a.k_only) == (d.steps, d.lr, d.every, d.val_windows, False)
    assert FinetuneConfig(steps=a.steps, lr=a.lr, val_windows=a.val, every=a.every) == d


def test_finetune_cli_needs_files_except_to_dump_ids(capsys):
    from kvstore.tools.finetune import main, parser
    assert parser().parse_args(["--dump-ids", "ids.pt"]).src is None
    with pytest.raises(SystemExit):
        main(["src.safetensors"])                       # no out: refused before the model loads
    assert "src and out are required" in capsys.readouterr().err
