"""`make demo` (kvstore.tools.demo_model) with SmolLM2: its prompt is long enough
that pq blocks seal, fp16 through the daemon gives transformers' own tokens, and
it prints the daemon's real bytes per token (fp16 sinks and tail included), not
a sealed block's nominal ratio."""
import inspect
import math
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.client.hf import DEFAULT_PQ_SINKS, KVStoreAdapter  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from kvstore.tools import demo_model  # noqa: E402
from kvstore.tools.models import SMOLLM2_MODEL_ID, smollm2_gguf  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    if smollm2_gguf() is None:     # make install installs it: in CI its absence is a failure
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("SmolLM2 not installed (make install)")
    from kvstore.tools.models import load_smollm2
    return load_smollm2()


def adapter_seal_threshold() -> int:
    """Tokens a pq sequence keeps in fp16 with the adapter's defaults: sinks + residual + one block."""
    d = inspect.signature(KVStoreAdapter).parameters
    bs, r = d["block_size"].default, d["residual"].default
    return math.ceil(DEFAULT_PQ_SINKS / bs) * bs + r + bs


def test_the_prompt_alone_seals_blocks(smollm2):
    _, tok = smollm2
    n = demo_model.chat_ids(tok, demo_model.PROMPT).shape[1]
    assert n >= adapter_seal_threshold() + 4 * 16, f"a {n}-token prompt seals (almost) nothing"


def test_fp16_tokens_are_transformers_own(daemon, smollm2, capsys):
    model, tok = smollm2
    ids = demo_model.chat_ids(tok, demo_model.CHECK_PROMPTS[0])
    assert demo_model.run_codec(model, tok, daemon, "fp16", ids, 6, torch.get_num_threads())
    out = capsys.readouterr().out
    assert "tokens IDENTICAL" in out and "in-process (transformers generate)" in out


def test_pq_prints_the_real_bytes_per_token(daemon, smollm2, tmp_path, capsys):
    model, tok = smollm2
    c = model.config
    hkv, d = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    m = d // 2
    cb = Codebooks(k=torch.randn(c.num_hidden_layers, hkv, m, 256, 2, generator=g),
                   v=torch.randn(c.num_hidden_layers, hkv, m, 256, 2, generator=g)).describe(
        model_id=SMOLLM2_MODEL_ID, num_q_heads=c.num_attention_heads)          # a file that says: no transform
    path = str(tmp_path / "cb.safetensors")
    cb.save(path)
    ids = demo_model.chat_ids(tok, demo_model.PROMPT)
    demo_model.run_codec(model, tok, daemon, "pq", ids, 4, torch.get_num_threads(), codebooks=path)
    out = capsys.readouterr().out
    m_seal = re.search(r"(\d+) tokens; (\d+) blocks sealed \((\d+) tokens quantized\), (\d+) tokens fp16", out)
    m_mem = re.search(r"([\d,]+) B/token effective \(([\d.]+)x vs fp16 ([\d,]+) B/token; "
                      r"a sealed block alone: ([\d,]+) B/token\)", out)
    assert m_seal and m_mem, out
    tokens, blocks, quantized, fp16_tokens = map(int, m_seal.groups())
    eff, ratio, fp16_bpt, pq_bpt = (float(x.replace(",", "")) for x in m_mem.groups())
    # generate() never runs the model on its last token: the cache holds prompt + new - 1
    assert tokens == ids.shape[1] + 4 - 1 and quantized == 16 * blocks > 0 and fp16_tokens == tokens - quantized
    assert fp16_bpt == c.num_hidden_layers * hkv * d * 2 * 2           # K and V, fp16
    assert pq_bpt == c.num_hidden_layers * hkv * m * 2                 # one byte code per subvector, K and V
    # what the pools hold: the PQ blocks, and whole fp16 blocks for the sinks and the tail
    sinks = math.ceil(DEFAULT_PQ_SINKS / 16) * 16
    held = quantized * pq_bpt + (sinks // 16 + math.ceil((fp16_tokens - sinks) / 16)) * 16 * fp16_bpt
    assert eff == pytest.approx(held / tokens, abs=1)
    assert ratio == pytest.approx(fp16_bpt / eff, abs=0.01) and ratio < fp16_bpt / pq_bpt
    assert "prompt tokens from the daemon's cache" in out
