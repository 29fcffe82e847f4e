"""The LMDB store's durable batches: a process killed at any point of a
synced write_batch leaves the previous commit or the whole batch, never part
of it; the file is allocated up front for its writable map."""
import os
import subprocess
import sys

import pytest

from kvstore.tiers import lmdb_recovery
from kvstore.tiers.lmdb_file import ALLOC_STEP
from kvstore.tiers.lmdb_store import LMDBStore
from tests.helpers import ROOT

N, SIZE = 24, 300_000     # values past LMDB's page size: overflow pages, as block payloads are

# Writes one committed batch ("old"), then a durable batch ("new") of N values
# that replaces old/0 and deletes old/1, killing itself with SIGKILL at the
# env.sync call number given (1: the sync after the commit; 2: none, the batch
# returns) or, at 0, when the batch first starts the disk writing its values,
# half of them put, before the commit.
CHILD = r"""
import os, signal, sys
from kvstore.tiers import lmdb_store
from kvstore.tiers.lmdb_store import LMDBStore
path, kill_at, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = LMDBStore(path, map_size=1 << 20)          # small: the batch grows the map on the way
s.put_many([(b"old/%d" % i, bytes([i]) * 1000) for i in range(3)], sync=True)
lmdb_store.WRITEBACK_STEP = n * size // 2
if kill_at == 0:
    lmdb_store.start_writeback = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
calls = [0]
real = s.env.sync
class Env:
    def __getattr__(self, name):
        return getattr(real.__self__, name)
    def sync(self, force=False):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(force)
env = s.env
s.env = Env()
s.write_batch([(b"new/%d" % i, bytes([i % 251]) * size) for i in range(n)] + [(b"old/0", b"x" * 5000)], [b"old/1"],
              sync=True)
print("returned")
"""


@pytest.mark.parametrize("kill_at, committed", [(0, False), (1, True), (2, True)])
def test_a_spill_killed_mid_way_is_all_or_nothing(tmp_path, kill_at, committed):
    path = str(tmp_path / "lmdb")
    r = subprocess.run([sys.executable, "-c", CHILD, path, str(kill_at), str(N), str(SIZE)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode == -9) == (kill_at < 2), r.stderr
    s = LMDBStore(path)
    got = s.get_many([b"new/%d" % i for i in range(N)] + [b"old/0", b"old/1", b"old/2"])
    if committed:
        assert all(got[i] == bytes([i % 251]) * SIZE for i in range(N))
        assert got[N:] == [b"x" * 5000, None, bytes([2]) * 1000]
    else:
        assert got[:N] == [None] * N, "a part of the batch is readable"
        assert got[N:] == [bytes([i]) * 1000 for i in range(3)]
    assert s.used_bytes == sum(len(k) + len(v) for k, v in s.scan(b""))
    s.close()


def test_a_system_crash_before_a_durable_batch_is_synced_is_verified_at_open(tmp_path, monkeypatch):
    """Committed, then killed before its sync ended, then the system restarted:
    the kernel may have written the meta page before the values, so the
    marker is up and the next open checks every value; here all check out."""
    path = str(tmp_path / "lmdb")
    r = subprocess.run([sys.executable, "-c", CHILD, path, "1", str(N), str(SIZE)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    assert lmdb_recovery.marker(path) == lmdb_recovery.boot_id(), "a commit not yet synced without the marker"
    monkeypatch.setattr(lmdb_recovery, "boot_id", lambda: "another-boot")
    s = LMDBStore(path)
    assert (s.counters["verified_opens"], s.counters["dropped_entries"]) == (1, 0)
    got = s.get_many([b"new/%d" % i for i in range(N)] + [b"old/0", b"old/1", b"old/2"])
    assert all(got[i] == bytes([i % 251]) * SIZE for i in range(N))
    assert got[N:] == [b"x" * 5000, None, bytes([2]) * 1000]
    assert lmdb_recovery.marker(path) is None
    s.close()


def test_the_file_is_allocated_past_its_pages_not_for_the_whole_map(tmp_path):
    s = LMDBStore(str(tmp_path / "lmdb"), map_size=1 << 20)
    s.put_many([(b"k%d" % i, b"v" * 100_000) for i in range(40)], sync=True)     # grows the map twice over
    path = tmp_path / "lmdb" / "data.mdb"
    info, st = s.env.info(), s.env.stat()
    assert s.stats()["map_size"] >= 4 << 20
    assert os.stat(path).st_blocks * 512 >= (info["last_pgno"] + 1) * st["psize"], \
        "holes under the written pages: a full disk would SIGBUS a write"
    s.close()
    # A new store with the default map (1 GiB) takes one allocation step of disk, not
    # the map: many stores (one per daemon, per test) must not fill the disk.
    fresh = LMDBStore(str(tmp_path / "fresh"))
    assert fresh.stats()["map_size"] >= 1 << 30
    assert os.stat(tmp_path / "fresh" / "data.mdb").st_blocks * 512 <= ALLOC_STEP + (1 << 20)
    fresh.close()


def test_a_synced_spill_survives_reopening(tmp_path, monkeypatch):
    """A durable batch larger than the writeback step: every value reads back
    after the store is closed and opened again, and the books match."""
    import kvstore.tiers.lmdb_store as lmdb_store
    started = []
    real = lmdb_store.start_writeback
    monkeypatch.setattr(lmdb_store, "WRITEBACK_STEP", 1 << 20)
    monkeypatch.setattr(lmdb_store, "start_writeback", lambda fd: (started.append(fd), real(fd)))
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)         # room for the batch: a map that grows puts it again
    items = [(b"v/%d" % i, bytes([i % 251]) * SIZE) for i in range(N)]
    s.put_many(items, sync=True)
    per_step = -(-(1 << 20) // (len(items[0][0]) + SIZE))      # values put between two starts
    assert len(started) == N // per_step, "the disk was not started on the batch as it filled"
    used = s.used_bytes
    s.close()
    s = LMDBStore(path)
    assert s.get_many([k for k, _ in items]) == [v for _, v in items]
    assert s.used_bytes == used == sum(len(k) + len(v) for k, v in items)
    s.close()


def test_a_batch_that_fails_mid_way_changes_nothing(tmp_path):
    """A put LMDB refuses (a key over its limit) after values were put and the
    disk was started on them: the previous commit stays, books included, and
    the store takes the next batch."""
    import lmdb
    path = str(tmp_path / "lmdb")
    s = LMDBStore(path)
    s.put_many([(b"old", b"o" * SIZE)], sync=True)
    before = (s.used_bytes, s.keys())
    bad = [(b"new/%d" % i, bytes([i]) * SIZE) for i in range(N)] + [(b"k" * 1000, b"x")]
    with pytest.raises(lmdb.BadValsizeError):
        s.put_many(bad, sync=True)
    assert (s.used_bytes, s.keys()) == before
    assert s.get_many([b"new/0", b"old"]) == [None, b"o" * SIZE]
    s.put_many([(b"new/0", b"n")], sync=True)
    s.close()
    s = LMDBStore(path)
    assert s.get_many([b"new/0", b"new/1", b"old"]) == [b"n", None, b"o" * SIZE]
    s.close()


def test_a_store_held_by_another_daemon_is_refused_not_recovered(tmp_path, python):
    """A second daemon on a running one's --lmdb would take its open marker for a crash
    and recover the file under it: it is refused at the start, naming --lmdb, and the
    first daemon's store is as it was."""
    from kvstore.tiers.lmdb_store import StoreInUse
    path = str(tmp_path / "lmdb")
    first = LMDBStore(path)
    first.put_many([(b"Bk", b"v" * 100)], sync=True)
    with pytest.raises(StoreInUse, match="in use by another process"):
        LMDBStore(path)
    r = subprocess.run([python, os.path.join(ROOT, "server.py"), "--device", "cpu", "--lmdb", path,
                        "--socket", str(tmp_path / "kv.sock")], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(
        f"kvstore-server: --lmdb {path}: LMDB store {path} is in use by another process"), r.stderr
    assert first.get_many([b"Bk"]) == [b"v" * 100]
    first.close()
    again = LMDBStore(path)                 # released by close
    assert again.get_many([b"Bk"]) == [b"v" * 100]
    again.close()
