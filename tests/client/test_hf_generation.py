"""generate() strategies through the transformers adapter: beam search and
num_return_sequences (generate repeats the prompt rows after the cache was made,
then reorders them every step: the daemon forks the rows taken twice and frees the
ones no beam keeps) give transformers' own tokens and leave no sequence behind;
what the daemon cannot do (assisted generation, which drops draft tokens; no cache
at all) is refused before anything runs, naming the setting."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from tests.client.test_hf_models import build, prompt  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

BEAMS = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, num_beams=3,
             num_return_sequences=2)


def _reference(model, ids, **kw):
    """transformers' generate on an untouched copy."""
    with torch.no_grad():
        return copy.deepcopy(model).generate(ids, **kw)


def live_sequences(ad) -> int:
    return sum(s.sequences for _, s in ad.stats_by_group())


def strict_generate(ad, ids, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback
        with torch.no_grad():
            return ad.generate(ids, **kw)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_beam_search_equals_transformers(daemon, name):
    """gemma2: two layer groups (a sliding one), each forked and freed alike."""
    model = build(name)
    ids = prompt()
    want = _reference(model, ids, **BEAMS)
    ad = KVStoreAdapter(model, daemon, cache=name, codec="fp16", block_size=8, residual=8)
    kv = ad.client()
    forks = []
    fork = kv.fork
    kv.fork = lambda cache, sid, new: forks.append(new) or fork(cache, sid, new)
    got = strict_generate(ad, ids, **BEAMS)
    assert got.shape == (2, ids.shape[1] + 12)
    assert torch.equal(got, want), (got, want)
    assert forks and len(set(forks)) == len(forks) // len(ad.groups)      # fresh ids, one fork per group cache
    assert live_sequences(ad) == 0
    s = ad.stats()
    assert s.attend_calls > 0
    ad.close()


def test_beam_search_after_a_prefix_hit_forks_the_cached_prefix(daemon):
    model = build("llama")
    ids = prompt(61)
    want = _reference(model, ids, **BEAMS)
    ad = KVStoreAdapter(model, daemon, cache="hit", codec="fp16", block_size=8, residual=8)
    strict_generate(ad, ids[:, :50], **BEAMS)
    hits = ad.stats().prefix_hit_tokens
    assert torch.equal(strict_generate(ad, ids, **BEAMS), want)
    assert ad.stats().prefix_hit_tokens - hits == 48
    assert live_sequences(ad) == 0


def test_sampled_return_sequences_equal_transformers(daemon):
    """num_return_sequences with sampling: the same seed draws the same tokens."""
    model = build("qwen2")
    ids = prompt()
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0,
              num_return_sequences=3)
    torch.manual_seed(7)
    want = _reference(model, ids, **kw)
    ad = KVStoreAdapter(model, daemon, cache="sampled", codec="fp16", block_size=8, residual=8)
    torch.manual_seed(7)
    got = strict_generate(ad, ids, **kw)
    assert got.shape[0] == 3 and len({tuple(r.tolist()) for r in got}) > 1
    assert torch.equal(got, want)
    assert live_sequences(ad) == 0


def test_daemon_gone_during_beam_search_goes_on_in_process(tmp_path):
    """The daemon stops mid-search: every beam is recomputed in-process from its own
    (reordered) tokens, and the search ends with transformers' beams."""
    from kvstore.service.daemon import create_server
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    model = build("mistral")
    ids = prompt()
    want = _reference(model, ids, **BEAMS)
    ad = KVStoreAdapter(model, f"unix://{sock}", cache="gone", codec="fp16", block_size=8, residual=8, timeout=5)
    calls = []

    def stop_at_the_seventh_forward(module, args, kwargs):
        calls.append(1)
        if len(calls) == 7:
            server.stop(0)
    hook = model.register_forward_pre_hook(stop_at_the_seventh_forward, with_kwargs=True)
    try:
        with pytest.warns(RuntimeWarning, match="unreachable"), torch.no_grad():
            got = ad.generate(ids, **BEAMS)
    finally:
        hook.remove()
        server.stop(0)
    assert torch.equal(got, want)
    assert ad.fallbacks == 1


@pytest.mark.parametrize("kw,named", [
    (dict(use_cache=False), "use_cache=False"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens: assisted / speculative generation"),
    (dict(assistant_model="the draft model"), "assistant_model: assisted / speculative generation"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions: the daemon's decode steps"),
])
def test_what_the_daemon_cannot_do_is_refused_before_anything_runs(daemon, kw, named):
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="refused", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match=named):
        ad.generate(prompt(), max_new_tokens=4, pad_token_id=0, **kw)
    s = ad.stats()
    assert s.sequences == 0 and s.appended_tokens == 0


def test_a_cache_given_to_generate_refuses_to_drop_tokens(daemon):
    """model.generate with the adapter's cache and prompt lookup: crop() is refused,
    naming the feature, rather than keeping the rejected draft tokens."""
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="crop", codec="fp16", block_size=8, residual=8)
    ids = torch.cat([prompt(), prompt()[:, :20]], dim=1)       # repeats: prompt lookup finds drafts
    cache = ad.cache_for(ids)
    try:
        with pytest.raises(ValueError, match="crop: assisted / speculative generation"), torch.no_grad():
            model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0, prompt_lookup_num_tokens=4)
    finally:
        cache.release()
    assert live_sequences(ad) == 0


@pytest.mark.parametrize("kw,named", [
    (dict(use_cache=False), "use_cache=False"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions: the daemon's decode steps"),
])
def test_a_cache_given_to_generate_refuses_what_the_daemon_cannot_serve(daemon, kw, named):
    """The manual path (cache_for, then model.generate with that cache) refuses what
    the adapter's generate() refuses, at the first forward, and appends nothing."""
    model = build("llama")
    ad = KVStoreAdapter(model, daemon, cache="manual-refused", codec="fp16", block_size=8, residual=8)
    ids = prompt()
    cache = ad.cache_for(ids)
    try:
        with pytest.raises(ValueError, match=named), torch.no_grad():
            model.generate(ids, past_key_values=cache, max_new_tokens=4, pad_token_id=0, **kw)
    finally:
        cache.release()
    s = ad.stats()
    assert s.sequences == 0 and s.appended_tokens == 0
