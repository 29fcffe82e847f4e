"""How requests meet the adapter's cache: a forward that does not continue the cache
(assisted generation running the prompt again over a cached prefix) is refused, naming
it, rather than appended after the wrong tokens; a call the daemon refuses frees the
request's sequences as it falls back; generate() settings left unset (None) read as
transformers reads them."""
import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from tests.client.test_hf_generation import _reference, live_sequences, strict_generate  # noqa: E402
from tests.client.test_hf_models import build, prompt  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("assisted", ["prompt_lookup_num_tokens", "assistant_model"])
def test_assisted_generation_over_a_cached_prefix_is_refused(daemon, assisted):
    """The prompt's blocks are cached, so cache_for's cache starts with them; assisted
    generation feeds the whole prompt again with its drafts, which must not reach the
    daemon (it refuses those ids there) nor a fallback on a cache holding the prefix twice."""
    model = build("llama")
    ids = torch.cat([prompt(30, seed=2), prompt(30, seed=2)[:, :12]], dim=1)    # repeats: lookup finds drafts
    extra = {assisted: 3 if assisted == "prompt_lookup_num_tokens" else build("llama", seed=3)}
    ad = KVStoreAdapter(model, daemon, cache="assisted-hit", codec="fp16", block_size=16, residual=16)
    strict_generate(ad, ids, **GREEDY)
    cache = ad.cache_for(ids)
    assert cache.length == 32
    try:
        with pytest.raises(ValueError, match=r"start at position 0, but the kvstore cache holds 32 tokens.*"
                                             r"Assisted / speculative generation"), torch.no_grad():
            model.generate(ids, past_key_values=cache, **GREEDY, **extra)
    finally:
        cache.release()
    assert ad.fallbacks == 0 and live_sequences(ad) == 0


def test_a_forward_that_skips_tokens_is_refused(daemon):
    """By hand: a forward whose attention_mask says tokens are missing before it."""
    model = build("llama")
    ids = prompt(20)
    ad = KVStoreAdapter(model, daemon, cache="skip", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(ids[:, :10])
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match="start at position 15, but the kvstore cache holds 10 tokens"):
                model(input_ids=ids[:, 15:], attention_mask=torch.ones(1, 20, dtype=torch.long),
                      past_key_values=cache, use_cache=True)
    finally:
        cache.release()
    assert ad.fallbacks == 0 and live_sequences(ad) == 0


def test_a_refused_call_frees_the_requests_sequences(daemon, monkeypatch):
    """The daemon is up but refuses a decode step: generation goes on in-process with
    transformers' tokens, and the request's daemon sequences are freed at once."""
    import grpc
    from kvstore.client import KVStoreClient
    from kvstore.client.stream import rpc_error
    model = build("llama")
    ids = prompt(30)
    want = _reference(model, ids, **GREEDY)
    ad = KVStoreAdapter(model, daemon, cache="refusing", codec="fp16", block_size=8, residual=8)
    calls, real = [], KVStoreClient.append_attend

    def refusing(self, *a, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        return real(self, *a, **kw)
    monkeypatch.setattr(KVStoreClient, "append_attend", refusing)
    cache = ad.cache_for(ids)
    try:
        with pytest.warns(RuntimeWarning, match="refused a call"), torch.no_grad():
            got = model.generate(ids, past_key_values=cache, **GREEDY)
        assert torch.equal(got, want) and ad.fallbacks == 1
        assert live_sequences(ad) == 0          # before release: nothing left for the lease to lapse
    finally:
        cache.release()


def test_generation_config_leaving_use_cache_unset_uses_the_cache(daemon, tmp_path):
    """GenerationConfig() and a saved generation_config.json without use_cache leave it
    None, which transformers reads as True: generate() runs through the daemon."""
    from transformers import GenerationConfig
    model = build("llama")
    ids = prompt(20)
    gc = GenerationConfig(**GREEDY)
    assert gc.use_cache is None
    want = _reference(model, ids, generation_config=gc)
    ad = KVStoreAdapter(model, daemon, cache="gc", codec="fp16", block_size=8, residual=8)
    assert torch.equal(strict_generate(ad, ids, generation_config=gc), want)
    ad.close()

    model.save_pretrained(tmp_path)
    with open(tmp_path / "generation_config.json", "w") as f:     # as most checkpoints': no use_cache
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.use_cache is None
    ad = KVStoreAdapter(loaded, daemon, cache="gc-saved", codec="fp16", block_size=8, residual=8)
    assert torch.equal(strict_generate(ad, ids, **GREEDY), want)
    assert ad.stats().attend_calls > 0
    with pytest.raises(ValueError, match="use_cache=False"):
        ad.generate(ids, generation_config=GenerationConfig(use_cache=False, **GREEDY))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_the_cache_generate_returned_is_refused_for_the_next_turn(daemon, name):
    """adapter.generate frees the cache it returns (return_dict_in_generate): given to the
    next turn's model.generate it is refused, naming what to do instead, and that (the
    whole conversation to adapter.generate) gives transformers' tokens for the turn."""
    model = build(name)
    ids1 = prompt(37, seed=5)
    with torch.no_grad():
        ref = copy.deepcopy(model)
        first = ref.generate(ids1, return_dict_in_generate=True, **GREEDY)
        ids2 = torch.cat([first.sequences, prompt(9, seed=6)], dim=1)
        want = ref.generate(ids2, past_key_values=first.past_key_values, **GREEDY)
    ad = KVStoreAdapter(model, daemon, cache="turns", codec="fp16", block_size=16, residual=16)
    with torch.no_grad():
        out = ad.generate(ids1, return_dict_in_generate=True, **GREEDY)
        with pytest.raises(ValueError, match="past_key_values: this kvstore cache was released"):
            model.generate(ids2, past_key_values=out.past_key_values, **GREEDY)
    assert torch.equal(strict_generate(ad, ids2, **GREEDY), want)
    assert ad.fallbacks == 0 and live_sequences(ad) == 0


def test_adapter_generate_refuses_a_cache_of_the_callers(daemon):
    from transformers import DynamicCache
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="own", codec="fp16", block_size=8, residual=8)
    for given in (ad.cache_for(prompt(20)), DynamicCache()):
        with pytest.raises(ValueError, match="past_key_values: adapter.generate makes .* a kvstore cache of its own"):
            ad.generate(prompt(20), past_key_values=given, **GREEDY)
        if hasattr(given, "release"):
            given.release()
    assert live_sequences(ad) == 0


def other_id(model) -> str:
    from kvstore.client.hf_variants import weights_id
    return weights_id(model)


def test_models_named_by_no_hub_id_are_named_by_their_weights(daemon, tmp_path):
    """A model loaded from a local path (or built, with no name) says nothing of its
    weights: two checkpoints of one architecture on one cache name would share K/V.
    Its weights name it instead: the same weights, saved and loaded again, share the
    cache (and hit its prefix); other weights are refused it, naming model_id."""
    a, b = build("llama", seed=0), build("llama", seed=1)
    a.save_pretrained(tmp_path / "a")
    a2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    ids = prompt(40, seed=5)
    ad = KVStoreAdapter(a, daemon, cache="local", codec="fp16", block_size=16, residual=16)
    assert torch.equal(strict_generate(ad, ids, **GREEDY), _reference(a, ids, **GREEDY))
    same = KVStoreAdapter(a2, daemon, cache="local", codec="fp16", block_size=16, residual=16)
    assert same.spec["model_id"] == ad.spec["model_id"] != other_id(b)
    assert torch.equal(strict_generate(same, ids, **GREEDY), _reference(a, ids, **GREEDY))
    assert same.stats().prefix_hit_tokens >= 32
    other = KVStoreAdapter(b, daemon, cache="local", codec="fp16", block_size=16, residual=16)
    assert other.spec["model_id"].startswith("LlamaForCausalLM@weights-")
    with pytest.raises(ValueError, match=r"refuses it: ALREADY_EXISTS: .*model_id.*named by its weights"):
        other.generate(ids, **GREEDY)
    for x in (ad, same, other):
        x.close()


def test_a_custom_4d_mask_is_refused_and_the_standard_one_taken(daemon):
    """A forward continuing the cache with its own 4-D mask: one hiding a cached token
    from the new ones would be attended as if it hid nothing, so it is refused, naming
    attention_mask; the causal mask given explicitly goes to the daemon and gives
    transformers' logits."""
    from transformers import DynamicCache
    model = build("llama")
    ids = prompt(20)
    causal = torch.ones(1, 1, 4, 20, dtype=torch.bool).tril(diagonal=16)
    hiding = causal.clone()
    hiding[..., 3] = False
    ad = KVStoreAdapter(model, daemon, cache="mask4d", codec="fp16", block_size=8, residual=8)
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        model(input_ids=ids[:, :16], past_key_values=ref, use_cache=True)
        want = model(input_ids=ids[:, 16:], past_key_values=ref, attention_mask=causal, use_cache=True).logits
        for mask in (hiding, torch.where(causal, 0.0, -1.0)):
            cache = prefilled(ad, model, ids[:, :16])
            try:
                with pytest.raises(ValueError, match="attention_mask: layer 0's mask"):
                    model(input_ids=ids[:, 16:], past_key_values=cache, attention_mask=mask, use_cache=True)
            finally:
                cache.release()
        cache = prefilled(ad, model, ids[:, :16])
        try:
            got = model(input_ids=ids[:, 16:], past_key_values=cache, attention_mask=causal, use_cache=True).logits
        finally:
            cache.release()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)      # K/V in fp16 at the daemon
    assert ad.fallbacks == 0 and live_sequences(ad) == 0


def prefilled(ad, model, ids):
    """The adapter's cache for ids, holding all of them (the part not cached run)."""
    cache = ad.cache_for(ids)
    model(input_ids=ids[:, cache.length:], past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("cached", [0, 16])
def test_a_prefill_under_a_custom_4d_mask_stores_nothing(daemon, cached, monkeypatch):
    """A prefill given the adapter's cache with a 4-D mask that hides a token: its K/V
    (every layer after the first depends on the mask) would go to the daemon under the
    prompt's ids and serve a later prompt of the same ids that hides nothing. It is
    refused naming attention_mask, before the Append; the causal mask given as 4-D is
    taken, and a later prompt hitting what it stored gets transformers' tokens. cached:
    tokens of the prompt cached before (the rest then follows a hit). The mask is
    compared 8 query rows at a time, so the hole is in a later group than the first."""
    from kvstore.client import hf_masks
    monkeypatch.setattr(hf_masks, "ROWS", 8)
    model = build("llama")
    ids = prompt(40, seed=5)
    ad = KVStoreAdapter(model, daemon, cache=f"mask4d-prefill{cached}", codec="fp16", block_size=8, residual=8)
    if cached:
        strict_generate(ad, ids[:, :cached], max_new_tokens=1, do_sample=False, pad_token_id=0)
    causal = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()[:, :, cached:]
    hiding = causal.clone()
    hiding[:, :, 20 - cached:, cached + 2] = False
    for mask in (hiding, causal):
        cache = ad.cache_for(ids)
        assert cache.length == cached          # nothing of the refused forward was stored
        try:
            with torch.no_grad():
                if mask is hiding:
                    with pytest.raises(ValueError, match=r"attention_mask: layer 0's mask differs from the causal"):
                        model(input_ids=ids[:, cached:], past_key_values=cache, attention_mask=mask, use_cache=True)
                else:
                    model(input_ids=ids[:, cached:], past_key_values=cache, attention_mask=mask, use_cache=True)
                    assert cache.length == 40
        finally:
            cache.release()
        assert live_sequences(ad) == 0
    assert torch.equal(strict_generate(ad, ids, **GREEDY), _reference(model, ids, **GREEDY))
    assert ad.fallbacks == 0 and ad.stats().prefix_hit_tokens >= 32


def test_a_forward_at_other_positions_is_refused_before_anything_is_stored(daemon):
    """A forward given the adapter's cache whose position_ids skip ahead inside it: its
    K/V (rotated at those positions) would be stored under the prompt's ids and serve a
    later prompt of the same ids at the usual positions. It is refused naming
    position_ids; the positions generate() gives are taken."""
    model = build("llama")
    ids = prompt(40, seed=6)
    ad = KVStoreAdapter(model, daemon, cache="positions", codec="fp16", block_size=8, residual=8)
    gap = torch.cat([torch.arange(20), torch.arange(30, 50)])[None]
    for pos in (gap, torch.arange(40)[None]):
        cache = ad.cache_for(ids)
        assert cache.length == 0          # nothing of the refused forward was stored
        try:
            with torch.no_grad():
                if pos is gap:
                    with pytest.raises(ValueError, match=r"position_ids: the forward's positions are not each row's"):
                        model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
                else:
                    model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        finally:
            cache.release()
    assert torch.equal(strict_generate(ad, ids, **GREEDY), _reference(model, ids, **GREEDY))
    assert ad.fallbacks == 0 and ad.stats().prefix_hit_tokens >= 32 and live_sequences(ad) == 0
