"""staging.gather: many host buffers into one device tensor, copied by
threads in chunks (CPU here; the pinned-memory path on a GPU)."""
import numpy as np
import pytest
import torch

from kvstore.tiers import staging


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n, width, offset", [(1, 7, 0), (13, 1000, 88), (40, 4096, 3)])
def test_gather_copies_every_row_at_its_offset(monkeypatch, device, n, width, offset):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    monkeypatch.setattr(staging, "CHUNK_BYTES", 3 * width)      # several chunks, so several threads
    rng = np.random.default_rng(n)
    want = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
    sources = [bytes(rng.integers(0, 256, size=offset, dtype=np.uint8)) + row.tobytes()
               + b"tail" for row in want]
    sources[0] = memoryview(sources[0])                          # LMDB hands out memoryviews
    out = staging.gather(sources, width, device, offset=offset)
    assert out.shape == (n, width) and out.device.type == device
    assert torch.equal(out.cpu(), torch.from_numpy(want))


def test_gather_of_nothing_and_errors_wait_for_every_thread(monkeypatch):
    assert staging.gather([], 16, "cpu").shape == (0, 16)
    monkeypatch.setattr(staging, "CHUNK_BYTES", 16)
    done = []

    def fn(a, b):
        if a == 0:
            raise ValueError("first span")
        done.append(a)
        return a
    with pytest.raises(ValueError, match="first span"):
        staging.run_all(fn, staging.spans(8, 16))
    assert sorted(done) == list(range(1, 8)), "every other span ran to its end before the error surfaced"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n", [3, 70])
def test_gather_checked_names_the_rows_that_changed(monkeypatch, device, n):
    """Rows whose bytes are not those their checksums were taken of are named,
    wherever they are checked: on the copy threads (a CPU, or fewer than
    DEVICE_CHECK_MIN_ROWS rows) or by the device check (a GPU, enough rows)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from kvstore import kernels
    from kvstore.tiers.checksum import checksum
    monkeypatch.setattr(staging, "CHUNK_BYTES", 4096)
    rng = np.random.default_rng(n)
    want = rng.integers(0, 256, size=(n, 1024), dtype=np.uint8)
    sums = [checksum(r) for r in want]
    sources = [bytearray(r.tobytes()) for r in want]
    for i in (1, n - 1):
        sources[i][500] ^= 0x10
    calls = []

    def device_check(rows):
        calls.append(rows.shape[0])
        return kernels.xxh3_64_rows(rows)
    rows, verdict = staging.gather_checked(sources, sums, 1024, device, device_check)
    assert verdict() == [1, n - 1]
    assert calls == ([n] if device == "cuda" and n >= staging.DEVICE_CHECK_MIN_ROWS else [])
    assert torch.equal(rows[0].cpu(), torch.from_numpy(want[0]))
