"""LMDB store benchmark: a synced spill (put_many(sync=True) of N block-sized
values in one transaction) vs a plain write + fdatasync of the same bytes to a
file beside it, interleaved, medians over the rounds.

  fresh: the values grow the file (a first spill); reuse: they replace the
  previous spill's values (pages from LMDB's free list, as repeated spills do)

and the read back of the spill (staging.gather on the copy threads, from the
page cache) with each value checked against its stored checksum, as the disk
tier reads, against the same read unchecked. With --device cuda the read goes
to the GPU, and is checked either on the copy threads or, as the disk tier
does on a GPU, by the XXH3 kernel where the rows land (staging.gather_checked).

python bench/bench_lmdb_spill.py [--values 256] [--value-kib 512] [--rounds 5] [--dir DIR] [--device cuda]
(--dir on the disk to measure, not a tmpfs: the default is a temp dir under it)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from kvstore import kernels
from kvstore.tiers.lmdb_store import LMDBStore
from kvstore.tiers.staging import gather, gather_checked


def disk_write(path: str, data: memoryview) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        off = 0
        while off < len(data):
            off += os.write(fd, data[off:off + (64 << 20)])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    os.unlink(path)
    return dt


def spill(store: LMDBStore, rows: np.ndarray, tag: bytes) -> float:
    items = [(tag + b"/%08d" % i, memoryview(r)) for i, r in enumerate(rows)]
    t = time.perf_counter()
    store.put_many(items, sync=True)
    return time.perf_counter() - t


def read_back(store: LMDBStore, keys: list[bytes], width: int, check: str, device: str) -> float:
    """check: "none", "threads" (each row on the copy threads) or "device" (the disk tier's path on a GPU)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with store.reader(buffers=True) as txn:
        values, sums = zip(*(store.stored(txn, k) for k in keys))
        bad = []
        if check == "none":
            gather(list(values), width, device)
        else:      # "threads": no device check given, so the copy threads check each row
            _, verdict = gather_checked(list(values), sums, width, device,
                                        kernels.xxh3_64_rows if check == "device" else None)
            bad = verdict()
        if cuda:
            torch.cuda.synchronize()
    assert not bad, "a value failed its checksum"
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", type=int, default=256)
    p.add_argument("--value-kib", type=int, default=512, help="a 4-bit PQ block of 32 layers is 512 KiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--device", default="cpu", help="where the read back goes (cuda: also the check on the device)")
    args = p.parse_args()
    checks = ["none", "threads"] + (["device"] if args.device.startswith("cuda") else [])
    rows = np.random.default_rng(0).integers(0, 256, (args.values, args.value_kib << 10), dtype=np.uint8)
    nbytes = rows.nbytes
    tmp = tempfile.mkdtemp(prefix="kvbench-lmdb-", dir=args.dir)
    times = dict(disk=[], fresh=[], reuse=[], **{c: [] for c in checks})
    try:
        for r in range(args.rounds):
            times["disk"].append(disk_write(os.path.join(tmp, "disk-baseline"), memoryview(rows.reshape(-1))))
            path = os.path.join(tmp, f"lmdb{r}")
            store = LMDBStore(path)
            times["fresh"].append(spill(store, rows, b"a"))
            store.delete_many([b"a/%08d" % i for i in range(args.values)])
            store.env.sync(True)
            times["reuse"].append(spill(store, rows, b"b"))
            keys = [b"b/%08d" % i for i in range(args.values)]
            for _ in range(2):      # interleaved: the second pass of each reads a warm page cache
                for c in checks:
                    times[c].append(read_back(store, keys, rows.shape[1], c, args.device))
            store.close()
            shutil.rmtree(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"\nLMDB synced spill: {args.values} values of {args.value_kib} KiB ({nbytes / 2**20:.1f} MiB), "
          f"{args.rounds} rounds, medians ({tmp})")
    print(f"  disk: write + fdatasync of the same bytes  {gb / med['disk']:6.2f} GB/s  {med['disk'] * 1e3:7.1f} ms")
    for k in ("fresh", "reuse"):
        print(f"  LMDB spill, {k:5s} pages ({'put_many(sync=True)'})  {gb / med[k]:6.2f} GB/s  "
              f"{med[k] * 1e3:7.1f} ms  {med['disk'] / med[k]:.2f}x of the disk's speed")
    where = "into memory" if args.device == "cpu" else f"to {args.device} ({torch.cuda.get_device_name()})"
    print(f"  read back {where}:")
    for c, how in (("none", "unchecked"), ("threads", "checked on the copy threads"),
                   ("device", "checked on the device (the disk tier's way)")):
        if c in med:
            print(f"    {how:44s} {gb / med[c]:6.2f} GB/s  {med[c] * 1e3:7.1f} ms  "
                  f"{med['none'] / med[c]:.2f}x of the unchecked read's speed")


if __name__ == "__main__":
    main()
