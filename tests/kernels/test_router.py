"""The router (kernels/router.py) is the one place that picks a backend: reference off the
GPU, CUDA C++ where its kernels take the shape, dtypes and alignment, Triton for the rest.

CPU only: the GPU is stood in for by monkeypatching what the choice reads (cupy's
availability, the device's compute capability).
"""
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import make_pq_case

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels import router, tunables
from kvstore.kernels.cuda import attention as cuda_attention
from kvstore.kernels.cuda import build

GEO = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.fixture
def fake_gpu(monkeypatch):
    """An sm_90 GPU with cupy, as far as the choice can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "cupy", lambda: object())
    monkeypatch.setattr(build, "capability", lambda idx: (9, 0))
    monkeypatch.setattr(build, "reserved_smem", lambda idx: 1024)
    monkeypatch.setattr(tunables, "CUDA", True)


def choose(kind="pq", device="cuda:0", dtype=torch.float16, **kw):
    return kernels.decode_backend(kind, device=device, dtype=dtype, **{**GEO, **kw})


def test_cpu_device_is_reference_for_every_op():
    assert choose(device="cpu") == choose("paged", device="cpu") == kernels.REFERENCE
    assert kernels.encode_backend(torch.zeros(2, 32, 256, 2)) == kernels.REFERENCE
    # a decode plan is a GPU object: off the GPU the reference entry points serve
    with pytest.raises(ValueError, match="reference"):
        kernels.plan_decode("pq", [16], [3], tail_block_size=16, device="cpu", dtype=torch.float16, **GEO)
    c = make_pq_case([2], [3], 4, 2, 64, 2, 16, 16, torch.float32, "cpu")
    c["k_codebook"], c["v_codebook"] = c["k_codebook"].float(), c["v_codebook"].float()
    got, want = kernels.pq_decode_attention(**c, scale=0.1), ref.pq_decode_attention(**c, scale=0.1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert kernels.codebook_images(c["k_codebook"][None], c["v_codebook"][None], 4) is None


def test_every_layer_encode_off_the_gpu_is_each_layers_reference():
    # the engine's seal encodes [L, n] tokens in one call: here one reference call a layer
    gen = torch.Generator().manual_seed(4)
    layers, hkv, d, n, bs, nb = 3, 2, 64, 40, 16, 4
    x = torch.randn(layers, n + 3, hkv, d, generator=gen)[:, :n]
    cb = torch.randn(layers, hkv, d // 2, 256, 2, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    assert kernels.encode_backend(cb) == kernels.REFERENCE
    got = torch.full((layers, nb, hkv, d // 2, bs), 7, dtype=torch.uint8)
    kernels.pq_encode_to_slots(x, cb, slots, v_codes=got)
    for i in range(layers):
        want = torch.full((nb, hkv, d // 2, bs), 7, dtype=torch.uint8)
        ref.pq_encode_to_slots(x[i], cb[i], slots, v_codes=want)
        assert torch.equal(got[i], want)
    with pytest.raises(ValueError, match="v_codes must be \\[3, nb"):
        kernels.pq_encode_to_slots(x, cb, slots, v_codes=got[:2])
    with pytest.raises(ValueError, match="x must be \\[3, N"):
        kernels.pq_encode_to_slots(x[:2], cb, slots, v_codes=got)


def test_cuda_where_the_kernels_take_it_triton_elsewhere(fake_gpu, monkeypatch):
    assert choose() == kernels.CUDA
    assert choose(dtype=torch.bfloat16) == kernels.CUDA
    # what the CUDA kernels do not take goes to Triton at plan time, never at run time
    assert choose(dtype=torch.float32) == kernels.TRITON                     # fp32 q
    assert choose(codebook_dtype=torch.bfloat16) == kernels.TRITON           # codebooks of another dtype
    assert choose(kv_dtype=torch.float32) == kernels.TRITON                  # an fp32 tail
    assert choose(aligned=False) == kernels.TRITON                           # q at a 2-byte offset
    assert choose(head_dim=256) == kernels.CUDA                                # a cluster of two CTAs (sm_90)
    assert choose(head_dim=96) == kernels.TRITON
    assert choose(num_qo_heads=8 * 16) == kernels.TRITON                     # GQA group of 16
    assert choose(block_size=8) == choose(block_size=48) == kernels.TRITON   # < 16, not a power of two
    assert choose(block_size=128) == kernels.CUDA
    assert choose("paged") == kernels.TRITON                                 # no CUDA C++ paged kernel
    assert choose(backend="triton") == kernels.TRITON
    with pytest.raises(ValueError, match="backend='cuda'"):
        choose(dtype=torch.float32, backend="cuda")
    with pytest.raises(ValueError, match="kind"):
        choose("dense")
    monkeypatch.setattr(build, "reserved_smem", lambda idx: 2048)          # tables at other addresses
    assert choose() == choose(head_dim=256) == kernels.TRITON
    monkeypatch.setattr(build, "reserved_smem", lambda idx: 1024)
    monkeypatch.setattr(build, "capability", lambda idx: (7, 5))             # below sm_80
    assert choose() == kernels.TRITON
    monkeypatch.setattr(build, "capability", lambda idx: (8, 0))
    assert choose() == kernels.CUDA
    assert choose(head_dim=256) == kernels.TRITON                              # clusters need sm_90
    assert kernels.encode_backend(FakeCodebook(2, 64, 256, 2)) == kernels.CUDA
    assert kernels.encode_backend(FakeCodebook(2, 32, 256, 4)) == kernels.CUDA
    assert kernels.encode_backend(FakeCodebook(2, 60, 256, 2)) == kernels.TRITON  # M not a multiple of 8
    assert kernels.encode_backend(FakeCodebook(2, 64, 16, 2)) == kernels.TRITON   # not 256 centroids
    monkeypatch.setattr(tunables, "CUDA", False)                             # KVSTORE_CUDA_PQ=0
    assert choose() == kernels.TRITON
    assert kernels.encode_backend(FakeCodebook(2, 64, 256, 2)) == kernels.TRITON


class FakeCodebook:
    """A CUDA codebook's metadata, on a machine without a GPU."""
    is_cuda = True

    def __init__(self, *shape):
        self.shape = shape

    def dim(self):
        return len(self.shape)


def test_many_query_rows_go_to_triton(fake_gpu, monkeypatch):
    """A multi-token PQ plan whose T x G query rows per KV head reach MTQ_TRITON_ROWS runs
    on Triton's wide row blocks, where the CUDA kernel would decode the codes once for
    every 8 of them; fewer rows, d 256, an insisted backend and the knob at 0 keep CUDA."""
    monkeypatch.setattr(tunables, "MTQ_TRITON_ROWS", 256)
    assert choose(query_tokens=64) == choose(query_tokens=128) == kernels.TRITON        # 4 x 64 = 256 rows
    assert choose(query_tokens=86, num_qo_heads=24) == kernels.TRITON                     # G 3: 258 rows
    assert choose(query_tokens=63) == choose(query_tokens=16) == choose() == kernels.CUDA
    assert choose(query_tokens=128, head_dim=256) == kernels.CUDA
    assert choose(query_tokens=128, backend="cuda") == kernels.CUDA
    assert choose("paged", query_tokens=128) == kernels.TRITON
    assert choose(query_tokens=128, device="cpu") == kernels.REFERENCE
    monkeypatch.setattr(tunables, "MTQ_TRITON_ROWS", 0)
    assert choose(query_tokens=128) == kernels.CUDA
    # below 65 rows no plan has wide blocks: a small knob never sends one to narrow ones
    monkeypatch.setattr(tunables, "MTQ_TRITON_ROWS", 16)
    assert choose(query_tokens=16) == choose(query_tokens=4) == kernels.CUDA             # 64, 16 rows
    assert choose(query_tokens=17) == kernels.TRITON                                      # 68 rows


def test_plans_follow_the_one_choice(fake_gpu, monkeypatch):
    """plan_decode and the one-shot entry point build what decode_backend says, from
    the dtypes and alignment they are given."""
    made = []
    monkeypatch.setattr(cuda_attention, "plan_pq", lambda sl, tl_, **kw: made.append((sl, tl_, kw)) or "cuda plan")
    plan = kernels.plan_decode("pq", torch.tensor([32, 0]), [5, 7], tail_block_size=16, device="cuda:0",
                               dtype=torch.float16, spare_items=3, **GEO)
    assert plan == "cuda plan"
    (sl, tl_, kw), = made
    assert (sl, tl_) == ([32, 0], [5, 7]) and kw["dtype"] == torch.float16 and kw["spare_items"] == 3
    asked = []

    def decide(kind, **kw):
        asked.append((kind, kw["dtype"], kw["kv_dtype"], kw["codebook_dtype"], kw["aligned"]))
        return kernels.REFERENCE        # stop before anything is planned on a GPU
    monkeypatch.setattr(router, "decode_backend", decide)
    with pytest.raises(ValueError, match="reference"):
        kernels.plan_decode("pq", [16], [3], tail_block_size=16, device="cuda:0", dtype=torch.float32,
                            codebook_dtype=torch.float16, aligned=False, **GEO)
    assert asked == [("pq", torch.float32, None, torch.float16, False)]
    with pytest.raises(ValueError, match="sealed_lens"):        # lengths are checked before the choice
        kernels.plan_decode("pq", [15], [3], tail_block_size=16, device="cuda:0", dtype=torch.float16, **GEO)
    assert len(asked) == 1


def test_windows_and_softcap_plan_on_cuda(fake_gpu, monkeypatch):
    """A windowed or soft-capped PQ layer gets the CUDA plan where its geometry fits, its
    starts and cap passed on (the kernel has builds for both)."""
    made = []
    monkeypatch.setattr(cuda_attention, "plan_pq", lambda *lens, **kw: made.append((lens, kw)) or "cuda plan")
    assert kernels.plan_decode("pq", [32, 16], [5, 20], [7, 16], [0, 3], tail_block_size=16, device="cuda:0",
                               dtype=torch.bfloat16, softcap=50.0, **GEO) == "cuda plan"
    assert kernels.plan_decode("pq", [32], [5], tail_block_size=16, device="cuda:0", dtype=torch.float16,
                               softcap=30.0, **GEO) == "cuda plan"
    (lens, kw), (lens1, kw1) = made
    assert lens == ([32, 16], [5, 20], [7, 16], [0, 3]) and kw["softcap"] == 50.0
    assert lens1 == ([32], [5]) and kw1["softcap"] == 30.0
    assert kernels.decode_backend("pq", device="cuda:0", dtype=torch.float16, backend="cuda", **GEO) == kernels.CUDA


def test_query_alignment():
    q = torch.zeros(3 * 4 * 64 + 1, dtype=torch.float16)
    assert kernels.query_aligned(q[:-1].view(3, 4, 64))
    assert not kernels.query_aligned(q[1:].view(3, 4, 64))                  # 2-byte offset
    assert not kernels.query_aligned(torch.zeros(3, 5, 65, dtype=torch.float16)[:, :4, :64])   # odd stride


class Strided:
    """A tensor's address and strides, for tensors too large to allocate here."""

    def __init__(self, ptr, *strides):
        self.ptr, self.strides = ptr, strides

    def data_ptr(self):
        return self.ptr

    def stride(self, i=None):
        return self.strides if i is None else self.strides[i]


def test_code_pools_the_cuda_kernels_take():
    """Code blocks 16-byte aligned and less than 4 GiB apart (the kernel multiplies a block
    id by the block stride in 32 bits); anything else names the tensor, for Triton."""
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    tail = torch.zeros(3, 2, 16, 64, dtype=torch.float16)
    ok = Strided(1 << 20, 2 * 16 * 32, 16 * 32, 32, 1)
    assert cuda_attention.misaligned(q, ok, ok, tail, tail, 2) is None
    assert cuda_attention.misaligned(q, Strided(1 << 20, (1 << 32) - 16, 512, 32, 1), ok, tail, tail, 2) is None
    assert cuda_attention.misaligned(q, Strided(1 << 20, 1 << 32, 512, 32, 1), ok, tail, tail, 2) == "k_codes"
    assert cuda_attention.misaligned(q, ok, Strided(1 << 20, 1 << 33, 512, 16, 1), tail, tail, 2) == "v_codes"
    assert cuda_attention.misaligned(q, ok, Strided(8, 1024, 512, 16, 1), tail, tail, 2) == "v_codes"


def test_importing_the_kernels_imports_no_gpu_library():
    code = ("import sys, kvstore.kernels, kvstore.kernels.router, kvstore.kernels.cuda.attention; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'cupy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_bad_knob_is_refused_at_import_naming_it():
    code = "import kvstore.kernels"
    for env, value in (("KVSTORE_MTQ_TRITON_ROWS", "-1"), ("KVSTORE_TRITON_MTQ_2BIT_TILE", "48")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, env: value})
        assert out.returncode != 0 and env in out.stderr
