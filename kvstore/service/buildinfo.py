"""What this daemon is: the package version and git commit (`--version`), and
the libraries it runs on (the `kvstore_build_info` metric). Reading them
imports nothing heavy: versions come from the installed packages' metadata."""
from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import os
import subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache         # read once: Heartbeat answers it, and must not open a file per call
def version() -> str:
    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:    # a source checkout run without installing
        return "unknown"


@functools.cache
def commit() -> str:
    """The checkout's commit (12 hex digits, "+dirty" with uncommitted changes
    to tracked files); "" where there is no git checkout (an installed wheel)."""
    if not os.path.exists(os.path.join(_ROOT, ".git")):
        return ""
    try:
        head = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "-C", _ROOT, "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def version_line(prog: str) -> str:
    return f"{prog} {version()} (commit {commit() or 'unknown'})"


class VersionAction(argparse.Action):
    """`--version`: version_line(prog), exit 0 (git is asked only then)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print the version and git commit, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line(parser.prog))       # stdout, as `--version` goes: parser.exit would write stderr
        parser.exit(0)


def _package(name: str) -> str:
    """An installed package's version, "absent" if it is not installed."""
    if importlib.util.find_spec(name) is None:
        return "absent"
    for dist in (name, f"{name}-cuda12x", f"{name}-cuda11x"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "present"


@functools.cache
def build_info() -> dict[str, str]:
    """Labels of kvstore_build_info: versions of kvstore, torch, the CUDA torch
    was built for ("none": a CPU build), triton and cupy ("absent": not
    installed; the kernel router then uses what is there)."""
    import torch
    return dict(version=version(), commit=commit() or "unknown", torch=torch.__version__,
                cuda=torch.version.cuda or "none", triton=_package("triton"),
                cupy=_package("cupy"))
