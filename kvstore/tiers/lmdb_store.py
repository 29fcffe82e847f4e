"""The cold tier: a small key-value interface with LMDB as its implementation.

Keys and values are bytes; what they mean (block payloads, manifests) is
decided by kvstore/tiers/disk.py, and so is what goes when the store is over its
byte bound (the store only keeps the books). Batched writes go in one
transaction, so a sequence's blocks and its manifest are on disk together or
not at all.

Writes go through LMDB's writable map (writemap): a value is copied once,
into the file's pages, where without it LMDB copies it into a page it
allocated and then write()s that page at the commit. A durable batch
(sync=True) is a commit like any other, made under the marker of commits not
yet on disk (lmdb_recovery.py), then one sync of the map, which removes the
marker: a system crash before that sync ends is recovered as after any
unsynced commit. A sync before the commit too would write most of the batch
twice: LMDB's commit clears a flag in the first page of each page run it
wrote, and the kernel keeps file pages dirty by the folio (up to megabytes),
so the commit makes ~80 % of the synced batch dirty again (docs/scale.md).

What a synced spill costs beyond the disk's own write + fdatasync
(docs/scale.md, bench/bench_lmdb_spill.py): the first write to each page of
the map is a page fault that brings the page into the page cache, and a sync
after the last value was put waits for the whole batch. So the map is opened
with readahead (without it LMDB advises MADV_RANDOM and each fault brings in
its one page: the puts took 3-4x longer), and a durable batch starts the
disk's writeback as it goes (lmdb_file.py).

A writable map would turn a full disk into a SIGBUS: lmdb_file.py allocates
the file ahead of each write transaction, and lets a full disk take what the
file's own pages can hold.

Every value's length and checksum (checksum.py: XXH3-64) go into a second
database (SUMS_DB) in the transaction that puts the value, computed on the
copy threads while the values are put. Every read checks them: a value that
does not match (a page torn by a system crash, bytes changed behind LMDB's
back) is refused, counted (refused_values) and logged, and reads as absent;
never served. A commit without sync is in the page cache only and LMDB with
a writable map gives no guarantee for it across a system crash: what the
store does about that at open is lmdb_recovery.py's.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from typing import Iterable, Iterator

from kvstore.errors import Unavailable

from . import fs_errors
from . import lmdb_recovery as recovery
from . import lmdb_sums
from .checksum import checksum
from .lmdb_file import WRITEBACK_STEP, DataFile, start_writeback

log = logging.getLogger("kvstore.lmdb")

SUMS_DB = b"kvstore.checksums"   # the database of checksums: a reserved key of the main database
_SUM = lmdb_sums.SUM              # a value's length and checksum, as SUMS_DB holds them
_MARKED = {"damaged": "LMDB found the file damaged while the daemon ran"}      # why a marker other than a boot id


def entry_bytes(key: bytes, value) -> int:
    """What one entry counts against the bound: its key and value bytes (LMDB
    adds its page overhead on top: the file is somewhat larger)."""
    return len(key) + lmdb_sums.value_bytes(value)


class StoreInUse(OSError):
    """The store's directory is held by another LMDBStore (another daemon)."""


class LMDBStore:
    """The cold store (put_many, get_many, contains, delete_many, scan) on LMDB; a full map grows.

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
        self._hold(path)
        try:
            self.max_bytes = max_bytes
            self.durable_commits = sync
            self.lock = threading.RLock()
            self.counters = dict(refused_values=0, verified_opens=0, dropped_entries=0, moved_aside=0)
            self._map_size = map_size
            self._file: DataFile | None = None
            self._suspect, self._lost, self.dropped_keys = False, False, []   # _suspect: damaged: verify next open
            short = recovery.truncated(path)         # before the open allocates the file to its map
            self._open()
            if self.counters["moved_aside"]:        # a fresh file: nothing of the old one to verify
                short = None
            try:
                self._legacy = self._check_format()
            except (lmdb.CorruptedError, lmdb.PageNotFoundError):     # its record unreadable: verified below
                self._legacy = False
            was = recovery.marker(path)
            self._marked = was is not None
            # non-durable commits so far: a sync clears the marker only if none came since it began
            self._nondurable = 0
            if was and was == recovery.boot_id() and not short:
                # The process died, the kernel did not: the page cache holds the last commit.
                log.warning("LMDB store %s: not closed cleanly (the process ended; the system did not restart): "
                            "its last commit is intact in the page cache; synced", path)
                self.sync()
            elif was is not None or short:
                self._verify_into_fresh_file(short and f"{short}, whatever its last stop" or _MARKED.get(was))
            try:
                self._adopt_format()
                self._read_books()
            except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:     # a broken tree, whatever the marker said
                log.warning("LMDB store %s: %s while reading it: verifying every entry", path, e)
                self._verify_into_fresh_file(f"its tree is damaged ({type(e).__name__})")
                self._read_books()
        except BaseException:
            self._release()
            raise
        self.books = None     # what the owner of the key layout keeps over these entries (tiers.DiskTier)

    # ------------------------------------------------------------ opening
    def _hold(self, path: str) -> None:
        """One store object a directory, across processes: a second daemon on the same
        --lmdb would take the first's marker for a crash (recovering the file under it)
        and keep books of its own over the same entries."""
        fd = os.open(os.path.join(path, "kvstore.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreInUse(f"LMDB store {path} is in use by another process (one daemon a store)") from None
        self._lock_fd = fd

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)         # the lock goes with the descriptor
            self._lock_fd = -1

    def _open(self) -> None:
        """Open the environment; a file LMDB refuses to open is renamed aside
        and the store starts empty (lmdb_recovery)."""
        lmdb = self._lmdb
        # sync=False: commits reach the OS, not the disk; put_many(sync=True) calls env.sync().
        # readahead: without it LMDB advises MADV_RANDOM on the map, and every first
        # write to a page of the map faults that one page in alone (module docstring).
        kw = dict(map_size=self._map_size, subdir=True, sync=self.durable_commits, metasync=self.durable_commits,
                  max_dbs=2, lock=True, readahead=True, writemap=True)
        size = recovery.data_size(self.path)      # the open extends the file to the map
        try:
            self.env = lmdb.open(self.path, **kw)
            try:
                self.sums = self.env.open_db(SUMS_DB)       # reads the main tree's root: it may be cut off
            except lmdb.Error:
                self.env.close()
                raise
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError) as e:
            recovery.refused_at_open(self.path, e, size)
            self.counters["moved_aside"] += 1
            self.env = lmdb.open(self.path, **kw)
            self.sums = self.env.open_db(SUMS_DB)
        self._file = DataFile(self.env, self.path, lmdb.MapFullError)

    def _close_env(self) -> None:
        self.env.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _verify_into_fresh_file(self, why: str | None = None) -> None:
        """Not trusted (lmdb_recovery): the entries that pass their checksums go
        into a fresh file that replaces this one; the rest are dropped, loudly."""
        self.counters["verified_opens"] += 1
        map_size = self.env.info()["map_size"]
        kept, dropped, stopped, behind = recovery.copy_verified(
            self.env, self.sums, SUMS_DB, self.path, map_size, lambda k, v, s: lmdb_sums.passes(v, s, self._legacy))
        self._close_env()
        recovery.install_copy(self.path, kept, dropped, stopped, why)
        self.counters["dropped_entries"] += len(dropped) + behind
        self.dropped_keys = dropped       # the owner of the key layout names what they held
        self._map_size = map_size
        self._open()
        self.sync()      # the fresh file is on disk: the marker goes

    def _check_format(self) -> bool:
        """Whether the store predates the format record (lmdb_sums.py); one whose
        record names a format this version does not know is moved aside, untouched."""
        with self.env.begin() as txn:
            fmt = lmdb_sums.format_of(txn, self.sums)
        if fmt in (None, lmdb_sums.FORMAT):
            return fmt is None
        self._close_env()
        aside = recovery.move_aside(self.path, "format")
        self.counters["moved_aside"] += 1
        log.error("LMDB store %s: its checksums are of format %r, which this kvstore does not read (it reads %r: "
                  "a newer kvstore wrote it?); the file was moved to %s, untouched, and the store starts empty",
                  self.path, fmt[:64], lmdb_sums.FORMAT, aside)
        self._open()
        return False

    def _adopt_format(self) -> None:
        """A store without the format record: its checksum records brought up
        to date (lmdb_sums.updates), then the record; a new store gets the record."""
        with self.env.begin(buffers=True) as txn:
            if lmdb_sums.format_of(txn, self.sums) == lmdb_sums.FORMAT:
                return
            todo, seen = lmdb_sums.updates(txn, self.sums, SUMS_DB)
        psize = self.env.stat()["psize"]
        self._write(lambda txn: [txn.put(k, r, db=self.sums) for k, r in todo],
                    sum(len(k) + psize for k, _ in todo) + 4 * psize)
        self.sync()
        self._legacy = False
        if any(seen.values()):
            log.warning("LMDB store %s: written by an older kvstore: %d values without checksums were summed as "
                        "they are, %d checked by the weighted sum they were written with were summed again; %d "
                        "match no checksum and are refused when read", self.path, seen["unsummed"],
                        seen["weighted"], seen["failed"])

    def _read_books(self) -> None:
        self._sizes: dict[bytes, int] = {}
        with self.env.begin(buffers=True) as txn:   # values stay in the map: only their length is read
            for k, v in txn.cursor():
                if bytes(k) != SUMS_DB:
                    self._sizes[bytes(k)] = entry_bytes(k, v)
            for _ in txn.cursor(db=self.sums).iternext(values=False):     # its tree read whole too
                pass
        self.used_bytes = sum(self._sizes.values())

    def _write(self, fn, nbytes: int) -> None:
        """fn(txn) in a write transaction that adds at most nbytes to the file
        (lmdb_file.DataFile.write)."""
        with self.lock:
            self._file.write(fn, nbytes, self._touch)

    def _touch(self, txn) -> None:
        """The smallest commit: the format record put again."""
        txn.put(lmdb_sums.FORMAT_KEY, lmdb_sums.FORMAT, db=self.sums)

    # ------------------------------------------------------------ reading
    @contextlib.contextmanager
    def reader(self, buffers: bool = False):
        """A read transaction, held under self.lock (see the class docstring)."""
        with self.lock, self.env.begin(buffers=buffers) as txn:
            yield txn

    def stored(self, txn, key: bytes) -> tuple[memoryview | bytes | None, int]:
        """(value, its stored checksum) in txn, unchecked: the caller checks
        the bytes it copies out with checksum() and reports a mismatch with
        refuse(). (None, 0) if absent, or if its length is not the one stored."""
        try:
            v, r = txn.get(key), txn.get(key, db=self.sums)
        except (self._lmdb.CorruptedError, self._lmdb.PageNotFoundError) as e:   # damaged since the open
            self._damaged(e)            # logs it; txn is over: get_many goes on in another
            self.counters["refused_values"] += 1
            self._lost = True
            return None, 0
        except self._lmdb.BadTxnError:      # one its caller read on in after a damaged page (refused there)
            return None, 0
        if v is None:
            return None, 0
        n, s = _SUM.unpack(r) if r is not None and len(r) == _SUM.size else (-1, 0)
        if n != len(v):
            self.refuse(key, "its length is not the one stored with it" if r is not None else "it has no checksum")
            return None, 0
        return v, s

    def refuse(self, key: bytes, why: str = "its checksum does not match") -> None:
        """A value read from the store is not what was written: counted and
        logged; the caller treats it as absent."""
        self.counters["refused_values"] += 1
        log.warning("LMDB store %s: value of key %s refused: %s (served as a miss)", self.path, key[:48].hex(), why)

    def _checked(self, txn, key: bytes):
        v, s = self.stored(txn, key)
        if v is not None and checksum(v) != s:
            self.refuse(key)
            return None
        return v

    def size(self, key: bytes) -> int | None:
        """Bytes the entry counts, None if absent."""
        return self._sizes.get(key)

    def growth(self, puts: list[tuple[bytes, bytes]], deletes: Iterable[bytes]) -> int:
        """Bytes write_batch(puts, deletes) would add to used_bytes (< 0: frees)."""
        return sum(n - self._sizes.get(k, 0) for k, n in _after(puts, deletes).items())

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Values, checked; None for one absent or refused (after a damaged page, read on in a fresh transaction)."""
        out: list[bytes | None] = []
        while len(out) < len(keys):
            with self.reader() as txn:
                self._lost = False
                for k in keys[len(out):]:
                    out.append(self._checked(txn, k))
                    if self._lost:
                        break
        return out

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) under prefix in key order, checked: a refused value is left out.
        The keys come from the books, so that a damaged page costs its entries only."""
        keys = sorted(self.keys(prefix))
        return iter([(k, v) for k, v in zip(keys, self.get_many(keys)) if v is not None])

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        """Keys under prefix, from the books (no transaction)."""
        with self.lock:
            return [k for k in self._sizes if k.startswith(prefix)]

    # ------------------------------------------------------------ writing
    def put_many(self, items: Iterable[tuple[bytes, bytes]], sync: bool = False) -> None:
        self.write_batch(list(items), [], sync)

    def delete_many(self, keys: Iterable[bytes]) -> None:
        self.write_batch([], list(keys))

    def write_batch(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], sync: bool = False) -> None:
        """Puts and deletes in one transaction (deletes first); with sync, on
        disk when this returns (the module docstring says in which order)."""
        sums = lmdb_sums.start(puts)       # on the copy threads, while the values are put

        def fn(txn):
            for k in deletes:
                txn.delete(k)
                txn.delete(k, db=self.sums)
            unflushed = 0
            for k, v in puts:
                txn.put(k, v)
                unflushed += entry_bytes(k, v)
                if sync and unflushed >= WRITEBACK_STEP:     # the disk writes while the next values are put
                    start_writeback(self._file.fd)
                    unflushed = 0
            for (k, v), s in zip(puts, sums()):
                txn.put(k, _SUM.pack(entry_bytes(b"", v), s), db=self.sums)
        # What the transaction can add to the file: every byte, a page per entry
        # for rounding, and the leaf/branch pages each entry's path copies (in both databases).
        psize, depth = (self.env.stat()[k] for k in ("psize", "depth"))
        n = len(puts) + len(deletes) + 1
        nbytes = sum(entry_bytes(k, v) for k, v in puts) + 2 * n * (depth + 2) * psize
        with self.lock:
            with fs_errors.refused(self.path):
                # sync: durable at the sync below, which clears the marker (module docstring)
                if not self.durable_commits and not self._marked:
                    recovery.mark(self.path)      # on disk before any page of this commit can be
                    self._marked = True
                try:
                    self._write(fn, nbytes)
                except (self._lmdb.CorruptedError, self._lmdb.PageNotFoundError) as e:    # aborted: none written
                    self._damaged(e)
                    raise Unavailable("lmdb", f"the disk tier's file {self.path} is damaged ({type(e).__name__}: "
                                      f"{e}): nothing was written; it is verified when the daemon restarts") from e
            if not self.durable_commits:
                self._nondurable += 1
            for k, n in _after(puts, deletes).items():     # committed: the books follow
                self.used_bytes += n - self._sizes.get(k, 0)
                if n:
                    self._sizes[k] = n
                else:
                    self._sizes.pop(k, None)
        if sync:
            self.sync()

    def sync(self) -> None:
        """Everything committed so far on disk; then no non-durable commit is
        in flight, and the marker goes (unless one came in the meantime)."""
        with self.lock:
            seen = self._nondurable
        self.env.sync(True)
        with self.lock:
            if self._marked and self._nondurable == seen and not self._suspect:
                recovery.clear(self.path)
                self._marked = False

    def _damaged(self, e: Exception) -> None:
        with self.lock:
            if not self._suspect:
                recovery.damaged(self.path, e)
                self._marked = self._suspect = True

    def stats(self) -> dict:
        with self.lock:
            st = self.env.stat()
            info = self.env.info()
        pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return dict(entries=len(self._sizes), map_size=info["map_size"], pages=pages, bytes=pages * st["psize"],
                    used_bytes=self.used_bytes, max_bytes=self.max_bytes, **self.counters)

    def close(self) -> None:
        """A clean close: synced, the marker gone."""
        self.sync()
        self._close_env()
        self._release()


def _after(puts: list[tuple[bytes, bytes]], deletes: Iterable[bytes]) -> dict[bytes, int]:
    """key -> bytes it counts after a batch (0: deleted)."""
    out = {k: 0 for k in deletes}
    for k, v in puts:
        out[k] = entry_bytes(k, v)
    return out
