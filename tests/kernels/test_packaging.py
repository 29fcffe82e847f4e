"""An installed kvstore (a wheel, as the Docker image builds it) holds every kernel
source: the Python modules and the CUDA C++ files NVRTC compiles at run time."""
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wheel_holds_every_kernel_source(tmp_path):
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
    names = set(zipfile.ZipFile(wheel).namelist())
    want = set()
    for d, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for f in files:
            if f.endswith((".py", ".cu", ".cuh")):
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "kernels"))
                want.add("kvstore/kernels/" + rel.replace(os.sep, "/"))
    assert any(n.endswith(".cu") for n in want)
    assert want <= names, sorted(want - names)
