"""How a client reaches the daemon: its default socket, the service name, the
gRPC options of both ends and the metadata keys a call may carry. The daemon
(service/) and the client both read them here, so the client imports nothing
of the daemon."""
from __future__ import annotations

import os

from kvstore.v1 import kvstore_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
DEFAULT_MAX_MESSAGE_MB = 1024
SESSION_KEY = "x-kvstore-session"   # the caller's session id: its calls renew that session's lease
STREAM_KEY = "x-kvstore-stream"     # trailing metadata "refused": a stream turned away before reading a request
# The daemon process a caller's sequence ids are from (HeartbeatReply.instance, new at
# every start): a call naming sequences for another instance is refused before it runs,
# so that ids from before a restart never reach a sequence someone allocated since.
INSTANCE_KEY = "x-kvstore-instance"


def default_socket() -> str:
    """$KVSTORE_SOCKET (a path; a unix:// target is taken as its path), else the default."""
    path = os.environ.get("KVSTORE_SOCKET") or f"/tmp/kvstore-{os.getuid()}/kvstore.sock"
    return path.removeprefix("unix://")


def server_options(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB) -> list[tuple[str, int]]:
    """gRPC server options (also used by bench/bench_rpc.py's floor server)."""
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


# gRPC waits between connection attempts 1 s, then 1.6 times longer each failure, up to
# 120 s (grpc/doc/connection-backoff.md): after a restart a client whose attempts failed
# while the daemon was down would wait up to that long for it. A daemon is on this host
# or near it, so trying again every second at most costs nothing.
RECONNECT_INITIAL_MS = 100
RECONNECT_MAX_MS = 1000


def client_options(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB) -> list[tuple[str, int]]:
    """gRPC channel options of the client. Each channel keeps its connection to itself
    (use_local_subchannel_pool): by default the channels of a process with the same
    target and options share one, and its back-off, so a new client made to reconnect
    would inherit the failures of the old one and be refused at once."""
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
            ("grpc.use_local_subchannel_pool", 1)]
