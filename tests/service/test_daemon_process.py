"""The daemon as users run it: a separate process, health and reflection, two
client processes sharing a prefix, restarts."""
import math
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from kvstore.v1 import kvstore_pb2 as pb

from helpers import ROOT


WORKER = r"""
import sys, json, torch
from kvstore.client import KVStoreClient
target, seq, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = KVStoreClient(target)
prompt = list(range(1000, 2000))          # the same 1,000-token prompt in both workers
cached = kv.allocate("shared", seq, prompt)
g = torch.Generator().manual_seed(seed)
k = torch.randn(2, 1000 - cached, 2, 16, generator=g).half()
kv.append("shared", [seq], k, k, token_ids=[prompt[cached:]])
info = kv.sequence_info("shared", seq)
print(json.dumps({"cached": cached, "sealed": list(info.sealed_blocks), "tail": list(info.tail_blocks),
                  "hashes": [h.hex() for h in info.block_hashes]}))
"""


def start_daemon(sock, hash_seed="0", extra=(), run_in=(), code=None, env=()):
    """run_in: a command prefix that runs the daemon elsewhere (another network namespace);
    code: Python run in place of server.py (it gets the same arguments); env: more variables."""
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONUNBUFFERED="1", **dict(env))
    # -X faulthandler: a start that times out is sent SIGABRT below, which prints every
    # thread's Python stack, so the failure says where the daemon was
    main = ["-c", code] if code is not None else [os.path.join(ROOT, "server.py")]
    p = subprocess.Popen([*run_in, sys.executable, "-X", "faulthandler", *main, "--socket",
                          sock, "--device", "cpu", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    target = f"unix://{sock}"
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with grpc.insecure_channel(target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"),
                                                         timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return p, target
        except grpc.RpcError:
            time.sleep(0.2)
    p.send_signal(signal.SIGABRT)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
    raise RuntimeError("daemon did not become SERVING in 60 s; its output and stacks: " + p.stdout.read())


def stop_daemon(p):
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("daemon did not stop within 30 s of SIGTERM: " + (p.stdout.read() or "")[-3000:])
    assert rc == 0, (p.stdout.read() or "")[-3000:]


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "run" / "kv.sock")


def test_health_reflection_and_socket_mode(sock):
    p, target = start_daemon(sock)
    try:
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        assert oct(os.stat(os.path.dirname(sock)).st_mode & 0o777) == "0o700"
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        with grpc.insecure_channel(target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            services = {s.name for s in resp[0].list_services_response.service}
            assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= services
            resp = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="kvstore.v1.KVStore")])))
            assert resp[0].file_descriptor_response.file_descriptor_proto
    finally:
        stop_daemon(p)
    assert not os.path.exists(sock), "graceful stop removes the socket"


def _worker(target, seq, seed):
    import json
    r = subprocess.run([sys.executable, "-c", WORKER, target, seq, str(seed)], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("codec, sinks", [("pq", 0), ("fp16", 0), ("pq", 32)])
def test_two_processes_share_prefix_and_restart_keeps_hashes(sock, codec, sinks, capsys):
    from kvstore.tools import admin
    from kvstore.client import KVStoreClient
    import torch
    hashes_by_run = []
    for run, seed in enumerate(["0", "4242"]):
        # A lease longer than the run: worker a's sequence outlives its process while b starts.
        p, target = start_daemon(sock, hash_seed=seed, extra=("--lease-timeout", "600"))
        try:
            kv = KVStoreClient(target)
            kv.create_cache("shared", "m", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec=codec,
                            block_size=16, residual=128, num_blocks=256, sink_tokens=sinks)
            if codec == "pq":
                g = torch.Generator().manual_seed(0)
                kv.train_codebooks("shared", torch.randn(2, 512, 2, 16, generator=g),
                                   torch.randn(2, 512, 2, 16, generator=g), niter=2)
            start = kv.stats("shared").caches[0]
            a = _worker(target, "a", 1)
            b = _worker(target, "b", 2)
            assert a["cached"] == 0
            assert b["cached"] == 1000 // 16 * 16          # every full block of the prompt
            full_a = (a["sealed"] + a["tail"])[:62]
            full_b = (b["sealed"] + b["tail"])[:62]
            assert full_a == full_b
            info = kv.sequence_info("shared", "b")
            refs = list(info.sealed_block_refs) + list(info.tail_block_refs)
            assert refs[:62] == [2] * 62 and refs[62:] == [1]
            assert a["hashes"] == b["hashes"] and len(a["hashes"]) == 62
            if sinks:     # b shares a's sink blocks; a's sinks come back exactly as its worker sent them
                assert kv.get_cache("shared").spec.sink_tokens == kv.stats("shared").caches[0].sink_tokens == sinks
                assert info.sink_blocks == sinks // 16 and b["tail"][:2] == a["tail"][:2]
                assert len(info.sealed_blocks) == math.ceil((1000 - sinks - 128 - 16) / 16)
                sent = torch.randn(2, 1000, 2, 16, generator=torch.Generator().manual_seed(1)).half()
                assert torch.equal(kv.retrieve("shared", "a", 0, sinks)[0], sent[:, :sinks])
                admin.main(["--socket", sock, "seqs", "--cache", "shared"])
                rows = [line.split() for line in capsys.readouterr().out.splitlines()]
                header = next(r for r in rows if r and r[0] == "sequence")
                row_a = next(r for r in rows if r and r[0] == "a")
                assert row_a[header.index("sinks")] == "2" and row_a[header.index("tokens")] == "1000"
            hashes_by_run.append(a["hashes"])
            kv.free("shared", ["a", "b"])
            end = kv.stats("shared").caches[0]
            for pool in ("main", "tail"):
                s0, s1 = getattr(start, pool), getattr(end, pool)
                assert s1.used == s0.used == 0
                assert s1.free + s1.cached == s0.free + s0.cached == s0.capacity
            assert end.main.cached > 0                      # freed prefix blocks stay findable
            kv.close()
        finally:
            stop_daemon(p)
    assert hashes_by_run[0] == hashes_by_run[1]               # same across restarts and hash seeds


def test_stop_signals_in_a_burst_stop_it_once_and_cleanly(sock):
    """make and systemd signal every process of a group, so a daemon under `make serve`
    gets SIGTERM twice, and an operator's second Ctrl-C is common: however the signals
    fall, it stops once, exits 0 with no traceback and leaves no socket behind."""
    from kvstore.client import KVStoreClient
    p, target = start_daemon(sock)
    with KVStoreClient(target) as kv:
        kv.create_cache("c", "m", num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=16, codec="fp16",
                        num_blocks=4)
    deadline = time.monotonic() + 30
    sent = 0
    while p.poll() is None and time.monotonic() < deadline:
        p.send_signal(signal.SIGTERM if sent % 2 else signal.SIGINT)
        sent += 1
        time.sleep(0.0005)
    try:
        rc = p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"daemon still running 30 s into a burst of {sent} stop signals")
    out = p.stdout.read()
    assert sent >= 2
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1].endswith("stopped"), out[-3000:]     # a finished stop says so last
    assert not os.path.exists(sock)


STUCK = r"""
import os, sys, threading
sys.path.insert(0, os.environ["KV_ROOT"])
from kvstore.service import daemon, servicer

def stats(self, request, context):      # a handler that ignores cancellation, as one inside faiss does
    open(os.environ["KV_STUCK"], "w").close()
    threading.Event().wait()

servicer.KVStoreServicer.Stats = stats
daemon.GRACE_S, daemon.STOP_LIMIT_S = 0.2, 1.5
daemon.main(sys.argv[1:])
"""


def test_a_handler_that_ignores_cancellation_ends_in_exit_1_at_the_stop_limit(sock, tmp_path):
    """gRPC reports the server stopped once it has cancelled the calls, while a handler
    thread blocked outside Python keeps running and interpreter exit would join it: the
    daemon still exits, status 1, at STOP_LIMIT_S, with its disk tier synced, and names the call."""
    import threading
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
    stuck = tmp_path / "stuck"
    p, target = start_daemon(sock, extra=("--lmdb", str(tmp_path / "lmdb")), code=STUCK,
                             env={"KV_ROOT": ROOT, "KV_STUCK": str(stuck)})
    from kvstore.client import KVStoreClient
    with KVStoreClient(target) as kv:       # blocks only memory holds, for the stop to write to disk
        kv.create_cache("c", "m", num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=16, codec="fp16",
                        block_size=8, num_blocks=8)
        kv.allocate("c", "s", list(range(16)))
        k = torch.randn(1, 16, 1, 16).half()
        kv.append("c", ["s"], k, k, token_ids=[list(range(16))])
    codes = []

    def call():
        with grpc.insecure_channel(target) as ch:
            try:
                pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=60)
            except grpc.RpcError as e:
                codes.append(e.code())
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while not stuck.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stuck.exists(), "the stuck handler never ran"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("daemon still running 30 s after SIGTERM with a stop limit of 1.5 s: "
                             + p.stdout.read()[-3000:])
    elapsed = time.monotonic() - t0
    out = p.stdout.read()
    caller.join(10)
    assert rc == 1, out[-3000:]
    assert 1.5 <= elapsed < 20, (elapsed, out[-3000:])
    assert "calls still running 1.5 s after the stop signal: exiting without them: Stats (" in out, out[-3000:]
    assert codes == [grpc.StatusCode.UNAVAILABLE]          # the caller was cancelled at the grace period
    assert not os.path.exists(sock)
    assert "prefix blocks written to the disk tier" in out, out[-3000:]     # the engine closed
    assert out.rstrip().splitlines()[-1].endswith("stopped (calls cut off: exit status 1)"), out[-3000:]
    assert not (tmp_path / "lmdb" / "unclean").exists()                    # and synced the disk tier
