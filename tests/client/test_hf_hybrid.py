"""Hybrid models through the transformers adapter: layers of linear attention (Gated
DeltaNet), Mamba or MLP alone between the attention layers, or a Mamba mixer beside
attention in one layer. The daemon's cache holds the attention layers' K/V; the other
layers' recurrent and convolution states stay in transformers' own cache layers,
in-process. Tiny random models (no download), fp16 codec: greedy and beam-search
generate() equal transformers' own, the daemon going away at any point included."""
import copy
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from kvstore.client.hf_cache import KVStoreCache  # noqa: E402
from tests.client.test_hf_models import generate_with_the_daemon_stopping  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
             initializer_range=0.2, pad_token_id=0)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def _qwen3_5():     # Gated DeltaNet layers around one full-attention layer: the last keeps no K/V
    return transformers.Qwen3_5TextConfig(
        num_hidden_layers=3, head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        **HEADS, **SMALL)


def _bamba():       # Mamba-2, attention, Mamba-2
    return transformers.BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                                    mamba_d_state=16, mamba_chunk_size=16, **HEADS, **SMALL)


def _falcon_h1():   # every layer runs attention and a Mamba-2 mixer side by side
    return transformers.FalconH1Config(num_hidden_layers=2, head_dim=16, mamba_n_heads=4, mamba_d_head=16,
                                       mamba_d_state=16, mamba_d_ssm=64, mamba_chunk_size=16, **HEADS, **SMALL)


def _nemotron_h():  # Mamba-2, MLP, attention, MLP: layers without attention or state too
    return transformers.NemotronHConfig(
        num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "mlp", "full_attention", "mlp"],
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16, **HEADS, **SMALL)


MODELS = {"qwen3_5": (_qwen3_5, "Qwen3_5ForCausalLM", (1,)), "bamba": (_bamba, "BambaForCausalLM", (1,)),
          "falcon_h1": (_falcon_h1, "FalconH1ForCausalLM", (0, 1)),
          "nemotron_h": (_nemotron_h, "NemotronHForCausalLM", (2,))}      # -> the layers with K/V


def build(name, seed=0):
    make, cls, _ = MODELS[name]
    torch.manual_seed(seed)
    return getattr(transformers, cls)(make()).eval()


def prompt(n=41, seed=1, rows=1):
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def reference(model, ids, **kw):
    with torch.no_grad():
        return copy.deepcopy(model).generate(ids, **{**GEN, **kw})


@pytest.mark.parametrize("name", list(MODELS))
def test_fp16_greedy_equals_transformers(daemon, name):
    """The daemon's cache holds the attention layers only, and every decode step of each
    goes to it; the output is transformers' token for token."""
    model = build(name)
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-{name}", codec="fp16", block_size=8, residual=8)
    kv_layers = MODELS[name][2]
    assert ad.kv_layers == kv_layers and ad.num_layers == len(kv_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # no fallback
        with torch.no_grad():
            got = ad.generate(ids, **GEN)
    assert torch.equal(got, want), (got, want)
    spec = ad.client().get_cache(f"hy-{name}").spec
    assert spec.geometry.num_layers == len(kv_layers)
    s = ad.stats()
    # every step, and the prompt's last token: the prompt runs to its last block boundary
    # first, so that its states there are kept (hf_states.py)
    assert s.attend_calls == len(kv_layers) * GEN["max_new_tokens"]
    assert s.sequences == 0         # freed after generate()
    ad.close()


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_never_compiles_a_daemon_cache(daemon, name):
    """transformers' own linear-attention layers say they can be compiled; a cache of
    them only (Falcon-H1's) would have generate() compile the forward, RPCs and all, into
    CUDA graphs on a GPU. The cache says no, before and after a fallback."""
    model = build(name)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-compile-{name}", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(prompt())
    assert not cache.is_compileable
    assert all(not layer.is_compileable for j, layer in enumerate(cache.layers) if j in ad.kv_layers)
    cache.release()
    local = KVStoreCache(ad, [], prompt()[:, :0], None, local=True)
    assert not local.is_compileable
    ad.close()


def test_the_state_layers_change_the_answer():
    """The equality above checks the in-process states: with the Gated DeltaNet layers'
    state dropped at every step, transformers itself generates other tokens."""
    model = build("qwen3_5")
    ids = prompt()
    want = reference(model, ids)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        toks = [int(out.logits[0, -1].argmax())]
        for _ in range(GEN["max_new_tokens"] - 1):
            for layer in (0, 2):
                cache.layers[layer].reset()
            out = model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
            toks.append(int(out.logits[0, -1].argmax()))
    assert toks != want[0, ids.shape[1]:].tolist()


def _generate(ad, ids, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # no fallback
        with torch.no_grad():
            return ad.generate(ids, **GEN, **kw)


@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "falcon_h1", "nemotron_h"])
def test_a_prompt_seen_before_hits_with_its_states(daemon, name):
    """The first run keeps the states at the prompt's last block boundary (40 of 41
    tokens); the same prompt again hits there, from the daemon's K/V and those states,
    runs one token, and gets transformers' tokens."""
    model = build(name)
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-again-{name}", codec="fp16", block_size=8, residual=8)
    first = _generate(ad, ids)
    # the prompt's last boundary (40) and the answer's (56: 41 + 15 tokens fed)
    assert ad.states_off is None and len(ad.states) == 2 and ad.states.hits == 0
    cache = ad.cache_for(ids)
    assert cache.length == 40 and ad.states.hits == 1
    cache.release()
    second = _generate(ad, ids)
    assert torch.equal(first, want) and torch.equal(second, want), (first, second, want)
    # one token after the hit: it decodes, nothing retrieved (KVStoreAdapter.takes_codes)
    assert ad.states.hits == 2 and ad.prefix_runs == {"codes": 2, "retrieve": 0}
    assert ad.stats().prefix_hit_tokens == 80
    ad.close()


@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "falcon_h1", "nemotron_h"])
def test_a_chat_s_next_turn_hits_through_the_answer(daemon, name):
    """Turn 1: a 33-token prompt and a 16-token answer; the decode steps cross the block
    boundary at 40 and end on the one at 48, whose states are kept when the request ends.
    Turn 2 sends the prompt, the answer and 10 more tokens: it hits at 48, through the
    answer (at the prompt's own boundary, 32, without those states), and gets
    transformers' tokens."""
    model = build(name)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-chat-{name}", codec="fp16", block_size=8, residual=8)
    first = _generate(ad, prompt(33))
    assert len(ad.states) == 2              # the prompt's boundary (32) and the answer's (48)
    second = torch.cat([first, prompt(10, seed=9)], dim=1)
    before = ad.stats().prefix_hit_tokens
    got = _generate(ad, second)
    assert ad.stats().prefix_hit_tokens - before == 48 and ad.states.hits == 1
    assert torch.equal(got, reference(model, second))
    ad.close()


@pytest.mark.parametrize("n", [41, 51])
@pytest.mark.parametrize("path", ["codes", "retrieve"])
@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "falcon_h1", "nemotron_h"])
def test_a_hit_s_first_logits_are_the_whole_prompt_s(daemon, name, path, n):
    """The first 33 tokens of a prompt keep the states at 32 (blocks of 16); the whole
    prompt of n tokens then hits there and runs the rest through the daemon's
    multi-token path or over the retrieved prefix, from the restored states: 9 tokens
    as one forward, or 19 as forwards of 16 (to the boundary at 48) and 3, each at its
    own positions (Bamba's model counts from 0 unless told). The first step's logits are
    transformers' for the whole prompt to what the fp16 K/V allow (as for any model:
    tests/client/test_hf_prefix_codes.py). Tokens may part at a near-tie later (Falcon-H1
    by the multi-token path), as they do there."""
    model = build(name)
    ids = prompt(n)
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    ad = KVStoreAdapter(model, daemon, cache=f"hy-logits-{name}-{path}-{n}", codec="fp16", block_size=16,
                        residual=16, prefix_path=path)
    _generate(ad, ids[:, :33])
    with torch.no_grad():
        out = ad.generate(ids, **GEN, output_logits=True, return_dict_in_generate=True)
    assert ad.states.hits == 1 and ad.prefix_runs[path] == 1
    assert (out.logits[0][0] - want).abs().max().item() < 1e-2
    ad.close()


@pytest.mark.parametrize("path", ["codes", "retrieve"])
def test_a_shared_prefix_hits_from_the_third_prompt(daemon, path):
    """Three prompts share their first 24 tokens. The second finds the daemon's K/V of
    them but no states there: it runs in full, stopping at 24 to keep them; the third
    hits at 24, and runs its 16 tokens to its last boundary as any model's prompt after a
    hit (by the multi-token path, nothing retrieved; or over the retrieved prefix).
    Every answer is transformers'."""
    model = build("qwen3_5")
    head = prompt(24, seed=5)
    prompts = [torch.cat([head, prompt(17, seed=s)], dim=1) for s in (6, 7, 8)]
    ad = KVStoreAdapter(model, daemon, cache=f"hy-shared-{path}", codec="fp16", block_size=8, residual=8,
                        prefix_path=path)
    kv = ad.client()
    plain, retrieved = kv.retrieve, []
    kv.retrieve = lambda *a, **k: retrieved.append(a[2:]) or plain(*a, **k)
    hit_tokens = []
    for ids in prompts:
        before = ad.stats().prefix_hit_tokens
        assert torch.equal(_generate(ad, ids), reference(model, ids))
        hit_tokens.append(ad.stats().prefix_hit_tokens - before)
    # the daemon's hits: the second prompt's K/V hit at 24 is asked for, then given back
    assert hit_tokens == [0, 24, 24] and ad.states.hits == 1
    if path == "codes":
        assert ad.prefix_runs == {"codes": 1, "retrieve": 0} and retrieved == []
    else:       # the prefix once (from 0 to 24); the prompt's own parts stay in-process
        assert ad.prefix_runs == {"codes": 0, "retrieve": 1} and retrieved == [(0, 24)]
    # every boundary a prompt stopped at: 40 for each prompt, and 24; each answer's, 56
    assert len(ad.states) == 7
    ad.close()


def test_another_process_s_prefix_is_run_for_its_states(daemon):
    """A second adapter (another worker) finds the first's K/V in the daemon but has no
    states: it runs the whole prompt once, then hits."""
    model = build("falcon_h1")
    ids = prompt()
    want = reference(model, ids)
    one = KVStoreAdapter(model, daemon, cache="hy-two", codec="fp16", block_size=8, residual=8)
    assert torch.equal(_generate(one, ids), want)
    one.close()
    two = KVStoreAdapter(model, daemon, cache="hy-two", codec="fp16", block_size=8, residual=8)
    assert torch.equal(_generate(two, ids), want)
    assert two.states.hits == 0 and len(two.states) == 2        # the prompt's boundary and the answer's
    assert torch.equal(_generate(two, ids), want)
    assert two.states.hits == 1
    two.close()


def test_no_state_budget_no_hit(daemon):
    model = build("qwen3_5")
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="hy-nostates", codec="fp16", block_size=8, residual=8,
                        state_cache_bytes=0)
    assert ad.states_off == "state_cache_bytes is 0"
    for _ in range(2):
        assert torch.equal(_generate(ad, ids), want)
    assert len(ad.states) == 0 and ad.prefix_runs == {"codes": 0, "retrieve": 0}
    assert ad.stats().prefix_hit_tokens == 0
    with pytest.raises(ValueError, match="state_cache_bytes must be >= 0"):
        KVStoreAdapter(model, daemon, cache="hy-nostates", codec="fp16", block_size=8, state_cache_bytes=-1)
    with pytest.raises(ValueError, match="state_cache_bytes must be >= 0"):     # any model
        KVStoreAdapter(transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **HEADS, **SMALL)),
                       daemon, cache="hy-llama", codec="fp16", state_cache_bytes=-1)
    ad.close()


def test_a_model_the_check_cannot_run_takes_no_hit(daemon, monkeypatch):
    """The check of continues_states runs the model with transformers' own cache; when
    that fails, the adapter takes no hit, says why, and the request runs as before."""
    from kvstore.client import hf_states
    model = build("qwen3_5")
    ids = prompt()
    want = reference(model, ids)
    monkeypatch.setattr(hf_states, "DynamicCache", None)       # the check's cache cannot be made
    ad = KVStoreAdapter(model, daemon, cache="hy-nocheck", codec="fp16", block_size=8, residual=8)
    assert torch.equal(_generate(ad, ids), want)
    assert ad.states_off.startswith("the check failed: TypeError") and len(ad.states) == 0
    ad.close()


def test_states_that_cannot_be_kept_stop_the_hits_not_the_request(daemon, monkeypatch):
    """Host memory for a snapshot refused (pinned memory past a locked-memory limit): the
    request runs on, and the adapter keeps no states from then on, saying why."""
    from kvstore.client import hf_states

    def refused(n, pinned):
        raise RuntimeError("cudaHostAlloc: out of memory")
    model = build("qwen3_5")
    ids = prompt()
    want = reference(model, ids)
    monkeypatch.setattr(hf_states, "_host_bytes", refused)
    ad = KVStoreAdapter(model, daemon, cache="hy-nopin", codec="fp16", block_size=8, residual=8)
    for _ in range(2):
        assert torch.equal(_generate(ad, ids), want)
    assert ad.states_off == "keeping the states failed: cudaHostAlloc: out of memory"
    assert len(ad.states) == 0 and ad.stats().prefix_hit_tokens == 0
    ad.close()


def test_a_model_keeping_its_states_in_its_modules_takes_no_hit(daemon):
    """RecurrentGemma keeps its recurrent and convolution states in its modules, not in
    the cache: no snapshot can restore them, and a hit would go on from the state the
    last request left there (first logits 0.09 off transformers' for the tiny model). Its
    prompts run in full, the check says why, and greedy and beam search give
    transformers' tokens (beams: the prompt runs with generate()'s repeated rows)."""
    config = transformers.RecurrentGemmaConfig(
        num_hidden_layers=3, block_types=["recurrent", "recurrent", "attention"], head_dim=16, lru_width=64,
        attention_window_size=64, **{k: v for k, v in SMALL.items() if k != "initializer_range"}, **HEADS)
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    ids, other = prompt(), prompt(60, seed=2)
    ad = KVStoreAdapter(model, daemon, cache="hy-rg", codec="fp16", block_size=8, residual=8)
    for x in (ids, other, ids):
        assert torch.equal(_generate(ad, x), reference(model, x))
    assert ad.states_off.startswith("layer 0 (linear_attention) keeps its state outside the cache")
    assert len(ad.states) == 0 and ad.stats().prefix_hit_tokens == 0
    beams = dict(num_beams=3, num_return_sequences=2)
    assert torch.equal(_generate(ad, ids, **beams), reference(model, ids, **beams))
    ad.close()


def test_the_budget_drops_the_least_recently_used_states():
    """The store's budget holds two 16-byte snapshots: a third takes the least recently
    used one's slot, and what comes out of every slot is what went in."""
    from kvstore.client.hf_states import StateSnapshots

    def states(x):
        return {0: {"conv_states": {0: torch.full((4,), float(x))}, "recurrent_states": {0: None}, "device": None}}

    def value(key):
        got = store.copy_out(key)
        return None if got is None else got[0]["conv_states"][0].tolist()
    store = StateSnapshots(block_size=2, max_bytes=40)
    keys = store.keys([1, 2, 3, 4, 5, 6, 7])
    assert len(keys) == 3 and keys != store.keys([9, 2, 3, 4, 5, 6])[:3]
    assert keys[:2] == store.keys([1, 2, 3, 4])       # chained: a prefix's keys are its own
    assert store.keys([1, 2, 3, 4, 5, 6, 7], keys[:1]) == keys      # and go on from a prefix's
    for i, k in enumerate(keys):
        store.put(k, states(i))             # the third drops the first
    assert len(store) == 2 and store.bytes == 32 and store.evicted == 1
    assert store.longest(keys, 6) == 6 and store.longest(keys, 5) == 4
    assert store.longest(keys, 3) == 0 and value(keys[0]) is None     # the first block's states went
    assert value(keys[1]) == [1.0] * 4      # used: keys[2] is now the least recently used
    store.put(keys[0], states(7))
    assert store.longest(keys, 6) == 4 and store.longest(keys, 3) == 2 and store.evicted == 2
    assert value(keys[0]) == [7.0] * 4 and value(keys[1]) == [1.0] * 4 and value(keys[2]) is None
    store.put(keys[0], states(8))           # held: the same tokens' states are not copied again
    assert value(keys[0]) == [7.0] * 4 and store.stored == 4


def test_a_budget_smaller_than_one_snapshot_says_so(daemon):
    """state_cache_bytes below one snapshot of the model's states: the requests give
    transformers' tokens, none hits, and states_off names the setting and the size."""
    model = build("qwen3_5")
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="hy-tiny-budget", codec="fp16", block_size=8, residual=8,
                        state_cache_bytes=64)
    for _ in range(2):
        assert torch.equal(_generate(ad, ids), want)
    assert re.fullmatch(r"keeping the states failed: state_cache_bytes=64 holds no snapshot of this model's "
                        r"states \(\d+ bytes\)", ad.states_off), ad.states_off
    assert len(ad.states) == 0 and ad.stats().prefix_hit_tokens == 0
    ad.close()


def test_a_model_that_restarts_its_states_in_a_prompt_takes_no_hit(daemon):
    """transformers' Jamba runs a multi-token forward's Mamba scan from a zero state,
    whatever its cache holds: a state snapshot would be ignored, so the adapter finds
    that out and runs every prompt in full."""
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(
        num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4,
        mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False, **HEADS, **SMALL)).eval()
    ids = prompt()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="hy-jamba", codec="fp16", block_size=8, residual=8)
    for _ in range(2):
        assert torch.equal(_generate(ad, ids), want)
    assert ad.states_off.startswith("layer 0 (linear_attention) starts a multi-token forward from zero recurrent")
    assert len(ad.states) == 0 and ad.stats().prefix_hit_tokens == 0
    ad.close()


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1"])
def test_beam_search_reorders_the_states_with_the_rows(daemon, name):
    """generate() repeats the prompt for 3 beams and reorders the rows every step: the
    daemon forks and frees its sequences, the in-process states follow the same rows."""
    model = build(name)
    ids = prompt()
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=False)
    want = reference(model, ids, **kw)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-beam-{name}", codec="fp16", block_size=8, residual=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad():
            got = ad.generate(ids, **GEN, **kw)
    assert torch.equal(got, want), (got, want)
    assert ad.stats().sequences == 0
    ad.close()


def test_a_left_padded_batch_equals_transformers(daemon):
    model = build("bamba")
    ids = prompt(rows=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    want = reference(model, ids, attention_mask=mask)
    ad = KVStoreAdapter(model, daemon, cache="hy-batch", codec="fp16", block_size=8, residual=8)
    with torch.no_grad():
        got = ad.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got, want), (got, want)
    ad.close()


@pytest.mark.parametrize("where", ["prefill", "between steps", "mid-step"])
@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1", "nemotron_h"])
def test_daemon_gone_mid_generation_goes_on_in_process(tmp_path, monkeypatch, name, where):
    """The daemon stops before the prompt's Append, before a decode step, or before a
    step's last attention layer: the attention layers' tokens so far are recomputed
    in-process, while the state layers keep what they hold (this step's tokens in the
    layers already run), and generation ends with transformers' tokens."""
    model = build(name)
    want = reference(model, prompt())
    got, ad = generate_with_the_daemon_stopping(tmp_path, monkeypatch, model, name, where, MODELS[name][2][-1],
                                                prompt(), GEN)
    assert torch.equal(got, want), (got, want)
    assert ad.fallbacks == 1
    ad.close()


def test_calibrating_in_process_hands_the_attention_layers_over(daemon):
    """pq without codebooks: the in-process requests hand the attention layers' K/V
    over (one layer's, as the daemon's cache holds), then the daemon stores."""
    model = build("qwen3_5")
    ad = KVStoreAdapter(model, daemon, cache="hy-cal", codec="pq", calibrate_tokens=256, block_size=8,
                        residual=8, sink_tokens=8)
    for seed in range(3):      # 3 x (100 + 16 - 1 - 8) >= 256 rows
        ids = prompt(100, seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with torch.no_grad():
                assert torch.equal(ad.generate(ids, **GEN), reference(model, ids))
    info = ad.client().get_cache("hy-cal")
    assert info.has_codebooks and info.spec.geometry.num_layers == 1
    with torch.no_grad():
        ad.generate(prompt(100, seed=9), **GEN)
    assert ad.stats().attend_calls == GEN["max_new_tokens"] - 1
    ad.close()


def test_a_model_without_attention_layers_is_refused(daemon):
    cfg = _qwen3_5()
    cfg.layer_types = ["linear_attention"] * 3
    with pytest.raises(ValueError, match=r"no attention layer \(layer_types \['linear_attention'\]\)"):
        KVStoreAdapter(transformers.Qwen3_5ForCausalLM(cfg), daemon, cache="hy-none", codec="fp16")


def test_k_v_from_a_layer_its_config_says_keeps_none_stop_generation(daemon):
    """A config whose layer_types call an attention layer a linear one: its K/V would
    have no layer in the daemon's cache; the prompt's forward stops, naming the layer."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **HEADS, **SMALL)).eval()
    model.config.layer_types = ["full_attention", "linear_attention"]
    ad = KVStoreAdapter(model, daemon, cache="hy-astray", codec="fp16", block_size=8, residual=8)
    assert ad.kv_layers == (0,)
    with pytest.raises(ValueError, match="layer 1: the model stores K/V in a layer whose layer_types entry keeps none"):
        with torch.no_grad():
            ad.generate(prompt(), **GEN)
    ad.close()


def test_a_model_with_a_cache_class_of_its_own_is_refused(daemon):
    """MiniMax keeps its linear attention's state in its own Cache subclass and refuses
    any other cache: refused when the adapter is built, naming the class."""
    cfg = transformers.MiniMaxConfig(num_hidden_layers=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                     layer_types=["linear_attention", "full_attention"], **HEADS, **SMALL)
    with pytest.raises(ValueError, match="MiniMaxCache"):
        KVStoreAdapter(transformers.MiniMaxForCausalLM(cfg), daemon, cache="hy-own", codec="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1"])
def test_a_hybrid_model_on_the_gpu_equals_transformers(daemon, name):
    """The model and its in-process states on the GPU, the attention layers' K/V in the
    daemon's CUDA pools: transformers' tokens, every decode step through the daemon. The
    same prompt again hits at its last block boundary (32 of 33 tokens), the states there
    restored from pinned host memory to the GPU: the same computation as the first run's
    from there, so the same tokens, bit for bit."""
    model = build(name).cuda()
    ids = prompt(33).cuda()
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache=f"hy-gpu-{name}", codec="fp16", block_size=16, residual=16)
    first = _generate(ad, ids)
    assert torch.equal(first, want), (first, want)
    assert torch.equal(_generate(ad, ids), first)
    assert ad.states.hits == 1 and ad.stats().prefix_hit_tokens == 32
    # every step and the prompt's last token, both times
    assert ad.stats().attend_calls == 2 * len(MODELS[name][2]) * GEN["max_new_tokens"]
    ad.close()


def test_codebooks_calibrated_by_the_tools_fit_the_daemon_s_layers(daemon, tmp_path):
    """kvstore-calibrate's steps on Falcon-H1 (attention and a Mamba mixer in every
    layer): the sampler and the q-aware transform number the attention layers as the
    daemon's cache does, and the pq codec then runs every decode step in the daemon
    with those codebooks."""
    pytest.importorskip("faiss")
    from kvstore.tools import calibrate as C
    from kvstore.tools import hooks, models
    model = build("falcon_h1")
    sampler = C.Sampler(models.geometry_of(model), per_window=96, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(model, sampler):
        for s in range(3):
            model(input_ids=prompt(128, seed=s))
    tr = C.qaware_transform(model, sampler.qq)
    cb, tr = C.train(model, sampler, 8, tr, niter=2)
    assert cb.k.shape == (2, 2, 8, 256, 2)
    path = str(tmp_path / "cb.safetensors")
    cb.save(path)
    ad = KVStoreAdapter(model, daemon, cache="hy-pq", codec="pq", codebooks=path, transform=tr, block_size=8,
                        residual=8, sink_tokens=8)
    ids = prompt()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad():
            got = ad.generate(ids, **GEN)
    assert got.shape == (1, ids.shape[1] + GEN["max_new_tokens"])
    assert ad.stats().attend_calls == 2 * GEN["max_new_tokens"]
    ad.close()


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1"])
def test_beam_search_in_process_when_the_daemon_is_gone(tmp_path, name):
    """No daemon at all: the request runs in-process from the start, and generate()'s
    repeated and reordered rows reach the linear-attention layers too, which have no
    batch_repeat_interleave of their own."""
    model = build(name)
    ids = prompt()
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=False)
    want = reference(model, ids, **kw)
    ad = KVStoreAdapter(model, f"unix://{tmp_path}/none.sock", cache=f"hy-gone-{name}", codec="fp16",
                        block_size=8, residual=8, timeout=2)
    with pytest.warns(RuntimeWarning, match="unreachable"), torch.no_grad():
        got = ad.generate(ids, **GEN, **kw)
    assert torch.equal(got, want), (got, want)
    ad.close()
