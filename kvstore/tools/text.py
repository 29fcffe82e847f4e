"""The text the offline tools read (`--text`: files, folders, globs of plain
text) and the token windows cut from it. The tools fetch nothing: `make text`
puts Debian's python3.11-doc reST sources (the default text) and
debian-reference-en (a second kind of English) into the data directory.
By default calibration reads CALIB_DIRS of the Python docs, evaluation
EVAL_DIRS; the two never overlap."""
from __future__ import annotations

import glob
import os

SOURCES = "pydoc/usr/share/doc/python3.11/html/_sources"
CALIB_DIRS = ("library", "howto", "reference")   # ~1.9M tokens
EVAL_DIRS = ("tutorial",)                        # ~68K tokens; never calibrated on
TEXT_HELP = "plain text: files, folders (read recursively) or globs"


def data_dir() -> str:
    return os.environ.get("KVSTORE_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")


def default_text(dirs: tuple[str, ...]) -> list[str]:
    """The Python-docs folders `make text` fetches (they may not be there)."""
    return [os.path.join(data_dir(), SOURCES, d) for d in dirs]


def text_files(specs: list[str]) -> list[str]:
    """Each spec a file, a folder (every file under it) or a glob -> files, in
    the order given, each folder's and glob's sorted, none twice."""
    out: list[str] = []
    for spec in specs:
        if os.path.isfile(spec):
            found = [spec]
        else:
            tops = [spec] if os.path.isdir(spec) else sorted(glob.glob(spec, recursive=True))
            found = []
            for top in tops:
                found += ([top] if os.path.isfile(top) else
                          sorted(p for p in glob.glob(os.path.join(top, "**", "*"), recursive=True)
                                 if os.path.isfile(p)))
        out += [p for p in found if p not in out]
    return out


def _read(path: str) -> str | None:
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_text(specs: list[str]) -> str:
    """The plain-text files of `specs` (binary and non-UTF-8 files skipped),
    joined by blank lines. Raises naming --text when there is none."""
    files = text_files(specs)
    parts = [t for t in map(_read, files) if t and t.strip()]
    if not parts:
        what = (f"{len(files)} files, none plain UTF-8 text" if files else "nothing there")
        raise FileNotFoundError(f"--text: no text found in {', '.join(specs)} ({what}); pass --text with files, "
                                f"folders or globs of plain text, or run `make text` for the default Python docs")
    return "\n\n".join(parts)


def token_windows(tok, text: str, size: int, limit: int = 0) -> list[list[int]]:
    """Non-overlapping windows of `size` tokens of `text` (at most `limit`), each
    starting with the tokenizer's BOS where it puts one before a text (a model
    trained so expects it at position 0 of every window, not only the first)."""
    from .models import bos_id
    bos = bos_id(tok)
    ids = tok(text, add_special_tokens=False).input_ids
    if bos is None:
        return windows(ids, size, limit)
    return [[bos] + w for w in windows(ids, size - 1, limit)]


def windows(ids: list[int], size: int, limit: int = 0) -> list[list[int]]:
    """Non-overlapping full windows of `size` tokens (at most `limit`)."""
    out = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]
    return out[:limit] if limit else out
