"""LMDB store benchmark: a synced spill (put_many(sync=True) of N block-sized
values in one transaction) vs a plain write + fdatasync of the same bytes to a
file beside it, interleaved, medians over the rounds.

  fresh: the values grow the file (a first spill); reuse: they replace the
  previous spill's values (pages from LMDB's free list, as repeated spills do)

and the read back of the spill into memory (staging.gather on the copy
threads, from the page cache) with each value checked against its stored
checksum, as the disk tier reads, against the same read unchecked.

python bench/bench_lmdb_spill.py [--values 256] [--value-kib 512] [--rounds 5] [--dir DIR]
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

from kvstore.tiers.lmdb_store import LMDBStore, checksum
from kvstore.tiers.staging import gather


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


def read_back(store: LMDBStore, keys: list[bytes], width: int, checked: bool) -> float:
    t = time.perf_counter()
    with store.reader(buffers=True) as txn:
        values, sums = zip(*(store.stored(txn, k) for k in keys))
        bad = []
        check = (lambda i, row: checksum(row) == sums[i] or bad.append(i)) if checked else None
        gather(list(values), width, "cpu", check=check)
    assert not bad, "a value failed its checksum"
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", type=int, default=256)
    p.add_argument("--value-kib", type=int, default=512, help="a 4-bit PQ block of 32 layers is 512 KiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    rows = np.random.default_rng(0).integers(0, 256, (args.values, args.value_kib << 10), dtype=np.uint8)
    nbytes = rows.nbytes
    tmp = tempfile.mkdtemp(prefix="kvbench-lmdb-", dir=args.dir)
    times = dict(disk=[], fresh=[], reuse=[], read=[], checked=[])
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
                times["read"].append(read_back(store, keys, rows.shape[1], False))
                times["checked"].append(read_back(store, keys, rows.shape[1], True))
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
    print(f"  read back into memory, unchecked          {gb / med['read']:6.2f} GB/s  {med['read'] * 1e3:7.1f} ms")
    print(f"  read back, every value checked            {gb / med['checked']:6.2f} GB/s  "
          f"{med['checked'] * 1e3:7.1f} ms  {med['read'] / med['checked']:.2f}x of the unchecked read's speed")


if __name__ == "__main__":
    main()
