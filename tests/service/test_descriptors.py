"""Registered shared-memory buffers each keep a file descriptor: RegisterBuffer
leaves the daemon a margin of them (FD_RESERVE), so that a caller registering
buffers until none is left is refused by name, while every other call (those that
open files: Heartbeat, imports, new connections) goes on."""
from __future__ import annotations

import os
import resource
import secrets

import grpc
import pytest

from kvstore.service import buffers
from kvstore.service.daemon import create_server
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def test_register_buffer_leaves_the_daemon_its_descriptors(tmp_path, monkeypatch):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    name = f"kvstore-test-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(bytes(4096))
    channel = grpc.insecure_channel(f"unix://{sock}")
    stub = pb_grpc.KVStoreStub(channel)
    try:
        stub.Stats(pb.StatsRequest())
        used = len(os.listdir("/proc/self/fd"))
        real = resource.getrlimit(resource.RLIMIT_NOFILE)
        # A soft limit that leaves room for three more buffers past the margin (the test's
        # own listdir takes one descriptor for a moment, as the daemon's check does).
        monkeypatch.setattr(resource, "getrlimit", lambda which: (used + buffers.FD_RESERVE + 3, real[1]))
        ids, refused = [], None
        for _ in range(10):
            try:
                ids.append(stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=name, size=4096)).buffer_id)
            except grpc.RpcError as e:
                refused = e
                break
        assert refused is not None and 1 <= len(ids) <= 3, ids
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details().startswith(f"name: cannot register shared memory '{name}'")
        assert f"{buffers.FD_RESERVE} stay for its own work" in refused.details()
        stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=ids.pop()))
        ids.append(stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=name, size=4096)).buffer_id)
        for i in ids:
            stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=i))
    finally:
        channel.close()
        server.stop(0)
        os.unlink(path)
