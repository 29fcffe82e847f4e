"""How kvstore is installed: `make install`, the image (Dockerfile) and the
requirements files agree, the install shows its steps, `make serve` passes
ARGS to the daemon. (The image itself is built where Docker runs; here its
Dockerfile is read. The wheel's kernel sources: tests/kernels/test_packaging.py.)"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def requirements(name: str) -> dict[str, str]:
    """{normalized package name: its specifier} of a requirements file ('' when unpinned)."""
    out = {}
    for line in read(name).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"^([A-Za-z0-9._-]+)\s*(.*)$", line)
        out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2).replace(" ", "")
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in read("Dockerfile").splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        cur += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            if cur:
                word, _, rest = cur.partition(" ")
                out.append((word.upper(), rest))
            cur = ""
    return out


def pip_installs(command: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a shell command line."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out, words = [], []
    for tok in list(lex) + [";"]:
        if tok not in ("&&", ";", "||", "|", "&"):
            words.append(tok)
            continue
        for i in range(len(words) - 1):
            if words[i].endswith("pip") and words[i + 1] == "install":
                out.append(words[i + 2:])
        words = []
    return out


def files_and_packages(args: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """-> ([(flag, requirements file)], [packages named directly])."""
    files, pkgs, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a in ("-r", "-c", "--requirement", "--constraint"):
            files.append((a, args[i + 1]))
            i += 2
            continue
        if not a.startswith("-") and a not in (".", "-e"):
            pkgs.append(a)
        i += 1
    return files, pkgs


# ---------------------------------------------------------------- the image
def test_image_installs_the_pinned_requirements_and_names_no_package_itself():
    ins = dockerfile_instructions()
    copied = {w for op, rest in ins if op == "COPY" for w in rest.split()[:-1]}
    installs = [a for op, rest in ins if op == "RUN" for a in pip_installs(rest)]
    got = [files_and_packages(a) for a in installs]
    files = [f for fs, _ in got for f in fs]
    named = [p for _, ps in got for p in ps]
    assert not named, f"the Dockerfile pins packages of its own (a drifting copy): {named}; use requirements*.txt"
    assert ("-r", "requirements.txt") in files, files
    assert ("-r", "requirements-cuda.txt") in files and ("-c", "requirements.txt") in files, files
    assert {f for _, f in files} <= copied, f"requirements installed before being copied in: {files}, {copied}"


def test_make_install_uses_the_same_requirements_file():
    recipe = subprocess.run(["make", "-n", "-B", "-C", ROOT, ".venv/.installed"], capture_output=True, text=True,
                            check=True).stdout
    files = [f for a in pip_installs(recipe) for f in files_and_packages(a)[0]]
    assert ("-r", "requirements.txt") in files, recipe
    # the model side and cupy install under requirements.txt's pins: they can never replace its torch or numpy
    assert ("-c", "requirements.txt") in files, recipe


def test_pins_agree_across_requirements_files():
    base = requirements("requirements.txt")
    assert base["torch"] == "==2.13.0"
    for other in ("requirements-model.txt", "requirements-cuda.txt"):
        for name, spec in requirements(other).items():
            assert name not in base or base[name] == spec, f"{other}: {name}{spec} vs requirements.txt {base[name]}"
    cuda = requirements("requirements-cuda.txt")
    cupy = [n for n in cuda if n.startswith("cupy-cuda")]
    assert len(cupy) == 1 and cuda[cupy[0]].startswith("=="), cuda
    # the cupy wheel's CUDA major is the image's
    image = next(rest for op, rest in dockerfile_instructions() if op == "FROM")
    m = re.match(r"nvidia/cuda:(\d+)\.", image)
    assert m and cupy[0] == f"cupy-cuda{m.group(1)}x", (image, cupy)
    # pyproject's build backend is installed by requirements.txt (the image and make install
    # build with --no-build-isolation)
    assert "setuptools" in base and base["setuptools"].startswith("==")


def test_image_checks_its_kernel_sources_and_health():
    ins = dockerfile_instructions()
    run = " ".join(rest for op, rest in ins if op == "RUN")
    copied = " ".join(rest for op, rest in ins if op == "COPY")
    assert "kernels" in copied.split()
    assert "build.source(" in run, "the image build never checks the installed package finds its CUDA sources"
    for name in ("attention.cu", "merge.cu", "encode.cu"):
        assert os.path.exists(os.path.join(ROOT, "kernels", "cuda", name)) and name in run
    health = [rest for op, rest in ins if op == "HEALTHCHECK"]
    assert len(health) == 1 and "HealthStub" in health[0] and "KVSTORE_SOCKET" in health[0]


# ---------------------------------------------------------------- the Makefile
def test_make_install_shows_its_steps():
    recipe = subprocess.run(["make", "-n", "-B", "-C", ROOT, ".venv/.installed"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    pips = [i for i, line in enumerate(recipe) if " pip install" in line]
    assert pips
    for i in pips:
        words = recipe[i].split()
        assert "-q" not in words and "--quiet" not in words, f"a silent pip step: {recipe[i]}"
    steps = [line for line in recipe if re.match(r'^echo "==> \[\d+/\d+\]', line)]
    assert len(steps) >= 4, recipe
    assert recipe.index(steps[0]) < pips[0]


@pytest.fixture
def served_by_make(tmp_path):
    """Start `make serve ARGS=...` (the install step taken as done) -> (start(args), socket)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    sock = str(tmp_path / "kv.sock")
    procs = []

    def start(args: str) -> None:
        p = subprocess.Popen(["make", "-s", "-C", ROOT, "-o", "install", "serve", f"VPY={sys.executable}",
                              f"SOCKET={sock}", f"ARGS={args}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(p)
        from kvstore.tools.demo import wait_serving
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, "make serve did not bind its socket"
            time.sleep(0.1)
        wait_serving(f"unix://{sock}", p)
    yield start, sock
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)


def test_make_serve_passes_args_to_the_daemon(served_by_make):
    from kvstore.client import KVStoreClient
    start, sock = served_by_make
    start("--device cpu --max-pool-bytes 1048576 --log-level WARNING")
    with KVStoreClient(f"unix://{sock}") as kv:
        kv.create_cache("small", "m", num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=64, codec="fp16",
                        num_blocks=8)
        with pytest.raises(grpc.RpcError) as e:   # 1 MiB budget from ARGS: 512 fp16 blocks do not fit
            kv.create_cache("big", "m", num_layers=4, num_q_heads=1, num_kv_heads=1, head_dim=64, codec="fp16",
                            num_blocks=512)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
