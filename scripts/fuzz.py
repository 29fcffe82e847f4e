#!/usr/bin/env python3
"""Fuzz a live daemon (a subprocess) with malformed requests.

    python scripts/fuzz.py -n 10000 --seed 0

Requests are plausible ones with random fields rewritten (shapes, dtypes,
sizes, ids, enums, NaNs, huge numbers), raw garbage bytes sent to every method
path with identity serializers, bad or missing tokens over TCP, and a second
tenant naming the first one's sequences. They also cover the tiers (Offload
and Prefetch on a daemon with --lmdb and a cache with a host tier, frees in
between), odd names (non-ASCII, over-long, empty, control characters in cache
names, sequence ids and model ids), and values that overflow on conversion
(fp32 1e5, 7e4, -65520 into float16, 3.4e38 into bfloat16; huge, zero,
negative, NaN scales).

Passes if the daemon never dies, every answer is a documented status code
(INTERNAL, UNKNOWN, a deadline or a dropped connection fail), pool invariants
hold after every call (the daemon runs with KVSTORE_DEBUG_INVARIANTS=1), a
refused call leaves what clients see unchanged (Stats, GetCache and every
sequence's SequenceInfo of both tenants, compared before and after each
refusal; where a sequence lies, tier and block ids, is not compared: a call
may page in the sequences it names, and the pressure policy moves sequences
at any time), the pinned anchor sequences hold the same tokens at the end,
and once every fuzz sequence is freed the pools hold exactly the anchors'
blocks again.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]      # the package, and fuzz_requests.py beside this file

from fuzz_requests import (ANCHOR_CACHES, ANCHORS, BS, CACHES, HKV, HQ, STREAMS, SHM_BYTES, D, Gen, L,  # noqa: E402
                           R)
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc  # noqa: E402

C = grpc.StatusCode
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION,
              C.RESOURCE_EXHAUSTED, C.UNIMPLEMENTED, C.UNAUTHENTICATED, C.PERMISSION_DENIED}
TOKEN_OTHER = "fuzz-token-other-" + "x" * 16
SERVICE = "/kvstore.v1.KVStore/"
METHODS = list(pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name)
# The sequence calls get drawn more often, so the fuzz reaches states that take a few valid calls to build.
WEIGHTS = [4 if m in ("Allocate", "Append", "AppendAttend", "Attend", "Fork", "Free", "Reserve", "Retrieve") else
           3 if m in ("Offload", "Prefetch") else 2 if m == "AppendAttendStream" else 1 for m in METHODS]


# ------------------------------------------------------------------ daemon
def start_daemon(tmp: str, lease_timeout: float = 600.0):
    """-> (process, unix target, tcp port). Tokens: TOKEN_OTHER is tenant "other".
    An LMDB disk tier under tmp serves every cache."""
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        f.write(f"{TOKEN_OTHER} other\n")
    sock = os.path.join(tmp, "run", "kv.sock")
    env = dict(os.environ, KVSTORE_DEBUG_INVARIANTS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cpu",
                          "--port", "0", "--token-file", tokens, "--lease-timeout", str(lease_timeout),
                          "--max-pool-bytes", str(256 << 20), "--log-level", "WARNING",
                          "--lmdb", os.path.join(tmp, "lmdb")],
                         stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "daemon.log"), "w"), text=True, env=env)
    line = p.stdout.readline()
    if "serving on" not in line:
        p.kill()
        raise RuntimeError(f"daemon did not start: {line!r}; see {tmp}/daemon.log")
    port = int(line.split(" and ")[1].split(":")[1].split(",")[0].split()[0])
    return p, f"unix://{sock}", port


def serving(target: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# ------------------------------------------------------------------ setup
def setup(target: str) -> None:
    import torch
    from kvstore.client import KVStoreClient
    kv = KVStoreClient(target, transport="inline", heartbeat=False)
    for name, codec in zip(CACHES[:2], ("pq", "fp16")):
        kv.create_cache(name, "fuzz-model", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec,
                        block_size=BS, residual=R, num_blocks=48, max_sequences=24)
    # A small pool over a small host tier (and LMDB): pressure moves sequences down and back.
    kv.create_cache("fz-tier", "fuzz-model", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="pq",
                    block_size=BS, residual=R, num_blocks=12, max_sequences=24, host_bytes=24 << 10)
    kv.create_cache("fz-bf16", "fuzz-model", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                    codec="fp16", dtype="bfloat16", block_size=BS, residual=R, num_blocks=48, max_sequences=24)
    g = torch.Generator().manual_seed(0)
    for name in ("fz-pq", "fz-tier"):
        kv.train_codebooks(name, torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g),
                           niter=2)
    for name in ANCHOR_CACHES:
        for i, sid in enumerate(ANCHORS):
            prompt = list(range(100 * i, 100 * i + 30))
            kv.allocate(name, sid, prompt, pinned=True)
            k = torch.randn(L, 30, HKV, D, generator=g).half()
            kv.append(name, [sid], k, -k, token_ids=[prompt])
    kv.close()


# Where a sequence lies (its tier, its block ids and their ref counts) and what
# moving it costs or changes (sealed_tokens counts the sealed blocks in the GPU
# and host pools, none of a sequence on disk): not part of what a refused call
# must leave unchanged (see the module docstring); everything else of Stats and
# SequenceInfo is.
PLACEMENT = {"tier", "sealed_blocks", "sealed_block_refs", "tail_blocks", "tail_block_refs"}
MOVES = {"main", "tail", "host", "host_tail", "used_bytes", "effective_bytes_per_token", "sealed_tokens",
         "sequences_host", "sequences_disk", "offloads_host", "offloads_disk", "page_ins_host", "page_ins_disk",
         "bytes_down", "bytes_up", "spilled_blocks", "prefix_hit_blocks_host", "prefix_hit_blocks_disk",
         "disk_bytes", "disk_entries", "disk_used_bytes", "disk_held_bytes", "disk_evictions", "disk_evicted_bytes",
         "disk_skipped_spills", "host_metadata_bytes"}


def _fields(msg, skip) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields if f.name not in skip}


def _info(info) -> dict:
    return _fields(info, PLACEMENT)


def snapshot(stub) -> dict:
    """The anchors' metadata (less placement) and K/V bytes."""
    out = {}
    for name in ANCHOR_CACHES:
        for sid in ANCHORS:
            info = stub.SequenceInfo(pb.SequenceInfoRequest(cache=name, sequence_id=sid), timeout=30)
            r = stub.Retrieve(pb.RetrieveRequest(cache=name, sequence_id=sid, start=0, end=info.length), timeout=30)
            out[f"{name}/{sid}"] = (_info(info), r.k.inline, r.v.inline)
    return out


def _diff(old, new) -> str:
    out = [f"{k}: {old[0][k]} -> {new[0][k]}" for k in old[0] if old[0][k] != new[0][k]]
    if old[1:] != new[1:]:
        out.append("K/V bytes differ")
    return "; ".join(str(x).replace("\n", " ") for x in out)


def seen_state(stub, tcp_stub, other_md) -> dict:
    """What clients see, less placement: Stats and GetCache of every cache, and
    SequenceInfo of every sequence of both tenants (ListSequences)."""
    out = {}
    for c in stub.Stats(pb.StatsRequest(), timeout=30).caches:
        out[f"Stats {c.cache}"] = _fields(c, MOVES)
        out[f"GetCache {c.cache}"] = stub.GetCache(pb.GetCacheRequest(cache=c.cache), timeout=30).SerializeToString(
            deterministic=True)
        for who, st, md in (("default", stub, ()), ("other", tcp_stub, other_md)):
            for s in st.ListSequences(pb.ListSequencesRequest(cache=c.cache), timeout=30, metadata=md).sequences:
                out[f"{who} {c.cache}/{s.sequence_id!r}"] = _info(s)
    return out


def state_diff(before: dict, after: dict) -> list[str]:
    """What changed: a key, or a key and its fields that changed."""
    out = []
    for k in sorted(before.keys() | after.keys()):
        a, b = before.get(k), after.get(k)
        if a != b:
            fields = sorted(f for f in a if a[f] != b[f]) if isinstance(a, dict) and isinstance(b, dict) else []
            out.append(f"{k} {fields}" if fields else k)
    return out


def pool_usage(stub) -> dict:
    """Blocks used per GPU pool, and what lies below (host pools, disk sequences)."""
    out = {}
    for c in stub.Stats(pb.StatsRequest(), timeout=30).caches:
        for t in ("main", "tail", "host", "host_tail"):
            p = getattr(c, t)
            assert p.used + p.cached + p.free == p.capacity, f"{c.cache}.{t}: {p}"
            out[f"{c.cache}.{t}"] = p.used
        out[f"{c.cache}.sequences_disk"] = c.sequences_disk
    return out


def free_all(stub, md=()) -> int:
    n = 0
    for c in stub.Stats(pb.StatsRequest(), timeout=30, metadata=md).caches:
        seqs = stub.ListSequences(pb.ListSequencesRequest(cache=c.cache), timeout=30, metadata=md).sequences
        ids = [s.sequence_id for s in seqs if s.sequence_id not in ANCHORS or c.cache not in ANCHOR_CACHES or md]
        if ids:
            stub.Free(pb.FreeRequest(cache=c.cache, sequence_ids=ids), timeout=30, metadata=md)
            n += len(ids)
    return n


# ------------------------------------------------------------------ the run
def invoke(stub, method: str, req, md) -> list:
    """-> the replies (one, or a stream's)."""
    if method in STREAMS:                        # one request on a fresh stream
        return list(getattr(stub, method)(iter([req]), timeout=30, metadata=md))
    return [getattr(stub, method)(req, timeout=30, metadata=md)]


def nonfinite(replies) -> bool:
    """Whether an accepted call's inline K, V or attention output holds NaN or
    Inf: finite inputs the daemon took must never come back so."""
    import numpy as np
    import torch
    for r in replies:
        for name in ("out", "k", "v"):
            t = getattr(r, name, None)
            if t is None or t.WhichOneof("data") != "inline" or not t.inline:
                continue
            if t.dtype == pb.FLOAT32:
                x = np.frombuffer(t.inline, dtype=np.float32)
            else:
                x = torch.frombuffer(bytearray(t.inline), dtype=torch.bfloat16 if t.dtype == pb.BFLOAT16
                                     else torch.float16).float().numpy()
            if not np.isfinite(x).all():
                return True
    return False


def run(n: int = 10_000, seed: int = 0, verbose: bool = True) -> dict:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvstore-fuzz-")
    shm_name = f"kvstore-fuzz-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SHM_BYTES)
    os.close(fd)
    proc, target, port = start_daemon(tmp)
    unix = grpc.insecure_channel(target)
    tcp = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub, tcp_stub = pb_grpc.KVStoreStub(unix), pb_grpc.KVStoreStub(tcp)
    other = (("authorization", f"Bearer {TOKEN_OTHER}"),)
    outcomes: collections.Counter = collections.Counter()
    by_method: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    refusals_checked = 0
    t0 = time.time()
    try:
        setup(target)
        gen = Gen(rng, shm_name)
        gen.buffer_id = stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=shm_name, size=SHM_BYTES),
                                            timeout=30).buffer_id
        before, usage0 = snapshot(stub), pool_usage(stub)
        seen = None      # seen_state() before the call at hand
        for i in range(n):
            if seen is None:
                seen = seen_state(stub, tcp_stub, other)
            method = rng.choices(METHODS, WEIGHTS)[0]
            kind = rng.random()
            md: tuple = ()
            if rng.random() < 0.1:
                md = (("x-kvstore-session", rng.choice(["s-1", "s-2", "bad session!", "x" * 100])),)
            try:
                if kind < 0.12:
                    # Raw bytes: garbage, or a real request with bytes flipped or cut.
                    gen.other = False
                    raw = gen.base(method).SerializeToString()
                    raw = rng.choice([rng.randbytes(rng.randint(0, 200)), raw[:rng.randint(0, len(raw))],
                                      bytes(b ^ (rng.random() < 0.05) * rng.randint(1, 255) for b in raw)])
                    if method in STREAMS:          # one message on a fresh stream
                        list(unix.stream_stream(SERVICE + method)(iter([raw]), timeout=30, metadata=md))
                    else:
                        call = unix.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
                        call(raw, timeout=30, metadata=md)
                else:
                    gen.other = 0.72 <= kind < 0.94
                    clean = gen.clean = kind < 0.72 and rng.random() < 0.4
                    req = gen.base(method)
                    gen.clean = False
                    if rng.random() < 0.6 and not clean:
                        for _ in range(rng.randint(1, 3)):
                            gen.mutate(req)
                    if method == "DeleteCache" and kind < 0.72 and req.cache in CACHES:
                        # The default tenant may delete any cache: keep the ones the run checks at its end
                        # (tests/service/test_delete_cache.py tests deleting); others are PERMISSION_DENIED.
                        req.cache = "fz-new"
                    if kind < 0.72:
                        if rng.random() < 0.03 and not clean:
                            md += (("authorization", rng.choice(["Bearer nope", "Basic x", "Bearer "])),)
                        replies = invoke(stub, method, req, md)
                    elif kind < 0.94:
                        replies = invoke(tcp_stub, method, req, md + other)
                    else:
                        bad = rng.choice([(), (("authorization", "Bearer wrong-token-123456789"),)])
                        replies = invoke(tcp_stub, method, req, md + bad)
                    if nonfinite(replies):
                        failures.append(f"#{i} {method}: OK, but its reply holds NaN or Inf")
                code, detail = C.OK, ""
                if kind >= 0.12 and not gen.other:
                    gen.observe(STREAMS.get(method, method), req)
            except grpc.RpcError as e:
                code, detail = e.code(), e.details()
            outcomes[code.name] += 1
            by_method[method][code.name] += 1
            if code not in DOCUMENTED:
                failures.append(f"#{i} {method}: {code.name}: {detail}")
                if proc.poll() is not None:
                    failures.append(f"daemon died with exit code {proc.returncode}")
                    break
            if code == C.OK:
                seen = None
            else:               # a refusal: nothing a client sees may have changed
                after = seen_state(stub, tcp_stub, other)
                changed = state_diff(seen, after)
                if changed:
                    failures.append(f"#{i} {method}: {code.name} ({detail}) changed {changed[:4]}")
                refusals_checked += 1
                seen = after
            if verbose and (i + 1) % 2000 == 0:
                print(f"  {i + 1} requests, {time.time() - t0:.0f}s, {dict(outcomes)}", flush=True)
        elapsed = time.time() - t0
        # ---- end-of-run checks
        alive = proc.poll() is None and serving(target)
        if not alive:
            failures.append("daemon is not SERVING after the run")
        else:
            free_all(stub)
            free_all(tcp_stub, other)
            for name in ANCHOR_CACHES:      # pressure may have moved them down
                stub.Prefetch(pb.PrefetchRequest(cache=name, sequence_ids=ANCHORS), timeout=30)
            after = snapshot(stub)
            for key in before:
                if after[key] != before[key]:
                    failures.append(f"anchor {key} changed: {_diff(before[key], after[key])}")
            usage = pool_usage(stub)
            for key, used in usage.items():
                want = usage0.get(key, 0)
                if used != want:
                    failures.append(f"{key}: {used} blocks used after freeing every fuzz sequence, expected {want}")
    finally:
        unix.close()
        tcp.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        os.unlink(f"/dev/shm/{shm_name}")
    result = dict(requests=sum(outcomes.values()), seconds=round(elapsed, 1), outcomes=dict(outcomes.most_common()),
                  by_method={m: dict(c) for m, c in sorted(by_method.items())}, refusals_checked=refusals_checked,
                  failures=failures[:50], ok=not failures, log=os.path.join(tmp, "daemon.log"))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=10_000, help="requests to send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run(args.n, args.seed, verbose=not args.json)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"fuzz: {res['requests']} requests in {res['seconds']}s against a live daemon, "
              f"state compared around {res['refusals_checked']} refusals")
        w = max(len(k) for k in res["outcomes"]) if res["outcomes"] else 0
        for code, cnt in res["outcomes"].items():
            print(f"  {code.ljust(w)}  {cnt:6d}")
        for f in res["failures"]:
            print("FAIL", f)
        print("PASS" if res["ok"] else f"FAIL (daemon log: {res['log']})")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
