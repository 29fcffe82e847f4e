"""Many host buffers (LMDB values read in place from its map) into one
[n, width] uint8 tensor on a device, at memory speed.

One thread copying 512 KiB values one at a time runs at a fraction of what
the memory and the PCIe link can do, and a restore that first fills a host
buffer and only then starts its host-to-device copy pays both in full. Here
a few threads copy chunks of rows (numpy's copy releases the GIL; so does
an optional check of each row, checksum.py's) into pinned memory, and each chunk's
host-to-device copy is queued on the current stream as soon as the chunk is
full, so reading the page cache overlaps the DMA. On a CPU device the
threads copy straight into the result.

The sources must stay valid until gather returns (an LMDB read transaction
stays open around it): it returns only after every thread is done with them.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from kvstore.cuda.pinned import to_device

from .checksum import checksum

CHUNK_BYTES = 8 << 20       # rows per copy task and per H2D copy: the first DMA starts after 8 MiB
THREADS = max(1, min(8, os.cpu_count() or 1))
# Fewer rows than this are checked on the host even on a GPU: the XXH3 kernel hashes
# a row in one program, block after block (the format is serial), so a few long rows
# leave the GPU idle (nine 2 MiB fp16 tail rows: 1.7 ms on an H100, where the copy
# threads hash them in a fraction of their copy).
DEVICE_CHECK_MIN_ROWS = 64

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> ThreadPoolExecutor:
    """The copy threads, shared by every cache (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvstore-copy")
        return _pool


def run_all(fn, spans: list[tuple[int, int]]) -> list:
    """fn(a, b) for every span, on the copy threads; results in span order.
    Waits for every span before raising the first error (a source may be
    released as soon as this returns)."""
    if len(spans) <= 1 or THREADS == 1:
        return [fn(a, b) for a, b in spans]
    futures = [workers().submit(fn, a, b) for a, b in spans]
    wait(futures)
    return [f.result() for f in futures]


def spans(n: int, width: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of about CHUNK_BYTES each."""
    per = max(1, CHUNK_BYTES // max(1, width))
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def gather(sources: list, width: int, device, offset: int = 0, check=None) -> torch.Tensor:
    """Bytes [offset, offset + width) of each bytes-like source -> row i of a
    [len(sources), width] uint8 tensor on device (queued on the current
    stream: a later kernel on it sees the rows). check(i, row), if given,
    runs on the copy threads on each host row once it is copied (row: a
    numpy uint8 view): the bytes checked are the bytes served."""
    device = torch.device(device)
    n = len(sources)
    out = torch.empty((n, width), dtype=torch.uint8, device=device)
    if not n:
        return out
    cuda = device.type == "cuda"
    host = torch.empty((n, width), dtype=torch.uint8, pin_memory=True) if cuda else out
    arr = host.numpy()

    def copy(a: int, b: int) -> None:
        for i in range(a, b):
            arr[i] = np.frombuffer(sources[i], dtype=np.uint8, count=width, offset=offset)
            if check is not None:
                check(i, arr[i])
    parts = spans(n, width)
    if not cuda or len(parts) == 1 or THREADS == 1:
        run_all(copy, parts)
        if cuda:
            out.copy_(host, non_blocking=True)
        return out
    futures = [workers().submit(copy, a, b) for a, b in parts]
    try:
        for (a, b), f in zip(parts, futures):
            f.result()                                   # this chunk is in pinned memory:
            out[a:b].copy_(host[a:b], non_blocking=True)  # its DMA overlaps the next chunks' copies
    finally:
        wait(futures)
    return out


def gather_checked(sources: list, sums: list[int], width: int, device, device_checksums=None):
    """gather() of values each checked against its stored checksum (XXH3-64):
    -> (rows, verdict), verdict() -> the indices of rows that did not match.
    The bytes checked are the bytes served. On a GPU, given device_checksums
    (rows [n, width] uint8 -> int64 [n], kernels.xxh3_64_rows: tiers import no
    kernels) and at least DEVICE_CHECK_MIN_ROWS rows, they are checked where
    they land, by one kernel queued behind their copies, and verdict() waits
    for it: the caller can read more meanwhile. Elsewhere the copy threads
    check each row as they copy it; on the host that is a second pass over
    every byte on a memory bandwidth the copies already use up
    (docs/scale.md, Checking restored rows on the GPU)."""
    device = torch.device(device)
    if device.type == "cuda" and device_checksums is not None and len(sources) >= DEVICE_CHECK_MIN_ROWS:
        rows = gather(sources, width, device)
        got = device_checksums(rows)
        return rows, lambda: [i for i, (s, want) in enumerate(zip(got.tolist(), sums)) if s & _U64 != want]
    bad: list[int] = []

    def check(i: int, row) -> None:
        if checksum(row) != sums[i]:
            bad.append(i)
    rows = gather(sources, width, device, check=check)
    return rows, lambda: sorted(bad)


_U64 = (1 << 64) - 1


def index(device, ids: list[int]) -> torch.Tensor:
    """Row ids -> an index tensor on device (without a stall: cuda.pinned)."""
    return to_device(torch.tensor(ids, dtype=torch.long), device)


def put_rows(rows: torch.Tensor, idx: list[int], src: torch.Tensor) -> None:
    """rows[idx[j]] = src[j]: one slice copy where idx is a run."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        rows[idx[0]:idx[0] + len(idx)] = src
    else:
        rows[index(rows.device, idx)] = src


def to_host(payload: torch.Tensor) -> torch.Tensor:
    """A device tensor -> a CPU copy, through pinned memory (a copy into
    pageable memory runs at a fraction of the link's speed); CPU tensors as
    they are. Synchronous: the caller reads the bytes next."""
    if payload.device.type != "cuda":
        return payload
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    host.copy_(payload, non_blocking=True)
    torch.cuda.current_stream(payload.device).synchronize()
    return host
