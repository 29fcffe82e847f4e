"""After a prefix hit, the adapter's default path runs the rest of the prompt through
multi-token AppendAttend calls (chunks of up to 128 tokens, attended from the codes)
instead of Retrieve + in-process prefill: on a tiny random Llama, greedy generate equals
the Retrieve path's (fp16; pq where no suffix token is sealed before it is attended: its
first tokens, and the first step's logits to 1e-2),
and with pq over several chunks the first token's logits stay within the bound the
quantized suffix allows."""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.client import hf  # noqa: E402
from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from tests.client.test_hf_adapter import GEN, prompt, tiny_llama  # noqa: E402


def adapter(model, daemon, codec, path):
    kw = dict(block_size=8, residual=8, prefix_path=path, cache=f"{codec}-{path}")
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g), v=torch.randn(2, 2, 8, 256, 2, generator=g))
        kw.update(codebooks=cb.to_bytes(), transform="none", sink_tokens=8)
    return KVStoreAdapter(model, daemon, codec=codec, **kw)


def generate(ad, model, first, second):
    """Fill the prefix with `first`, then generate from `second` -> (tokens, first
    step's logits, input lengths of the base model's forwards, stats)."""
    with torch.no_grad():
        ad.generate(first, **GEN)
        seen = []
        hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]),
                                                     with_kwargs=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # no fallback
            out = ad.generate(second, **GEN, output_scores=True, return_dict_in_generate=True)
        hook.remove()
    return out.sequences, out.scores[0], seen, ad.stats()


@pytest.mark.parametrize("codec,suffix", [("fp16", 30), ("fp16", 150), ("pq", 9)])
def test_codes_path_equals_retrieve_path(daemon, codec, suffix):
    model = tiny_llama()
    first = prompt(40)
    second = torch.cat([first, prompt(suffix, 7)], dim=1)
    want, want_logits, _, _ = generate(adapter(model, daemon, codec, "retrieve"), model, first, second)
    got, logits, seen, s = generate(adapter(model, daemon, codec, "codes"), model, first, second)
    if codec == "fp16":
        assert torch.equal(got, want)
    else:   # fp16 rounding of the chunk's own K/V (in-process: fp32) flips a near-tie after ~18 tokens
        assert torch.equal(got[:, :second.shape[1] + 8], want[:, :second.shape[1] + 8])
    assert s.prefix_hit_tokens == 40
    chunk = hf.MAX_QUERY_TOKENS if codec == "fp16" else 9     # pq: at most residual + 1 tokens a call
    rest = suffix - 1                                 # generate() runs the prompt's last token
    sizes = [min(chunk, rest - i) for i in range(0, rest, chunk)]
    assert seen[:len(sizes) + 1] == sizes + [1]       # the chunks, then generate from one token
    # every chunk and decode step is one AppendAttend a layer, no in-process prefill
    assert s.attend_calls - 2 * (GEN["max_new_tokens"] - 1) == 2 * (len(sizes) + GEN["max_new_tokens"])
    assert (logits - want_logits).abs().max().item() < 1e-2


def test_pq_codes_path_over_several_chunks_within_bound(daemon):
    # Suffix tokens sealed between chunks are read from their codes by later chunks
    # (the Retrieve path reads them exact): the first token's logits differ by what that
    # quantization moves, bounded here by the gap between pq and fp16 on the same prompt.
    model = tiny_llama()
    first = prompt(40)
    second = torch.cat([first, prompt(40, 7)], dim=1)
    _, ret, _, _ = generate(adapter(model, daemon, "pq", "retrieve"), model, first, second)
    _, codes, seen, _ = generate(adapter(model, daemon, "pq", "codes"), model, first, second)
    _, exact, _, _ = generate(adapter(model, daemon, "fp16", "retrieve"), model, first, second)
    assert seen[:5] == [9, 9, 9, 9, 3]
    err, gap = (codes - ret).norm().item(), (ret - exact).norm().item()
    assert err < gap


@pytest.mark.gpu
def test_a_model_on_the_gpu_continues_a_cached_prefix(daemon):
    """Retrieve answers in host memory: the prefix must reach the model's device
    (both paths run, and agree)."""
    model = tiny_llama().cuda()
    first = prompt(40).cuda()
    second = torch.cat([first, prompt(20, 7).cuda()], dim=1)
    want, _, _, s1 = generate(adapter(model, daemon, "fp16", "retrieve"), model, first, second)
    got, _, _, s2 = generate(adapter(model, daemon, "fp16", "codes"), model, first, second)
    assert s1.prefix_hit_tokens == s2.prefix_hit_tokens == 40
    assert torch.equal(got, want)


def test_auto_path_takes_codes_for_short_suffixes_and_retrieve_past_the_bound(daemon, monkeypatch):
    # prefix_path="auto" (the default): up to codes_suffix_limit(hit) tokens after the hit
    # run as multi-token chunks, more as Retrieve + one in-process prefill; same tokens
    # either way. A hit shorter than CODES_MIN_HIT retrieves unless only the last token
    # follows it. Here a 40-token hit is long enough, and the limit 20 tokens.
    assert [hf.codes_suffix_limit(p) for p in (40, 16384, 24575, 24576, 1 << 17)] == [1, 1, 1, 128, 128]
    monkeypatch.setattr(hf, "CODES_MIN_HIT", 40)
    monkeypatch.setattr(hf, "CODES_MAX_SUFFIX", 20)
    model = tiny_llama()
    first = prompt(40)
    ad = KVStoreAdapter(model, daemon, codec="fp16", block_size=8, residual=8, cache="fp16-auto")
    assert ad.prefix_path == "auto"
    for suffix, path, seed in ((20, "codes", 7), (21, "retrieve", 8)):
        second = torch.cat([first, prompt(suffix, seed)], dim=1)
        seen = []
        with torch.no_grad():
            ad.generate(first, **GEN)                    # the prefix (a full hit from the second round)
            runs = dict(ad.prefix_runs)
            hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]),
                                                         with_kwargs=True)
            got = ad.generate(second, **GEN)
            hook.remove()
        assert {p: ad.prefix_runs[p] - runs[p] for p in runs} == \
            {path: 1, "codes" if path == "retrieve" else "retrieve": 0}
        # one chunk then the last prompt token, or the whole suffix in one prefill
        assert seen[:3] == ([suffix - 1, 1, 1] if path == "codes" else [suffix, 1, 1])
        want, _, _, _ = generate(adapter(model, daemon, "fp16", "retrieve"), model, first, second)
        assert torch.equal(got, want)


def test_prefix_path_is_checked(daemon):
    with pytest.raises(ValueError, match="prefix_path"):
        KVStoreAdapter(tiny_llama(), daemon, codec="fp16", prefix_path="fast")
