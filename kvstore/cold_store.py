"""The cold tier: a small key-value interface with LMDB as its implementation.

Keys and values are bytes; what they mean (block payloads, manifests) is
decided by kvstore/tiers.py. Batched writes go in one transaction, so a
sequence's blocks and its manifest are on disk together or not at all.
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Iterator, Protocol

class ColdStore(Protocol):
    def put_many(self, items: Iterable[tuple[bytes, bytes]], sync: bool = ...) -> None: ...
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...
    def contains(self, key: bytes) -> bool: ...
    def delete_many(self, keys: Iterable[bytes]) -> None: ...
    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


class LMDBStore:
    """LMDB-backed ColdStore. A full map grows instead of failing."""

    def __init__(self, path: str, map_size: int = 1 << 30, sync: bool = False):
        import lmdb
        self._lmdb = lmdb
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.path = path
        # sync=False: commits reach the OS, not the disk; durable writes ask for
        # sync explicitly (put_many(sync=True) calls env.sync()).
        self.env = lmdb.open(path, map_size=map_size, subdir=True, sync=sync, metasync=sync,
                             max_dbs=0, lock=True, readahead=False)
        self._grow_lock = threading.Lock()

    def _write(self, fn) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except self._lmdb.MapFullError:
                with self._grow_lock:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def put_many(self, items: Iterable[tuple[bytes, bytes]], sync: bool = False) -> None:
        items = list(items)

        def fn(txn):
            for k, v in items:
                txn.put(k, v)
        self._write(fn)
        if sync:
            self.env.sync(True)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin(buffers=False) as txn:
            return [txn.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        with self.env.begin() as txn:
            return txn.get(key) is not None

    def delete_many(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)

        def fn(txn):
            for k in keys:
                txn.delete(k)
        self._write(fn)

    def write_batch(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], sync: bool = False) -> None:
        """Puts and deletes in one transaction."""
        def fn(txn):
            for k in deletes:
                txn.delete(k)
            for k, v in puts:
                txn.put(k, v)
        self._write(fn)
        if sync:
            self.env.sync(True)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        with self.env.begin() as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                yield bytes(k), bytes(v)

    def stats(self) -> dict:
        st = self.env.stat()
        info = self.env.info()
        return dict(entries=st["entries"], map_size=info["map_size"],
                    pages=st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"],
                    bytes=(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"])

    def close(self) -> None:
        self.env.close()
