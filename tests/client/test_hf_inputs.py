"""What a request brings besides its token ids, and how the prefix cache keeps out of its
way: embeddings (inputs_embeds: what the model runs, so a prompt neither takes a cached
prefix nor is stored under its ids), hidden states of every prompt token, positions a
padded batch run by hand must give, and inputs the adapter cannot serve (a 4-D mask to
generate, images), refused naming them."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from tests.client.test_hf_generation import _reference, live_sequences, strict_generate  # noqa: E402
from tests.client.test_hf_models import build, prompt  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def edited(model, ids):
    """The prompt's embeddings with some positions changed (a soft prompt's edit)."""
    e = model.get_input_embeddings()(ids).detach().clone()
    e[:, 3:12] *= 3
    return e


@pytest.mark.parametrize("first", ["plain", "embeds"])
def test_embeddings_neither_take_nor_leave_k_v_under_the_prompts_ids(daemon, first):
    """generate(input_ids, inputs_embeds=...) runs the embeddings: a cached plain prompt
    of the same ids must not stand in for them, and their K/V must not serve a later
    plain prompt of those ids; each request gets transformers' tokens, in either order."""
    model = build("llama")
    ids = prompt(40, seed=7)
    emb = edited(model, ids)
    want = {"plain": _reference(model, ids, **GREEDY),
            "embeds": _reference(model, ids, inputs_embeds=emb, **GREEDY)}
    assert not torch.equal(want["plain"], want["embeds"])
    ad = KVStoreAdapter(model, daemon, cache=f"embeds-{first}", codec="fp16", block_size=8, residual=8)
    for kind in ([first, "plain" if first == "embeds" else "embeds"] * 2):
        kw = dict(inputs_embeds=emb) if kind == "embeds" else {}
        assert torch.equal(strict_generate(ad, ids, **kw, **GREEDY), want[kind]), kind
    without_ids = strict_generate(ad, None, inputs_embeds=emb, **GREEDY)       # transformers: the new tokens only
    assert torch.equal(without_ids, _reference(model, None, inputs_embeds=emb, **GREEDY))
    assert ad.fallbacks == 0 and live_sequences(ad) == 0


def test_a_forward_of_embeddings_over_a_cache_of_prompt_ids_is_refused(daemon):
    """By hand: cache_for(input_ids) tells the daemon the prompt's ids; a forward of other
    embeddings would store its K/V under them. Refused naming inputs_embeds before
    anything is stored; reuse_prefix=False makes a cache that takes it."""
    model = build("llama")
    ids = prompt(40, seed=8)
    emb = edited(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="embeds-hand", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(ids)
    try:
        with pytest.raises(ValueError, match=r"^inputs_embeds: the daemon holds this cache's prompt ids"), \
                torch.no_grad():
            model(inputs_embeds=emb, past_key_values=cache, use_cache=True)
    finally:
        cache.release()
    cache = ad.cache_for(ids, reuse_prefix=False)
    try:
        with torch.no_grad():
            model(inputs_embeds=emb, past_key_values=cache, use_cache=True)
        assert cache.length == 40
    finally:
        cache.release()
    assert torch.equal(strict_generate(ad, ids, **GREEDY), _reference(model, ids, **GREEDY))
    assert ad.stats().prefix_hit_tokens == 0 and ad.fallbacks == 0


def test_hidden_states_cover_every_prompt_token_after_a_cached_prefix(daemon):
    """output_hidden_states: transformers gives the whole prompt's at the first step; a
    prompt that hit a cached prefix would run (and give) only the rest, so it takes none."""
    model = build("llama")
    ids = prompt(60, seed=9)
    kw = dict(GREEDY, return_dict_in_generate=True, output_hidden_states=True)
    want = _reference(model, ids, **kw)
    ad = KVStoreAdapter(model, daemon, cache="hidden", codec="fp16", block_size=8, residual=8)
    strict_generate(ad, ids, **GREEDY)                    # the prompt is cached
    got = strict_generate(ad, ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert [h.shape for h in got.hidden_states[0]] == [h.shape for h in want.hidden_states[0]]
    torch.testing.assert_close(got.hidden_states[0][-1], want.hidden_states[0][-1], atol=1e-2, rtol=0)
    assert live_sequences(ad) == 0


def test_a_padded_batch_run_by_hand_must_give_its_positions(daemon):
    """A forward of a left-padded batch without position_ids numbers each row from its
    padding (transformers' cache positions), but the daemon's row starts at its first
    token: refused naming position_ids; the positions generate() gives are taken."""
    model = build("llama")
    ids = torch.cat([prompt(30, seed=10), prompt(30, seed=11)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ad = KVStoreAdapter(model, daemon, cache="padded-hand", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(ids, mask)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"^position_ids: the kvstore cache holds a left-padded batch"):
                model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                  position_ids=cache.positions(0, 30))
        assert cache.length == 30
    finally:
        cache.release()
    assert live_sequences(ad) == 0 and ad.fallbacks == 0


def test_inputs_it_cannot_serve_are_refused_naming_them(daemon):
    model = build("llama")
    ids = prompt(20)
    ad = KVStoreAdapter(model, daemon, cache="refusals", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match=r"^attention_mask: a 2-D mask \[batch, tokens\] \(as generate\(\) takes\)"):
        ad.generate(ids, attention_mask=torch.ones(1, 1, 20, 20, dtype=torch.bool), **GREEDY)
    with pytest.raises(ValueError, match=r"^pixel_values: image, video and audio inputs are not supported"):
        ad.generate(ids, pixel_values=torch.zeros(1, 3, 8, 8), **GREEDY)
    assert ad.stats().sequences == 0


def test_an_attention_without_a_cache_layer_runs_in_process():
    """A vision tower's attention (no layer_idx) under a model whose configs all name
    the kvstore attention: run by the attention the model had, as it would without it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvstore.client.hf_attention import kvstore_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    tower = type("Tower", (), {"config": object(), "is_causal": False, "num_key_value_groups": 1})()
    got, _ = kvstore_attention(tower, q, k, v, None, scaling=0.5)
    want, _ = sdpa_attention_forward(tower, q, k, v, None, scaling=0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rope", ["dynamic", "default"])
def test_a_rope_that_depends_on_the_length_takes_no_cached_prefix(daemon, rope):
    """Dynamic NTK rotates a prompt longer than max_position_embeddings with other
    frequencies than a short one: K cached from a short prompt would serve a longer one
    that starts with it, where transformers rotates every token with the long prompt's.
    Such a model's prompts take no cached prefix; a plain RoPE's do."""
    model = build("llama", max_position_embeddings=32,
                  rope_parameters={"rope_type": rope, "factor": 2.0, "rope_theta": 10000.0})
    short, long = prompt(24, seed=12), torch.cat([prompt(24, seed=12), prompt(24, seed=13)], dim=1)
    want = _reference(model, long, **GREEDY)
    ad = KVStoreAdapter(model, daemon, cache=f"rope-{rope}", codec="fp16", block_size=8, residual=8)
    strict_generate(ad, short, **GREEDY)
    assert torch.equal(strict_generate(ad, long, **GREEDY), want)
    assert (ad.stats().prefix_hit_tokens > 0) == (rope == "default")
    # nor are its blocks indexed: an adapter of the same weights with a plain RoPE (the
    # same label: the model_id names weights, not settings) finds none of them
    plain = KVStoreAdapter(build("llama"), daemon, cache=f"rope-{rope}", codec="fp16", block_size=8, residual=8)
    hits = plain.stats().prefix_hit_tokens
    strict_generate(plain, long, **GREEDY)
    assert (plain.stats().prefix_hit_tokens > hits) == (rope == "default")


def test_hidden_states_by_hand_over_a_cached_prefix_are_refused(daemon):
    """model.generate(output_hidden_states=True) given cache_for's cache after a hit would
    return the hidden states of the rest only: refused naming output_hidden_states;
    reuse_prefix=False gives every prompt token's."""
    model = build("llama")
    ids = prompt(60, seed=14)
    ad = KVStoreAdapter(model, daemon, cache="hidden-hand", codec="fp16", block_size=8, residual=8)
    strict_generate(ad, ids, **GREEDY)
    kw = dict(GREEDY, return_dict_in_generate=True, output_hidden_states=True)
    for reuse in (True, False):
        cache = ad.cache_for(ids, reuse_prefix=reuse)
        try:
            with torch.no_grad():
                if reuse:
                    with pytest.raises(ValueError, match=r"^output_hidden_states: the kvstore cache starts with"):
                        model.generate(ids, past_key_values=cache, **kw)
                else:
                    out = model.generate(ids, past_key_values=cache, **kw)
                    assert out.hidden_states[0][0].shape[1] == 60
        finally:
            cache.release()
    assert live_sequences(ad) == 0


def test_generate_takes_transformers_inputs_keyword_and_names_a_missing_prompt(daemon):
    from kvstore.client import hf_variants
    model = build("llama")
    ids = prompt(20)
    ad = KVStoreAdapter(model, daemon, cache="inputs-kw", codec="fp16", block_size=8, residual=8)
    assert torch.equal(strict_generate(ad, None, inputs=ids, **GREEDY), _reference(model, ids, **GREEDY))
    with pytest.raises(ValueError, match=r"^input_ids: adapter.generate needs the prompt's input_ids"):
        ad.generate(**GREEDY)
    # flags and token ids named after media are no media input (a text-only omni model's)
    hf_variants.check_media(dict(use_audio_in_video=False, image_token_id=5, image_sizes=None))


@pytest.mark.parametrize("name", ["llama", "bamba"])
def test_a_forward_repeating_what_cache_for_ran_is_refused_naming_input_ids(daemon, name):
    """cache_for may have run part of the prompt already (a hit; a hybrid model's prompt up
    to its state boundaries): a forward by hand that starts the prompt again would append
    its tokens after them. Refused naming input_ids before anything reaches the daemon;
    the prompt's next tokens are taken."""
    from tests.client.test_hf_hybrid import build as build_hybrid
    model = build(name) if name == "llama" else build_hybrid(name)
    ids = prompt(40, seed=15)
    ad = KVStoreAdapter(model, daemon, cache=f"repeat-{name}", codec="fp16", block_size=8, residual=8)
    strict_generate(ad, ids, **GREEDY)
    cache = ad.cache_for(ids)
    assert cache.length > 0
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"^input_ids: the kvstore cache holds \d+ tokens of the prompt"):
                model(input_ids=ids[:, :24], past_key_values=cache, use_cache=True)
            model(input_ids=ids[:, cache.length:], past_key_values=cache, use_cache=True,
                  position_ids=torch.arange(cache.length, 40)[None])
        assert cache.length == 40 and not cache.local
    finally:
        cache.release()
    assert ad.fallbacks == 0 and live_sequences(ad) == 0
