"""An installed kvstore (a wheel, as the Docker image builds it) holds every kernel
source: the Python modules and the CUDA C++ files NVRTC compiles at run time, and
the installed package finds them there."""
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_wheel(tmp_path):
    """`pip wheel . --no-deps` of a copy of the sources -> the wheel's path."""
    src = tmp_path / "src"
    src.mkdir()
    # a copy of what the wheel is built from: the build writes its egg-info beside the sources
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", ".venv", "build")
    for name in ("kvstore", "kernels", "client", "protos"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel, = (tmp_path / "dist").iterdir()
    return wheel


def test_wheel_holds_every_kernel_source(tmp_path):
    names = set(zipfile.ZipFile(build_wheel(tmp_path)).namelist())
    want = set()
    for d, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for f in files:
            if f.endswith((".py", ".cu", ".cuh")):
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "kernels"))
                want.add("kvstore/kernels/" + rel.replace(os.sep, "/"))
    assert any(n.endswith(".cu") for n in want)
    assert want <= names, sorted(want - names)


def test_installed_wheel_finds_its_cuda_sources_at_run_time(tmp_path):
    wheel = build_wheel(tmp_path)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # Run from an empty folder with the target first on sys.path: the installed copy, not this checkout
    # (the editable install's finder comes after the path entries).
    probe = ("import json, os\n"
             "from kvstore.kernels.cuda import build\n"
             "print(json.dumps({'file': build.__file__,\n"
             "                  'src': {n: build.source(n) for n in ('attention.cu', 'merge.cu', 'encode.cu')}}))\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json
    got = json.loads(r.stdout)
    assert os.path.realpath(got["file"]).startswith(os.path.realpath(target)), got["file"]
    cuda_dir = os.path.join(ROOT, "kernels", "cuda")
    for name, text in got["src"].items():
        assert '#include "' not in text, f"{name}: a local include was not inlined"
        for part in (name, "common.cuh") + (("attention.cuh",) if name == "attention.cu" else ()):
            with open(os.path.join(cuda_dir, part)) as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.startswith('#include "')]
            missing = [ln for ln in lines if ln not in text]
            assert not missing, f"{name}: {part} not in the compiled text: {missing[:3]}"
