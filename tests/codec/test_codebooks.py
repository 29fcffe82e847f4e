"""PQ codebooks: faiss training per layer and KV head, safetensors round trip, fingerprint."""
import pytest
import torch

from kvstore.codec.codebooks import Codebooks, fingerprint, train_codebooks
from kvstore.errors import InvalidArgument
from kvstore.kernels import reference as ref
from tests.helpers import config


@pytest.mark.parametrize("m", [8, 4])          # head_dim 16: M = d/2 (4 bits) and d/4 (2 bits)
def test_training_gives_separate_codebooks_that_beat_random(m):
    cfg = config(m=m)
    g = torch.Generator().manual_seed(0)
    # Give each (layer, head) its own scale so shared codebooks would be visibly wrong.
    scale = torch.tensor([1.0, 4.0]).view(1, 1, 2, 1)
    k = torch.randn(2, 1024, 2, 16, generator=g) * scale
    v = torch.randn(2, 1024, 2, 16, generator=g) + 3.0
    cb = train_codebooks(cfg, k, v, niter=10)
    assert cb.k.shape == (2, 2, m, 256, 16 // m) and cb.v.shape == cb.k.shape
    assert not torch.equal(cb.k[0, 0], cb.k[0, 1]) and not torch.equal(cb.k, cb.v)
    x = k[0]                                             # [N, Hkv, d]
    err = (ref.pq_dequantize(ref.pq_encode(x, cb.k[0]), cb.k[0]) - x).pow(2).mean() / x.pow(2).mean()
    rnd = cb.k[0][:, :, torch.randperm(256)]             # centroids paired with the wrong codes
    err_rnd = (ref.pq_dequantize(ref.pq_encode(x, cb.k[0]), rnd) - x).pow(2).mean() / x.pow(2).mean()
    assert err < 0.25 * err_rnd
    assert err < (0.1 if m == 8 else 0.3)


def test_safetensors_round_trip_and_sha():
    cfg = config()
    cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2), v=torch.randn(2, 2, 8, 256, 2))
    back = Codebooks.from_bytes(cb.to_bytes())
    assert torch.equal(back.k, cb.k) and torch.equal(back.v, cb.v)
    assert back.sha256() == cb.sha256()
    back.validate(cfg)
    f0 = fingerprint(cfg, None)
    f1 = fingerprint(cfg, cb)
    cb2 = Codebooks(k=cb.k.clone(), v=cb.v.clone())
    cb2.k[0, 0, 0, 0, 0] += 1
    assert len({f0, f1, fingerprint(cfg, cb2)}) == 3      # the codebook bytes are in the fingerprint


def test_bad_codebooks_are_refused():
    cfg = config()
    with pytest.raises(InvalidArgument, match="codebooks"):
        Codebooks.from_bytes(b"not safetensors")
    with pytest.raises(InvalidArgument, match="codebooks.k"):
        Codebooks(k=torch.randn(2, 2, 4, 256, 4), v=torch.randn(2, 2, 8, 256, 2)).validate(cfg)
    bad = Codebooks(k=torch.randn(2, 2, 8, 256, 2), v=torch.randn(2, 2, 8, 256, 2))
    bad.v[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN"):
        bad.validate(cfg)
    with pytest.raises(InvalidArgument, match="k_samples"):
        train_codebooks(cfg, torch.randn(2, 100, 2, 16), torch.randn(2, 100, 2, 16))


def test_reference_encode_writes_slots_in_both_layouts():
    g = torch.Generator().manual_seed(1)
    cb = torch.randn(2, 8, 256, 2, generator=g)
    x = torch.randn(5, 2, 16, generator=g)
    k_codes = torch.zeros(4, 2, 8, 8, dtype=torch.uint8)     # [nb, Hkv, bs, M]
    v_codes = torch.zeros(4, 2, 8, 8, dtype=torch.uint8)     # [nb, Hkv, M, bs]
    slots = torch.tensor([0, 9, 10, 31, 17])
    ref.pq_encode_to_slots(x, cb, slots, k_codes=k_codes)
    ref.pq_encode_to_slots(x, cb, slots, v_codes=v_codes)
    codes = ref.pq_encode(x, cb)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_codes[s // 8, :, s % 8, :], codes[i])
        assert torch.equal(v_codes[s // 8, :, :, s % 8], codes[i])
    # nearest centroid really is nearest
    d = ((x.view(5, 2, 8, 1, 2) - cb.view(1, 2, 8, 256, 2)) ** 2).sum(-1)
    assert torch.equal(codes.long(), d.argmin(-1))


def test_new_codebooks_go_into_the_same_tensors():
    """A worker that mapped the pool (MapPool) holds the codebooks' memory, and a
    captured CUDA graph their addresses: codebooks set again on an emptied cache
    must land in those same tensors, with the new values."""
    from kvstore.engine.engine import Engine
    eng = Engine()
    cfg = config()
    eng.create_cache(cfg)
    cb1 = Codebooks(k=torch.randn(2, 2, 8, 256, 2), v=torch.randn(2, 2, 8, 256, 2))
    eng.set_codebooks(cfg.name, cb1)
    main = eng.caches[cfg.name].main
    ptrs = (main.k_cb.data_ptr(), main.v_cb.data_ptr())
    cb2 = Codebooks(k=torch.randn(2, 2, 8, 256, 2), v=torch.randn(2, 2, 8, 256, 2))
    eng.set_codebooks(cfg.name, cb2)
    assert (main.k_cb.data_ptr(), main.v_cb.data_ptr()) == ptrs
    assert torch.equal(main.k_cb, cb2.k) and torch.equal(main.v_cb, cb2.v)
    assert main.cb_images is None           # no image on CPU: no kernel there reads one
