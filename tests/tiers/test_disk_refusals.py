"""A filesystem that refuses the disk tier's writes (full, read-only, removed) gives a
status naming the store (RESOURCE_EXHAUSTED for a full disk, UNAVAILABLE otherwise), moves
nothing, leaks no block, and keeps the daemon's other duties going: spills of cached
blocks are skipped and counted, a lapsed session is still reaped, and the stop still
offloads every other cache's persist sequences. The refusal is the store's data file
(lmdb_file.DataFile) failing a write, as it does on a real full disk whose file has no
room left inside."""
import errno

import pytest
import torch

from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.tiers.lmdb_file import DataFile
from kvstore.tiers.lmdb_store import LMDBStore
from tests.tiers.test_tier_books import T, engine, kv_of, put, read, reopen, same, toks


def refuse(monkeypatch, code: int) -> None:
    """Every write the store's file would take: what its pages hold on a full disk too."""
    def full(self, fn, nbytes, touch):
        raise OSError(code, {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system"}[code])
    monkeypatch.setattr(DataFile, "write", full)


@pytest.mark.parametrize("code, error", [(errno.ENOSPC, ResourceExhausted), (errno.EROFS, Unavailable)])
def test_an_offload_the_filesystem_refuses_names_the_store_and_moves_nothing(tmp_path, monkeypatch, code, error):
    e = engine(tmp_path, codec="fp16")
    put(e, "s", toks(0, 40))
    want, before = read(e, "s"), e.stats()["c"]
    refuse(monkeypatch, code)
    with pytest.raises(error, match=r"^lmdb: the disk tier.*/lmdb: .*(space|Read-only).*: nothing was written") as info:
        e.offload("c", T, ["s"])
    assert info.value.field == "lmdb"
    assert e.sequence_info("c", T, "s").tier == "gpu" and same(read(e, "s"), want)
    assert e.stats()["c"]["main"] == before["main"]
    e.check_invariants()
    monkeypatch.undo()                                 # room again: the same call goes through
    e.offload("c", T, ["s"])
    assert e.sequence_info("c", T, "s").tier == "disk" and same(read(e, "s"), want)


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_a_spill_the_disk_refuses_is_skipped_and_leaks_no_block(tmp_path, monkeypatch, codec):
    """Freed prompts stay cached in the GPU pool; reusing their blocks spills them to disk
    first. A full disk skips those copies (counted): the write that needed the blocks goes
    through, and the pool holds exactly what the sequences hold."""
    e = engine(tmp_path, codec=codec, num_blocks=16, residual=8, max_sequences=8)
    for i in range(3):
        put(e, f"p{i}", toks(1000 * (i + 1), 40))
        e.free("c", T, [f"p{i}"])
    assert e.stats()["c"]["main"].cached > 0
    refuse(monkeypatch, errno.ENOSPC)
    for i in range(3):
        put(e, f"n{i}", toks(100_000 * (i + 1), 40))    # takes the cached blocks
    s = e.stats()["c"]
    assert s["main"].evictions > 0 and s["tiers"]["disk"]["skipped_spills"] > 0
    e.check_invariants()
    e.free("c", T, ["n0", "n1", "n2"])
    assert e.stats()["c"]["main"].used == 0
    e.check_invariants()


def test_the_stop_offloads_every_cache_when_one_cannot_keep_its_prefix_blocks(tmp_path, monkeypatch, caplog):
    """One cache's cached prefix blocks fail to go to disk at the stop: the next cache's
    persist sequence is still offloaded, and the store is closed cleanly."""
    import logging
    caplog.set_level(logging.WARNING)
    e = engine(tmp_path, codec="fp16")
    cfg = e.cache("c").cfg
    d = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "name": "d"})
    e.create_cache(d)
    put(e, "cached", toks(0, 40))
    e.free("c", T, ["cached"])
    e.allocate("d", T, "chat", toks(5000, 24), owner="session", persist=True)
    k, v = kv_of(toks(5000, 24))
    e.append("d", T, ["chat"], k, v, [24], token_ids=[toks(5000, 24)])
    want = e.retrieve("d", T, "chat", 0, 24)

    def fails(self, deadline):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(type(e.cache("c").tiering), "keep_on_disk", fails)
    e.close()
    assert any("not written to the disk tier at the stop" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    e = reopen(e, tmp_path, codec="fp16")
    e.create_cache(d)
    assert [(i.seq_id, i.tier) for i in e.list_sequences("d", T)] == [("chat", "disk")]
    got = e.retrieve("d", T, "chat", 0, 24)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_evict_hook_that_fails_gives_the_blocks_back():
    from kvstore.core.block_pool import BlockPool
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        pool.set_hash(b, bytes([i]) * 32)
    pool.release(ids)                                   # all four cached
    assert pool.num_allocatable() == 4

    def fails(evicted):
        raise OSError(errno.ENOSPC, "No space left on device")
    pool.on_evict = fails
    with pytest.raises(OSError):
        pool.allocate(2)
    assert pool.num_allocatable() == 4 and all(b.ref_cnt == 0 for b in pool.blocks)
    pool.check_invariants({})


def test_a_disk_short_of_a_whole_allocation_step_still_takes_what_fits(tmp_path, monkeypatch):
    """The store grows its file in 16 MiB steps; a disk with less than a step free still
    opens it and takes the writes that fit, and refuses the one that does not, whole."""
    import os
    real = os.posix_fallocate

    def short(fd, offset, length):                     # 4 MiB of room on this disk
        if length > 4 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", short)
    store = LMDBStore(str(tmp_path / "db"))
    store.put_many([(b"k%d" % i, b"x" * 1000) for i in range(100)])
    used = store.used_bytes
    with pytest.raises(ResourceExhausted, match="^lmdb: the disk tier's filesystem is full"):
        store.put_many([(b"big", b"y" * (8 << 20))])
    assert store.get_many([b"k7", b"big"]) == [b"x" * 1000, None] and store.used_bytes == used
    store.close()


def test_a_full_disk_takes_writes_into_the_pages_deleted_entries_freed(tmp_path, monkeypatch):
    """Once the disk is full, deleting entries makes room inside the file: the next
    write goes into the pages LMDB freed (the file does not grow), deletes themselves
    go through, and a write bigger than what was freed is still refused whole."""
    import os
    real, room = os.posix_fallocate, [64 << 20]

    def disk(fd, offset, length):                      # a disk of `room` bytes for this file
        if length > room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)
    monkeypatch.setattr(os, "posix_fallocate", disk)
    store = LMDBStore(str(tmp_path / "db"))
    value = b"x" * (256 << 10)
    n = 0
    with pytest.raises(ResourceExhausted, match="^lmdb: the disk tier's filesystem is full"):
        while True:                                    # fill the disk
            store.put_many([(b"k%d" % n, value)])
            n += 1
    blocks = os.stat(tmp_path / "db" / "data.mdb").st_blocks
    assert n > 100 and store.used_bytes == sum(len(b"k%d" % i) + len(value) for i in range(n))
    room[0] = 0                                        # and nothing more for it
    with pytest.raises(ResourceExhausted):
        store.put_many([(b"new0", value)])
    store.delete_many([b"k%d" % i for i in range(8)])  # a delete on the full disk
    assert store.get_many([b"k0", b"k8"]) == [None, value]
    store.put_many([(b"new%d" % i, value) for i in range(6)], sync=True)     # into the freed pages
    assert store.get_many([b"new0", b"new5", b"k9"]) == [value, value, value]
    with pytest.raises(ResourceExhausted):            # more than was freed: nothing of it written
        store.put_many([(b"more%d" % i, value) for i in range(8)])
    assert store.get_many([b"more0", b"more7"]) == [None, None]
    assert os.stat(tmp_path / "db" / "data.mdb").st_blocks <= blocks
    store.close()
    room[0] = 1 << 40
    again = LMDBStore(str(tmp_path / "db"))          # every committed write is there after a reopen
    assert again.get_many([b"new5", b"k%d" % (n - 1), b"k3", b"more0"]) == [value, value, None, None]
    again.close()


def test_the_default_disk_budget_counts_what_the_store_takes_not_its_sparse_size(tmp_path):
    import shutil
    from kvstore.service.cli import disk_budget
    d = tmp_path / "lmdb"
    d.mkdir()
    with open(d / "data.mdb", "wb") as f:               # a sparse map of 64 GiB, a few bytes written
        f.truncate(64 << 30)
        f.write(b"x")
    assert disk_budget(str(d), None) <= shutil.disk_usage(d).free * 0.9 + (1 << 20)
    assert disk_budget(str(d), 123) == 123


def test_a_full_filesystem_takes_the_write_once_unreferenced_blocks_go(tmp_path, monkeypatch):
    """No bound (--lmdb-max-bytes 0) and a full filesystem: the prefix blocks no sequence
    references (a freed disk sequence's) are the tier's to drop, and the pages they free
    take the next Offload, rather than every Offload being refused until a restart."""
    from kvstore.tiers import fs_errors
    e = engine(tmp_path, codec="fp16")
    disk = e.disk
    for i, sid in enumerate(("old", "new")):     # their hashed blocks stay, unreferenced, the old ones first
        put(e, sid, toks(1000 * i, 80))
        e.offload("c", T, [sid])
        e.free("c", T, [sid])
        if i == 0:
            old = list(disk.lru)
    unreferenced = len(disk.lru)
    assert unreferenced > len(old) > 0
    real, freed = LMDBStore.write_batch, []

    def write_batch(self, puts, deletes, sync=False):     # full until blocks are deleted
        if puts and not freed:
            with fs_errors.refused(self.path):
                raise OSError(errno.ENOSPC, "No space left on device")
        real(self, puts, deletes, sync=sync)
        freed.extend(deletes)
    monkeypatch.setattr(LMDBStore, "write_batch", write_batch)
    put(e, "t", toks(5000, 40))
    want = read(e, "t")
    e.offload("c", T, ["t"])
    assert e.sequence_info("c", T, "t").tier == "disk" and same(read(e, "t"), want)
    # the oldest go, as many as the write needs: not the whole prefix cache
    assert 0 < disk.counters["evictions"] == len(freed) < unreferenced
    assert freed == old[:len(freed)] and not set(freed) & set(disk.lru)
    e.check_invariants()
