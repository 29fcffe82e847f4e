"""How requests meet the adapter's cache: generate() settings left unset (None) read as
transformers reads them."""
import copy
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from tests.client.test_hf_models import build, prompt  # noqa: E402
from tests.helpers import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def _reference(model, ids, **kw):
    with torch.no_grad():
        return copy.deepcopy(model).generate(ids, **kw)


def live_sequences(ad) -> int:
    return sum(s.sequences for _, s in ad.stats_by_group())


def strict_generate(ad, ids, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback
        with torch.no_grad():
            return ad.generate(ids, **kw)


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
