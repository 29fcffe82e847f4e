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
