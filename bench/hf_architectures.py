"""Every causal LM class transformers ships, through the HF adapter: a tiny random
model from each architecture's default config (sizes shrunk), greedy generate() with
the fp16 codec through an in-process daemon beside transformers' own generate() of
the same prompt (its cache holding K/V rounded to float16, as the daemon does), then
the same prompt again through the adapter, which hits the daemon's cached prefix (a
hybrid model's states from the adapter's snapshots, hf_states.py), and two longer
prompts after that hit, by the Retrieve path and the multi-token path, whose first
logits must be transformers' for the whole prompt within PART_TOLERANCE (relative). Each
architecture ends as one of

    EQUAL     the daemon's tokens are transformers' own, both times
    REFUSED   the adapter refused it when built, naming the feature (hf_variants.py)
    STOPPED   generation stopped with an error naming what the model does (hf_cache.py)
    FALLBACK  the adapter gave up on the daemon and went on in-process (a warning)
    DIFF      other tokens, silently: a bug (DIFF-HIT: after a hit only: the same prompt
              again, or a longer prompt's first logits)
    SKIP      no tiny model: the shrunk config does not build or transformers' own
              generate fails (the stage and error are printed)

and the script exits 1 if any is DIFF or DIFF-HIT. CPU, about 8 minutes:

    python bench/hf_architectures.py                  # all of them
    python bench/hf_architectures.py llama gpt2 git   # by model_type
"""
from __future__ import annotations

import argparse
import copy
import gc
import signal
import sys
import tempfile
import warnings

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            head_dim=16, sliding_window=16, initializer_range=0.2, n_layer=2, n_head=4, n_embd=64, d_model=64,
            n_positions=512, num_layers=2, num_heads=4, moe_intermediate_size=32, n_routed_experts=4,
            num_experts=4, num_local_experts=4, num_experts_per_tok=2, ffn_dim=128, word_embed_proj_dim=64)
# What a default config needs besides TINY to build a tiny model: hybrid models whose
# default has no attention layer get one Mamba layer, then one attention layer, and Mamba
# heads that fit the shrunk hidden size; others lack a setting their modeling file reads
# (a dotted name sets a sub-config's).
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16)
CONFIG_FIXES = {"bamba": dict(attn_layer_indices=[1], **_MAMBA),
                "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], **_MAMBA),
                "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
                "dots1": dict(n_shared_experts=1),
                "gpt_bigcode": dict(num_key_value_heads=1),      # multi_query (the default): one KV head
                "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0, "attn_config.kv_n_heads": 2,
                         "ffn_config.hidden_size": 64, "ffn_config.ffn_hidden_size": 128},
                "zamba2": dict(attention_hidden_size=128, attention_head_dim=32, n_mamba_heads=4, mamba_headdim=32,
                               mamba_d_state=16)}
GEN = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


class _Timeout(Exception):
    pass


def _settable(config, name: str) -> bool:
    """The config has `name` as a plain value (one it declares per layer, as Gemma 4's
    head_dim, counts: its global value is set, its layers' overrides stay)."""
    try:
        return hasattr(config, name) and not isinstance(getattr(config, name), (dict, list))
    except Exception as e:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, by name
        return type(e).__name__ == "AmbiguousGlobalPerLayerAttributeError"


def tiny_model(model_type: str):
    import transformers
    from kvstore.client.hf_variants import kv_layer_indices
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = getattr(transformers, name if isinstance(name, str) else name[0])
    cfg = CONFIG_MAPPING[model_type]()
    text = cfg.get_text_config(decoder=True)
    default_types = list(getattr(text, "layer_types", None) or [])
    for k, v in TINY.items():
        if _settable(text, k):
            try:
                setattr(text, k, v)
            except Exception:  # noqa: BLE001 - a derived or per-layer attribute: the config keeps its own
                pass
    # A hybrid model's first attention layer may come after its first two (Qwen3.5: every
    # fourth layer): keep layers up to it, so that the tiny model has K/V for the daemon
    # (a layer type the adapter does not know counts: its refusal names it).
    first = (kv_layer_indices(default_types, len(default_types)) or [0])[0]
    if 2 <= first < 8:
        text.num_hidden_layers = first + 1
    _cut_layer_types(text, default_types)
    for k, v in CONFIG_FIXES.get(model_type, {}).items():
        *path, name = k.split(".")
        obj = text
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, name, v)
    torch.manual_seed(0)
    own = getattr(cls, "config_class", None)      # a text-only class of a multimodal model_type (Llama 4)
    return cls(text if own is not None and not isinstance(cfg, own) and isinstance(text, own) else cfg).eval()


def _cut_layer_types(text, default_types: list[str]) -> None:
    """The config's layer_types for its num_hidden_layers: the default's first ones."""
    if getattr(text, "layer_types", None) is None:
        return
    try:
        types = text.layer_types if len(text.layer_types) == text.num_hidden_layers else default_types
        text.layer_types = types[:text.num_hidden_layers] if len(types) >= text.num_hidden_layers else None
    except AttributeError:   # derived from other settings (Jamba, Mamba): it follows them
        pass


def rounding_cache(model):
    """transformers' own cache, but holding K/V rounded to float16 as the daemon's fp16
    codec stores them (the models here are float32): a router's top-k (MoE) can turn a
    rounding difference into another token, which is not what this script looks for.
    The prompt's own attention reads them exact, as the adapter's prefill does."""
    from transformers import DynamicCache

    class Rounding(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            past = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
            out = super().update(k.half().to(k.dtype), v.half().to(v.dtype), layer_idx, *args, **kwargs)
            return (k, v) if past == 0 else out
    return Rounding(config=model.config)


def run(model_type: str, target: str) -> tuple[str, str]:
    from kvstore.client.hf import KVStoreAdapter
    try:
        model = tiny_model(model_type)
        reference = copy.deepcopy(model)       # before the adapter binds the model's attention
    except _Timeout:
        raise
    except Exception as e:  # noqa: BLE001 - a shrunk config that does not build
        return "SKIP", f"config: {type(e).__name__}: {str(e)[:120]}"
    try:
        ad = KVStoreAdapter(model, target, cache=model_type.replace("_", "-"), codec="fp16", block_size=8,
                            residual=8)
    except ValueError as e:
        return "REFUSED", str(e).split(": not supported")[0][:160]
    ids = torch.randint(3, 128, (1, 41), generator=torch.Generator().manual_seed(1))
    try:
        try:
            with torch.no_grad():
                want = reference.generate(ids, past_key_values=rounding_cache(reference), **GEN)
        except _Timeout:
            raise
        except Exception as e:  # noqa: BLE001 - transformers' own generate fails on the tiny model
            return "SKIP", f"reference: {type(e).__name__}: {str(e)[:120]}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)      # a fallback in-process is not a pass
                with torch.no_grad():
                    got = ad.generate(ids, **GEN)
                    again = ad.generate(ids, **GEN)
                    parts = [rest_after_hit(ad, reference, ids, path, seed) for seed, path in
                             ((2, "auto"), (3, "codes"))]
        except (ValueError, RuntimeError) as e:
            return "STOPPED", f"{type(e).__name__}: {str(e)[:160]}"
        except RuntimeWarning as e:
            return "FALLBACK", str(e)[:160]
    finally:
        ad.close()
    if not torch.equal(got, want):
        return "DIFF", f"{got[0, 41:].tolist()} != {want[0, 41:].tolist()}"
    if not torch.equal(again, want):
        return "DIFF-HIT", f"{again[0, 41:].tolist()} != {want[0, 41:].tolist()}"
    for path, err in zip(("auto", "codes"), parts):
        if err > PART_TOLERANCE:
            return "DIFF-HIT", (f"a longer prompt after the hit ({path}): first logits {err:.3g} off "
                                "transformers' (relative)")
    return "EQUAL", f"longer prompts after the hit: first logits {max(parts):.1e} off (relative)"


# A longer prompt after a hit: its first logits against transformers' for the whole prompt,
# as a fraction of the largest of these. The prefix's K/V come back rounded to float16, so
# they differ a little (5.0e-3 at most, Granite; under 2e-3 the others). A part run at
# wrong positions (Bamba's, before the adapter passed them) was 0.216 off, one that went on
# from the last request's state (RecurrentGemma's, before the adapter refused its hits) 1.2e-2.
PART_TOLERANCE = 0.01


def rest_after_hit(ad, reference, ids: torch.Tensor, path: str, seed: int) -> float:
    """The prompt and 27 new tokens (a hit at 40, then 28 tokens: a hybrid model runs them
    in parts, to its last block boundary and after it) through the adapter on `path`
    (auto: Retrieve at this hit; codes: the multi-token path) -> max |logits - transformers'|
    of the first new token / max |transformers'|."""
    longer = torch.cat([ids, torch.randint(3, 128, (1, 27), generator=torch.Generator().manual_seed(seed))], dim=1)
    want = reference(longer).logits[0, -1]
    kept, ad.prefix_path = ad.prefix_path, path
    try:
        out = ad.generate(longer, **{**GEN, "max_new_tokens": 1, "min_new_tokens": 1}, output_logits=True,
                          return_dict_in_generate=True)
    finally:
        ad.prefix_path = kept
    return ((out.logits[0][0].float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from kvstore.service.daemon import create_server
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_types", nargs="*", help="transformers model_type names (default: every causal LM)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per architecture")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    sock = tempfile.mkdtemp(prefix="kvstore-archs-") + "/kv.sock"
    server, _, _ = create_server(socket_path=sock)

    def alarm(*_):
        raise _Timeout()
    signal.signal(signal.SIGALRM, alarm)
    counts: dict[str, int] = {}
    for mt in args.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        try:
            try:
                verdict, why = run(mt, f"unix://{sock}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:        # also when it fires after run() returned, before the timer is off
            verdict, why = "SKIP", f"over {args.timeout:.0f} s"
        gc.collect()
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{mt:32s} {verdict:8s} {why}", flush=True)
    server.stop(0)
    print(" ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    sys.exit(1 if counts.get("DIFF") or counts.get("DIFF-HIT") else 0)


if __name__ == "__main__":
    main()
