#!/usr/bin/env python3
"""Fuzz a live daemon (a subprocess) with malformed requests.

    python scripts/fuzz.py -n 10000 --seed 0

Requests are plausible ones with random fields rewritten (shapes, dtypes,
sizes, ids, enums, NaNs, huge numbers), raw garbage bytes sent to every method
path with identity serializers, bad or missing tokens over TCP, and a second
tenant naming the first one's sequences. Passes if the daemon never dies,
every answer is a documented status code (INTERNAL, UNKNOWN, a deadline or a
dropped connection fail), pool invariants hold after every call (the daemon
runs with KVSTORE_DEBUG_INVARIANTS=1), the pinned anchor sequences are
byte-identical at the end, and once every fuzz sequence is freed the pools
hold exactly the anchors' blocks again.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc  # noqa: E402

C = grpc.StatusCode
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION,
              C.RESOURCE_EXHAUSTED, C.UNIMPLEMENTED, C.UNAUTHENTICATED, C.PERMISSION_DENIED}
L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
CACHES = ("fz-pq", "fz-f16")
SEQS = [f"fz-{i}" for i in range(6)]
ANCHORS = ["anchor-0", "anchor-1"]
TOKEN_OTHER = "fuzz-token-other-" + "x" * 16
SERVICE = "/kvstore.v1.KVStore/"
METHODS = list(pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name)
# The sequence calls get drawn more often, so the fuzz reaches states that take a few valid calls to build.
WEIGHTS = [4 if m in ("Allocate", "Append", "AppendAttend", "Attend", "Fork", "Free", "Reserve", "Retrieve") else
           2 if m == "AppendAttendStream" else 1 for m in METHODS]
STREAMS = {"AppendAttendStream": "AppendAttend"}     # streaming method -> the unary call of each message
SHM_BYTES = 1 << 16


# ------------------------------------------------------------------ daemon
def start_daemon(tmp: str, lease_timeout: float = 600.0):
    """-> (process, unix target, tcp port). Tokens: TOKEN_OTHER is tenant "other"."""
    tokens = os.path.join(tmp, "tokens")
    with open(tokens, "w") as f:
        f.write(f"{TOKEN_OTHER} other\n")
    sock = os.path.join(tmp, "run", "kv.sock")
    env = dict(os.environ, KVSTORE_DEBUG_INVARIANTS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cpu",
                          "--port", "0", "--token-file", tokens, "--lease-timeout", str(lease_timeout),
                          "--max-pool-bytes", str(256 << 20), "--log-level", "WARNING"],
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
    for name, codec in zip(CACHES, ("pq", "fp16")):
        kv.create_cache(name, "fuzz-model", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec,
                        block_size=BS, residual=R, num_blocks=48, max_sequences=24)
    g = torch.Generator().manual_seed(0)
    kv.train_codebooks("fz-pq", torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g),
                       niter=2)
    for name in CACHES:
        for i, sid in enumerate(ANCHORS):
            prompt = list(range(100 * i, 100 * i + 30))
            kv.allocate(name, sid, prompt, pinned=True)
            k = torch.randn(L, 30, HKV, D, generator=g).half()
            kv.append(name, [sid], k, -k, token_ids=[prompt])
    kv.close()


def snapshot(stub) -> dict:
    """The anchors' metadata and K/V bytes, and pool usage per cache."""
    out = {}
    for name in CACHES:
        for sid in ANCHORS:
            info = stub.SequenceInfo(pb.SequenceInfoRequest(cache=name, sequence_id=sid), timeout=30)
            r = stub.Retrieve(pb.RetrieveRequest(cache=name, sequence_id=sid, start=0, end=info.length), timeout=30)
            out[f"{name}/{sid}"] = (info.SerializeToString(deterministic=True), r.k.inline, r.v.inline)
    return out


def _diff(old, new) -> str:
    a, b = pb.SequenceInfoReply.FromString(old[0]), pb.SequenceInfoReply.FromString(new[0])
    out = [f"{f.name}: {getattr(a, f.name)} -> {getattr(b, f.name)}" for f in a.DESCRIPTOR.fields
           if getattr(a, f.name) != getattr(b, f.name)]
    if old[1:] != new[1:]:
        out.append("K/V bytes differ")
    return "; ".join(str(x).replace("\n", " ") for x in out)


def pool_usage(stub) -> dict:
    out = {}
    for c in stub.Stats(pb.StatsRequest(), timeout=30).caches:
        for t in ("main", "tail"):
            p = getattr(c, t)
            assert p.used + p.cached + p.free == p.capacity, f"{c.cache}.{t}: {p}"
            out[f"{c.cache}.{t}"] = p.used
    return out


def free_all(stub, md=()) -> int:
    n = 0
    for c in stub.Stats(pb.StatsRequest(), timeout=30, metadata=md).caches:
        seqs = stub.ListSequences(pb.ListSequencesRequest(cache=c.cache), timeout=30, metadata=md).sequences
        ids = [s.sequence_id for s in seqs if s.sequence_id not in ANCHORS or c.cache not in CACHES or md]
        if ids:
            stub.Free(pb.FreeRequest(cache=c.cache, sequence_ids=ids), timeout=30, metadata=md)
            n += len(ids)
    return n


# ---------------------------------------------------------------- requests
class Gen:
    def __init__(self, rng: random.Random, shm_name: str):
        self.rng = rng
        self.shm_name = shm_name
        self.buffer_id = ""
        self.other = False      # building for tenant "other": it may name the anchors (and must not reach them)
        self.live: dict[str, set[str]] = {c: set() for c in CACHES}   # default tenant's fuzz sequences, roughly

    def observe(self, method: str, req) -> None:
        """Track what an OK call of the default tenant created or freed, so
        later calls name live sequences more often than not."""
        live = self.live.get(getattr(req, "cache", ""))
        if live is None:
            return
        if method == "Allocate":
            live.add(req.sequence_id)
        elif method == "Fork":
            live.add(req.new_sequence_id)
        elif method == "Free":
            live.difference_update(req.sequence_ids)

    # --- values
    def string(self) -> str:
        r = self.rng
        return r.choice(["", "fz-0", "fz-pq", "fz-f16", "x" * 300, "../../etc/passwd", "\x00",
                         "é中文", "a b", secrets.token_hex(r.randint(1, 8)), r.choice(SEQS)])

    def scalar(self, f):
        r = self.rng
        t = f.cpp_type
        if t == f.CPPTYPE_BOOL:
            return r.random() < 0.5
        if t == f.CPPTYPE_STRING:
            if f.type == f.TYPE_BYTES:
                return r.randbytes(r.choice([0, 1, 7, 64, 1000]))
            return self.string()
        if t in (f.CPPTYPE_FLOAT, f.CPPTYPE_DOUBLE):
            return r.choice([0.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 1e-30, r.uniform(-10, 10)])
        if t == f.CPPTYPE_ENUM:
            return r.randint(-3, 12)
        lo, hi = {f.CPPTYPE_INT32: (-2**31, 2**31 - 1), f.CPPTYPE_INT64: (-2**63, 2**63 - 1),
                  f.CPPTYPE_UINT32: (0, 2**32 - 1), f.CPPTYPE_UINT64: (0, 2**64 - 1)}[t]
        return r.choice([lo, hi, 0, 1, max(lo, -1), 2, 7, 8, 16, 255, 256, 4096, r.randint(max(lo, -100), 100),
                         r.randint(lo, hi)])

    def mutate(self, msg, depth: int = 0) -> None:
        r = self.rng
        if not msg.DESCRIPTOR.fields:
            return
        f = r.choice(msg.DESCRIPTOR.fields)
        try:
            if f.message_type is not None and not f.is_repeated:
                if r.random() < 0.25 or depth > 3:
                    msg.ClearField(f.name)
                else:
                    self.mutate(getattr(msg, f.name), depth + 1)
            elif f.is_repeated:
                field = getattr(msg, f.name)
                if f.message_type is not None:
                    if r.random() < 0.5:
                        del field[:]
                    else:
                        for _ in range(r.randint(1, 3)):
                            self.mutate(field.add(), depth + 1)
                else:
                    del field[:]
                    field.extend(self.scalar(f) for _ in range(r.choice([0, 1, 2, 3, 5, 9, 300])))
            else:
                setattr(msg, f.name, self.scalar(f))
        except (ValueError, TypeError, OverflowError):
            pass   # the client library refuses this value: not a request we can send

    # --- plausible requests
    def tensor(self, shape, dtype=pb.FLOAT16) -> pb.Tensor:
        r = self.rng
        n = math.prod(shape) * (4 if dtype == pb.FLOAT32 else 2)
        if self.buffer_id and r.random() < 0.3 and n <= SHM_BYTES:
            return pb.Tensor(shape=list(shape), dtype=dtype,
                             ref=pb.BufferRef(buffer_id=self.buffer_id, offset=r.choice([0, 64, SHM_BYTES - n])))
        import numpy as np
        data = np.random.default_rng(r.randint(0, 2**31)).standard_normal(math.prod(shape))
        return pb.Tensor(shape=list(shape), dtype=dtype,
                         inline=data.astype(np.float32 if dtype == pb.FLOAT32 else np.float16).tobytes())

    def out_ref(self):
        return pb.OutputRef(buffer_id=self.buffer_id, offset=self.rng.choice([0, 128, SHM_BYTES - 8]))

    def base(self, method: str):
        method = STREAMS.get(method, method)       # a stream carries the unary call's requests
        r = self.rng
        cache = r.choice(CACHES) if r.random() < 0.85 else r.choice(("fz-new", "nope", ""))
        # The default tenant names its anchors only in calls that cannot change them.
        names = SEQS + ANCHORS if self.other else SEQS
        sid = r.choice(SEQS + ANCHORS if self.other or method in ("SequenceInfo", "Retrieve", "Fork") else SEQS)
        ids = r.sample(names, r.randint(1, 3))
        live = sorted(self.live.get(cache, ()))
        if live and not self.other and method != "Allocate" and r.random() < 0.7:
            sid = r.choice(live)
            ids = r.sample(live, r.randint(1, min(3, len(live))))
        b = len(ids)
        if method == "CreateCache":
            spec = pb.CacheSpec(name=r.choice(["fz-new", "fz-pq", f"fz-c{r.randint(0, 3)}"]), model_id="fuzz",
                                geometry=pb.Geometry(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D),
                                codec=r.choice(["pq", "fp16"]), block_size=BS, num_blocks=r.randint(1, 32),
                                max_sequences=r.randint(1, 8))
            return pb.CreateCacheRequest(spec=spec, exist_ok=r.random() < 0.5)
        if method == "GetCache":
            return pb.GetCacheRequest(cache=cache)
        if method == "SetCodebooks":
            return pb.SetCodebooksRequest(cache=cache, safetensors=r.randbytes(r.choice([0, 8, 200])))
        if method == "TrainCodebooks":
            n = r.choice([0, 10, 256])
            return pb.TrainCodebooksRequest(cache=cache, k_samples=self.tensor((L, n, HKV, D)),
                                            v_samples=self.tensor((L, n, HKV, D)), niter=r.randint(0, 2))
        if method == "Allocate":
            return pb.AllocateRequest(cache=cache, sequence_id=sid,
                                      prompt_token_ids=[r.randint(0, 20) for _ in range(r.randint(0, 40))])
        if method == "Reserve":
            return pb.ReserveRequest(cache=cache, sequence_id=sid, num_tokens=r.randint(0, 12))
        if method == "Append":
            counts = [r.randint(1, 6) for _ in ids]
            layer = r.choice([None, 0, 1])
            shape = (sum(counts), HKV, D) if layer is not None else (L, sum(counts), HKV, D)
            req = pb.AppendRequest(cache=cache, sequence_ids=ids, counts=counts, k=self.tensor(shape),
                                   v=self.tensor(shape))
            if layer is not None:
                req.layer = layer
            elif r.random() < 0.5:
                req.token_ids.extend(pb.TokenIds(ids=[r.randint(0, 20) for _ in range(c)]) for c in counts)
            return req
        if method in ("Attend", "AppendAttend"):
            req = (pb.AttendRequest if method == "Attend" else pb.AppendAttendRequest)(
                cache=cache, layer=r.randint(0, L - 1), sequence_ids=ids, q=self.tensor((b, HQ, D)))
            if method == "AppendAttend":
                req.k.CopyFrom(self.tensor((b, HKV, D)))
                req.v.CopyFrom(self.tensor((b, HKV, D)))
            if self.buffer_id and r.random() < 0.3:
                req.out.CopyFrom(self.out_ref())
            return req
        if method == "Retrieve":
            s = r.randint(0, 20)
            req = pb.RetrieveRequest(cache=cache, sequence_id=sid, start=s, end=s + r.randint(0, 20),
                                     layer_start=r.randint(0, 1), layer_end=r.randint(0, 2))
            if self.buffer_id and r.random() < 0.3:
                req.k_out.CopyFrom(self.out_ref())
                req.v_out.CopyFrom(self.out_ref())
            return req
        if method == "Fork":
            return pb.ForkRequest(cache=cache, sequence_id=sid, new_sequence_id=r.choice(SEQS))
        if method in ("Free", "Offload", "Prefetch"):
            return getattr(pb, f"{method}Request")(cache=cache, sequence_ids=ids)
        if method == "RegisterBuffer":
            return pb.RegisterBufferRequest(kind=r.choice([pb.SHM, pb.CUDA_IPC, 0]),
                                            name=r.choice([self.shm_name, "nope"]), size=r.choice([1, SHM_BYTES]))
        if method == "UnregisterBuffer":
            return pb.UnregisterBufferRequest(buffer_id=r.choice(["shm-0000", "", self.buffer_id]))
        if method in ("MapPool", "Stats", "ListSequences"):
            return getattr(pb, f"{method}Request")(cache=cache)
        if method == "SequenceInfo":
            return pb.SequenceInfoRequest(cache=cache, sequence_id=sid)
        if method == "Heartbeat":
            return pb.HeartbeatRequest()
        raise KeyError(method)


# ------------------------------------------------------------------ the run
def invoke(stub, method: str, req, md) -> None:
    if method in STREAMS:                        # one request on a fresh stream
        list(getattr(stub, method)(iter([req]), timeout=30, metadata=md))
    else:
        getattr(stub, method)(req, timeout=30, metadata=md)


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
    t0 = time.time()
    try:
        setup(target)
        gen = Gen(rng, shm_name)
        gen.buffer_id = stub.RegisterBuffer(pb.RegisterBufferRequest(kind=pb.SHM, name=shm_name, size=SHM_BYTES),
                                            timeout=30).buffer_id
        before, usage0 = snapshot(stub), pool_usage(stub)
        for i in range(n):
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
                    req = gen.base(method)
                    if rng.random() < 0.6:
                        for _ in range(rng.randint(1, 3)):
                            gen.mutate(req)
                    if kind < 0.72:
                        if rng.random() < 0.03:
                            md += (("authorization", rng.choice(["Bearer nope", "Basic x", "Bearer "])),)
                        invoke(stub, method, req, md)
                    elif kind < 0.94:
                        invoke(tcp_stub, method, req, md + other)
                    else:
                        bad = rng.choice([(), (("authorization", "Bearer wrong-token-123456789"),)])
                        invoke(tcp_stub, method, req, md + bad)
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
                  by_method={m: dict(c) for m, c in sorted(by_method.items())}, failures=failures[:50],
                  ok=not failures, log=os.path.join(tmp, "daemon.log"))
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
        print(f"fuzz: {res['requests']} requests in {res['seconds']}s against a live daemon")
        w = max(len(k) for k in res["outcomes"]) if res["outcomes"] else 0
        for code, cnt in res["outcomes"].items():
            print(f"  {code.ljust(w)}  {cnt:6d}")
        for f in res["failures"]:
            print("FAIL", f)
        print("PASS" if res["ok"] else f"FAIL (daemon log: {res['log']})")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
