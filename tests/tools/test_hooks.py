"""The tools' attention hooks leave the model's attention as it is: on tiny
random models with sliding windows (Mistral, Gemma-2's alternating layers,
Gemma-3's 5:1), logit soft-capping and query_pre_attn_scalar (Gemma-2),
head_dim 256 with one KV head (Gemma-3) and learned attention sinks (gpt-oss),
the perplexity through the hooks is transformers' own, and the protocols'
doubled key axis keeps each layer's window."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from kvstore.tools import calibrate as C  # noqa: E402
from kvstore.tools import evaluate as E  # noqa: E402
from kvstore.tools import hooks, models  # noqa: E402

WINDOW = 16          # the models' sliding window; the token windows are 4x longer


def tiny(kind: str):
    T = transformers
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=128, initializer_range=0.3)
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common)).eval()
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=WINDOW)).eval()
    if kind == "gemma2":      # alternating sliding/global, soft-caps, scaling by query_pre_attn_scalar, d != hidden/heads
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=32, sliding_window=WINDOW,
                                                  query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
                                                  final_logit_softcapping=5.0)).eval()
    if kind == "gemma3":      # 5 sliding layers to 1 global, head_dim 256, one KV head
        cfg = dict(common, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1)
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**cfg, head_dim=256, sliding_window=WINDOW)).eval()
    if kind == "gptoss":      # learned attention-sink logits, alternating windows
        return T.GptOssForCausalLM(T.GptOssConfig(**dict(common, intermediate_size=64), head_dim=16,
                                                  sliding_window=WINDOW, num_local_experts=4,
                                                  num_experts_per_tok=2)).eval()
    mha = dict(vocab_size=128, initializer_range=0.3)         # no num_key_value_heads: one KV head a query head
    if kind == "gpt2":        # fused c_attn, Conv1D projections
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=512, **mha)).eval()
    if kind == "gpt_neox":    # rotary on a quarter of each head, output projection `dense`
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                                    intermediate_size=128, rotary_pct=0.25, **mha)).eval()
    if kind == "opt":         # output projection `out_proj`
        return T.OPTForCausalLM(T.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, ffn_dim=128,
                                            word_embed_proj_dim=64, **mha)).eval()
    if kind == "qwen3_5":     # Gated DeltaNet layers around one attention layer
        return T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(
            **dict(common, num_hidden_layers=3), head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)).eval()
    if kind == "falcon_h1":   # attention and a Mamba-2 mixer (its own out_proj) side by side in each layer
        return T.FalconH1ForCausalLM(T.FalconH1Config(**common, head_dim=16, mamba_n_heads=4, mamba_d_head=16,
                                                      mamba_d_state=16, mamba_d_ssm=64, mamba_chunk_size=16)).eval()
    raise AssertionError(kind)


KINDS = ["llama", "mistral", "gemma2", "gemma3", "gptoss", "gpt2", "gpt_neox", "opt", "qwen3_5", "falcon_h1"]


def token_windows(n=2, size=4 * WINDOW):
    return [torch.randint(1, 128, (size,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]


def transformers_nll(model, wins) -> torch.Tensor:
    """Summed next-token NLL per window, by transformers alone (no hook)."""
    with torch.no_grad():
        return torch.stack([F.cross_entropy(model(input_ids=torch.tensor([w])).logits[0, :-1].float(),
                                            torch.tensor(w[1:]), reduction="sum") for w in wins])


class Identity:
    """A quantizer that returns K/V as they came: every protocol must then be exact."""

    def __call__(self, layer, k, v):
        return k, v


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_baseline_is_transformers_own(kind):
    model = tiny(kind)
    wins = token_windows()
    want = transformers_nll(model, wins)
    got = E.window_nll(model, wins, E.exact_attention_handler)
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    # and the model is left as it was
    assert model.config._attn_implementation != "kvstore_hook"
    assert torch.allclose(transformers_nll(model, wins), want, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("protocol,residual,sinks", [("i", 0, 0), ("i", 8, 4), ("ii", 128, 4), ("ii", 128, 0)])
def test_protocols_with_exact_keys_keep_the_window(kind, protocol, residual, sinks):
    """Protocol i's keys are [K_deq; K_exact] (2n) under a narrowed mask: with a
    quantizer that changes nothing, every protocol is the model itself, so the
    doubled key axis kept each layer's window, soft-cap and sinks."""
    model = tiny(kind)
    wins = token_windows(1)
    want = transformers_nll(model, wins)
    got = E.window_nll(model, wins, E.QuantizedAttention(Identity(), protocol, residual, block_size=8, sinks=sinks))
    assert torch.allclose(got, want, rtol=1e-5), (got, want)


def test_a_real_quantizer_changes_a_windowed_model():
    model = tiny("gemma3")
    wins = token_windows()
    cb = C.Codebooks(k=torch.randn(6, 1, 128, 256, 2), v=torch.randn(6, 1, 128, 256, 2))
    got = E.window_nll(model, wins, E.QuantizedAttention(E.SimQuantizer(cb), "ii"))
    assert (got - transformers_nll(model, wins)).abs().max() > 1e-2


def test_sampler_sees_the_models_own_kv_and_keeps_its_output():
    """Calibration samples the K/V the model computes (post-RoPE, Gemma's k-norm)
    and the forward pass it runs is the model's own."""
    model = tiny("gemma3")
    w = token_windows(1)[0]
    seen = {}

    def spy(call):
        seen[call.layer] = call.key[0].transpose(0, 1).clone()
        return call.attend()

    with torch.no_grad(), hooks.attention_handler(model, spy):
        a = model(input_ids=torch.tensor([w])).logits
    sampler = C.Sampler(models.geometry_of(model), per_window=8, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(model, sampler):
        b = model(input_ids=torch.tensor([w])).logits
    assert torch.allclose(a, b) and torch.allclose(b, model(input_ids=torch.tensor([w])).logits, atol=1e-5)
    k, _ = sampler.samples()                                   # [L, 12, Hkv, d]
    for layer in range(6):
        assert torch.equal(k[layer, :4], seen[layer][:4].half())   # the sink rows, in order


def test_geometry_from_the_config():
    g = models.geometry_of(tiny("gemma3"))
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim) == (6, 2, 1, 256)   # 256 != 64 / 2
    assert models.geometry_of(tiny("gemma2")).head_dim == 32


def test_a_hybrid_model_s_tools_count_its_attention_layers_only():
    """The tools number layers as the daemon's cache does: among those that keep K/V.
    The sampler fills one layer of the Qwen3.5-like model (its attention layer, model
    layer 1); the q-aware transform reads each Falcon-H1 layer's attention output
    projection, not its Mamba mixer's."""
    qwen = tiny("qwen3_5")
    assert models.kv_layers(qwen) == [1] and models.geometry_of(qwen).num_layers == 1
    assert [m.layer_idx for m in models.attention_modules(qwen)] == [1]
    sampler = C.Sampler(models.geometry_of(qwen), per_window=8, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(qwen, sampler):
        qwen(input_ids=torch.tensor([token_windows(1)[0]]))
    k, v = sampler.samples()
    assert k.shape == v.shape == (1, 12, 2, 16)
    falcon = tiny("falcon_h1")
    mods = models.attention_modules(falcon)
    assert [m.layer_idx for m in mods] == [0, 1] and all(hasattr(m, "o_proj") for m in mods)
    assert models.output_weight(falcon, 1).shape == (64, 4 * 16)


def test_the_hook_refuses_attention_it_cannot_wrap():
    model = tiny("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        with hooks.attention_handler(model, hooks.exact_attention):
            pass


@pytest.mark.parametrize("kind", KINDS)
def test_output_projection_as_the_model_applies_it(kind):
    """--transform qaware weighs V by the output projection: read as [hidden, Hq * d]
    whatever the layer calls it and however it stores it (GPT-2's Conv1D: transposed)."""
    model = tiny(kind)
    g = models.geometry_of(model)
    for layer, attn in enumerate(models.attention_modules(model)):
        w = models.output_weight(model, layer)
        proj = next(getattr(attn, a) for a in models.OUT_PROJ if hasattr(attn, a))
        x = torch.randn(3, g.num_q_heads * g.head_dim)
        bias = proj.bias if getattr(proj, "bias", None) is not None else 0
        with torch.no_grad():
            assert torch.allclose(proj(x) - bias, x @ w.T, atol=1e-5)
    eye = torch.eye(g.head_dim).expand(g.num_layers, g.num_kv_heads, g.head_dim, g.head_dim)
    tr = C.qaware_transform(model, eye)
    assert tr.v.shape == (g.num_layers, g.num_kv_heads, g.head_dim, g.head_dim) and torch.isfinite(tr.v).all()
