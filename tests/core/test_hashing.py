"""Block hashes are chained SHA-256, identical across processes, hash seeds and restarts."""
import subprocess
import sys

from kvstore.core.hashing import block_hash, chain_hashes

SCRIPT = r"""
import torch
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine
g = ModelGeometry(2, 4, 2, 16)
e = Engine()
info = e.create_cache(CacheConfig(name="c", model_id="m", geometry=g, codec=CodecConfig("fp16"), num_blocks=32))
e.allocate("c", "t", "s", list(range(100)))
k = torch.zeros(2, 100, 2, 16).half()
e.append("c", "t", ["s"], k, k, [100])
print(info.fingerprint.hex(), ",".join(h.hex() for h in e.sequence_info("c", "t", "s").block_hashes))
"""


def test_chain_is_sha256_of_parent_tokens_fingerprint():
    import hashlib
    import struct
    fp = b"\x01" * 32
    h0 = hashlib.sha256(b"" + struct.pack("<4q", 1, 2, 3, 4) + fp).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4q", 5, 6, 7, 8) + fp).digest()
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, fp) == [h0, h1]
    assert block_hash(b"", [1, 2, 3, 4], fp) == h0
    # The chain makes a block's hash depend on everything before it.
    assert chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, fp)[1] != h1
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, b"\x02" * 32)[1] != h1


def test_hashes_identical_across_processes_and_hash_seeds():
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        outs.add(r.stdout.strip())
    assert len(outs) == 1
    fp, hashes = outs.pop().split()
    assert len(hashes.split(",")) == 100 // 16
