"""kvstore-eval's and kvstore-calibrate's command lines: a file a flag names that
is not there is one argparse line naming the flag before the model loads, the
default rows say which of them are left out, and --help shows the defaults."""
import pytest

from kvstore.tools import calibrate as C
from kvstore.tools import evaluate as E


@pytest.fixture
def text(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(E, "load_model", no_model)
    path = tmp_path / "t.txt"
    path.write_text("some text\n")
    return str(path)


@pytest.mark.parametrize("args, says", [
    (["--codebooks", "/nonexistent/pq4.safetensors"], "--codebooks: no such file /nonexistent/pq4.safetensors"),
    (["--codebooks2", "/nonexistent/pq2.safetensors"], "--codebooks2: no such file /nonexistent/pq2.safetensors"),
    (["--row", "fp16=", "--row", "q=cb=/nonexistent/cb.safetensors"], "--row q: cb: no such file"),
    (["--row", "fp16=", "--row", "q=cb={text},transform=/nonexistent/t.safetensors"],
     "--row q: transform: no such file /nonexistent/t.safetensors"),
    (["--row", "q=cb={text},proto=iii"], "proto must be i or ii"),
    (["--row", "q=cb={text},sinks=x"], "sinks and R must be integers"),
])
def test_a_missing_file_is_one_argparse_line_naming_its_flag(text, capsys, args, says):
    with pytest.raises(SystemExit) as e:
        E.main(["--text", text, *(a.format(text=text) for a in args)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvstore-eval: error: ") and says in err[-1], err


def p_args(cb4, cb2, *rows):
    return E.argparse.Namespace(row=list(rows), codebooks=cb4, codebooks2=cb2)


def test_default_rows_say_what_they_leave_out():
    assert E.skipped_rows(p_args("pq4", None)) == ["no --codebooks2: the 2-bit row is skipped"]
    assert E.skipped_rows(p_args(None, None)) == ["no --codebooks: the 4-bit rows are skipped",
                                                  "no --codebooks2: the 2-bit row is skipped"]
    assert E.skipped_rows(p_args("pq4", "pq2")) == []
    assert E.skipped_rows(p_args(None, None, "fp16=")) == []         # --row replaces the default rows


@pytest.mark.parametrize("main, shown", [(C.main, ["(default: 32)", "(default: 16)", "(default: 0.001)"]),
                                         (E.main, ["(default: 32)", "(default: 128)", "(default: daemon)"])])
def test_help_shows_the_defaults(capsys, main, shown):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(s in out for s in shown), out
    assert "(default: None)" not in out and "(default: [])" not in out


@pytest.mark.parametrize("main, prog", [(E.main, "kvstore-eval"), (C.main, "kvstore-calibrate")])
def test_a_target_no_daemon_answers_is_refused_before_the_model_loads(text, tmp_path, capsys, monkeypatch,
                                                                      main, prog):
    monkeypatch.setattr(C, "load_model", E.load_model)       # the fixture's: fails if called
    with pytest.raises(SystemExit) as e:
        main(["--text", text, "--target", f"unix://{tmp_path}/none.sock", "--out", str(tmp_path / "o{bits}")]
             if main is C.main else ["--text", text, "--target", f"unix://{tmp_path}/none.sock"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(f"{prog}: error: --target: no daemon answers at unix://"), err


def test_sinks_the_daemon_cannot_keep_are_refused_before_the_model_loads(text, capsys):
    with pytest.raises(SystemExit):
        E.main(["--text", text, "--codebooks", text, "--sinks", "20"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--sinks: 20 is not a multiple of the daemon cache's block_size 16" in err, err


def _model_folder(tmp_path, **cfg):
    from transformers import GPT2Config, GPT2LMHeadModel
    from tests.tools.test_models_text import word_tokenizer
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, **cfg)).save_pretrained(folder)
    word_tokenizer(True).save_pretrained(folder)
    return str(folder)


def test_model_errors_name_their_flag(tmp_path, capsys):
    """A path that is not there, a folder with no model, a window past the model's
    positions (GPT-2's learned table), a codebooks file of another geometry or bit
    width, or whose transform the adapter would refuse (an old file saying none, a
    described one given another): one argparse line naming the flag, before any row runs."""
    pytest.importorskip("transformers")
    from test_calibrate_eval import rand_codebooks
    words = tmp_path / "t.txt"
    words.write_text(" ".join(f"w{i % 120}" for i in range(400)))
    folder = _model_folder(tmp_path, n_positions=64)
    rand_codebooks(2, 2, 8, 2).describe().save(str(tmp_path / "4.safetensors"))      # head_dim 16: this one's
    rand_codebooks(2, 2, 4, 4).describe().save(str(tmp_path / "2.safetensors"))
    rand_codebooks(2, 2, 16, 2).describe().save(str(tmp_path / "other.safetensors"))  # head_dim 32
    rand_codebooks(2, 2, 8, 2).save(str(tmp_path / "old.safetensors"))      # no description, nothing beside
    cases = [(["--model", str(tmp_path / "none")], "--model: no such file or folder"),
             (["--model", str(tmp_path)], "holds no config.json"),
             (["--model", folder, "--window", "128"], "--window: 128 tokens, but the model takes at most 64"),
             (["--model", folder, "--window", "32", "--codebooks", str(tmp_path / "2.safetensors")],
              "--codebooks: " + str(tmp_path / "2.safetensors") + " holds 2-bit codebooks"),
             (["--model", folder, "--window", "32", "--codebooks2", str(tmp_path / "4.safetensors")],
              "--codebooks2: " + str(tmp_path / "4.safetensors") + " holds 4-bit codebooks"),
             (["--model", folder, "--window", "32", "--codebooks", str(tmp_path / "other.safetensors")],
              "codebooks.head_dim: the file was made for head_dim 32, this model has 16"),
             (["--model", folder, "--window", "32", "--codebooks", str(tmp_path / "old.safetensors")],
              "--codebooks: " + str(tmp_path / "old.safetensors") + ": transform: a codebooks file of the old "
              "format does not say whether it was calibrated after a transform"),
             (["--model", folder, "--window", "32", "--row", f"q=cb={tmp_path / 'old.safetensors'},transform=none",
               "--row", f"r=cb={tmp_path / '4.safetensors'},transform={tmp_path / '4.safetensors'}"],
              "--row r: " + str(tmp_path / "4.safetensors") + ": transform: the codebooks file says its own")]
    for args, says in cases:
        with pytest.raises(SystemExit) as e:
            E.main(["--text", str(words), "--backend", "sim", *args])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and err.startswith("kvstore-eval: error: ") and says in err, (args, err)


def test_eval_on_a_target_deletes_its_caches(tmp_path, daemon, capsys):
    pytest.importorskip("transformers")
    from kvstore.client import KVStoreClient
    words = tmp_path / "t.txt"
    words.write_text(" ".join(f"w{i % 120}" for i in range(400)))
    folder = _model_folder(tmp_path, n_positions=64)
    E.main(["--text", str(words), "--model", folder, "--window", "32", "--windows", "1", "--target", daemon])
    out = capsys.readouterr().out
    assert "daemon: 2 caches of this row, 96 tokens appended" in out, out     # 2 layers x (32 + 16 padding)
    with KVStoreClient(daemon) as kv:
        assert [c.cache for c in kv.stats().caches] == []


def test_calibrate_names_its_files_after_the_model():
    assert C.default_out("/models/Qwen2-0.5B/") == "qwen2-0.5b-pq{bits}.safetensors"
    assert C.default_out(None) == "smollm2-pq{bits}.safetensors"


def test_rows_that_read_no_code_say_so():
    pytest.importorskip("transformers")
    from transformers import MistralConfig, MistralForCausalLM
    from test_calibrate_eval import tiny_llama
    rows = E.default_rows("pq4", "pq2", 32, 128)
    short = E.unquantized_rows(tiny_llama(), rows, 160)
    assert len(short) == 2 and "reads codes only past token 176" in short[0] and "equals fp16" in short[0]
    assert E.unquantized_rows(tiny_llama(), rows, 512) == []
    mistral = MistralForCausalLM(MistralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                               num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                                               sliding_window=48))
    slid = E.unquantized_rows(mistral, rows, 512)
    assert len(slid) == 2 and "the last 48 tokens, all in the fp16 tail" in slid[0]


def test_calibrate_refuses_too_few_samples_and_a_short_text(text, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(C, "load_model", E.load_model)       # the fixture's: fails if called
    with pytest.raises(SystemExit):
        C.main(["--text", text, "--windows", "1", "--per-window", "200", "--out", str(tmp_path / "o{bits}")])
    assert "--windows 1 x --per-window 200: k-means of 256 centroids" in capsys.readouterr().err
    pytest.importorskip("transformers")
    from test_calibrate_eval import tiny_llama
    from tests.tools.test_models_text import word_tokenizer
    from kvstore.tools.models import LoadedModel
    monkeypatch.setattr(C, "load_model", lambda spec: LoadedModel(tiny_llama(), word_tokenizer(True), "x"))
    with pytest.raises(SystemExit) as e:
        C.main(["--text", text, "--window", "64", "--out", str(tmp_path / "o{bits}"), "--model", "x"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--text: the text is shorter than one window of 64 tokens" in err, err


def test_a_model_whose_attention_the_tools_cannot_see_is_refused(tmp_path, capsys):
    """Falcon runs its own attention, not transformers' AttentionInterface: eval's pq rows
    would print fp16's perplexity as the codec's and calibrate would train on nothing, so
    both stop on the first window, naming --model."""
    pytest.importorskip("transformers")
    from transformers import FalconConfig, FalconForCausalLM
    from tests.tools.test_models_text import word_tokenizer
    folder = tmp_path / "falcon"
    FalconForCausalLM(FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=128,
                                   new_decoder_architecture=False)).save_pretrained(folder)
    word_tokenizer(True).save_pretrained(folder)
    words = tmp_path / "t.txt"
    words.write_text(" ".join(f"w{i % 120}" for i in range(400)))
    says = "--model: FalconForCausalLM's attention does not go through transformers' AttentionInterface in 2 of its 2"
    for main, extra in ((E.main, ["--backend", "sim"]), (C.main, ["--out", str(tmp_path / "o{bits}"), "--bits", "4"])):
        with pytest.raises(SystemExit) as e:
            main(["--model", str(folder), "--text", str(words), "--window", "32", "--windows", "2", *extra])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and says in err, err


def test_calibrate_refuses_one_file_for_two_bit_widths_and_no_windows(text, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(C, "load_model", E.load_model)       # the fixture's: fails if called
    for args, says in ((["--out", str(tmp_path / "x.safetensors")], "names one file for --bits 4 2: put {bits} in it"),
                       (["--windows", "0"], "--windows: must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            C.main(["--text", text, *args])
        assert says in capsys.readouterr().err


def test_a_row_may_not_give_a_described_file_another_transform(tmp_path):
    from test_calibrate_eval import rand_codebooks
    path = str(tmp_path / "cb.safetensors")
    rand_codebooks().describe().save(path)                # described, no transform
    assert E.Row.parse(f"q=cb={path},transform=none").load()[1] is None
    with pytest.raises(ValueError, match="transform: .* says its own \\(transform none\\); leave transform unset"):
        E.Row.parse(f"q=cb={path},transform={path}").load()
