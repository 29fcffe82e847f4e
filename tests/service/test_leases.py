"""Leases: a session that stops calling loses its unpinned sequences (freed
through the engine, so the pools stay consistent) and its buffers; pinned
ones stay; persisted ones go to disk when there is a disk tier."""
import importlib.metadata
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition
from kvstore.service.daemon import create_server
from kvstore.service.leases import LeaseManager
from kvstore.service.metrics import Metrics
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import config

L, HKV, D = 2, 2, 16


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def engine_with(tmp_path=None, lmdb_max_bytes=0):
    e = Engine(lmdb_path=str(tmp_path / "lmdb") if tmp_path is not None else None, lmdb_max_bytes=lmdb_max_bytes)
    e.create_cache(config(codec="fp16", num_blocks=64))
    return e


def fill(e, sid, owner, n=20, **kw):
    e.allocate("c", "default", sid, list(range(n)), owner=owner, **kw)
    k = torch.randn(L, n, HKV, D).half()
    e.append("c", "default", [sid], k, k, [n])


def test_lapsed_session_frees_only_its_unpinned_sequences():
    e, clock = engine_with(), Clock()
    leases = LeaseManager(e, timeout_s=10, clock=clock)
    fill(e, "a1", "s1")
    fill(e, "a2", "s1")
    fill(e, "pin", "s1", pinned=True)
    fill(e, "b", "s2")
    fill(e, "nobody", "")               # no session metadata: never lapses
    leases.touch("default", "s1")
    leases.touch("default", "s2")
    clock.t += 6
    leases.touch("default", "s2")
    assert leases.reap() == []
    clock.t += 5                        # s1 silent for 11 s, s2 for 5 s
    assert leases.reap() == [("default", "s1")]
    assert sorted(s.seq_id for s in e.list_sequences("c", "default")) == ["b", "nobody", "pin"]
    e.check_invariants()
    assert leases.stats()["freed_sequences"] == 2 and leases.stats()["sessions"] == 1
    clock.t += 100
    assert leases.reap() == [("default", "s2")]
    assert sorted(s.seq_id for s in e.list_sequences("c", "default")) == ["nobody", "pin"]
    e.check_invariants()


def test_sessions_are_per_tenant():
    e, clock = engine_with(), Clock()
    leases = LeaseManager(e, timeout_s=10, clock=clock)
    e.allocate("c", "alice", "x", [1], owner="same-id")
    leases.touch("alice", "same-id")
    clock.t += 8
    leases.touch("bob", "same-id")      # bob cannot keep alice's session alive
    clock.t += 5
    assert leases.reap() == [("alice", "same-id")]
    assert e.list_sequences("c", "alice") == []


def test_persist_is_refused_without_a_disk_tier():
    e = engine_with()
    with pytest.raises(FailedPrecondition) as err:
        e.allocate("c", "default", "keep", list(range(20)), owner="s", persist=True)
    assert err.value.field == "persist" and "--lmdb" in err.value.message
    assert e.list_sequences("c", "default") == []


@pytest.mark.parametrize("room", ["enough", "none"])
def test_persisted_sequences_are_offloaded_or_kept_and_counted(tmp_path, room, caplog):
    # "none": a disk bound smaller than the sequence, so the offload at the lapse is refused
    # and the sequence stays in memory (the stop offloads it: test_persist_restart.py)
    e, clock = engine_with(tmp_path, lmdb_max_bytes=0 if room == "enough" else 1024), Clock()
    leases = LeaseManager(e, timeout_s=1, clock=clock)
    fill(e, "keep", "s", persist=True)
    fill(e, "drop", "s")
    leases.touch("default", "s")
    clock.t += 2
    with caplog.at_level("INFO", logger="kvstore.leases"):
        leases.reap()
    left = {s.seq_id: s for s in e.list_sequences("c", "default")}
    assert leases.counters["offload_requests"] == 1
    lapsed = next(r.getMessage() for r in caplog.records if "lapsed" in r.getMessage())
    if room == "enough":
        assert list(left) == ["keep"] and e.cache("c").seqs[("default", "keep")].tier == "disk"
        assert leases.counters["offload_failed"] == 0
        assert lapsed.endswith("freed 1 sequences, offloaded 1 persist sequence(s) to disk"), lapsed
    else:
        assert list(left) == ["keep"] and e.cache("c").seqs[("default", "keep")].tier == "gpu"
        assert leases.counters["offload_failed"] == 1
        assert lapsed.endswith("freed 1 sequences, kept 1 persist sequence(s) in memory"), lapsed
    e.check_invariants()


def test_a_full_disk_at_the_lapse_keeps_the_persist_sequence_and_frees_the_rest(tmp_path, monkeypatch):
    """The disk refuses the persist sequence's offload (a full filesystem): it stays in
    memory, counted, and the session's other sequences, and the next lapsed session's,
    are freed all the same."""
    import errno
    from kvstore.tiers.lmdb_file import DataFile
    e, clock = engine_with(tmp_path), Clock()
    leases = LeaseManager(e, timeout_s=1, clock=clock)
    fill(e, "keep", "s", persist=True)
    fill(e, "drop", "s")
    fill(e, "other", "t")
    for session in ("s", "t"):
        leases.touch("default", session)

    def full(self, fn, nbytes, touch):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DataFile, "write", full)
    clock.t += 2
    assert sorted(leases.reap()) == [("default", "s"), ("default", "t")]
    assert [i.seq_id for i in e.list_sequences("c", "default")] == ["keep"]
    assert e.cache("c").seqs[("default", "keep")].tier == "gpu" and leases.counters["offload_failed"] == 1
    e.check_invariants()


def test_a_session_whose_reaping_fails_does_not_keep_the_next_ones_sequences(monkeypatch):
    e, clock = engine_with(), Clock()
    leases = LeaseManager(e, timeout_s=1, clock=clock)
    fill(e, "a", "s")
    fill(e, "b", "t")
    for session in ("s", "t"):
        leases.touch("default", session)
    owned = e.owned_sequences

    def broken(tenant, session):
        if session == "s":
            raise RuntimeError("a bug reaping s")
        return owned(tenant, session)
    monkeypatch.setattr(e, "owned_sequences", broken)
    clock.t += 2
    leases.reap()
    assert [i.seq_id for i in e.list_sequences("c", "default")] == ["a"]


def test_a_call_in_flight_keeps_its_session_live():
    # A call longer than the timeout (or one waiting behind a cache's lock) is not silence:
    # the lease runs from its end.
    e, clock = engine_with(), Clock()
    leases = LeaseManager(e, timeout_s=10, clock=clock)
    fill(e, "a", "s")
    leases.enter("default", "s")
    clock.t += 30
    assert leases.reap() == [] and [i.seq_id for i in e.list_sequences("c", "default")] == ["a"]
    leases.leave("default", "s")
    clock.t += 9
    assert leases.reap() == []
    clock.t += 2
    assert leases.reap() == [("default", "s")] and e.list_sequences("c", "default") == []


def test_a_step_the_lapse_cut_short_is_refused_at_its_other_layers(tmp_path, caplog):
    # Layer 0 of a step is in when the lease lapses; the lapse drops it with the persist
    # sequence's move to disk. The worker, resumed, must not write layer 1 of that step
    # beside the next step's layer 0: it is told to run the step again.
    e, clock = engine_with(tmp_path), Clock()
    leases = LeaseManager(e, timeout_s=1, clock=clock)
    fill(e, "p", "s", persist=True)
    step = [torch.randn(1, HKV, D).half() for _ in range(L)]
    e.append("c", "default", ["p"], step[0], step[0], [1], layer=0)
    leases.touch("default", "s")
    clock.t += 2
    with caplog.at_level("INFO", logger="kvstore.leases"):
        leases.reap()
    assert "offloaded 1 persist sequence(s) to disk (dropping 1 token(s) of a step they were in)" in caplog.text
    info = e.sequence_info("c", "default", "p")
    assert (info.tier, info.length, info.pending) == ("disk", 20, [0, 0])
    e.prefetch("c", "default", ["p"])
    with pytest.raises(FailedPrecondition, match="layer: 1 continues a step of sequence 'p' that was dropped"):
        e.append("c", "default", ["p"], step[1], step[1], [1], layer=1)
    assert e.sequence_info("c", "default", "p").pending == [0, 0]      # refused: nothing written
    for layer in range(L):                                             # the step again, from layer 0
        e.append("c", "default", ["p"], step[layer], step[layer], [1], layer=layer)
    k, _ = e.retrieve("c", "default", "p", 20, 21)
    assert e.sequence_info("c", "default", "p").length == 21
    assert all(torch.equal(k[layer, 0], step[layer][0]) for layer in range(L))
    e.check_invariants()


def test_reserved_slots_the_lapse_dropped_are_told_at_the_next_reserve(tmp_path):
    # A mapped worker stalls between Reserve and the next one: the lapse drops the slots it
    # may have written. The next Reserve, which would commit nothing and hand out the same
    # positions, is refused once (the notice), and the step then runs again.
    e, clock = engine_with(tmp_path), Clock()
    leases = LeaseManager(e, timeout_s=1, clock=clock)
    fill(e, "p", "s", persist=True)
    first = e.reserve("c", "default", "p", 1)
    leases.touch("default", "s")
    clock.t += 2
    leases.reap()
    assert (e.sequence_info("c", "default", "p").length, e.sequence_info("c", "default", "p").reserved) == (20, 0)
    with pytest.raises(FailedPrecondition, match=r"^sequence_ids: sequences \['p'\]: the slots their last Reserve"):
        e.reserve_batch("c", "default", ["p"], 1)
    again = e.reserve_batch("c", "default", ["p"], 1)[0]
    assert again.length == first.length == 21      # the same position again, in whatever block now
    e.check_invariants()


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    metrics = Metrics()
    server, _, _ = create_server(socket_path=sock, lease_timeout=1.0, metrics=metrics)
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False)
    kv.create_cache("c", "m", num_layers=L, num_q_heads=4, num_kv_heads=HKV, head_dim=D, codec="fp16",
                    block_size=8, num_blocks=64)
    yield f"unix://{sock}", metrics
    kv.close()
    server.stop(0)


def used_blocks(target):
    with KVStoreClient(target, heartbeat=False) as kv:
        return kv.stats("c").caches[0].main.used


def test_heartbeat_keeps_a_session_and_silence_frees_it(live):
    target, _ = live
    quiet = KVStoreClient(target, heartbeat=False, transport="inline")
    beating = KVStoreClient(target, transport="inline")      # beats every lease_timeout / 3
    for kv, sid in ((quiet, "q"), (beating, "b")):
        kv.allocate("c", sid, list(range(20)))
        k = torch.randn(L, 20, HKV, D).half()
        kv.append("c", [sid], k, k)
    assert quiet.heartbeat().sequences == 1
    assert beating.heartbeat().lease_timeout_s == 1.0
    time.sleep(2.5)
    with KVStoreClient(target, heartbeat=False) as admin:
        assert [s.sequence_id for s in admin.list_sequences("c")] == ["b"]
        assert admin.sequence_info("c", "b").owner_session == beating.session_id
    beating.close()
    time.sleep(2.5)
    assert used_blocks(target) == 0
    quiet.close()


def test_a_pinned_sequence_names_its_session_only_while_the_lease_is_current(live):
    target, _ = live
    worker = KVStoreClient(target, heartbeat=False, transport="inline")
    worker.allocate("c", "pin", list(range(20)), pinned=True)
    with KVStoreClient(target, heartbeat=False) as admin:
        assert admin.sequence_info("c", "pin").owner_session == worker.session_id
        time.sleep(2.5)                                  # the worker's lease (1 s) lapses; the pin stays
        assert [(i.sequence_id, i.owner_session) for i in admin.list_sequences("c")] == [("pin", "")]
        assert admin.sequence_info("c", "pin").owner_session == ""
        admin.free("c", ["pin"])
    worker.close()


def test_heartbeat_names_the_daemons_version(live):
    target, _ = live
    with KVStoreClient(target, heartbeat=False) as kv:
        assert kv.heartbeat().version == importlib.metadata.version("kvstore")


def test_a_sequence_made_by_a_call_that_outlived_its_lease_is_still_reaped(tmp_path):
    # The call waits past the lease (as behind a long call holding the cache's lock): its
    # session is live while it runs, and the sequence it makes is reaped once it is silent.
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock, lease_timeout=0.5)
    engine, allocate = server.kvstore_engine, server.kvstore_engine.allocate

    def slow_allocate(*a, **kw):
        time.sleep(1.5)
        return allocate(*a, **kw)
    engine.allocate = slow_allocate
    with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
        kv.create_cache("c", "m", num_layers=L, num_q_heads=4, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, num_blocks=64)
        kv.allocate("c", "late", list(range(20)))
        assert [s.seq_id for s in engine.list_sequences("c", "default")] == ["late"]
        deadline = time.monotonic() + 10
        while engine.list_sequences("c", "default") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.list_sequences("c", "default") == []
    server.stop(0)


@pytest.mark.parametrize("doorbell", [False, True])
def test_a_client_whose_lease_lapsed_registers_its_buffers_again(live, doorbell, caplog):
    target, _ = live
    kv = KVStoreClient(target, heartbeat=False, doorbell=doorbell)      # a process that was stopped
    k = torch.randn(L, 20, HKV, D).half()
    kv.allocate("c", "a", list(range(20)))
    kv.append("c", ["a"], k, k)
    first = kv._arena.buffer_id
    time.sleep(2.5)                      # lapsed: its sequence and its buffer (and doorbell token) are gone
    with pytest.raises(grpc.RpcError) as e:
        kv.sequence_info("c", "a")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    kv.allocate("c", "b", list(range(20)))
    kv.append("c", ["b"], k, k)
    one = torch.randn(1, HKV, D).half()
    q = torch.randn(1, 4, D).half()
    out = kv.append_attend("c", 0, ["b"], one, one, q)
    assert kv._arena.buffer_id != first and "registering them again" in caplog.text
    assert "buffers: it restarted, or this session's lease lapsed" in caplog.text   # no heartbeats: either
    assert torch.equal(out, kv.attend("c", 0, ["b"], q))
    kv.close()


def test_heartbeat_needs_a_valid_session(live):
    target, _ = live
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        for md in ((), (("x-kvstore-session", "not a valid id!"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(pb.HeartbeatRequest(), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("x-kvstore-session")
        # Without a session a sequence has no owner and never lapses.
        stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="orphan", prompt_token_ids=[1]), timeout=10)
    time.sleep(2.0)
    with KVStoreClient(target, heartbeat=False) as kv:
        assert [s.sequence_id for s in kv.list_sequences("c")] == ["orphan"]


CRASHER = r"""
import os, sys, torch
from kvstore.client import KVStoreClient
kv = KVStoreClient(sys.argv[1], transport="shm")
kv.allocate("c", "crash", list(range(30)))
k = torch.randn(2, 30, 2, 16).half()
kv.append("c", ["crash"], k, k)
print(kv._arena.name, flush=True)
os._exit(1)     # no free, no unregister
"""


def test_crashed_client_is_cleaned_up(live):
    target, metrics = live
    r = subprocess.run([sys.executable, "-c", CRASHER, target], capture_output=True, text=True, timeout=120)
    shm = r.stdout.strip()
    assert r.returncode == 1 and shm, r.stderr
    try:
        assert used_blocks(target) > 0
        time.sleep(2.5)
        assert used_blocks(target) == 0
        text = metrics.render()
        assert "kvstore_registered_buffers 0.0" in text
        assert "kvstore_lease_released_buffers_total 1.0" in text
        # The client dropped the shared-memory name once both sides had it mapped.
        assert not os.path.exists(f"/dev/shm/{shm}")
    finally:
        if os.path.exists(f"/dev/shm/{shm}"):
            os.unlink(f"/dev/shm/{shm}")


def _gauge(metrics, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.render().splitlines() if line.startswith(name + " "))


def test_read_only_admin_calls_hold_no_lease(live, capsys):
    from kvstore.tools import admin
    target, metrics = live
    time.sleep(2.5)                     # the fixture's session (it made the cache) lapses first
    expired = _gauge(metrics, "kvstore_lease_expired_total")
    assert _gauge(metrics, "kvstore_sessions") == 0
    with pytest.raises(ValueError, match="without a session id"):
        KVStoreClient(target, session_id="")
    with KVStoreClient(target, heartbeat=False, session_id="") as kv:      # a sequence for `seq` to name
        kv.allocate("c", "s", list(range(20)))
    for _ in range(3):                  # a monitoring loop
        for argv in (["stats"], ["seqs"], ["blocks"], ["seq", "s", "--cache", "c"], ["health"]):
            admin.main(["--socket", target[len("unix://"):], *argv])
    assert "owner_session: \n" in capsys.readouterr().out
    assert _gauge(metrics, "kvstore_sessions") == 0
    assert 'method="Heartbeat"' not in metrics.render()      # none sent only to be refused for its missing session
    time.sleep(2.5)                     # past the lease timeout (1 s) and the reaper's period
    assert _gauge(metrics, "kvstore_lease_expired_total") == expired
    with KVStoreClient(target, heartbeat=False) as kv:
        assert [s.sequence_id for s in kv.list_sequences("c")] == ["s"]      # no owner: never lapses


def test_a_session_with_a_call_in_flight_past_its_timeout_holds_its_sequences():
    """A call longer than the lease (TrainCodebooks, a wait behind a cache's lock) keeps
    its session live for the reaper and for what reads the lease: SequenceInfo's owner
    and DeleteCache's refusal without force; once the call ends, the lease runs on."""
    from kvstore.errors import FailedPrecondition
    e, clock = engine_with(), Clock()
    leases = LeaseManager(e, timeout_s=10, clock=clock)
    fill(e, "a", "s1")
    leases.enter("default", "s1")
    clock.t += 30
    assert leases.is_live("default", "s1") and leases.reap() == []
    with pytest.raises(FailedPrecondition, match="1 of its 1 sequences are held by live client leases"):
        e.delete_cache("c", live=leases.is_live)
    leases.leave("default", "s1")
    clock.t += 11
    assert not leases.is_live("default", "s1")
    assert leases.reap() == [("default", "s1")]
    assert [s.seq_id for s in e.list_sequences("c", "default")] == []
