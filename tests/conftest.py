import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Without CUDA the Triton kernels' tests run in Triton's interpreter, which triton reads
# from the environment when it is first imported: set here, before any test module, as
# several import the kernels (tests/kernels/test_triton_kernels.py: the interpreter tests).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist (make test-gpu: GPU_WORKERS processes) each worker's torch would run
# its CPU ops (the fp64 references) on a thread per core, every worker on every core. Each
# worker gets its share of the cores instead: with one thread a worker the multi-token GPU
# tests (tests/kernels/test_multi_kernels.py, 73, 16 workers, H200 host of 16 cores) took
# 33.5 s, where the slowest of them had taken 45-157 s each with the threads left as they were.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def daemon(tmp_path):
    """A daemon in this process on a temp Unix socket -> 'unix://…' target."""
    from kvstore.service.daemon import create_server
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    yield f"unix://{sock}"
    server.stop(0)


@pytest.fixture
def python():
    return sys.executable
