"""kvstore-calibrate where users run it: the model and the torch k-means on
a device (the CPU here, the GPU in the gpu-marked test), codebooks as good
as faiss's on the same samples."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("faiss")

from kvstore.tools import calibrate as C  # noqa: E402
from kvstore.tools import hooks, models  # noqa: E402

from test_hooks import tiny  # noqa: E402


def sample(model, device, windows=3, n=160):
    model.to(device)
    sampler = C.Sampler(models.geometry_of(model), per_window=120, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(model, sampler):
        for s in range(windows):
            ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(s)).to(device)
            model(input_ids=ids, use_cache=False)
    model.to("cpu")
    return sampler


def k_error(sampler, cb, tr, layer=0):
    """Mean squared error of the K samples' PQ reconstruction in the transformed space."""
    k = sampler.samples()[0][layer].float()                                  # [N, Hkv, d]
    kt = tr.forward(k, layer, "k")
    c = cb.k[layer]                                                          # [Hkv, M, 256, dsub]
    h, m, _, dsub = c.shape
    xs = kt.reshape(-1, h, m, dsub).permute(1, 2, 0, 3)                     # [Hkv, M, N, dsub]
    return float((torch.cdist(xs, c).amin(-1) ** 2).mean())


def check_device(device):
    model = tiny("mistral")                                                 # sliding window, GQA, d 16
    s = sample(model, device)
    assert s.qq.device.type == "cpu" and s.samples()[0].device.type == "cpu"
    tr = C.qaware_transform(model, s.qq)
    cb_faiss, tr_faiss = C.train(model, s, 8, tr, niter=10)
    cb_torch, tr_torch = C.train(model, s, 8, tr, niter=10, device=device)
    assert cb_torch.k.shape == cb_faiss.k.shape == (2, 2, 8, 256, 2)
    assert torch.allclose(tr_torch.k, tr_faiss.k)                            # the same OPQ rotation
    assert k_error(s, cb_torch, tr_torch) <= 1.05 * k_error(s, cb_faiss, tr_faiss)


def test_calibration_with_the_torch_kmeans_on_cpu():
    check_device("cpu")


@pytest.mark.gpu
def test_calibration_on_the_gpu():
    check_device("cuda")


def test_the_torch_kmeans_needs_no_faiss(monkeypatch):
    """A GPU box where faiss does not install still calibrates with --device."""
    model = tiny("llama")
    s = sample(model, "cpu")
    tr = C.qaware_transform(model, s.qq)
    monkeypatch.setitem(__import__("sys").modules, "faiss", None)     # import faiss -> ImportError
    cb, _ = C.train(model, s, 8, tr, niter=3, device="cpu")
    assert torch.isfinite(cb.k).all() and cb.k.shape[-2:] == (256, 2)
