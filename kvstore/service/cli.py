"""kvstore-server's command line: its arguments and their checks, all made
before the daemon binds or opens anything (daemon.py), and the budgets
derived from them. Every flag can also come from the environment or a config
file (settings.py); docs/operations.md's table of them is generated here
(`python -m kvstore.service.cli`)."""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket

from kvstore.core.config import check_device
from kvstore.core.sizes import parse_bytes
from kvstore.errors import InvalidArgument
from kvstore.protocol.channel import DEFAULT_MAX_MESSAGE_MB, default_socket
from kvstore.tiers.redis_config import RedisConfig

from . import buildinfo, logs, settings, sockets
from .auth import Authenticator
from .leases import DEFAULT_TIMEOUT_S
from .servicer import DEFAULT_MAX_STREAMS

DESCRIPTION = "The daemon: `python server.py` / `kvstore-server`."

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_LEASE_S = 1.0       # --lease-timeout's least: see check_args


# Defaults as the docs show them, where the value depends on who runs it.
DOC_DEFAULTS = {"socket": "/tmp/kvstore-$UID/kvstore.sock"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line that says what is wrong, not the whole usage above it.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Flags over KVSTORE_* variables over the config file over defaults."""
    p = parser()
    settings.apply(p, argv)
    return p, p.parse_args(argv)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvstore-server", description=DESCRIPTION)
    p.add_argument("--version", action=buildinfo.VersionAction)
    p.add_argument("--config", metavar="PATH",
                   help="TOML file of settings, keys named as these flags without the dashes (env KVSTORE_CONFIG); "
                        "flags and KVSTORE_* variables override it")
    p.add_argument("--socket", default=default_socket(), type=lambda v: v.removeprefix("unix://"),
                   help="Unix socket path (default: %(default)s); its directory must be writable only by this uid "
                        "(a missing one is made 0700, one of ours that others can write is made 0700)")
    p.add_argument("--port", type=int, default=None, help="also listen on TCP 127.0.0.1:PORT")
    p.add_argument("--host", default="127.0.0.1", help="TCP address to bind with --port")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--lmdb", default=None, metavar="PATH",
                   help="disk tier: LMDB directory; offloaded sequences and prefix blocks survive restarts")
    p.add_argument("--lmdb-sync", action="store_true",
                   help="make pressure spills durable too (Offload always syncs)")
    p.add_argument("--lmdb-max-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="bound of the disk tier, in bytes (40GiB, 512MB and the like work too; 0: none); past it the "
                        "least recently used prefix blocks no sequence holds go first, and an Offload that cannot fit "
                        "is RESOURCE_EXHAUSTED (default: 90%% of the free space of --lmdb's filesystem at start)")
    p.add_argument("--redis", default=None, metavar="URL",
                   help="shared tier below --lmdb, for daemons on many hosts: redis://[user:password@]host:port/db "
                        "(rediss:// for TLS); run Redis with maxmemory-policy allkeys-lru")
    p.add_argument("--redis-ttl", type=int, default=0, metavar="SECONDS",
                   help="expiry of each block put to Redis, renewed by hits (default: none)")
    p.add_argument("--redis-timeout", type=float, default=0.25, metavar="SECONDS",
                   help="connect and socket timeout of Redis calls (default: %(default)s)")
    p.add_argument("--redis-backoff", type=float, default=10.0, metavar="SECONDS",
                   help="longest pause before trying a failed Redis again (default: %(default)s)")
    p.add_argument("--redis-read-connections", type=int, default=0, metavar="N",
                   help="connections a prefix lookup reads over from each Redis (each primary of a cluster) "
                        "(default: 0, by the server: 1 for Redis, whose main thread is the bound, 4 for Valkey, "
                        "whose I/O threads serve several; docs/scale.md)")
    p.add_argument("--max-message-mb", type=int, default=DEFAULT_MAX_MESSAGE_MB, metavar="MB",
                   help="largest gRPC message either way, in MiB (default: %(default)s); larger calls are "
                        "RESOURCE_EXHAUSTED: send big tensors through a registered buffer")
    p.add_argument("--workers", type=int, default=8, help="threads serving calls (default: %(default)s)")
    p.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
                   help="open AppendAttendStream streams (one per client), each on a thread of its own beside "
                        "--workers (default: %(default)s), and as many doorbell connections; past them clients "
                        "call AppendAttend")
    p.add_argument("--no-doorbell", action="store_true",
                   help="serve no doorbell socket (SOCKET.bell): clients send every AppendAttend over gRPC")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads of the daemon's own torch CPU work (default: %(default)s): decode calls "
                        "are tiny ops, where waking a thread team costs more than it saves, and the worker pool "
                        "already runs calls side by side; raise it for bulk CPU work (large CPU-device appends)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="%(choices)s, any case (default: %(default)s)")
    p.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="text: one human line per record; json: one JSON object per line (time, level, logger, "
                        "message, exception) (default: %(default)s)")
    p.add_argument("--auth-token", default=None,
                   help="bearer token for TCP callers, tenant 'default' (prefer the environment or --token-file: "
                        "argv is visible to other users)")
    p.add_argument("--token-file", help="lines `TOKEN TENANT`; `@unix TENANT` or `@unix -` sets Unix callers' tenant")
    p.add_argument("--tls-cert", help="PEM certificate for the TCP port")
    p.add_argument("--tls-key", help="PEM private key for the TCP port")
    p.add_argument("--lease-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds without a call or heartbeat before a session's unpinned sequences are freed")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")
    p.add_argument("--max-pool-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="memory all caches' pools may take together, in bytes (40GiB, 512MB and the like work too; "
                        "default: 90%% of the GPU, or half the RAM on CPU; 0: no bound); CreateCache beyond it is "
                        "RESOURCE_EXHAUSTED")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Authenticator, tuple | None]:
    """Every argument, before anything is bound or opened: p.error (one line,
    exit 2) on the first that is wrong. -> (auth, tls)."""
    args.device = args.device or ("cuda" if _cuda() else "cpu")
    try:
        check_device("--device", args.device)
    except InvalidArgument as e:
        p.error(str(e))
    try:
        # Without --redis a stand-in URL, so that a bad --redis-* value (from a config
        # file, say) is refused now and not the day --redis is added.
        cfg = RedisConfig(args.redis or "redis://localhost", ttl_s=args.redis_ttl, timeout_s=args.redis_timeout,
                          backoff_s=args.redis_backoff, read_connections=args.redis_read_connections)
    except InvalidArgument as e:
        p.error(f"--{e}")
    args.redis_cfg = cfg if args.redis else None
    if args.redis:
        try:
            import redis  # noqa: F401
        except ImportError:
            p.error("--redis needs the redis client: pip install 'redis==8.1.0' (the repository's [redis] extra)")
    if args.device.startswith("cuda"):
        n = _cuda_devices()
        index = int(args.device.partition(":")[2] or 0)
        if n == 0:
            p.error(f"--device {args.device}: no CUDA device here; use --device cpu")
        if index >= n:
            p.error(f"--device {args.device}: there are {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
        from kvstore.cuda.ipc import check_allocator
        check_allocator()      # refuses allocator settings that break CUDA IPC, saying why
    for flag, value, low, high in (("--port", args.port, 0, 65535), ("--metrics-port", args.metrics_port, 0, 65535),
                                   ("--workers", args.workers, 1, None), ("--max-streams", args.max_streams, 0, None),
                                   ("--torch-threads", args.torch_threads, 1, None),
                                   ("--max-message-mb", args.max_message_mb, 1, 2047),
                                   ("--max-pool-bytes", args.max_pool_bytes, 0, None)):
        if value is not None and (value < low or (high is not None and value > high)):
            p.error(f"{flag} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    # Clients heartbeat every third of the timeout, but at most every 0.2 s and at least every
    # 10 s (client/session.py): below 1 s a live, heartbeating client would lapse.
    if not MIN_LEASE_S <= args.lease_timeout < float("inf"):
        p.error(f"--lease-timeout must be a finite number of seconds >= {MIN_LEASE_S:g} (clients heartbeat every "
                f"third of it, at most every 0.2 s), got {args.lease_timeout}")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert and args.port is None:
        p.error("--tls-cert needs --port")
    try:
        auth = Authenticator.from_args(args.auth_token, args.token_file)
    except ValueError as e:
        p.error(str(e))
    if args.port is not None and not auth.has_tokens:
        p.error("--port needs --auth-token or --token-file: TCP callers must authenticate")
    tls = None
    if args.tls_cert:
        try:
            with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
                tls = (c.read(), k.read())
        except OSError as e:
            p.error(f"--tls-cert/--tls-key: {e.filename}: {e.strerror}")
    return auth, tls


def check_listen(host: str, port: int, flags: tuple[str, str] = ("--host", "--port")) -> None:
    """SocketError naming the host's or the port's flag if nothing can listen on
    host:port now (resolved, bound and closed at once), so that the bind after
    it is not the first to find out: gRPC's "Failed to bind" names neither."""
    host_flag, port_flag = flags
    try:
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise sockets.SocketError(f"{host_flag} {host}: cannot resolve it: {e.strerror}") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)       # port 0 too: an address not of this host fails whatever the port
    except OSError as e:
        # Busy or privileged: the port's fault; any other (not an address here): the host's.
        flag = f"{port_flag} {port}" if e.errno in (errno.EADDRINUSE, errno.EACCES) else f"{host_flag} {host}"
        raise sockets.SocketError(f"{flag}: cannot listen on {host}:{port}: {e.strerror}") from None


def pool_budget(device: str, given: int | None) -> int:
    if given is not None:
        return given
    if device.startswith("cuda"):
        import torch
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * 0.9)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def disk_budget(path: str | None, given: int | None) -> int:
    if given is not None or not path:
        return given or 0
    os.makedirs(path, mode=0o700, exist_ok=True)
    # What the store's files take of the disk now (st_blocks): data.mdb is sparse, its
    # apparent size the map's, which would count space the filesystem does not have.
    held = sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path))
    return int((shutil.disk_usage(path).free + held) * 0.9)


def _cuda() -> bool:
    return _cuda_devices() > 0


def _cuda_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install is no GPU to us
        return 0


def flags_markdown(p: argparse.ArgumentParser | None = None) -> str:
    """docs/operations.md's table of every setting (tests check it is current)."""
    p = p or parser()
    rows = ["| flag | environment | default | what |", "| --- | --- | --- | --- |"]
    for key, a in settings.settings(p).items():
        if settings.is_switch(a):
            default, flag = "off", f"`--{key}`"
        else:
            default = DOC_DEFAULTS.get(key, "unset" if a.default is None else a.default)
            flag = f"`--{key} {a.metavar or a.dest.upper()}`"
        what = (a.help or "") % {"default": default, "choices": ", ".join(map(str, a.choices or ()))}
        rows.append(f"| {flag} | `{settings.env_name(key)}` | `{default}` | {what.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(flags_markdown())
