"""The README's code blocks run as they are written.

A block is marked by the HTML comment on the line before its fence:
  <!-- ci: run -->           run it; a non-zero exit fails the test
  <!-- ci: daemon -->        start it in the background (the daemon), wait until it
                             serves on $KVSTORE_SOCKET, stop it after the last block
  <!-- ci: skip REASON -->   never run (it needs a GPU, a download, ...): say why
Unmarked ```sh blocks are not run; every ```python block carries a marker, so none
is left untested by accident. Marked blocks run in README order, in one temporary
directory, with KVSTORE_SOCKET set to a socket of their own (a daemon someone
runs on the default socket is never used) and this interpreter's bin folder first
on PATH (`python`, `kvstore-server`, `kvstore-calibrate`, ...).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKER = re.compile(r"^\s*<!--\s*ci:\s*(run|daemon|skip)\b\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
BLOCK_TIMEOUT_S = 900       # one block; a CPU calibration on a busy 2-core machine takes minutes


@dataclass(slots=True)
class Block:
    line: int          # 1-based line of the opening fence
    lang: str
    mode: str | None   # run, daemon, skip, or None (unmarked)
    reason: str
    code: str


def parse(text: str) -> list[Block]:
    """Every fenced block with the marker on the line before it. A marker not
    followed by a fence is an error (it would silently run nothing)."""
    lines = text.splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            assert pending is None, f"README.md:{pending[0]}: ci marker not followed by a code block"
            pending = (i + 1, m.group(1), m.group(2))
            i += 1
            continue
        f = FENCE.match(lines[i])
        if not f:
            if pending is not None and lines[i].strip():
                raise AssertionError(f"README.md:{pending[0]}: ci marker not followed by a code block")
            i += 1
            continue
        indent, lang, start = f.group(1), f.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        assert i < len(lines), f"README.md:{start + 1}: code block never closed"
        mode, reason = (pending[1], pending[2]) if pending else (None, "")
        blocks.append(Block(start + 1, lang, mode, reason, "\n".join(body) + "\n"))
        pending = None
        i += 1
    assert pending is None, f"README.md:{pending[0]}: ci marker not followed by a code block"
    return blocks


def readme_blocks() -> list[Block]:
    with open(README, encoding="utf-8") as f:
        return parse(f.read())


# ------------------------------------------------------------- the marker rules
def test_every_python_block_is_marked_and_every_skip_says_why():
    blocks = readme_blocks()
    unmarked = [b.line for b in blocks if b.lang == "python" and b.mode is None]
    assert not unmarked, f"README.md lines {unmarked}: python blocks without a <!-- ci: ... --> marker"
    bad = [b.line for b in blocks if b.mode == "skip" and not b.reason]
    assert not bad, f"README.md lines {bad}: <!-- ci: skip --> without a reason"
    bad = [(b.line, b.lang) for b in blocks if b.mode in ("run", "daemon") and b.lang not in ("python", "sh")]
    assert not bad, f"README.md: only python and sh blocks can run: {bad}"
    run = [b for b in blocks if b.mode == "run"]
    assert sum(b.lang == "python" for b in run) >= 3 and sum(b.mode == "daemon" for b in blocks) == 1


def test_parser_reads_markers_indented_fences_and_refuses_a_dangling_marker():
    text = ("<!-- ci: run -->\n```python\nprint(1)\n```\n\n- item\n\n  <!-- ci: skip needs a GPU -->\n"
            "  ```sh\n  nvidia-smi\n  ```\n```sh\nls\n```\n")
    got = [(b.line, b.lang, b.mode, b.reason, b.code) for b in parse(text)]
    assert got == [(2, "python", "run", "", "print(1)\n"), (9, "sh", "skip", "needs a GPU", "nvidia-smi\n"),
                   (12, "sh", None, "", "ls\n")]
    with pytest.raises(AssertionError, match="README.md:1: ci marker not followed"):
        parse("<!-- ci: run -->\nsome text\n```sh\nls\n```\n")
    with pytest.raises(AssertionError, match="never closed"):
        parse("```sh\nls\n")


# ------------------------------------------------------------------- running them
def _serving(sock: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _command(b: Block, path: str) -> list[str]:
    with open(path, "w") as f:
        f.write(b.code)
    return [sys.executable, path] if b.lang == "python" else ["bash", "-eo", "pipefail", path]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)     # its own session: the shell and the daemon it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_blocks(blocks: list[Block], workdir: str, sock: str) -> None:
    """Run the marked blocks in order in workdir; AssertionError naming the first that fails."""
    env = dict(os.environ, KVSTORE_SOCKET=sock, PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    daemons: list[subprocess.Popen] = []
    try:
        for n, b in enumerate(blocks):
            if b.mode not in ("run", "daemon"):
                continue
            cmd = _command(b, os.path.join(workdir, f".readme-block-{n}.{'py' if b.lang == 'python' else 'sh'}"))
            if b.mode == "daemon":
                log = open(os.path.join(workdir, f".readme-daemon-{n}.log"), "w+")
                p = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
                daemons.append(p)
                deadline = time.monotonic() + 120
                while not _serving(sock):
                    if p.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise AssertionError(f"README.md:{b.line}: the daemon block did not serve on "
                                             f"{sock}:\n{b.code}\n{log.read()[-4000:]}")
                    time.sleep(0.2)
                continue
            t0 = time.monotonic()
            r = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=BLOCK_TIMEOUT_S, start_new_session=True)
            print(f"README.md:{b.line} ({b.lang}): exit {r.returncode} in {time.monotonic() - t0:.1f} s")
            assert r.returncode == 0, (f"README.md:{b.line}: the {b.lang} block failed (exit {r.returncode}):\n"
                                       f"{b.code}\n--- output ---\n{r.stdout[-6000:]}")
    finally:
        for p in daemons:
            _stop(p)


def test_run_blocks_fails_naming_the_block(tmp_path):
    text = "<!-- ci: run -->\n```sh\ntrue\n```\n\n<!-- ci: run -->\n```python\nraise SystemExit('boom')\n```\n"
    with pytest.raises(AssertionError, match=r"(?s)README.md:7: the python block failed.*boom"):
        run_blocks(parse(text), str(tmp_path), str(tmp_path / "kv.sock"))


@pytest.mark.timeout(2 * BLOCK_TIMEOUT_S)     # the blocks load SmolLM2 three times and calibrate once
def test_readme_blocks_run(tmp_path):
    pytest.importorskip("transformers")
    from kvstore.tools.models import smollm2_gguf
    if smollm2_gguf() is None:     # make install installs it: in CI its absence is a failure
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("SmolLM2 not installed (make install)")
    sock = os.path.join(str(tmp_path), "kv.sock")
    assert len(sock) < 100, "a Unix socket path must fit sun_path"
    # The blocks run as a reader runs them, from a checkout's root: its docs/ is the calibration text.
    os.symlink(os.path.join(ROOT, "docs"), os.path.join(str(tmp_path), "docs"))
    run_blocks(readme_blocks(), str(tmp_path), sock)
