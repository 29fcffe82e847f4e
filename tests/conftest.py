import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
