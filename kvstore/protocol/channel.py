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


def default_socket() -> str:
    return os.environ.get("KVSTORE_SOCKET") or f"/tmp/kvstore-{os.getuid()}/kvstore.sock"


def server_options(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB) -> list[tuple[str, int]]:
    """gRPC server options (also used by bench/bench_rpc.py's floor server)."""
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


def client_options(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB) -> list[tuple[str, int]]:
    """gRPC channel options of the client."""
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
