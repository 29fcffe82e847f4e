"""The daemon: `python server.py` / `kvstore-server`.

Listens on a Unix socket (mode 0600, in a directory only its uid can write;
sockets.py) by default, on TCP only when asked and then only with bearer
tokens (auth.py), optionally over TLS. It refuses to start on a socket a live
daemon serves, and checks all of its arguments (cli.py) before it binds anything.
Health checking and reflection are registered, so grpcurl and
grpc_health_probe work; health is NOT_SERVING until the engine is ready.
Client sessions hold leases (leases.py); Prometheus metrics on --metrics-port.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.engine.engine import Engine
from kvstore.protocol.channel import DEFAULT_MAX_MESSAGE_MB, SERVICE, server_options
from kvstore.tiers.redis_store import CredentialsRefused
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from . import cli, fence, logs, sockets
from .auth import Authenticator, GateInterceptor
from .buffers import BufferRegistry
from .inflight import CallsInFlight, describe
from .leases import DEFAULT_TIMEOUT_S, LeaseManager
from .servicer import DEFAULT_MAX_STREAMS, KVStoreServicer

log = logging.getLogger("kvstore.daemon")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 5.0           # calls in flight at a stop signal get this long to finish
STREAM_POLL_S = 0.02    # how often the stop looks whether only idle streams are left
STOP_LIMIT_S = 15.0     # past this the daemon exits (status 1) without the calls that are still running


def _stop_pipe() -> int:
    """Make SIGTERM/SIGINT write their number to a pipe -> its read end.

    The Python handlers do nothing: a handler that stopped the server itself
    would run again, nested inside the first, for the next signal (make and
    systemd signal every process of a group, so a daemon under `make serve`
    gets SIGTERM twice), and a nested Event.set or Lock acquire deadlocks on
    the lock the interrupted frame holds. CPython writes to the wakeup fd in
    whichever thread the kernel delivers the signal to, so the main thread,
    blocked reading the pipe, wakes at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for s in STOP_SIGNALS:
        signal.signal(s, lambda *_: None)
    return r


def _wait_for_stop(pipe: int) -> int:
    """Block until a stop signal -> its number; later ones are ignored from here
    through interpreter exit (an ignored disposition outlives the signal module)."""
    while (signum := os.read(pipe, 1)[0]) not in STOP_SIGNALS:
        pass
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    return signum


def create_server(engine: "Engine | None" = None, socket_path: str | None = None, port: int | None = None,
                  max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, workers: int = 8,
                  host: str = "127.0.0.1", auth: Authenticator | None = None,
                  tls: tuple[bytes, bytes] | None = None, lease_timeout: float = DEFAULT_TIMEOUT_S,
                  metrics=None, max_pool_bytes: int = 0,
                  max_streams: int = DEFAULT_MAX_STREAMS,
                  doorbell: bool = True) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and start a server. port=0 binds a free TCP port (returned).
    auth: tokens and tenants (TCP refuses to start without tokens); tls: (cert
    PEM, key PEM) for the TCP port; metrics: a kvstore.service.metrics.Metrics to feed;
    max_pool_bytes: memory all caches' pools may take (0: unlimited);
    max_streams: open AppendAttendStream streams, each holding a thread of
    its own beside the `workers` that serve calls (and as many doorbell
    connections); doorbell: serve the per-step fast lane (doorbell.py) next to
    the Unix socket.
    The server's kvstore_calls (inflight.py) lists the handlers still running.
    Returns (server, tcp_port or 0, health servicer)."""
    auth = auth or Authenticator()
    if port is not None and not auth.has_tokens:
        raise ValueError("TCP needs bearer tokens: pass --auth-token or --token-file with --port")
    opts = server_options(max_message_mb)
    # Metrics outside the gate, so that calls it refuses are counted too.
    calls = CallsInFlight()
    instance = fence.new_instance()
    interceptors = [calls] + ([metrics.interceptor] if metrics is not None else []) + [GateInterceptor(auth, instance)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers + max_streams), options=opts,
                         interceptors=interceptors)
    server.kvstore_calls = calls
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    leases = LeaseManager(None, lease_timeout)
    servicer = KVStoreServicer(None, BufferRegistry(), auth, leases, max_streams)
    servicer.instance = server.kvstore_instance = instance
    leases.release_buffers = servicer.buffer_table.release_session
    servicer.max_pool_bytes = max_pool_bytes
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    server.kvstore_servicer = servicer
    if socket_path:             # before binding anything: sockets.SocketError if a live daemon serves there
        sockets.claim(socket_path)
        if doorbell:
            sockets.claim(socket_path + ".bell", socket.SOCK_SEQPACKET)
    try:
        bound = _bind_and_start(server, socket_path, port, host, tls)
        servicer.engine = engine if engine is not None else Engine()
        leases.engine = servicer.engine
        server.kvstore_engine = servicer.engine
        leases.start()
        if socket_path and doorbell:
            _start_doorbell(server, servicer, leases, socket_path, max_streams, metrics)
    except BaseException:       # leave nothing behind: no listener, no socket file
        leases.stop()
        server.stop(None)       # and the sockets bound so far with it
        raise
    if metrics is not None:
        metrics.bind(servicer.engine, leases, servicer.buffer_table)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def _bind_and_start(server: grpc.Server, socket_path: str | None, port: int | None, host: str,
                    tls: tuple[bytes, bytes] | None) -> int:
    """Listen and start; the Unix socket (0600) is removed by server.stop()
    while it is still the one bound here. -> the TCP port (0 without one).

    NOTE: gRPC unlinks the path it bound when it stops, whatever is there by
    then (another daemon's socket, if one took the path over). So it binds a
    staging name beside the socket, which is renamed into place once ready:
    gRPC's unlink then finds nothing, and ours checks the inode first."""
    bound = 0
    staging = sockets.staging_path(socket_path) if socket_path else None
    if staging:
        server.add_insecure_port(f"unix:{staging}")
    if port is not None:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls[1], tls[0])]))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    umask = os.umask(0o077)    # no moment where the socket is open to others before the chmod
    try:
        server.start()
    finally:
        os.umask(umask)
    if socket_path:
        os.chmod(staging, 0o600)
        os.rename(staging, socket_path)
        ident = sockets.identity(socket_path)
        stop = server.stop

        def stop_and_unlink(grace):
            sockets.remove_if_ours(socket_path, ident)
            return stop(grace)
        server.stop = stop_and_unlink
    return bound


def cut_idle_streams(server, until: float) -> None:
    """After server.stop(GRACE_S): the calls running get the grace to finish, but an open
    AppendAttendStream between two messages is no call at work (its next message is
    refused now): once only such streams are left, the server stops at once, cancelling
    them, rather than waiting out the grace for a message that may never come."""
    servicer = server.kvstore_servicer
    servicer.stopping = True
    while time.monotonic() < until:
        if servicer.streams_idle() and all(m == "AppendAttendStream" for m, _ in server.kvstore_calls.running()):
            server.stop(grace=0)
            return
        time.sleep(STREAM_POLL_S)


def _start_doorbell(server, servicer: KVStoreServicer, leases: LeaseManager, socket_path: str,
                    max_conns: int, metrics=None) -> None:
    from .doorbell import Doorbell
    bell = Doorbell(socket_path + ".bell", servicer.handlers, max_conns)
    if metrics is not None:
        bell.observe = metrics.interceptor.observe
    try:
        bell.start()
    except OSError as e:       # e.g. a path past the 108 bytes of sun_path: gRPC still serves every call
        log.warning("no doorbell at %s: %s", bell.path, e)
        return
    servicer.doorbell = server.kvstore_doorbell = bell
    release = leases.release_buffers

    def release_session(tenant: str, session: str) -> int:
        bell.revoke(tenant, session)
        return release(tenant, session)
    leases.release_buffers = release_session
    stop = server.stop

    def stop_all(grace):
        bell.stop()
        return stop(grace)
    server.stop = stop_all      # callers (tests, main) stop the server: the doorbell goes with it


def _raise_file_limit() -> None:
    """Descriptors up to the hard limit: every connection and registered shared-memory
    buffer holds one, and a soft limit of 1024 is a few hundred clients."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> None:
    p, args = cli.parse_args(argv)
    auth, tls = cli.check_args(p, args)
    logs.setup(args.log_level, args.log_format)
    # A fatal signal (a SIGBUS from a shared-memory buffer a client shrank during a call:
    # buffers.py, check_size) leaves its traceback in the log rather than nothing.
    faulthandler.enable()
    _raise_file_limit()
    import torch
    torch.set_num_threads(args.torch_threads)
    metrics = None
    try:
        # Refuse a live daemon's socket before anything is opened or bound.
        sockets.claim(args.socket)
        if not args.no_doorbell:
            sockets.claim(args.socket + ".bell", socket.SOCK_SEQPACKET)
        if args.port is not None:
            cli.check_listen(args.host, args.port)
        if args.metrics_port is not None:     # bound first: it is the one bind not rolled back by create_server
            from .metrics import Metrics
            cli.check_listen(args.metrics_host, args.metrics_port, ("--metrics-host", "--metrics-port"))
            metrics = Metrics()
            try:
                mport = metrics.serve(args.metrics_port, args.metrics_host)
            except OSError as e:
                raise sockets.SocketError(f"--metrics-port {args.metrics_port}: cannot listen on "
                                          f"{args.metrics_host}:{args.metrics_port}: {e.strerror}") from None
        try:
            engine = Engine(args.device, args.lmdb, args.lmdb_sync, cli.disk_budget(args.lmdb, args.lmdb_max_bytes),
                            args.redis_cfg)
        except CredentialsRefused as e:
            raise sockets.SocketError(f"--redis: {e}") from None
        except Exception as e:  # noqa: BLE001 - e.g. an LMDB directory we cannot open: one line, not a traceback
            raise sockets.SocketError(f"--lmdb {args.lmdb}: {e}" if args.lmdb else f"engine: {e}") from None
        wake = _stop_pipe()     # before the server starts: from then on a signal stops it cleanly
        try:
            server, port, health_servicer = create_server(
                engine, args.socket, args.port, args.max_message_mb, args.workers, args.host, auth=auth, tls=tls,
                lease_timeout=args.lease_timeout, metrics=metrics,
                max_pool_bytes=cli.pool_budget(args.device, args.max_pool_bytes), max_streams=args.max_streams,
                doorbell=not args.no_doorbell)
        except RuntimeError as e:    # gRPC's "Failed to bind to address ..."
            raise sockets.SocketError(str(e).split(";")[0]) from None
    except (sockets.SocketError, OSError) as e:
        if metrics is not None:
            metrics.stop()
        sys.exit(f"kvstore-server: {e}")
    where = f"unix:{args.socket}" + (f" and {args.host}:{port}" if args.port is not None else "")
    if args.redis_cfg is not None:
        where += f", redis tier {args.redis_cfg.redacted()} ({'up' if engine.redis.up else 'down'})"
    if metrics is not None:
        where += f", metrics on http://{args.metrics_host}:{mport}/metrics"
    log.info("kvstore serving on %s (device %s, instance %s)", where, args.device, server.kvstore_instance)
    print(f"kvstore: serving on {where}", flush=True)
    signum = _wait_for_stop(wake)
    deadline = time.monotonic() + STOP_LIMIT_S
    log.info("signal %s: stopping", signum)
    health_servicer.enter_graceful_shutdown()
    # Bounded: a handler that ignores cancellation must not keep the engine from
    # closing below (LMDB synced, queued Redis puts sent) before a supervisor's SIGKILL.
    # gRPC's event says stopped once it has cancelled the calls, not once their
    # handlers return (interpreter exit joins those), so the calls' own table decides.
    # server.stop also removes our sockets, if they are still ours.
    stopping = server.stop(grace=GRACE_S)
    cut_idle_streams(server, time.monotonic() + GRACE_S)
    stopped = stopping.wait(max(0.0, deadline - time.monotonic()))
    left = server.kvstore_calls.wait(deadline)
    cut = not stopped or bool(left)
    if cut:
        log.warning("calls still running %g s after the stop signal: exiting without them: %s", STOP_LIMIT_S,
                    describe(left) or "gRPC's stop has not finished")
    if metrics is not None:
        metrics.stop()
    eng = getattr(server, "kvstore_engine", None)
    if eng is not None:
        eng.close()         # LMDB synced, queued Redis puts sent
    # The last line of a stop: without it a log cannot tell a finished stop from a hang.
    log.info("stopped%s", " (calls cut off: exit status 1)" if cut else "")
    logging.shutdown()
    if cut or args.device.startswith("cuda"):
        # Interpreter exit would join the handler threads still running; and its
        # teardown of CUDA memory that workers still map through IPC can block.
        # LMDB is synced by now, so leave (1: calls were cut off).
        sys.stdout.flush()
        os._exit(1 if cut else 0)


if __name__ == "__main__":
    main()
