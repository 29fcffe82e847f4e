"""A worker outlives its daemon: after a restart on the same socket, its client and a
new one reach the new daemon within about a second of "serving on", however long the
failed attempts went on before."""
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.client.stream import rpc_error
from kvstore.protocol.channel import client_options

from helpers import ROOT

REACH_S = 2.0     # the reconnect back-off's cap (1 s, jitter 20 %) and a margin
GEOM = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16", block_size=8, num_blocks=64)


def step(kv: KVStoreClient, seq: str) -> None:
    """A sequence of 20 tokens in cache c, sent through the client's buffer."""
    kv.create_cache("c", "m", exist_ok=True, **GEOM)
    kv.allocate("c", seq, list(range(20)))
    k = torch.randn(2, 20, 2, 16).half()
    kv.append("c", [seq], k, k)


def start(sock: str, log) -> tuple[subprocess.Popen, float]:
    """A daemon process on sock -> (it, when it printed "serving on")."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cpu"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    for line in p.stdout:
        if "serving on" in line:
            return p, time.monotonic()
    raise AssertionError(f"the daemon exited with {p.wait()} before serving: see {log.name}")


def reach(kv: KVStoreClient, since: float) -> float:
    """Seconds from `since` until a call of kv succeeds (at most 15)."""
    while time.monotonic() - since < 15:
        try:
            kv.stats()
            return time.monotonic() - since
        except grpc.RpcError:
            time.sleep(0.05)
    raise AssertionError("not reached in 15 s")


def fails(kv: KVStoreClient) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        kv.stats()
    return e.value.code()


def test_each_channel_connects_on_its_own_and_tries_again_every_second_at_most():
    opts = dict(client_options())
    assert opts["grpc.use_local_subchannel_pool"] == 1
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"] <= 1000


def test_clients_reach_a_restarted_daemon_at_once(tmp_path, caplog):
    sock, log = str(tmp_path / "kv.sock"), open(tmp_path / "daemon.log", "w")
    target = f"unix://{sock}"
    p, _ = start(sock, log)
    worker = KVStoreClient(target, timeout=5)         # heartbeats, as every client does
    try:
        step(worker, "a")
        assert worker._arena is not None
        # Stopped and started again at once: the worker's call in between failed, and a
        # new client of the same process (what the HF adapter makes to reconnect) must
        # not inherit that failure.
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert fails(worker) == grpc.StatusCode.UNAVAILABLE
        p, up = start(sock, log)
        with KVStoreClient(target, heartbeat=False) as fresh:
            fresh.stats()                             # its first call
        assert reach(worker, up) < REACH_S
        # Killed and down for seconds of failed calls: with gRPC's own back-off (1 s, then
        # 1.6 times longer each failure) the next attempt could be 4 s away.
        p.kill()
        p.wait()
        down = time.monotonic()
        while time.monotonic() - down < 4:
            assert fails(worker) == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.2)
        p, up = start(sock, log)
        assert reach(worker, up) < REACH_S
        with KVStoreClient(target, heartbeat=False) as fresh:
            assert reach(fresh, up) < REACH_S
        # A new id goes; the new daemon holds none of the worker's buffers, and the client
        # says the daemon restarted, not that the lease may have lapsed. The sequence it
        # named before the restarts is fenced: its id may name one allocated since.
        step(worker, "b")
        assert "buffers: it restarted (" in caplog.text and "lapsed" not in caplog.text
        with pytest.raises(grpc.RpcError) as e:
            worker.sequence_info("c", "a")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith("x-kvstore-instance: ")
    finally:
        worker.close()
        p.kill()
        p.wait()


class _Refusing:
    def __init__(self, code):
        self.code = code

    def RegisterBuffer(self, request, timeout=None):
        raise rpc_error(self.code, "refused")


@pytest.mark.parametrize("code, transport", [(grpc.StatusCode.UNAVAILABLE, "shm"), (grpc.StatusCode.CANCELLED, "shm"),
                                             (grpc.StatusCode.PERMISSION_DENIED, "inline")])
def test_a_daemon_away_at_registration_leaves_the_transport_as_it_was(tmp_path, code, transport):
    """UNAVAILABLE and CANCELLED say the daemon went away, not that it cannot map a buffer:
    the call fails, and the next registers again; a refusal sends tensors inline from then on."""
    kv = KVStoreClient(f"unix://{tmp_path}/none.sock", heartbeat=False)
    kv.stub = _Refusing(code)
    try:
        if transport == "shm":
            with pytest.raises(grpc.RpcError) as e:
                kv._arena_for(1024)
            assert e.value.code() == code
        else:
            assert kv._arena_for(1024) is None
        assert kv.transport == transport and kv._arena is None
    finally:
        kv.close()
