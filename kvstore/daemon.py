"""The daemon: `python server.py` / `kvstore-server`.

Listens on a Unix socket (mode 0600, directory 0700) by default, on TCP only
when asked. Health checking and reflection are registered, so grpcurl and
grpc_health_probe work; health is NOT_SERVING until the engine is ready.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import wire
from .engine import Engine
from .servicer import KVStoreServicer
from .v1 import kvstore_pb2 as pb
from .v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.daemon")
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
DEFAULT_MAX_MESSAGE_MB = 1024


def default_socket() -> str:
    return os.environ.get("KVSTORE_SOCKET") or f"/tmp/kvstore-{os.getuid()}/kvstore.sock"


def _prepare_socket(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)   # a stale socket from a daemon that died


def create_server(engine: "Engine | None" = None, socket_path: str | None = None, port: int | None = None,
                  max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, workers: int = 8,
                  host: str = "127.0.0.1") -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and start a server. port=0 binds a free TCP port (returned).
    Returns (server, tcp_port or 0, health servicer)."""
    limit = max_message_mb * 1024 * 1024
    opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=opts)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    servicer = KVStoreServicer(None, wire.BufferRegistry())
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    bound = 0
    if socket_path:
        _prepare_socket(socket_path)
        server.add_insecure_port(f"unix:{socket_path}")
    if port is not None:
        bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    if socket_path:
        os.chmod(socket_path, 0o600)
    servicer.engine = engine if engine is not None else Engine()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore-server", description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=default_socket(), help="Unix socket path (default: %(default)s)")
    p.add_argument("--port", type=int, default=None, help="also listen on TCP 127.0.0.1:PORT")
    p.add_argument("--host", default="127.0.0.1", help="TCP address to bind with --port")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--max-message-mb", type=int, default=DEFAULT_MAX_MESSAGE_MB)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server, port, health_servicer = create_server(Engine(args.device), args.socket, args.port,
                                                  args.max_message_mb, args.workers, args.host)
    where = f"unix:{args.socket}" + (f" and {args.host}:{port}" if args.port is not None else "")
    log.info("kvstore serving on %s (device %s)", where, args.device)
    print(f"kvstore: serving on {where}", flush=True)
    done = threading.Event()

    def stop(signum, _frame):
        log.info("signal %s: stopping", signum)
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=5).wait()
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    if args.socket and os.path.exists(args.socket):
        os.unlink(args.socket)


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
