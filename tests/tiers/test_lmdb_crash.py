"""The LMDB store after what its pages can go through outside a clean close
(kvstore/tiers/lmdb_recovery.py): a process killed after a non-durable spill,
the same followed by a system crash (pages torn on disk), bytes changed behind
LMDB's back, meta pages LMDB refuses. No wrong bytes are ever served; every
event is counted and logged; what is intact is still served."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.tiers import lmdb_recovery
from kvstore.tiers.lmdb_store import LMDBStore
from tests.helpers import ROOT

SIZE = 300_000      # past LMDB's page size: overflow pages, as block payloads are


def value(tag: str, i: int, size: int = SIZE) -> bytes:
    """Bytes no other value shares (so a test finds them in data.mdb)."""
    seed = int.from_bytes(tag.encode(), "little") * 1000 + i
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


DURABLE = [(b"d/%d" % i, value("durable", i)) for i in range(4)]
SPILLED = [(b"n/%d" % i, value("spilled", i)) for i in range(4)]

# A daemon's store: a durable batch (Offload), a non-durable one (a pressure
# spill), then the process is killed before any clean close.
CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from kvstore.tiers.lmdb_store import LMDBStore
from tests.tiers.test_lmdb_crash import DURABLE, SPILLED
s = LMDBStore(sys.argv[1])
s.put_many(DURABLE, sync=True)
s.put_many(SPILLED)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_after_a_spill(path: str) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, path, ROOT], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -9, r.stderr


def garble(path: str, v: bytes) -> None:
    """Change bytes in the middle of every copy of v in data.mdb, behind LMDB's back."""
    data_path = os.path.join(path, "data.mdb")
    with open(data_path, "rb") as f:
        data = f.read()
    at = data.find(v)
    assert at >= 0, "the value is not in the file"
    with open(data_path, "r+b") as f:
        while at >= 0:
            f.seek(at + len(v) // 2)
            f.write(bytes(b ^ 0xFF for b in v[len(v) // 2:len(v) // 2 + 64]))
            at = data.find(v, at + 1)


def asides(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("data.mdb."))


def test_the_marker_is_up_exactly_while_non_durable_commits_are_unsynced(tmp_path):
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    assert lmdb_recovery.marker(path) is None
    s.put_many(DURABLE, sync=True)
    assert lmdb_recovery.marker(path) is None, "a durable batch needs no marker"
    s.put_many(SPILLED[:1])
    assert lmdb_recovery.marker(path) == lmdb_recovery.boot_id()
    s.delete_many([b"n/0"])
    assert lmdb_recovery.marker(path) is not None
    s.put_many(SPILLED[1:2], sync=True)      # syncs the whole map: the earlier commits too
    assert lmdb_recovery.marker(path) is None
    s.put_many(SPILLED[2:])
    s.close()
    assert lmdb_recovery.marker(path) is None, "a clean close leaves no marker"
    s = LMDBStore(path)
    assert s.counters["verified_opens"] == 0
    assert s.get_many([k for k, _ in DURABLE + SPILLED]) == [v for _, v in DURABLE] + [None] + \
        [v for _, v in SPILLED[1:]]
    s.close()
    durable = LMDBStore(str(tmp_path / "synced"), sync=True)     # --lmdb-sync: every commit is durable
    durable.put_many(SPILLED)
    assert lmdb_recovery.marker(durable.path) is None
    durable.close()


def test_a_process_killed_after_a_non_durable_spill_reopens_whole(tmp_path, caplog):
    """The kernel kept its page cache: every commit is served, nothing is
    verified or dropped, and the store is synced so the marker goes."""
    path = str(tmp_path / "lmdb")
    killed_after_a_spill(path)
    assert lmdb_recovery.marker(path) == lmdb_recovery.boot_id(), "no marker left by the non-durable spill"
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.get_many([k for k, _ in DURABLE + SPILLED]) == [v for _, v in DURABLE + SPILLED]
    assert (s.counters["verified_opens"], s.counters["dropped_entries"]) == (0, 0)
    assert lmdb_recovery.marker(path) is None
    assert "not closed cleanly" in caplog.text and path in caplog.text
    s.close()


@pytest.mark.parametrize("torn", [False, True])
def test_a_system_crash_after_a_non_durable_spill_serves_only_what_verifies(tmp_path, monkeypatch, caplog, torn):
    """Killed after a spill, then the system restarted (another boot id) with
    one of the spilled values torn on disk: that value is dropped, counted and
    logged, the old file kept aside; the durable values and the intact
    spilled ones are served, now and after a clean restart."""
    path = str(tmp_path / "lmdb")
    killed_after_a_spill(path)
    if torn:
        garble(path, SPILLED[1][1])
    monkeypatch.setattr(lmdb_recovery, "boot_id", lambda: "another-boot")
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    want = [v for _, v in DURABLE + SPILLED]
    if torn:
        want[len(DURABLE) + 1] = None
    assert s.get_many([k for k, _ in DURABLE + SPILLED]) == want
    assert s.counters["verified_opens"] == 1
    assert s.counters["dropped_entries"] == int(torn)
    assert s.keys() == sorted(k for (k, _), w in zip(DURABLE + SPILLED, want) if w is not None)
    assert s.used_bytes == sum(len(k) + len(v) for k, v in s.scan(b""))
    assert "system restarted" in caplog.text and path in caplog.text
    assert len(asides(path)) == int(torn), "the old file is kept aside exactly when something was dropped"
    assert lmdb_recovery.marker(path) is None
    s.put_many([(b"after", b"a" * 1000)])
    s.close()
    s = LMDBStore(path)
    assert s.counters["verified_opens"] == 0
    assert s.get_many([k for k, _ in DURABLE + SPILLED] + [b"after"]) == want + [b"a" * 1000]
    s.close()


def test_bytes_changed_behind_lmdbs_back_are_refused_not_served(tmp_path, caplog):
    """A clean store whose value bytes change on disk afterwards: reads refuse
    that value (a miss, counted, logged), the others are served."""
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many(DURABLE, sync=True)
    s.close()
    garble(path, DURABLE[2][1])
    s = LMDBStore(path)
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        got = s.get_many([k for k, _ in DURABLE])
        scanned = dict(s.scan(b"d/"))
    assert got == [DURABLE[0][1], DURABLE[1][1], None, DURABLE[3][1]]
    assert scanned == {k: v for k, v in DURABLE if k != b"d/2"}
    assert s.counters["refused_values"] == 2       # once per read
    assert "refused" in caplog.text and b"d/2".hex() in caplog.text
    s.close()


@pytest.mark.parametrize("damage", ["meta0", "meta1", "truncated"])
def test_a_store_lmdb_cannot_open_is_moved_aside_and_a_fresh_one_starts(tmp_path, caplog, damage):
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many(DURABLE, sync=True)
    s.close()
    data_path = os.path.join(path, "data.mdb")
    with open(data_path, "r+b") as f:
        if damage == "truncated":
            f.truncate(100)
        else:
            f.seek(4096 if damage == "meta1" else 0)
            f.write(b"\xa5" * 64)
    with open(data_path, "rb") as f:
        before = f.read()
    with caplog.at_level(logging.ERROR, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.keys() == [] and s.get_many([b"d/0"]) == [None]
    assert s.counters["moved_aside"] == 1
    (aside,) = asides(path)
    with open(os.path.join(path, aside), "rb") as f:
        assert f.read() == before, "the refused file was changed"
    assert "cannot open" in caplog.text and aside in caplog.text
    s.put_many(SPILLED[:1], sync=True)
    s.close()
    s = LMDBStore(path)
    assert s.get_many([SPILLED[0][0]]) == [SPILLED[0][1]] and s.counters["moved_aside"] == 0
    s.close()


def test_a_store_written_before_checksums_is_summed_once(tmp_path):
    """Values put without a checksum record (as stores were written before
    they had one) are summed at open and then checked like any other."""
    import lmdb
    path = str(tmp_path / "lmdb")
    env = lmdb.open(path, map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in DURABLE:
            txn.put(k, v)
    env.close()
    s = LMDBStore(path)
    assert s.get_many([k for k, _ in DURABLE]) == [v for _, v in DURABLE]
    assert s.keys() == [k for k, _ in DURABLE] and s.stats()["entries"] == len(DURABLE)
    s.close()
    garble(path, DURABLE[0][1])
    s = LMDBStore(path)
    assert s.get_many([DURABLE[0][0]]) == [None] and s.counters["refused_values"] == 1
    s.close()


def rewrite_sums(path: str, fn) -> None:
    """Each checksum record of the store at path as fn(value) makes it (None:
    no record); the format record goes, as in a store written before it."""
    import lmdb
    from kvstore.tiers import lmdb_sums
    from kvstore.tiers.lmdb_store import SUMS_DB
    env = lmdb.open(path, max_dbs=2)
    sums = env.open_db(SUMS_DB)
    with env.begin(write=True) as txn:
        txn.delete(lmdb_sums.FORMAT_KEY, db=sums)
        for k, v in list(txn.cursor()):
            if k != SUMS_DB:
                r = fn(v)
                txn.delete(k, db=sums) if r is None else txn.put(k, lmdb_sums.SUM.pack(len(v), r), db=sums)
    env.close()


@pytest.mark.parametrize("sums", ["weighted", "xxh3 without the format record"])
@pytest.mark.parametrize("restart", ["clean", "system crash"])
def test_a_store_an_older_kvstore_summed_is_read_whole(tmp_path, monkeypatch, caplog, sums, restart):
    """Checksum records an older kvstore wrote (the weighted numpy sum, or
    XXH3-64 before stores named their checksum format) pass as what they are:
    every value is served, also after a system crash's verified reopen, and
    the records are XXH3-64 afterwards. One value changed on disk is still
    refused, and nothing intact is dropped."""
    from kvstore.tiers.checksum import checksum, weighted_sum
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many(DURABLE, sync=True)
    s.close()
    rewrite_sums(path, weighted_sum if sums == "weighted" else checksum)
    garble(path, DURABLE[3][1])
    if restart == "system crash":
        lmdb_recovery.mark(path)
        monkeypatch.setattr(lmdb_recovery, "boot_id", lambda: "another-boot")
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
        got = s.get_many([k for k, _ in DURABLE])
    assert got == [v for _, v in DURABLE[:3]] + [None]
    assert s.counters["dropped_entries"] == int(restart == "system crash"), "only the changed value is dropped"
    if sums == "weighted":
        assert "3 checked by the weighted sum" in caplog.text and path in caplog.text
    s.close()
    caplog.clear()
    rewrite_sums(path, lambda v: None if v == DURABLE[0][1] else checksum(v))    # XXH3, one value unsummed
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.get_many([k for k, _ in DURABLE[:3]]) == [v for _, v in DURABLE[:3]]
    assert "1 values without checksums were summed" in caplog.text
    s.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)          # the format record is there now: nothing to bring up to date
    assert s.get_many([DURABLE[1][0]]) == [DURABLE[1][1]] and "older kvstore" not in caplog.text
    s.close()


def test_a_store_of_a_checksum_format_it_does_not_know_is_moved_aside(tmp_path, caplog):
    """A newer kvstore's store (its format record names another checksum) is
    neither read nor changed: moved aside, byte for byte, and a fresh store starts."""
    import lmdb
    from kvstore.tiers import lmdb_sums
    from kvstore.tiers.lmdb_store import SUMS_DB
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many(DURABLE, sync=True)
    s.close()
    env = lmdb.open(path, max_dbs=2)
    db = env.open_db(SUMS_DB)
    with env.begin(write=True) as txn:
        txn.put(lmdb_sums.FORMAT_KEY, b"blake3", db=db)
    env.close()
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        before = f.read()
    with caplog.at_level(logging.ERROR, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.keys() == [] and s.counters["moved_aside"] == 1
    (aside,) = asides(path)
    with open(os.path.join(path, aside), "rb") as f:
        assert f.read() == before
    assert "blake3" in caplog.text and aside in caplog.text
    s.close()


@pytest.mark.parametrize("restart", ["clean", "system crash"])
def test_a_sequence_with_a_damaged_block_is_never_served(tmp_path, monkeypatch, caplog, restart):
    """Two offloaded sequences, one block of one of them changed on disk. After
    a clean restart its page-in is DATA_LOSS naming it, nothing served; after
    a system crash (unclean marker, another boot) the block is dropped at open,
    counted and logged, and the sequence is still listed: DATA_LOSS naming it
    too, not NOT_FOUND, until Free drops what is left of it. The other sequence
    is served exactly either way."""
    import torch

    from kvstore.errors import DataLoss, NotFound
    from kvstore.tiers.disk import block_key
    from tests.tiers.test_tier_books import T, engine, kv_of, toks
    e = engine(tmp_path, "fp16")
    want = {}
    for sid, first in (("s", 0), ("t", 5000)):
        tokens = toks(first, 70)
        k, v = kv_of(tokens)
        e.allocate("c", T, sid, tokens)
        e.append("c", T, [sid], k, v, [70], token_ids=[tokens])
        want[sid] = e.retrieve("c", T, sid, 0, 70)
        e.offload("c", T, [sid])
    c = e.caches["c"]
    key = block_key(c.fingerprint, bytes.fromhex(c.seqs[(T, "s")].manifest["sealed_hashes"][2]))
    (damaged,) = e.cold_store.get_many([key])
    e.cold_store.close()
    path = str(tmp_path / "lmdb")
    garble(path, damaged)
    if restart == "system crash":
        lmdb_recovery.mark(path)      # non-durable commits were in flight when the system went down
        monkeypatch.setattr(lmdb_recovery, "boot_id", lambda: "another-boot")
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        e = engine(tmp_path, "fp16")
        got = e.retrieve("c", T, "t", 0, 70)
        assert torch.equal(got[0], want["t"][0]) and torch.equal(got[1], want["t"][1])
        if restart == "clean":
            with pytest.raises(DataLoss, match="'s'"):
                e.retrieve("c", T, "s", 0, 70)
            assert e.sequence_info("c", T, "s").tier == "disk", "a refused page-in changed the sequence"
            assert e.cold_store.counters["refused_values"] >= 1
            assert scraped(e)['kvstore_disk_refused_values_total'] >= 1
        else:
            assert e.sequence_info("c", T, "s").tier == "disk"
            with pytest.raises(DataLoss, match="^sequence_id: sequence 's' .*1 of its 9 blocks on disk are missing"):
                e.retrieve("c", T, "s", 0, 70)
            assert e.sequence_info("c", T, "s").tier == "disk", "a refused page-in changed the sequence"
            assert e.cold_store.counters["dropped_entries"] == 1
            assert e.cold_store.books.counters["dropped_sequences"] == 0      # no manifest was refused
            assert "miss blocks of their disk copy" in caplog.text and "'s'" in caplog.text
            m = scraped(e)
            assert m['kvstore_disk_dropped_entries_total'] == 1
            assert m['kvstore_disk_verified_opens_total'] == 1
    entries = e.cold_store.stats()["entries"]
    e.free("c", T, ["s"])               # drops what is left of its copy
    with pytest.raises(NotFound):
        e.sequence_info("c", T, "s")
    assert e.cold_store.stats()["entries"] < entries
    e.check_invariants()
    e.cold_store.close()


def test_a_sequence_missing_a_block_is_listed_and_whole_again_once_the_block_is_back(tmp_path, caplog):
    """A block of an offloaded sequence deleted behind the store's back: after a restart the
    sequence is listed and DATA_LOSS when paged in; a spill that brings the same block back
    (a prompt with the same prefix) makes its copy whole, and it is served exactly. A
    sequence whose manifest is refused is dropped at open, counted and logged."""
    import torch

    from kvstore.errors import DataLoss, NotFound
    from kvstore.tiers.disk import block_key, manifest_key
    from tests.tiers.test_tier_books import T, engine, kv_of, toks
    e = engine(tmp_path, "fp16")
    tokens = toks(0, 70)
    k, v = kv_of(tokens)
    for sid, ids in (("s", tokens), ("m", toks(9000, 40))):
        e.allocate("c", T, sid, ids)
        kk, vv = kv_of(ids)
        e.append("c", T, [sid], kk, vv, [len(ids)], token_ids=[ids])
        e.offload("c", T, [sid])
    want = e.retrieve("c", T, "s", 0, 70)
    c = e.caches["c"]
    lost = block_key(c.fingerprint, bytes.fromhex(c.seqs[(T, "s")].manifest["sealed_hashes"][1]))
    e.cold_store.delete_many([lost])
    (manifest,) = e.cold_store.get_many([manifest_key(c.fingerprint, "c", T, "m")])
    e.cold_store.close()
    garble(str(tmp_path / "lmdb"), manifest)
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        e = engine(tmp_path, "fp16")
    assert "'c'/'default'/'m'" in caplog.text and "'c'/'default'/'s'" in caplog.text
    assert e.cold_store.books.counters["dropped_sequences"] == 1
    with pytest.raises(NotFound):
        e.sequence_info("c", T, "m")
    with pytest.raises(DataLoss, match="'s'"):
        e.prefetch("c", T, ["s"])
    e.check_invariants()
    hit = e.allocate("c", T, "again", tokens).cached_tokens     # up to the lost block; the rest afresh
    assert 0 < hit < 70
    e.append("c", T, ["again"], k[:, hit:], v[:, hit:], [70 - hit], token_ids=[tokens[hit:]])
    e.free("c", T, ["again"])
    for i in range(30):                            # other prompts reuse the cached blocks' slots: they spill
        if e.cold_store.contains(lost):
            break
        ids = toks(20_000 + 1000 * i, 64)
        e.allocate("c", T, "x", ids)
        e.append("c", T, ["x"], *kv_of(ids), [64], token_ids=[ids])
        e.free("c", T, ["x"])
    assert e.cold_store.contains(lost)
    e.check_invariants()
    got = e.retrieve("c", T, "s", 0, 70)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.check_invariants()


def scraped(e) -> dict[str, float]:
    """The daemon's Prometheus samples for engine e."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvstore.service.metrics import EngineCollector
    from tests.service.test_ops_metrics_admin import samples
    reg = CollectorRegistry()
    reg.register(EngineCollector(e))
    return samples(generate_latest(reg).decode())


def cut_short(path: str, fraction: float) -> int:
    """Truncate a closed store's data file to `fraction` of the pages its meta page
    names (a copy or restore that stopped) -> the bytes it keeps."""
    import lmdb
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=2)
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    env.close()
    os.truncate(os.path.join(path, "data.mdb"), int(need * fraction))
    return int(need * fraction)


@pytest.mark.parametrize("fraction, killed", [(0.99, False), (0.5, False), (0.5, True)])
def test_a_store_cut_short_is_verified_at_the_start_not_opened_as_whole(tmp_path, caplog, fraction, killed):
    """A store whose file lost its end: the start sees it (the open would fill the end
    with zeros, which LMDB reads as damaged pages, one failing call at a time), and
    verifies every entry, whatever the marker says (killed: this boot's, which alone
    would mean the page cache holds every commit): what cannot be read or checked is
    dropped, counted and named; the rest is served, and the store reads and writes as any other."""
    path = str(tmp_path / "lmdb")
    items = [(b"k/%03d" % i, value("cut", i, 20_000)) for i in range(60)]
    s = LMDBStore(path)
    s.put_many(items, sync=True)
    s.close()
    cut_short(path, fraction)
    if killed:
        lmdb_recovery.mark(path)
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    got = s.get_many([k for k, _ in items])
    kept = sum(g is not None for g in got)
    assert all(g is None or g == v for g, (_, v) in zip(got, items))
    assert s.counters["verified_opens"] == 1 and s.counters["dropped_entries"] == len(items) - kept
    assert "cut short" in caplog.text and path in caplog.text and len(asides(path)) == 1
    s.put_many([(b"after", b"a" * 5000)], sync=True)
    s.delete_many([k for k, _ in items[:5]])
    assert s.used_bytes == sum(len(k) + len(v) for k, v in s.scan(b""))
    s.close()
    s = LMDBStore(path)
    assert s.counters["verified_opens"] == 0 and s.get_many([b"after"]) == [b"a" * 5000]
    s.close()


def test_a_store_cut_before_its_tree_is_moved_aside_untouched(tmp_path, caplog):
    """Cut short before the main tree's root: LMDB cannot open its databases; the file
    goes aside as it was (the failed open's zeros cut off again), the store starts empty."""
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many(DURABLE, sync=True)
    s.close()
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        before = f.read(3 * 4096)
    os.truncate(os.path.join(path, "data.mdb"), 3 * 4096)
    with caplog.at_level(logging.ERROR, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.keys() == [] and s.counters["moved_aside"] == 1 and s.counters["verified_opens"] == 0
    (aside,) = asides(path)
    with open(os.path.join(path, aside), "rb") as f:
        assert f.read() == before, "the refused file was changed"
    assert "cannot open" in caplog.text
    s.close()


def test_a_page_damaged_while_the_store_runs_fails_calls_by_name_and_is_verified_next_start(tmp_path, caplog):
    """A tree page damaged under a running store: reads LMDB cannot make are refused
    (misses, counted), writes are UNAVAILABLE naming lmdb, with nothing written; the
    store stays marked, so the next start does not open it as whole."""
    from kvstore.errors import Unavailable
    path = str(tmp_path / "lmdb")
    items = [(b"k/%03d" % i, value("live", i, 20_000)) for i in range(60)]
    s = LMDBStore(path)
    s.put_many(items, sync=True)
    psize = s.env.stat()["psize"]
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        page = f.read((s.env.info()["last_pgno"] + 1) * psize).find(b"k/030") // psize
        f.seek(page * psize + 10)                       # the flags of the leaf page holding k/030
        f.write(b"\xff\xff")
    with caplog.at_level(logging.ERROR, "kvstore.lmdb"):
        got = s.get_many([b"k/030"])
    assert got == [None] and s.counters["refused_values"] == 1 and "damaged" in caplog.text
    used = s.used_bytes
    with pytest.raises(Unavailable, match="lmdb: the disk tier's file .* is damaged .* nothing was written"):
        s.put_many([(b"new", b"x" * 100)])
    assert s.used_bytes == used and b"new" not in s.keys()
    s.close()
    assert lmdb_recovery.marker(path) == "damaged"
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    assert s.counters["verified_opens"] + s.counters["moved_aside"] == 1
    assert all(g is None or g == v for g, (_, v) in zip(s.get_many([k for k, _ in items]), items))
    s.close()


def offloaded_pair(tmp_path):
    """An engine (codec fp16) with sequences "s" and "t", 70 tokens each, offloaded."""
    from tests.tiers.test_tier_books import T, engine, kv_of, toks
    e = engine(tmp_path, "fp16")
    for sid, first in (("s", 0), ("t", 5000)):
        tokens = toks(first, 70)
        k, v = kv_of(tokens)
        e.allocate("c", T, sid, tokens)
        e.append("c", T, [sid], k, v, [70], token_ids=[tokens])
        e.offload("c", T, [sid])
    return e


def test_sequences_the_starts_verification_drops_are_named_and_their_blocks_go(tmp_path, monkeypatch, caplog):
    """A system crash, and the manifest of an offloaded sequence torn on disk: the
    verification at the start drops it; the sequence is named in the log, not silently
    unlisted, and its own blocks go with it (they would count against the disk bound,
    held by no sequence). The other sequence is listed and served."""
    from tests.tiers.test_tier_books import T, engine, read
    e = offloaded_pair(tmp_path)
    want = read(e, "t")
    (manifest,) = [v for k, v in e.cold_store.scan(b"M") if k.endswith(b"s")]
    e.cold_store.close()
    path = str(tmp_path / "lmdb")
    garble(path, manifest)
    lmdb_recovery.mark(path)            # non-durable commits were in flight when the system went down
    monkeypatch.setattr(lmdb_recovery, "boot_id", lambda: "another-boot")
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        e = engine(tmp_path, "fp16")
    assert [i.seq_id for i in e.list_sequences("c", T)] == ["t"]
    line = next(r.getMessage() for r in caplog.records if "sequences dropped" in r.getMessage())
    assert "1 sequences dropped" in line and f"'c'/{T!r}/'s'" in line, line
    manifests = e.cold_store.keys(b"M")
    assert all(any(k[1:].startswith(m[1:]) for m in manifests) for k in e.cold_store.keys(b"S"))
    got = read(e, "t")
    assert all(x.equal(y) for x, y in zip(got, want))
    e.check_invariants()


def test_the_verification_walks_past_a_value_whose_page_is_damaged(tmp_path, caplog):
    """A value's own page damaged (its overflow page's header), found by the verification
    at the start: that entry is dropped and named, and every entry after it is kept (the
    walk goes over the checksum records, which no value's pages hold)."""
    path = str(tmp_path / "lmdb")
    items = [(b"k/%03d" % i, value("walk", i, 12_000)) for i in range(50)]
    s = LMDBStore(path)
    s.put_many(items, sync=True)
    psize = s.env.stat()["psize"]
    s.close()
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        page = f.read().find(items[20][1]) // psize
        f.seek(page * psize + 10)                   # the flags of the value's first overflow page
        f.write(b"\xff\xff")
    lmdb_recovery.mark(path, "damaged")             # as a running store marks itself
    with caplog.at_level(logging.WARNING, "kvstore.lmdb"):
        s = LMDBStore(path)
    got = s.get_many([k for k, _ in items])
    assert [i for i, g in enumerate(got) if g is None] == [20], "one entry dropped, the walk went on"
    assert all(g == v for g, (_, v) in zip(got, items) if g is not None)
    assert s.counters["dropped_entries"] == 1 and items[20][0].hex() in caplog.text
    assert "damaged while the daemon ran" in caplog.text and "system restarted" not in caplog.text
    s.close()


def test_a_damaged_page_costs_a_read_its_own_entries_only(tmp_path, caplog):
    """A leaf page damaged under a running store: a read of many keys (get_many, scan)
    refuses the entries LMDB cannot reach, and reads the keys after them in a fresh
    transaction (LMDB ends the one that met the page), never raising."""
    path = str(tmp_path / "lmdb")
    items = [(b"k/%04d" % i, bytes([i % 251]) * 100) for i in range(2000)]
    s = LMDBStore(path)
    s.put_many(items, sync=True)
    psize = s.env.stat()["psize"]
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        page = f.read((s.env.info()["last_pgno"] + 1) * psize).find(b"k/1000") // psize
        f.seek(page * psize + 10)
        f.write(b"\xff\xff")
    with caplog.at_level(logging.ERROR, "kvstore.lmdb"):
        got = s.get_many([k for k, _ in items])
        scanned = dict(s.scan(b"k/"))
    lost = [i for i, g in enumerate(got) if g is None]
    assert 0 < len(lost) < 200 and got[-1] == items[-1][1], lost
    assert all(g == v for g, (_, v) in zip(got, items) if g is not None)
    assert s.counters["refused_values"] == 2 * len(lost) and len(scanned) == len(items) - len(lost)
    assert caplog.text.count("found the file damaged") == 1
    s.close()


def test_blocks_of_a_sequence_whose_manifest_is_gone_are_freed_at_the_start(tmp_path):
    """A sequence's own blocks with no manifest (one a verification that stopped early
    could not name): dropped at the start, where they held the disk bound for good."""
    from tests.tiers.test_tier_books import T, engine
    e = offloaded_pair(tmp_path)
    store = e.cold_store
    (mk,) = [k for k in store.keys(b"M") if k.endswith(b"s")]
    own = store.keys(b"S" + mk[1:])
    assert own, "a partial block of its own"
    store.delete_many([mk])                  # the manifest gone, its blocks left
    store.close()
    e = engine(tmp_path, "fp16")
    assert [i.seq_id for i in e.list_sequences("c", T)] == ["t"]
    assert not set(own) & set(e.cold_store.keys(b"S")) and e.cold_store.keys(b"S")
    e.check_invariants()
