"""kvstore-admin: inspect a running daemon (ops tooling).

    kvstore-admin stats                  # pools per tier, hit rates, bytes per token, Redis tier
    kvstore-admin seqs --cache llama     # the caller's tenant's sequences
    kvstore-admin seq req-1 --cache llama
    kvstore-admin blocks                 # blocks per tier and state, ref-count histogram
    kvstore-admin watch --interval 2     # stats, refreshed
    kvstore-admin health                 # exit 0 if SERVING
    kvstore-admin delete-cache llama     # drop a cache (tenant "default"); --force: even leased sequences
Each takes --json (numbers as JSON numbers). It talks to the daemon over its Unix socket (--socket) or
TCP (--target HOST:PORT with --token). Sequences are per tenant: the listing
shows the tenant the caller authenticates as; Stats count every tenant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from .args import bounded

TIERS = ("main", "tail", "host", "host_tail")    # PoolStats fields of CacheStats


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _dict(msg) -> dict:
    """A message as JSON-ready data. 64-bit integers stay numbers: the
    protobuf JSON mapping writes them as strings (for JavaScript's doubles),
    which every consumer of this output would have to undo."""
    return _numbers(msg.DESCRIPTOR, MessageToDict(msg, always_print_fields_with_no_presence=True,
                                                  preserving_proto_field_name=True))


def _numbers(desc, d: dict) -> dict:
    for name, v in d.items():
        f = desc.fields_by_name.get(name)
        if f is None:
            continue
        if f.type in _INT64:
            d[name] = [int(x) for x in v] if isinstance(v, list) else int(v)
        elif f.message_type is not None and isinstance(v, dict):
            _numbers(f.message_type, v)
        elif f.message_type is not None and isinstance(v, list):
            for x in v:
                if isinstance(x, dict):
                    _numbers(f.message_type, x)
    return d


def _client(args):
    from kvstore.client import KVStoreClient   # imports torch: keep `--help` fast
    from kvstore.protocol.channel import default_socket
    target = args.target or f"unix://{os.path.abspath(args.socket or default_socket())}"    # gRPC takes no relative path
    # No session id: the daemon would keep a lease for it, which lapses a --lease-timeout
    # later and counts in kvstore_lease_expired_total, one per call of a monitoring loop.
    return KVStoreClient(target, transport="inline", heartbeat=False, token=args.token, tls_ca=args.tls_ca,
                         timeout=args.timeout, session_id="")


def _cli_words(details: str) -> str:
    """The daemon names request fields; this command's flags for them."""
    return details.replace("pass force=true", "pass --force")


def _hint(e: grpc.RpcError, kv, tls_ca: str | None = None) -> str:
    """What to do about an UNAVAILABLE, told apart by gRPC's text: nothing listening
    (connection refused, no socket file) and a TCP port reached where TLS did not fit."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    details = e.details() or ""
    if not kv.target.startswith("unix:"):
        if "handshake failed" in details.lower():
            return (f"\n  a TLS handshake with {kv.target} failed: --tls-ca must name the CA that signed the "
                    "daemon's --tls-cert, for the host name in --target; a daemon without --tls-cert serves "
                    "plain TCP: drop --tls-ca")
        if "socket closed" in details.lower() and not tls_ca:
            # A TLS port closes a connection that starts in plain text; a refused one says so.
            return (f"\n  {kv.target} took the connection and closed it: if the daemon serves TLS there "
                    "(--tls-cert), pass --tls-ca CA.pem (and --token TOKEN)")
    return (f"\n  no daemon answers at {kv.target}: start one (kvstore-server, or make serve), "
            "or name its socket with --socket (--target for TCP)")


def _caches(kv, cache: str) -> list[str]:
    return [cache] if cache else [c.cache for c in kv.stats().caches]


def _mib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in cells)


def _tiers(c) -> list[tuple[str, object]]:
    return [(t, getattr(c, t)) for t in TIERS if c.HasField(t) and getattr(c, t).capacity]


def render_stats(reply) -> str:
    out = []
    for c in reply.caches:
        out.append(f"cache {c.cache}: {c.sequences} sequences, {c.tokens} tokens ({c.sealed_tokens} sealed), "
                   f"prefix hits {c.prefix_hit_tokens}/{c.prefix_query_tokens} tokens ({c.prefix_hit_rate:.1%})")
        out.append("  " + _bytes_per_token(c))
        out.append(f"  {c.appended_tokens} appended, {c.sealed_blocks} sealed blocks ({c.dedup_blocks} dedup), "
                   f"{c.attend_calls} attend calls")
        # (reserved, used) bytes; the host tier's cover both host pools, on the `host` row.
        memory = {"main": (c.main_reserved_bytes, c.main_used_bytes),
                  "tail": (c.tail_reserved_bytes, c.tail_used_bytes), "host": (c.host_tier_bytes, c.host_used_bytes)}
        rows = [[t, p.capacity, p.used, p.cached, p.free, p.evictions,
                 *((_mib(b) for b in memory[t]) if t in memory else ("", ""))] for t, p in _tiers(c)]
        out.append(_indent(_table(rows, ["tier", "capacity", "used", "cached", "free", "evictions", "reserved",
                                         "used bytes"])))
        out.append(f"  reserved {_mib(c.reserved_bytes)} in all, allocated at creation (main and tail pools, "
                   f"on the daemon's device, and the host tier: its row counts both host pools); used "
                   f"{_mib(c.used_bytes)} of the main and tail pools")
        if c.sequences_host or c.sequences_disk or c.page_ins_host or c.page_ins_disk:
            out.append(f"  sequences host/disk {c.sequences_host}/{c.sequences_disk}, page-ins host/disk "
                       f"{c.page_ins_host}/{c.page_ins_disk}, offloads host/disk {c.offloads_host}/{c.offloads_disk}")
        if c.bytes_down or c.bytes_up or c.redis_state:
            hits = [f"host {c.prefix_hit_blocks_host}", f"disk {c.prefix_hit_blocks_disk}"]
            moved = [f"host {_mib(c.bytes_down_host)}/{_mib(c.bytes_up_host)}",
                     f"disk {_mib(c.bytes_down_disk)}/{_mib(c.bytes_up_disk)}"]
            if c.redis_state:
                hits.append(f"redis {c.prefix_hit_blocks_redis}")
                moved.append(f"redis {_mib(c.redis_bytes_out)}/{_mib(c.redis_bytes_in)}")
            out.append(f"  prefix hit blocks by tier: {', '.join(hits)}; bytes down/up by tier: {', '.join(moved)}")
        if c.redis_state:
            out.append(f"  redis {c.redis_state}: {c.prefix_hit_blocks_redis} blocks in ({_mib(c.redis_bytes_in)}), "
                       f"{c.redis_blocks_out} out ({_mib(c.redis_bytes_out)}), {c.redis_misses} misses, "
                       f"{c.redis_refused} refused, {c.redis_dropped_puts} puts dropped, {c.redis_errors} errors"
                       + (f"; last error: {c.redis_last_error}" if c.redis_last_error else ""))
    # The one store under every cache: one line, also with no cache (right after a restart);
    # from a cache's disk_* fields where the daemon sends no StatsReply.disk.
    c = next((c for c in reply.caches if c.disk_entries or c.disk_bytes), None)
    d = reply.disk if reply.HasField("disk") else None if c is None else type(reply.disk)(
        bytes=c.disk_bytes, entries=c.disk_entries, used_bytes=c.disk_used_bytes, max_bytes=c.disk_max_bytes,
        held_bytes=c.disk_held_bytes)
    if d is not None and (d.entries or d.bytes):      # entries and bytes, not blocks; nothing reserved at creation
        bound = f"of a {_mib(d.max_bytes)} bound" if d.max_bytes else "(no bound)"
        out.append(f"disk (shared by every cache): {d.entries} entries (blocks and manifests), "
                   f"{_mib(d.used_bytes)} used {bound}, {_mib(d.held_bytes)} of it held by sequences")
    return "\n".join(out) if out else "no caches"


def _bytes_per_token(c) -> str:
    """Nominal (what a sealed token takes) and effective (what the cache
    holds per token now, fp16 tail and partly filled blocks included) bytes
    per token: until sequences are long enough to seal, the two differ."""
    sinks = f"; the first {c.sink_tokens} tokens of each sequence stay fp16 (sinks)" if c.sink_tokens else ""
    nominal = (f"nominal {c.bytes_per_token} B/token for sealed tokens (x{c.compression_ratio:.2f} vs fp16's "
               f"{c.fp16_bytes_per_token}){sinks}")
    if not c.tokens:
        return f"{nominal}; effective: no tokens yet"
    if not c.effective_bytes_per_token:
        return f"{nominal}; effective: no tokens in the main and tail pools ({c.tokens} tokens below them)"
    ratio = c.fp16_bytes_per_token / c.effective_bytes_per_token if c.effective_bytes_per_token else 0.0
    return (f"{nominal}; effective {c.effective_bytes_per_token:,.0f} B/token now (x{ratio:.2f}: the main and tail "
            f"pools' used bytes / their tokens; {c.tokens} tokens in all tiers, {c.sealed_tokens} of them sealed)")


def _indent(s: str) -> str:
    return "\n".join("  " + line for line in s.splitlines())


def _seq_row(s) -> list:
    # Block counts; the sink blocks lead tail_blocks.
    return [s.sequence_id, s.length, s.sink_blocks, len(s.sealed_blocks), len(s.tail_blocks) - s.sink_blocks,
            s.tier or "gpu", (s.owner_session[:12] or "-"), "pinned" if s.pinned else ("persist" if s.persist else "")]


def cmd_stats(kv, args):
    r = kv.stats(args.cache or "")
    return _dict(r) if args.json else render_stats(r)


def cmd_seqs(kv, args):
    by_cache = {name: kv.list_sequences(name) for name in _caches(kv, args.cache)}
    if args.json:
        return {name: [_dict(s) for s in seqs] for name, seqs in by_cache.items()}
    out = []
    for name, seqs in by_cache.items():
        out.append(f"cache {name}: {len(seqs)} sequences")
        if seqs:
            out.append(_indent(_table([_seq_row(s) for s in seqs],
                                      ["sequence", "tokens", "sinks", "sealed", "tail", "tier", "session",
                                       "flags"])))
    return "\n".join(out) if out else "no caches"


def cmd_seq(kv, args):
    names = _caches(kv, args.cache)
    for name in names:
        try:
            info = kv.sequence_info(name, args.id)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND and len(names) > 1:
                continue
            raise
        if args.json:
            return {"cache": name, **_dict(info)}
        d = _dict(info)
        d["block_hashes"] = [h[:16] + "..." for h in d.get("block_hashes", [])]
        return f"cache {name}\n" + "\n".join(f"  {k}: {v}" for k, v in d.items())
    raise SystemExit(f"kvstore-admin: no sequence {args.id!r} in {', '.join(names) or 'any cache'}")


def _holders(c, seqs) -> Counter:
    """How many of seqs (the caller's tenant's, as listed) hold each GPU block,
    keyed by (pool, id). A cache of codec fp16 reports no tail pool: its tail ids
    are main-pool ids, so a block one sequence holds sealed and another in its tail
    is one block. Holes (sealed blocks that left the sliding window) name the null
    block and hold none. Not the replies' ref counts: those count every tenant's sequences."""
    tail_pool = "tail" if c.HasField("tail") else "main"
    held: Counter = Counter()
    for s in seqs:
        if (s.tier or "gpu") == "gpu":
            held.update(("main", b) for b in s.sealed_blocks[s.window_freed_blocks:])
            held.update((tail_pool, b) for b in s.tail_blocks)
    return held


def cmd_blocks(kv, args):
    stats = {c.cache: c for c in kv.stats(args.cache or "").caches}
    out, js = [], {}
    for name, c in stats.items():
        hist = Counter(_holders(c, kv.list_sequences(name)).values())
        tiers = {t: _dict(p) for t, p in _tiers(c)}
        js[name] = {"tiers": tiers, "refs_histogram": {str(k): v for k, v in sorted(hist.items())}}
        out.append(f"cache {name}")
        out.append(_indent(_table([[t, p["capacity"], p["used"], p["cached"], p["free"],
                                    f"{int(p['used']) / max(1, int(p['capacity'])):.1%}"] for t, p in tiers.items()],
                                  ["tier", "capacity", "used", "cached", "free", "occupancy"])))
        if hist:
            out.append("  GPU blocks by this tenant's sequences referencing them: " +
                       ", ".join(f"{k} seq{'s' if k > 1 else ''}: {v}" for k, v in sorted(hist.items())))
    return js if args.json else ("\n".join(out) or "no caches")


def cmd_watch(kv, args):
    n = 0
    while args.count <= 0 or n < args.count:
        body = cmd_stats(kv, args)
        if args.json:
            print(json.dumps({"time": time.time(), **body}), flush=True)
        else:
            sys.stdout.write("\x1b[H\x1b[2J" if sys.stdout.isatty() else "\n")
            print(f"kvstore {kv.target}  {time.strftime('%H:%M:%S')}  (every {args.interval}s, ^C to stop)")
            print(body, flush=True)
        n += 1
        if args.count <= 0 or n < args.count:
            time.sleep(args.interval)
    return None


def cmd_delete_cache(kv, args):
    r = kv.delete_cache(args.name, force=args.force)
    if args.json:
        return {"cache": args.name, **_dict(r)}
    return (f"deleted cache {args.name}: {r.sequences} sequences ({r.leased_sequences} held by live leases, "
            f"{r.pinned_sequences} pinned, {r.disk_sequences} with a disk copy, deleted), blocks dropped: "
            f"{r.main_blocks} main, {r.tail_blocks} tail, {r.host_blocks} host, {r.cached_blocks} cached prefix; "
            f"{_mib(r.reserved_bytes)} given back. Prefix blocks on disk and in Redis stay (shared, by content).")


def cmd_health(kv, args):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    r = health_pb2_grpc.HealthStub(kv.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    if status != "SERVING":
        print(status)
        raise SystemExit(1)
    return {"status": status} if args.json else status


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`kvstore-admin ... | head -1`): nothing more to say, and
        # nothing to print at exit either (Python would flush stdout again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


def _main(argv: list[str] | None) -> None:
    from kvstore.service.buildinfo import VersionAction
    p = argparse.ArgumentParser(prog="kvstore-admin", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--socket", help="daemon Unix socket (default: the daemon's default, or KVSTORE_SOCKET)")
    p.add_argument("--target", help="HOST:PORT instead of the socket")
    p.add_argument("--token", help="bearer token (default: env KVSTORE_TOKEN)")
    p.add_argument("--tls-ca", help="CA PEM for a TLS port")
    p.add_argument("--timeout", type=bounded(float, 0, above=True), default=10.0, help="seconds a call may take")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("stats", "pools per tier, hit rates, bytes"), ("seqs", "sequences of a cache"),
                           ("blocks", "blocks per tier and state"), ("watch", "stats, refreshed"),
                           ("health", "exit 0 if the daemon is SERVING")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--cache", default="", help="one cache (default: all)")
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        if name == "watch":
            sp.add_argument("--interval", type=bounded(float, 0, above=True), default=2.0,
                            help="seconds between refreshes")
            sp.add_argument("--count", type=bounded(int, 0), default=0, help="stop after N refreshes (0: never)")
    sp = sub.add_parser("delete-cache", help="drop a cache, its sequences and pools (tenant default only)")
    sp.add_argument("name")
    sp.add_argument("--force", action="store_true", help="even sequences that live client sessions hold")
    sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    sp = sub.add_parser("seq", help="one sequence")
    sp.add_argument("id")
    sp.add_argument("--cache", default="")
    sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cmd = globals()[f"cmd_{args.cmd.replace('-', '_')}"]
    try:
        kv = _client(args)
    except ValueError as e:      # tls_ca: a file that is not there, or no certificate; an empty token
        for field, flag in (("tls_ca: ", f"--tls-ca {args.tls_ca}"), ("token: ", "--token")):
            if str(e).startswith(field):
                raise SystemExit(f"kvstore-admin: {flag}: {str(e).removeprefix(field)}") from None
        raise SystemExit(f"kvstore-admin: {e}") from None
    try:
        out = cmd(kv, args)
    except grpc.RpcError as e:
        raise SystemExit(f"kvstore-admin: {e.code().name}: {_cli_words(e.details())}{_hint(e, kv, args.tls_ca)}")
    except KeyboardInterrupt:
        out = None
    finally:
        kv.close()
    if out is not None:
        print(json.dumps(out, indent=2) if args.json else out)


if __name__ == "__main__":
    main()
