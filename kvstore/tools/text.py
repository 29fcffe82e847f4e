"""The text the offline tools read: Debian's python3.11-doc reST sources,
fetched once into the data directory. Calibration reads CALIB_DIRS,
evaluation EVAL_DIRS; the two never overlap."""
from __future__ import annotations

import glob
import os
import subprocess
import tempfile

DOC_PACKAGE = "python3.11-doc"
SOURCES = "usr/share/doc/python3.11/html/_sources"
CALIB_DIRS = ("library", "howto", "reference")   # ~1.9M tokens
EVAL_DIRS = ("tutorial",)                        # ~68K tokens; never calibrated on


def data_dir() -> str:
    return os.environ.get("KVSTORE_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")


def pydoc_root(fetch: bool = False) -> str | None:
    """Directory of the python3.11-doc reST sources; with fetch, download the
    Debian package (`apt-get download` + `dpkg -x`) if it is not there yet."""
    root = os.path.join(data_dir(), "pydoc")
    src = os.path.join(root, SOURCES)
    if os.path.isdir(src) or not fetch:
        return src if os.path.isdir(src) else None
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        def download() -> bool:
            return subprocess.run(["apt-get", "download", DOC_PACKAGE], cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        if not download():
            subprocess.run(["apt-get", "update"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if not download():
                raise RuntimeError(f"apt-get download {DOC_PACKAGE} failed")
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        subprocess.run(["dpkg", "-x", deb, root], check=True)
    return src


def read_text(dirs: tuple[str, ...], fetch: bool = True) -> str:
    """The .rst.txt files under dirs, in sorted path order, joined by blank lines."""
    root = pydoc_root(fetch=fetch)
    if root is None:
        raise FileNotFoundError(f"{DOC_PACKAGE} sources not found under {data_dir()} (run with --fetch-data)")
    files = sorted(p for d in dirs for p in glob.glob(os.path.join(root, d, "**", "*.rst.txt"), recursive=True))
    return "\n\n".join(open(p, encoding="utf-8").read() for p in files)


def windows(ids: list[int], size: int, limit: int = 0) -> list[list[int]]:
    """Non-overlapping full windows of `size` tokens (at most `limit`)."""
    out = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]
    return out[:limit] if limit else out
