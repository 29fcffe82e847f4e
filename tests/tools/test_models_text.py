"""The tools' --model and --text: models from a local folder (never a
download), text from files, folders and globs with a message naming --text
when there is none, BOS on every window where the tokenizer uses one, ids
that fit the vocabulary, a head_dim-256 transform at the tools' thread count,
and caches registered under the model's own id."""
import os

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codec.transform import Transform  # noqa: E402
from kvstore.tools import calibrate as C  # noqa: E402
from kvstore.tools import finetune as FT  # noqa: E402
from kvstore.tools import models, text  # noqa: E402

from test_calibrate_eval import rand_codebooks, tiny_llama  # noqa: E402


def word_tokenizer(bos: bool):
    """A real transformers tokenizer built offline: whitespace words, optional BOS."""
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(120)}}
    t = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", unk_token="<unk>")


@pytest.mark.parametrize("bos", [True, False])
def test_every_window_starts_with_bos_where_the_tokenizer_uses_one(bos):
    tok = word_tokenizer(bos)
    words = " ".join(f"w{i % 120}" for i in range(100))
    wins = text.token_windows(tok, words, 16)
    flat = [t for w in wins for t in (w[1:] if bos else w)]
    assert all(len(w) == 16 for w in wins)
    assert all((w[0] == 1) == bos for w in wins) and 1 not in flat      # BOS first in each, nowhere else
    assert flat == [i % 120 + 2 for i in range(len(flat))]               # the text, in order, nothing lost between
    assert len(wins) == (100 // 15 if bos else 100 // 16)
    assert text.token_windows(tok, words, 16, limit=2) == wins[:2]


def test_read_text_files_folders_globs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("first")
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "two.rst").write_text("second")
    (tmp_path / "a" / "blob.bin").write_bytes(b"\x00\x01\xff")             # skipped: not text
    (tmp_path / "three.txt").write_text("third")
    assert text.read_text([str(tmp_path / "a")]) == "first\n\nsecond"
    assert text.read_text([str(tmp_path / "three.txt"), str(tmp_path / "a")]) == "third\n\nfirst\n\nsecond"
    assert text.read_text([str(tmp_path / "**" / "*.txt")]) == "first\n\nthird"


def test_no_text_names_the_option(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    for spec in (str(tmp_path / "missing"), str(tmp_path / "*.none"), str(tmp_path)):
        with pytest.raises(FileNotFoundError, match="--text: no text found"):
            text.read_text([spec])


def test_tools_fail_naming_text_before_loading_a_model(tmp_path, monkeypatch, capsys):
    """No text anywhere: each tool says so, naming --text, and downloads nothing."""
    monkeypatch.setenv("KVSTORE_DATA", str(tmp_path))
    from kvstore.tools import evaluate as E
    for main in (C.main, E.main):
        with pytest.raises(SystemExit) as e:          # one line on stderr, exit 2, no traceback
            main(["--model", str(tmp_path / "no-model"), "--threads", str(torch.get_num_threads())])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--text" in err and "make text" in err and "Traceback" not in err
    assert not os.listdir(tmp_path)


def test_model_from_a_local_folder_and_never_a_download(tmp_path, monkeypatch):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(True).save_pretrained(tmp_path / "m")
    lm = models.load_model(str(tmp_path / "m"))
    assert lm.model_id == str(tmp_path / "m")
    assert torch.equal(lm.model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert models.geometry_of(lm.model).head_dim == 16
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(FileNotFoundError, match="--model: 'nobody/no-such-model'.*never download"):
        models.load_model("nobody/no-such-model")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="--model: .* not a .gguf"):
        models.load_model(str(tmp_path / "x.bin"))


def test_dump_ids_dtype_holds_the_vocabulary():
    assert FT.ids_dtype(49_152) == torch.uint16
    big = torch.tensor([[0, 65_535, 65_536, 262_143]])
    dt = FT.ids_dtype(262_144)
    assert torch.equal(big.to(dt).to(torch.int64), big)                    # a 262K vocabulary does not wrap


def test_transform_of_head_dim_256_builds_at_the_tools_thread_count():
    """torch.linalg.inv of float64 [.., 256, 256] batches fails (MKL pivots) or
    spins at 2 threads on the CPU torch; the transform inverts through Cholesky."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.eye(256) + 0.05 * torch.randn(3, 4, 256, 256, generator=g)
        t = Transform(k=a, v=a.flip(-1))
    finally:
        torch.set_num_threads(threads)
    eye = torch.eye(256).expand(3, 4, 256, 256)
    assert torch.allclose(t._inv["k"] @ a, eye, atol=1e-4)
    assert torch.allclose(t._inv["v"] @ a.flip(-1), eye, atol=1e-4)


def test_target_makes_the_cache_the_adapter_joins_with_its_defaults(daemon):
    """load_into_daemon (--target) creates the cache as KVStoreAdapter makes it by
    default: a model named by its hub id (--model-id) or, loaded from a local path, by
    its weights; an adapter given no file then joins it (same spec, same codebooks)."""
    from kvstore.client.hf import KVStoreAdapter
    model = tiny_llama()
    cb = rand_codebooks().describe(model_id="google/gemma-3-1b-it", num_q_heads=4)
    C.load_into_daemon(daemon, "gemma-pq4", model, cb, "google/gemma-3-1b-it")
    cb = rand_codebooks().describe(model_id="models/tiny", num_q_heads=4)     # a path, as calibrate writes it
    C.load_into_daemon(daemon, "local-pq4", model, cb, None)
    with KVStoreClient(daemon) as kv:
        assert kv.get_cache("gemma-pq4").spec.model_id == "google/gemma-3-1b-it"
        info = kv.get_cache("local-pq4")
    assert info.spec.model_id.startswith("LlamaForCausalLM@weights-") and info.has_codebooks
    assert info.codebooks_sha256 == cb.sha256()
    for cache, model_id in (("gemma-pq4", "google/gemma-3-1b-it"), ("local-pq4", None)):
        ad = KVStoreAdapter(model, daemon, cache=cache, codec="pq", model_id=model_id)
        assert ad.client() is not None and ad.spec["sink_tokens"] == 32
        ad.close()
    again = rand_codebooks(seed=1).describe(model_id="models/tiny", num_q_heads=4)     # calibrated again
    C.load_into_daemon(daemon, "local-pq4", model, again, None)
    with KVStoreClient(daemon) as kv:
        assert kv.get_cache("local-pq4").codebooks_sha256 == again.sha256() != cb.sha256()
    assert C.cache_name("google/gemma-3-1b-it") == "gemma-3-1b-it"
    assert C.cache_name(models.SMOLLM2_MODEL_ID) == "smollm2-135m-instruct"
    assert C.cache_name("/models/Llama 3 8B/") == "llama-3-8b"


def test_a_codebooks_file_does_not_name_a_local_model(tmp_path, daemon):
    """Two local models of one geometry given one codebooks file (which names the first
    model's path) are labelled by their own weights: the second never joins the first's
    cache and reads its K/V (a file fits any weights of its geometry)."""
    from kvstore.client.hf import KVStoreAdapter
    first, second = tiny_llama(0), tiny_llama(1)
    path = str(tmp_path / "cb.safetensors")
    rand_codebooks().describe(model_id=str(tmp_path), num_q_heads=4).save(path)
    ad = KVStoreAdapter(first, daemon, cache="shared", codec="pq", codebooks=path)
    ad.client()
    ad.close()
    with pytest.raises(ValueError, match="model_id .*weights-.* \\(existing\\) vs .*weights-"):
        KVStoreAdapter(second, daemon, cache="shared", codec="pq", codebooks=path).client()
    again = KVStoreAdapter(tiny_llama(0), daemon, cache="shared", codec="pq", codebooks=path)
    assert again.client() is not None       # the same weights join
    again.close()


def test_calibrate_command_line_on_a_hybrid_model_feeds_the_adapter(tmp_path, daemon):
    """kvstore-calibrate on a Qwen3.5-like folder (Gated DeltaNet, attention, Gated
    DeltaNet): codebooks and the daemon cache for its one attention layer, which the
    adapter then takes for pq decode in the daemon."""
    pytest.importorskip("faiss")
    import warnings

    from kvstore.client.hf import KVStoreAdapter
    from kvstore.codec.codebooks import Codebooks
    from tests.client.test_hf_hybrid import GEN, build, prompt
    folder = tmp_path / "tiny-qwen"
    build("qwen3_5").save_pretrained(folder)
    word_tokenizer(True).save_pretrained(folder)
    (tmp_path / "a.txt").write_text(" ".join(f"w{(i * 7) % 120}" for i in range(600)))
    C.main(["--model", str(folder), "--text", str(tmp_path / "a.txt"), "--window", "64", "--windows", "4",
            "--per-window", "80", "--bits", "4", "--niter", "2", "--out", str(tmp_path / "cb{bits}.safetensors"),
            "--target", daemon, "--device", "cpu", "--threads", str(torch.get_num_threads())])
    assert Codebooks.load(str(tmp_path / "cb4.safetensors")).k.shape[0] == 1
    with KVStoreClient(daemon) as kv:
        assert kv.get_cache("tiny-qwen-pq4").spec.geometry.num_layers == 1
    model = models.load_model(str(folder), torch.float32).model
    ad = KVStoreAdapter(model, daemon, cache="hybrid-pq", codec="pq", block_size=16, residual=128,
                        codebooks=str(tmp_path / "cb4.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # no fallback
        with torch.no_grad():
            ad.generate(prompt(300), **GEN)
    assert ad.stats().attend_calls == GEN["max_new_tokens"] - 1 and ad.stats().sealed_blocks > 0
    ad.close()


def test_calibrate_and_eval_command_lines_on_a_local_model(tmp_path, daemon, capsys):
    """kvstore-calibrate then kvstore-eval, --model a folder, --text a glob: codebooks
    loaded into the daemon under the model's own id, perplexity rows printed."""
    from kvstore.tools import evaluate as E
    folder = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    word_tokenizer(True).save_pretrained(folder)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(" ".join(f"w{(i * 7) % 120}" for i in range(600)))
    threads = ["--threads", str(torch.get_num_threads())]
    C.main(["--model", str(folder), "--text", str(tmp_path / "text" / "*.txt"), "--window", "64", "--windows", "4",
            "--per-window", "80", "--bits", "4", "--niter", "2", "--out", str(tmp_path / "cb{bits}.safetensors"),
            "--target", daemon, "--device", "cpu"] + threads)
    with KVStoreClient(daemon) as kv:
        assert kv.get_cache("tiny-llama-pq4").spec.model_id.startswith("LlamaForCausalLM@weights-")
    E.main(["--model", str(folder), "--text", str(tmp_path / "text"), "--window", "64", "--windows", "2",
            "--backend", "sim", "--codebooks", str(tmp_path / "cb4.safetensors")] + threads)
    out = capsys.readouterr().out
    assert "| pq 4-bit, protocol i |" in out and "2 windows of 64, 126 scored tokens" in out
