"""The transformers adapter on tiny random models of each architecture it claims (no
download): greedy generate() through an in-process daemon, codec fp16, equals
transformers' own token for token for prompts past twice the sliding window; the pq
codec's windowed decode attention equals the reference over what the daemon holds;
variants the daemon cannot run are refused when the adapter is built."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from kvstore.client.hf_cache import KVStoreCache  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from kvstore.kernels import reference as ref  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 16
PROMPT = 2 * WINDOW + 9          # past twice the window before the first decode step
GEN = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
             initializer_range=0.2)


def _llama():
    return transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **SMALL)


def _qwen2():      # layer 0 global, layer 1 slides (max_window_layers)
    return transformers.Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SMALL)


def _qwen3():      # head_dim 32, not hidden / heads = 16
    return transformers.Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SMALL)


def _mistral():    # every layer slides
    return transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=WINDOW, **SMALL)


def _gemma2():     # alternating windows, soft-capped logits, query_pre_attn_scalar scaling
    return transformers.Gemma2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     sliding_window=WINDOW, attn_logit_softcapping=3.0, query_pre_attn_scalar=20,
                                     final_logit_softcapping=30.0, **SMALL)


def _gemma3():     # 5 sliding layers to 1 global, head_dim 256, one KV head
    return transformers.Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=256, sliding_window=WINDOW, query_pre_attn_scalar=256, **SMALL)


def _phi3():
    return transformers.Phi3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   sliding_window=WINDOW, pad_token_id=0, **SMALL)


def _gpt2():       # no num_key_value_heads: one KV head a query head; fused c_attn
    return transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=512,
                                   initializer_range=0.2)


def _gpt_bigcode():    # multi_query: one KV head for all
    return transformers.GPTBigCodeConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=512,
                                         multi_query=True, initializer_range=0.2)


def _gpt_neox():   # rotary on a quarter of each head
    return transformers.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25, **SMALL)


def _opt():        # learned positions
    return transformers.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, ffn_dim=128,
                                  vocab_size=128, word_embed_proj_dim=64, max_position_embeddings=512)


def _granite():    # attention_multiplier: a scale other than 1/sqrt(head_dim)
    return transformers.GraniteConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      attention_multiplier=0.05, **SMALL)


def _cohere2():    # 3 sliding layers to 1 global
    return transformers.Cohere2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=WINDOW, **SMALL)


def _gemma4(**kw):   # geometry declared per layer; global layers' head_dim made the sliding ones'
    kw = dict(dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   global_head_dim=32, sliding_window=WINDOW, hidden_size_per_layer_input=16,
                   vocab_size_per_layer_input=128, layer_types=["sliding_attention", "full_attention"] * 2,
                   **SMALL), **kw)
    return transformers.Gemma4TextConfig(**kw)


def _llama4():     # chunked attention (the mask's alone) on 3 layers of 4, NoPE on the 4th, MoE
    return transformers.Llama4TextConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, attention_chunk_size=WINDOW, intermediate_size_mlp=128,
                                         num_local_experts=2, pad_token_id=0, no_rope_layers=[1, 1, 1, 0],
                                         layer_types=["chunked_attention"] * 3 + ["full_attention"], **SMALL)


def _gpt_oss():     # learned sink logits, alternating windows; MoE taking every expert (no routing to flip)
    return transformers.GptOssConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                     num_local_experts=2, num_experts_per_tok=2, pad_token_id=0, **SMALL)


MODELS = {"llama": (_llama, "LlamaForCausalLM"), "qwen2": (_qwen2, "Qwen2ForCausalLM"),
          "qwen3": (_qwen3, "Qwen3ForCausalLM"), "mistral": (_mistral, "MistralForCausalLM"),
          "gemma2": (_gemma2, "Gemma2ForCausalLM"), "gemma3": (_gemma3, "Gemma3ForCausalLM"),
          "phi3": (_phi3, "Phi3ForCausalLM"), "gpt2": (_gpt2, "GPT2LMHeadModel"),
          "gpt_bigcode": (_gpt_bigcode, "GPTBigCodeForCausalLM"), "gpt_neox": (_gpt_neox, "GPTNeoXForCausalLM"),
          "opt": (_opt, "OPTForCausalLM"), "granite": (_granite, "GraniteForCausalLM"),
          "cohere2": (_cohere2, "Cohere2ForCausalLM"), "gemma4": (_gemma4, "Gemma4ForCausalLM"),
          "llama4": (_llama4, "Llama4ForCausalLM"), "gpt_oss": (_gpt_oss, "GptOssForCausalLM")}
CHUNKS = {"llama4": (WINDOW,) * 3 + (0,)}
WINDOWS = {"llama4": (), "gpt2": (), "gpt_bigcode": (), "gpt_neox": (), "opt": (), "granite": (), "cohere2": (WINDOW,) * 3 + (0,),
           "llama": (), "qwen2": (0, WINDOW), "qwen3": (0, WINDOW), "mistral": (WINDOW,) * 2,
           "gemma2": (WINDOW, 0), "gemma3": (WINDOW,) * 5 + (0,), "phi3": (WINDOW,) * 2, "gemma4": (WINDOW, 0) * 2,
           "gpt_oss": (WINDOW, 0)}


def build(name, seed=0, **overrides):
    make, cls = MODELS[name]
    cfg = make()
    gemma = name.startswith("gemma")
    if gemma:
        # Gemma's embedding, tied and scaled by sqrt(hidden), makes a tiny random model
        # repeat its last input token whatever attention says; untied and small, it does not.
        cfg.tie_word_embeddings = False
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(cfg).eval()
    if gemma:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.05)
    if name == "gpt_oss":      # sink logits large enough to move the answer (initialised near 0)
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.tensor([2.5, -1.0, 0.5, 4.0]) + i)
    return model


def prompt(n=PROMPT, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def reference(model, ids):
    """transformers' generate on an untouched copy (its own attention implementation)."""
    with torch.no_grad():
        return copy.deepcopy(model).generate(ids, **GEN)


@pytest.mark.parametrize("name", list(MODELS))
def test_fp16_greedy_equals_transformers(daemon, name):
    model = build(name)
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache=name, codec="fp16", block_size=8, residual=8)
    assert ad.variant.windows == WINDOWS[name] and ad.variant.chunks == CHUNKS.get(name, ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no fallback
        with torch.no_grad():
            got = ad.generate(ids, **GEN)
    assert torch.equal(got, want), (got, want)
    windows, chunks = [0] * model.config.num_hidden_layers, [0] * model.config.num_hidden_layers
    for g in ad.groups:        # one cache per window or chunk; together they hold every layer once
        info = ad.client().get_cache(g.cache).spec
        assert len(set(info.layer_windows)) <= 1 and len(set(info.layer_chunks)) <= 1
        assert info.geometry.num_layers == len(g.layers)
        for layer, w in zip(g.layers, info.layer_windows):
            windows[layer] = w
        for layer, c in zip(g.layers, info.layer_chunks):
            chunks[layer] = c
        assert info.logit_softcap == (3.0 if name == "gemma2" else 0.0)
        want_sinks = [x for layer in g.layers for x in ad.variant.sinks[4 * layer:4 * layer + 4]]
        assert list(info.sink_logits) == pytest.approx(want_sinks) and bool(want_sinks) == (name == "gpt_oss")
    assert tuple(windows) == (WINDOWS[name] or (0,) * len(windows))
    assert tuple(chunks) == (CHUNKS.get(name) or (0,) * len(chunks))
    assert len(ad.groups) == len(set(zip(windows, chunks)))
    s = ad.stats()
    assert s.attend_calls == model.config.num_hidden_layers * (GEN["max_new_tokens"] - 1)
    ad.close()


@pytest.mark.parametrize("name", ["llama4", "mistral"])
def test_a_left_padded_batch_equals_transformers(daemon, name):
    """Rows of different lengths, left-padded: each row's windows and chunks count
    from its first token, as transformers' do (the daemon's sequences hold no
    padding), so every row's tokens equal transformers' own."""
    model = build(name)
    lens = (PROMPT, PROMPT - 3, PROMPT - 15)
    ids = torch.zeros(len(lens), PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, PROMPT - n:], mask[r, PROMPT - n:] = prompt(n, seed=r + 1)[0], 1
    with torch.no_grad():
        want = copy.deepcopy(model).generate(ids, attention_mask=mask, **GEN)
    ad = KVStoreAdapter(model, daemon, cache=f"{name}-batch", codec="fp16", block_size=8, residual=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no fallback
        with torch.no_grad():
            got = ad.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got, want), (got, want)
    ad.close()


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gemma4", "llama4"])
def test_windows_change_the_answer(name):
    """The equality above is a check of the windows: without them transformers itself
    generates other tokens from the same weights and prompt."""
    model = build(name)
    flat = build(name, **({"sliding_window": None} if name == "mistral"
                          else {"layer_types": ["full_attention"] * model.config.num_hidden_layers}))
    flat.load_state_dict(model.state_dict())
    want = reference(model, prompt())
    assert len(set(want[0, PROMPT:].tolist())) > 2           # not a model that repeats one token
    assert not torch.equal(want, reference(flat, prompt()))


def test_gemma3_pq_windowed_attention_equals_reference(daemon):
    """pq: every decode step's attention at every layer equals the fp64 reference over
    the K/V the daemon holds (Retrieve: dequantized sealed tokens, exact sinks and
    tail), read through the layer's window; the sliding layers' windows exclude the
    sinks once the sequence is past them."""
    model = build("gemma3")
    c = model.config
    m = c.head_dim // 2
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(c.num_hidden_layers, 1, m, 256, 2, generator=g) * 0.5,
                   v=torch.randn(c.num_hidden_layers, 1, m, 256, 2, generator=g) * 0.5)
    ad = KVStoreAdapter(model, daemon, cache="g3pq", codec="pq", codebooks=cb.to_bytes(), transform="none",
                        block_size=8, residual=8, sink_tokens=8)
    seen = []
    orig = KVStoreCache.decode_attention

    def spy(self, layer, q, k, v, scaling):
        out = orig(self, layer, q, k, v, scaling)
        if out[0] is not None:
            # the tokens before this step, then this step's (the cache counts it once its
            # last layer's call has returned)
            before = self.length - (layer == c.num_hidden_layers - 1)
            kk, vv = self.adapter.retrieve(self.adapter.client(), self.seq_ids[0], before)   # what the windows read
            kk = torch.cat([kk[layer], k[0, :, 0].half().unsqueeze(0)])
            vv = torch.cat([vv[layer], v[0, :, 0].half().unsqueeze(0)])
            seen.append((layer, q[0, :, 0].clone(), out[0][0, 0].clone(), kk, vv, scaling))
        return out
    KVStoreCache.decode_attention = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                ad.generate(prompt(), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    finally:
        KVStoreCache.decode_attention = orig
    assert len(seen) == 5 * c.num_hidden_layers
    assert ad.stats().sealed_blocks > 0
    for layer, q, out, k, v, scaling in seen:
        w = WINDOWS["gemma3"][layer]
        n = k.shape[0]
        lo = max(0, n - w) if w else 0
        want, _ = ref.attention_dense(q.double(), k[lo:].double(), v[lo:].double(), scaling)
        assert torch.allclose(out.double(), want, atol=2e-3, rtol=2e-3), layer
        if w:
            assert lo > 8            # past the 8 sink tokens: they are outside the window


def test_gemma3_sliding_group_holds_fewer_blocks_than_one_table(daemon):
    """Mid-request, a long prompt: the per-group caches hold less than one cache of every
    layer (a global layer keeps every block there), with the same tokens out."""
    model = build("gemma3")
    ids = prompt(6 * WINDOW + 5)
    held = {}
    for split in (True, False):
        ad = KVStoreAdapter(model, daemon, cache=f"g3{split}", codec="fp16", block_size=8, residual=8,
                            layer_groups=split)
        cache = ad.cache_for(ids)
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, **GEN)
        held[split] = (ad.stats(), out, [s.window_freed_blocks for _, s in ad.stats_by_group()])
        cache.release()
        ad.close()
    (grouped, out_g, freed_g), (one, out_1, freed_1) = held[True], held[False]
    assert torch.equal(out_g, out_1)
    n = ids.shape[1] + GEN["max_new_tokens"] - 1                 # tokens the daemon holds at the end
    assert grouped.tokens == one.tokens == n
    assert one.used_bytes == -(-n // 8) * 8 * one.fp16_bytes_per_token          # every block of every layer
    assert grouped.used_bytes < one.used_bytes * 0.6
    assert freed_g[0] == 0 and freed_g[1] > 0 and freed_1 == [0]             # the sliding group frees


def test_gemma3_prefix_hit_through_the_groups(daemon):
    """The same prompt again: every group hits (the sliding group through blocks it
    released but still caches), the prefix comes back from each group's window, and
    the tokens are transformers' own."""
    model = build("gemma3")
    ids = prompt(6 * WINDOW + 5)
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="g3hit", codec="fp16", block_size=8, residual=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert torch.equal(ad.generate(ids, **GEN), want)
            before = [s.prefix_hit_tokens for _, s in ad.stats_by_group()]
            assert torch.equal(ad.generate(ids, **GEN), want)
    hits = [s.prefix_hit_tokens - b for (_, s), b in zip(ad.stats_by_group(), before)]
    assert hits == [(ids.shape[1] - 1) // 8 * 8] * 2
    ad.close()


def test_gemma3_prefix_hit_is_the_shortest_of_the_groups(daemon):
    """The sliding group's cached blocks of a prompt were evicted (another sequence
    needed the slots), the global group's were not: the sequence gets the shorter hit
    in both groups, and the tokens are still transformers' own."""
    model = build("gemma3")
    ids = prompt(6 * WINDOW + 5)
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="g3evict", codec="fp16", block_size=8, residual=8, num_blocks=40)
    with torch.no_grad():
        assert torch.equal(ad.generate(ids, **GEN), want)
        kv, (glob, slide) = ad.client(), ad.groups
        k = torch.randn(len(slide.layers), 280, 1, 256).half()
        kv.allocate(slide.cache, "filler", [])
        kv.append(slide.cache, ["filler"], k, k, [280])     # 35 blocks at once of a pool of 40: cached ones go
        kv.free(slide.cache, ["filler"])
        cache = ad.cache_for(ids)
        hit = cache.length
        assert hit < (ids.shape[1] - 1) // 8 * 8                 # the sliding group lost its prefix
        assert [kv.sequence_info(c, cache.seq_ids[0]).length for c in ad.groups.caches()] == [hit, hit]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(model.generate(ids, past_key_values=cache, **GEN), want)
        cache.release()
    ad.close()


def test_bf16_model_runs_in_bf16(daemon):
    """A bf16 model makes a bf16 cache; generate runs through the daemon."""
    model = build("gemma2").to(torch.bfloat16)
    ad = KVStoreAdapter(model, daemon, cache="bf16", codec="fp16", block_size=8, residual=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = ad.generate(prompt(), **GEN)
    assert out.shape[1] == PROMPT + GEN["max_new_tokens"]
    assert all(ad.client().get_cache(c).spec.geometry.dtype == "bfloat16" for c in ad.groups.caches())


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_calibrating_in_process_hands_every_layer_s_tokens_over(daemon, name):
    """pq without codebooks (calibrate_tokens): requests run in-process, as transformers
    runs them, and hand their K/V over, sliding and chunked layers' every token too,
    until the daemon has trained codebooks; then the requests go to the daemon."""
    model = build(name)
    ad = KVStoreAdapter(model, daemon, cache=f"cal-{name}", codec="pq", calibrate_tokens=256, block_size=8,
                        residual=8, sink_tokens=8)
    for seed in range(3):      # 3 x (100 + 20 - 1 - 8) >= 256 rows
        ids = prompt(100, seed=seed)
        want = reference(model, ids)
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no fallback (faiss loads in the daemon meanwhile)
            with torch.no_grad():
                assert torch.equal(ad.generate(ids, **GEN), want)
    assert all(ad.client().get_cache(c).has_codebooks for c in ad.groups.caches())
    with torch.no_grad():
        ad.generate(prompt(100, seed=9), **GEN)
    assert ad.stats().attend_calls == model.config.num_hidden_layers * (GEN["max_new_tokens"] - 1)
    ad.close()


def test_sink_logits_change_the_answer(daemon):
    """The equality above is a check of the daemon's sink logits: the same model through
    a daemon cache whose logits say "no sink" (-inf) generates other tokens."""
    model = build("gpt_oss")
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="nosinks", codec="fp16", block_size=8, residual=8)
    assert ad.variant.sinks[:4] == (2.5, -1.0, 0.5, 4.0) and ad.variant.sinks[4:] == (3.5, 0.0, 1.5, 5.0)
    ad.spec["sink_logits"] = [float("-inf")] * len(ad.variant.sinks)
    with torch.no_grad():
        got = ad.generate(ids, **GEN)
    assert got.shape == want.shape and not torch.equal(got, want)
    ad.close()


def test_a_copy_taken_with_the_adapter_installed_runs_the_models_own_attention():
    """copy.deepcopy of a model while an adapter is installed: the copy's configs name the
    kvstore attention too, and must run the attention the model had (gpt-oss: eager, with
    its sink logits), not sdpa, whose logits differ."""
    model = build("gpt_oss")
    ids = prompt(30, seed=5)
    with torch.no_grad():
        want = model(ids).logits
    ad = KVStoreAdapter(model, "unix:///nonexistent.sock", cache="copied", codec="fp16",
                        block_size=8, residual=8)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, want)
    ad.close()
    assert model.config._attn_implementation == "eager"


def test_each_config_gets_back_its_own_attention():
    """A composite model's configs may each name another attention (a vision tower eager,
    the text model sdpa); setting a parent's sets its sub-configs', whatever order the
    model's modules list them in."""
    from kvstore.client.hf_attention import install, restore
    top = transformers.Gemma3Config()
    top._attn_implementation = "sdpa"
    top.vision_config._attn_implementation = "eager"
    configs = [top.vision_config, top.text_config, top]
    old = install(configs)
    assert [c._attn_implementation for c in configs] == ["kvstore"] * 3
    assert [c._attn_implementation.inner for c in configs] == ["eager", "sdpa", "sdpa"]
    restore(configs, old)
    assert [c._attn_implementation for c in configs] == ["eager", "sdpa", "sdpa"]


# --------------------------------------------------------------- refusals
def test_sink_logits_the_daemon_cannot_hold_are_refused(daemon):
    """Sink logits must be one per query head of one attention module a layer: others
    (here 3 for 4 heads) are refused when the adapter is built, naming them."""
    model = build("llama")
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="learned attention-sink logits outside one attention module.*"
                                         "model.layers.0.self_attn.sinks: \\(3,\\)"):
        KVStoreAdapter(model, daemon, cache="sinks", codec="fp16")


@pytest.mark.parametrize("attr,value,feature", [
    ("cross_attention_layers", [1], "cross-attention layers"),
    ("attention_chunk_size", 8, "chunked attention"),
    ("layer_types", ["full_attention", "indexed_attention"], r"layer_types \['indexed_attention'\]"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_unsupported_attention_is_refused_naming_it(daemon, attr, value, feature):
    model = build("llama")
    setattr(model.config, attr, value)
    with pytest.raises(ValueError, match=feature):
        KVStoreAdapter(model, daemon, cache="refused", codec="fp16")


@pytest.mark.parametrize("kw,feature", [
    ({"global_head_dim": 64}, r"head_dim differing by layer \(32 in layer 0, 64 in layer 1\)"),
    ({"num_global_key_value_heads": 1, "attention_k_eq_v": True},
     r"num_key_value_heads differing by layer \(2 in layer 0, 1 in layer 1\)"),
    ({"num_kv_shared_layers": 2}, r"another layer's K/V \(num_kv_shared_layers\)"),
])
def test_a_geometry_varying_by_layer_or_shared_k_v_is_refused(daemon, kw, feature):
    """Gemma 4 declares head_dim and KV heads per layer (its global layers' differ from
    its sliding ones') and lets later layers attend with an earlier one's K/V: one
    daemon cache has one geometry and takes every layer's own K/V."""
    model = transformers.Gemma4ForCausalLM(_gemma4(**kw))
    with pytest.raises(ValueError, match=feature):
        KVStoreAdapter(model, daemon, cache="gemma4-refused", codec="fp16")


def test_chunks_the_model_does_not_apply_stop_generation(daemon):
    """The daemon's chunked layers must be the model's: a model whose masks stop
    chunking (its layer_types changed after the adapter read them) is stopped at its
    first decode step, naming the layer."""
    model = build("llama4")
    ad = KVStoreAdapter(model, daemon, cache="chunks-astray", codec="fp16", block_size=8, residual=8)
    model.config.layer_types = ["full_attention"] * 4
    with pytest.raises(ValueError, match="layer 0: the model does not attend in chunks of 16 tokens"):
        with torch.no_grad():
            ad.generate(prompt(), **GEN)
    ad.close()


def test_attention_outside_the_interface_is_refused(daemon):
    """GPT-J's modeling file computes attention itself, never looking up the registered
    function: the daemon would never see its decode steps."""
    cfg = transformers.GPTJConfig(n_layer=2, n_head=4, n_embd=64, rotary_dim=8, vocab_size=128, n_positions=512)
    with pytest.raises(ValueError, match="GPTJForCausalLM: attention outside transformers' AttentionInterface"):
        KVStoreAdapter(transformers.GPTJForCausalLM(cfg), daemon, cache="gptj", codec="fp16")


ASTRAY = {   # how a model's attention call goes astray -> what the error says
    "in-process": "decode step of layer 0 did not call the registered attention function",
    "another layer": "decode step of layer 1 was attended by the attention module of layer 0",
    "other K/V": "decode step of layer 0 was attended with other K/V than the cache returned",
    "twice": "decode step of layer 0 was attended twice",
}


@pytest.mark.parametrize("how", list(ASTRAY))
def test_a_decode_step_attended_astray_stops_generation(daemon, monkeypatch, how):
    """A model that passes the checks at construction but then attends a decode step
    in-process (over the new token alone: the cache keeps nothing), through another
    layer's module, with K/V it changed after the cache (as differential attention
    does) or twice, stops with an error naming the layer, rather than generating on."""
    from transformers.models.llama import modeling_llama
    from kvstore.client.hf_attention import kvstore_attention
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="astray", codec="fp16", block_size=8, residual=8)

    def astray(module, q, k, v, *a, **kw):
        if how == "another layer":
            module = type("Shared", (), {"layer_idx": 0, "config": module.config})()
        if how == "other K/V":
            v = v.clone()
        if how == "twice":
            kvstore_attention(module, q, k, v, *a, **kw)
        return kvstore_attention(module, q, k, v, *a, **kw)

    class Astray:      # the lookup the modeling file makes, answered otherwise
        @staticmethod
        def get_interface(name, default):
            return default if how == "in-process" else astray
    with torch.no_grad():
        ad.generate(prompt(), max_new_tokens=2, do_sample=False, pad_token_id=0)     # unpatched: runs
        monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", Astray)
        with pytest.raises(RuntimeError, match=ASTRAY[how]):
            ad.generate(prompt(), **GEN)
        monkeypatch.undo()
        assert torch.equal(ad.generate(prompt(), **GEN), reference(model, prompt()))    # nothing left behind
    ad.close()


@pytest.mark.parametrize("name", ["gpt_oss", "llama"])
def test_a_decode_step_with_other_sink_logits_stops_generation(daemon, monkeypatch, name):
    """The daemon's cache holds the sink logits the model had when the adapter was built:
    a decode call passing others (s_aux that is not the attention's `sinks` parameter),
    or any to a model built without them, stops with an error naming the layer."""
    import importlib
    from kvstore.client.hf_attention import kvstore_attention
    model = build(name)
    ad = KVStoreAdapter(model, daemon, cache=f"aux-{name}", codec="fp16", block_size=8, residual=8)
    modeling = importlib.import_module(type(model).__module__)

    class Other:
        @staticmethod
        def get_interface(_name, _default):
            def call(module, q, k, v, *a, **kw):
                kw["s_aux"] = torch.zeros(q.shape[1]) if kw.get("s_aux") is None else kw["s_aux"] * 2
                return kvstore_attention(module, q, k, v, *a, **kw)
            return call
    monkeypatch.setattr(modeling, "ALL_ATTENTION_FUNCTIONS", Other)
    with torch.no_grad(), pytest.raises(ValueError, match="layer 0: the model attends with learned sink logits"):
        ad.generate(prompt(), **GEN)
    ad.close()


def test_differential_attention_is_refused(daemon):
    cfg = transformers.DiffLlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **SMALL)
    with pytest.raises(ValueError, match="differential attention"):
        KVStoreAdapter(transformers.DiffLlamaForCausalLM(cfg), daemon, cache="diff", codec="fp16")


@pytest.mark.parametrize("where", ["prefill", "between steps", "mid-step"])
@pytest.mark.parametrize("name", list(MODELS))
def test_daemon_gone_mid_generation_goes_on_in_process(tmp_path, monkeypatch, name, where):
    """The daemon stops during generate(): before the prompt's Append (the prefill's
    last layer), before a decode step, or before a step's last layer: a warning, the
    tokens so far are recomputed in-process (sliding layers too, whose masks were
    built for every token), each layer gets this step's K/V once, and generation ends
    with transformers' tokens."""
    model = build(name)
    want = reference(model, prompt())
    got, ad = generate_with_the_daemon_stopping(tmp_path, monkeypatch, model, name, where,
                                                model.config.num_hidden_layers - 1, prompt(), GEN)
    assert torch.equal(got, want), (got, want)
    assert ad.fallbacks == 1
    ad.close()


def generate_with_the_daemon_stopping(tmp_path, monkeypatch, model, name, where, last, ids, gen):
    """generate() through a daemon of its own that stops before the prompt's Append
    (where "prefill"), before the 6th forward ("between steps") or before the 5th
    decode step of model layer `last` ("mid-step") -> (tokens, the adapter)."""
    from kvstore.service.daemon import create_server
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    ad = KVStoreAdapter(model, f"unix://{sock}", cache=name, codec="fp16", block_size=8, residual=8, timeout=5)
    calls = []
    if where != "mid-step":
        def stop_before_a_forward(module, args, kwargs):
            calls.append(1)
            if len(calls) == (1 if where == "prefill" else 6):
                server.stop(0)
        hook = model.register_forward_pre_hook(stop_before_a_forward, with_kwargs=True)
    else:
        orig = KVStoreCache.decode_attention

        def stop_before_the_last_layer(self, layer, *a):
            calls.append(layer)
            if calls.count(last) == 5 and layer == last:
                server.stop(0)
            return orig(self, layer, *a)
        monkeypatch.setattr(KVStoreCache, "decode_attention", stop_before_the_last_layer)
    try:
        with pytest.warns(RuntimeWarning, match="unreachable"), torch.no_grad():
            got = ad.generate(ids, **gen)
    finally:
        server.stop(0)
        if where != "mid-step":
            hook.remove()
    return got, ad


def test_a_modeling_file_whose_text_attention_attends_by_itself_is_refused(daemon):
    """GIT looks the registered function up for its vision tower only; its text
    self-attention computes softmax(QK^T)V itself."""
    cfg = transformers.GitConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.vision_config.num_hidden_layers = 1
    with pytest.raises(ValueError, match="GitSelfAttention: attention outside transformers' AttentionInterface"):
        KVStoreAdapter(transformers.GitForCausalLM(cfg), daemon, cache="git", codec="fp16")


def test_a_config_whose_heads_differ_from_the_model_is_refused_at_the_first_step(daemon):
    """K/V of another shape than the config says never reach the daemon (which would
    refuse them, and the adapter would fall back every request): the error names both."""
    model = build("gpt_bigcode")
    model.config.num_key_value_heads = 2       # the model's attention still makes one (multi_query)
    ad = KVStoreAdapter(model, daemon, cache="heads", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match="the model's K/V have 1 heads of 16, its config says 2 of 16"):
        with torch.no_grad():
            ad.generate(prompt(), **GEN)
    assert ad.fallbacks == 0
    model = build("llama")
    model.config.num_attention_heads = 8       # queries: still 4 heads of 16
    ad = KVStoreAdapter(model, daemon, cache="qheads", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match="the model's queries have 4 heads, its config says 8"):
        with torch.no_grad():
            ad.generate(prompt(), **GEN)
    assert ad.fallbacks == 0


def test_non_causal_attention_is_refused_naming_the_module(daemon):
    """BERT as a causal LM without is_decoder attends both ways."""
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128)
    with pytest.raises(ValueError, match=r"non-causal attention \(bert\.encoder\.layer\.0\."):
        KVStoreAdapter(transformers.BertLMHeadModel(cfg), daemon, cache="bert", codec="fp16")


def test_a_window_the_mask_alone_applies_is_taken():
    """PhiMoE and Doge window through their mask and pass no sliding_window to the
    attention call: the call is taken when its mask hides every token before the
    window (or the window does not reach past the first token yet), refused otherwise."""
    from kvstore.client.hf_variants import AttentionVariant
    v = AttentionVariant(windows=(16,), softcap=0.0)
    windowed = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    windowed[..., :4] = False
    v.check_call(0, {}, windowed, 20)
    v.check_call(0, {}, None, 16)                                 # the window holds every token yet
    v.check_call(0, {"sliding_window": 16}, None, 20)
    additive = torch.zeros(1, 1, 1, 20).masked_fill(~windowed, torch.finfo(torch.float32).min)
    v.check_call(0, {}, additive, 20)
    every = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    for kwargs, mask in [({}, None), ({}, every), ({"sliding_window": 8}, windowed)]:
        with pytest.raises(ValueError, match="layer 0: the model attends with sliding_window="):
            v.check_call(0, kwargs, mask, 20)


def test_a_cache_the_daemon_refuses_is_an_error_not_a_fallback(daemon):
    """A spec the daemon refuses (head_dim 18: not a multiple of 4), or a cache name another
    spec holds, would be refused on every request: generate raises, naming the cache and
    the daemon's field, instead of warning "unreachable" and running in-process each time."""
    model = build("llama", head_dim=18)
    ad = KVStoreAdapter(model, daemon, cache="odd", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match="kvstore cache 'odd': the daemon refuses it: INVALID_ARGUMENT: "
                                         "spec.geometry.head_dim"), torch.no_grad():
        ad.generate(prompt(), **GEN)
    other = KVStoreAdapter(build("llama"), daemon, cache="taken", codec="fp16", block_size=8, residual=8)
    other.client()
    ad = KVStoreAdapter(build("llama"), daemon, cache="taken", codec="fp16", block_size=16, residual=8)
    with pytest.raises(ValueError, match="kvstore cache 'taken': the daemon refuses it: ALREADY_EXISTS"), \
            torch.no_grad():
        ad.generate(prompt(), **GEN)
    assert ad.fallbacks == 0


def test_a_call_the_daemon_refuses_mid_request_falls_back_saying_why(daemon):
    """A pool too small for the prompt: the daemon refuses the sequence; the request goes
    on in-process with transformers' tokens, and the warning quotes the daemon's refusal
    rather than calling it unreachable."""
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="small", codec="fp16", block_size=8, residual=8, num_blocks=2)
    said = r"kvstore daemon refused a call \(INVALID_ARGUMENT: prompt_token_ids: a sequence of 41"
    with pytest.warns(RuntimeWarning, match=said), torch.no_grad():
        got = ad.generate(prompt(), **GEN)
    assert torch.equal(got, reference(model, prompt()))
    assert ad.fallbacks == 1


def test_merged_stats_add_each_groups_bytes_per_token():
    """A model whose layers sit in several caches (a global and a sliding group): a token
    takes every group's bytes, over the tokens on the GPU (each group's own figure)."""
    from kvstore.client.hf_groups import merge_stats
    from kvstore.v1 import kvstore_pb2 as pb

    def group(name, used, per_token):
        return pb.CacheStats(cache=name, tokens=100, used_bytes=used, effective_bytes_per_token=per_token,
                             bytes_per_token=64)
    s = merge_stats([group("g", 8000, 80.0), group("w", 1200, 12.0)])       # every token on the GPU
    assert (s.cache, s.tokens, s.used_bytes, s.bytes_per_token) == ("g+w", 100, 9200, 128)
    assert s.effective_bytes_per_token == 92.0 == s.used_bytes / s.tokens
    s = merge_stats([group("g", 4000, 80.0), group("w", 600, 12.0)])        # half of them on the host
    assert s.effective_bytes_per_token == 92.0 and s.used_bytes / s.tokens == 46.0
