"""The cold tier: a small key-value interface with LMDB as its implementation.

Keys and values are bytes; what they mean (block payloads, manifests) is
decided by kvstore/tiers/disk.py, and so is what goes when the store is over its
byte bound (the store only keeps the books). Batched writes go in one
transaction, so a sequence's blocks and its manifest are on disk together or
not at all.

Writes go through LMDB's writable map (writemap): a value is copied once,
into the file's pages, where without it LMDB copies it into a page it
allocated and then write()s that page at the commit. A durable batch
(sync=True) flushes the map before its commit and again after it, so the
pages a commit points at are on disk before the pointer is: a crash at any
point leaves the previous commit or this one, never half of it.

What a synced spill costs beyond the disk's own write + fdatasync
(docs/scale.md, bench/bench_lmdb_spill.py): the first write to each page of
the map is a page fault that brings the page into the page cache, and the
sync waited for the whole batch after the last value was put. So the map is
opened with readahead (without it LMDB advises MADV_RANDOM and each fault
brings in its one page: the puts took 3-4x longer), and a durable batch
starts the disk writing every WRITEBACK_STEP bytes it puts
(sync_file_range(SYNC_FILE_RANGE_WRITE) where libc has it: a hint that waits
for nothing), so
the sync before the commit waits for the tail only. The syncs that make the
batch durable are unchanged.

A writable map fills holes of a sparse file on first write, and a full disk
would then kill the process (SIGBUS) instead of failing a write: before each
write transaction the file is allocated (posix_fallocate) past its last page
by at least what the transaction can add (its bytes, a page per entry for
rounding, and the B-tree pages it copies), in steps of ALLOC_STEP, so a disk
that cannot take a batch fails that write (OSError), nothing else. The file
holds what the store holds plus at most a step, not the whole map (a map
doubles as it fills; allocating all of it would take up to twice the data).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterable, Iterator, Protocol

ALLOC_STEP = 16 << 20       # bytes the file grows by at a time (module docstring)
WRITEBACK_STEP = 16 << 20   # a durable batch starts the disk writing after every this many bytes put


def _sync_file_range():
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk, without waiting for them
    (a hint: the sync that makes them durable still follows)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class ColdStore(Protocol):
    def put_many(self, items: Iterable[tuple[bytes, bytes]], sync: bool = ...) -> None: ...
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...
    def contains(self, key: bytes) -> bool: ...
    def delete_many(self, keys: Iterable[bytes]) -> None: ...
    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


def entry_bytes(key: bytes, value) -> int:
    """What one entry counts against the bound: its key and value bytes (LMDB
    adds its page overhead on top: the file is somewhat larger)."""
    return len(key) + (value.nbytes if isinstance(value, memoryview) else len(value))


class LMDBStore:
    """LMDB-backed ColdStore. A full map grows instead of failing.

    The size of every entry is kept in memory (read at open, updated at each
    commit; this process is the store's only writer), so `used_bytes` is exact
    and `contains` needs no transaction. `max_bytes` (0: none) is the bound the
    owner of the key layout keeps (tiers.DiskTier).

    One store serves every cache, and caches run requests in parallel. LMDB
    serialises write transactions itself, and py-lmdb's read transactions may
    be used from any thread, but growing the map (set_mapsize) invalidates
    every open transaction of the process and fails while any write is open,
    and the books must follow each commit: every transaction here runs under
    self.lock, which the owner of the books (tiers.DiskTier) also holds over
    its own check-then-write sequences."""

    def __init__(self, path: str, map_size: int = 1 << 30, sync: bool = False, max_bytes: int = 0):
        import lmdb
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._lmdb = lmdb
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        # sync=False: commits reach the OS, not the disk; durable writes ask for
        # sync explicitly (put_many(sync=True) calls env.sync()).
        # readahead: without it LMDB advises MADV_RANDOM on the map, and every first
        # write to a page of the map faults that one page in alone (module docstring).
        self.env = lmdb.open(path, map_size=map_size, subdir=True, sync=sync, metasync=sync,
                             max_dbs=0, lock=True, readahead=True, writemap=True)
        self._fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR)
        self._allocated = 0
        self._reserve(0)
        self.lock = threading.RLock()
        self._sizes: dict[bytes, int] = {}
        with self.env.begin(buffers=True) as txn:   # values stay in the map: only their length is read
            for k, v in txn.cursor():
                self._sizes[bytes(k)] = entry_bytes(k, v)
        self.used_bytes = sum(self._sizes.values())
        self.books = None     # what the owner of the key layout keeps over these entries (tiers.DiskTier)

    def _reserve(self, nbytes: int) -> None:
        """Disk blocks from the start of the file to past its last page by what a
        transaction of `nbytes` can add, rounded up to ALLOC_STEP and within the
        map (module docstring: a full disk fails here, not with a SIGBUS in a
        write through the map)."""
        info, st = self.env.info(), self.env.stat()
        need = (info["last_pgno"] + 1) * st["psize"] + nbytes
        need = min(-(-need // ALLOC_STEP) * ALLOC_STEP, info["map_size"])
        if need <= self._allocated:
            return
        os.posix_fallocate(self._fd, 0, need)
        self._allocated = need

    def _write(self, fn, nbytes: int) -> None:
        """fn(txn) in a write transaction that adds at most nbytes to the file;
        a full map doubles and fn runs again."""
        with self.lock:
            while True:
                self._reserve(nbytes)
                try:
                    with self.env.begin(write=True) as txn:
                        fn(txn)
                    return
                except self._lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)

    @contextlib.contextmanager
    def reader(self, buffers: bool = False):
        """A read transaction, held under self.lock (see the class docstring)."""
        with self.lock, self.env.begin(buffers=buffers) as txn:
            yield txn

    def size(self, key: bytes) -> int | None:
        """Bytes the entry counts, None if absent."""
        return self._sizes.get(key)

    def growth(self, puts: list[tuple[bytes, bytes]], deletes: Iterable[bytes]) -> int:
        """Bytes write_batch(puts, deletes) would add to used_bytes (< 0: frees)."""
        return sum(n - self._sizes.get(k, 0) for k, n in _after(puts, deletes).items())

    def put_many(self, items: Iterable[tuple[bytes, bytes]], sync: bool = False) -> None:
        self.write_batch(list(items), [], sync)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self.reader() as txn:
            return [txn.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def delete_many(self, keys: Iterable[bytes]) -> None:
        self.write_batch([], list(keys))

    def write_batch(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], sync: bool = False) -> None:
        """Puts and deletes in one transaction (deletes first); with sync, on
        disk when this returns (the module docstring says in which order)."""
        def fn(txn):
            for k in deletes:
                txn.delete(k)
            unflushed = 0
            for k, v in puts:
                txn.put(k, v)
                unflushed += entry_bytes(k, v)
                if sync and unflushed >= WRITEBACK_STEP:     # the disk writes while the next values are put
                    start_writeback(self._fd)
                    unflushed = 0
            if sync:
                self.env.sync(True)      # this transaction's pages, before the commit's meta page points at them
        # What the transaction can add to the file: every byte, a page per entry
        # for rounding, and the leaf/branch pages each entry's path copies.
        psize, depth = (self.env.stat()[k] for k in ("psize", "depth"))
        n = len(puts) + len(deletes) + 1
        nbytes = sum(entry_bytes(k, v) for k, v in puts) + n * (depth + 2) * psize
        with self.lock:
            self._write(fn, nbytes)
            for k, n in _after(puts, deletes).items():     # committed: the books follow
                self.used_bytes += n - self._sizes.get(k, 0)
                if n:
                    self._sizes[k] = n
                else:
                    self._sizes.pop(k, None)
        if sync:
            self.env.sync(True)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        out = []          # read whole: a generator would hold the lock between its items
        with self.reader() as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    out.append((bytes(k), bytes(v)))
        return iter(out)

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        """Keys under prefix, from the books (no transaction)."""
        with self.lock:
            return [k for k in self._sizes if k.startswith(prefix)]

    def stats(self) -> dict:
        with self.lock:
            st = self.env.stat()
            info = self.env.info()
        return dict(entries=st["entries"], map_size=info["map_size"],
                    pages=st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"],
                    bytes=(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"],
                    used_bytes=self.used_bytes, max_bytes=self.max_bytes)

    def close(self) -> None:
        self.env.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _after(puts: list[tuple[bytes, bytes]], deletes: Iterable[bytes]) -> dict[bytes, int]:
    """key -> bytes it counts after a batch (0: deleted)."""
    out = {k: 0 for k in deletes}
    for k, v in puts:
        out[k] = entry_bytes(k, v)
    return out
