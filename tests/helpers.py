"""Small shared builders for tests (tiny geometries: the reference kernels run on CPU)."""
import os

import pytest
import torch

from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the checkout
GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def config(codec="pq", name="c", block_size=8, residual=8, num_blocks=64, max_sequences=16, m=0, sink_tokens=0,
           **geom):
    g = ModelGeometry(**{**GEOM, **geom})
    return CacheConfig(name=name, model_id="test-model", geometry=g, codec=CodecConfig(kind=codec, num_subvectors=m),
                       block_size=block_size, residual=residual, num_blocks=num_blocks, max_sequences=max_sequences,
                       sink_tokens=sink_tokens)


def kv(layers, n, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, n, hkv, d, generator=g).half(), torch.randn(layers, n, hkv, d, generator=g).half())


@pytest.fixture
def one_thread():
    """Tiny tensors: torch's intra-op threads only contend (20x slower on a busy 2-core box).
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
