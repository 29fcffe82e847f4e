"""The LMDB store's data file on the filesystem: what it allocates ahead of a
write transaction, the writeback it starts, and how a full disk still takes
the writes the file's own pages can hold.

LMDB writes through its writable map (lmdb_store.py), and a writable map fills
holes of a sparse file on first write: a full disk would then kill the process
(SIGBUS) instead of failing a write. So before each write transaction the file
is allocated (posix_fallocate) past its last page by at least what the
transaction can add (its bytes, a page per entry for rounding, and the B-tree
pages it copies), in steps of ALLOC_STEP, so a disk that cannot take a batch
fails that write (fs_errors), nothing else. The file holds what the store holds
plus at most a step, not the whole map (a map doubles as it fills; allocating
all of it would take up to twice the data).

A disk that cannot give that much may still hold the transaction in pages the
file already has: the ones LMDB freed when entries were deleted, and the slack
of the last step. Then the transaction runs with the map cut to the allocated
extent, so LMDB fails it (map full) rather than write a page the disk has not
given. LMDB reuses a page a commit freed only after one more commit (the
previous snapshot stays whole), so a transaction that does not fit is tried
again after one small commit: a disk tier that filled up takes new sequences
again once others are freed from it, without waiting for other writes.

A durable batch starts the disk writing every WRITEBACK_STEP bytes it puts
(sync_file_range(SYNC_FILE_RANGE_WRITE) where libc has it: a hint that waits
for nothing), so its sync waits for the tail and for the pages the commit
dirtied again (docs/scale.md).
"""
from __future__ import annotations

import ctypes
import os

from . import fs_errors

ALLOC_STEP = 16 << 20       # bytes the file grows by at a time
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


class DataFile:
    """The allocated extent of an open environment's data file (its caller
    holds the store's lock: no other transaction of the process is open)."""

    def __init__(self, env, path: str, map_full: type[Exception]):
        self.env, self.map_full = env, map_full
        self.fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR)
        self.allocated = 0
        self.reserve(0)

    def close(self) -> None:
        os.close(self.fd)

    def reserve(self, nbytes: int) -> None:
        """Allocate the file past its last page by what a transaction of `nbytes` can add,
        rounded up to ALLOC_STEP (not on a disk short of the step), within the map. OSError
        if the disk cannot give it."""
        info, st = self.env.info(), self.env.stat()
        exact = min((info["last_pgno"] + 1) * st["psize"] + nbytes, info["map_size"])
        if exact <= self.allocated:
            return
        step = min(-(-exact // ALLOC_STEP) * ALLOC_STEP, info["map_size"])
        try:
            os.posix_fallocate(self.fd, 0, step)
        except OSError as e:        # a disk short of a whole step may still take this transaction
            if e.errno not in fs_errors.FULL or step == exact:
                raise
            os.posix_fallocate(self.fd, 0, exact)
            step = exact
        self.allocated = step

    def write(self, fn, nbytes: int, touch) -> None:
        """fn(txn) in a write transaction that adds at most nbytes to the file; a full
        map doubles and fn runs again. A disk that cannot give nbytes: fn within the
        allocated extent (module docstring), touch(txn) being the small commit that lets
        LMDB reuse the pages the last one freed; the disk's OSError if it does not fit."""
        while True:
            try:
                self.reserve(nbytes)
            except OSError as e:
                if e.errno in fs_errors.FULL and self._within_extent(fn, touch):
                    return
                raise
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except self.map_full:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _within_extent(self, fn, touch) -> bool:
        size, psize = self.env.info()["map_size"], self.env.stat()["psize"]
        # With a writable map LMDB truncates the file to the map's size: cut to whole pages
        # of the extent, past the last page in use (LMDB never cuts below it).
        self.allocated = self.allocated // psize * psize
        self.env.set_mapsize(self.allocated)
        try:
            return self._commit(fn) or (self._commit(touch) and self._commit(fn))
        finally:
            self.env.set_mapsize(size)       # the file is sparse past the extent again

    def _commit(self, fn) -> bool:
        """fn(txn) committed; False (nothing written) if the map cannot hold it."""
        try:
            with self.env.begin(write=True) as txn:
                fn(txn)
            return True
        except self.map_full:
            return False
