"""The requests scripts/fuzz.py sends: plausible ones of every method, to
be mutated, and the odd names and values it mixes in."""
from __future__ import annotations

import math
import random
import secrets

from kvstore.v1 import kvstore_pb2 as pb

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
CACHES = ("fz-pq", "fz-f16", "fz-tier", "fz-bf16")
ANCHOR_CACHES = CACHES[:2]     # the pinned anchors live here
SEQS = [f"fz-{i}" for i in range(6)]
ANCHORS = ["anchor-0", "anchor-1"]
STREAMS = {"AppendAttendStream": "AppendAttend"}     # streaming method -> the unary call of each message
SHM_BYTES = 1 << 16


# ---------------------------------------------------------------- requests
class Gen:
    def __init__(self, rng: random.Random, shm_name: str):
        self.rng = rng
        self.shm_name = shm_name
        self.buffer_id = ""
        self.other = False      # building for tenant "other": it may name the anchors (and must not reach them)
        # A valid call of the default tenant on a live sequence, clean fp16 data:
        # they fill sequences with tokens, so tiers move data and attends run.
        self.clean = False
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
    def name(self) -> str:
        """An odd name: non-ASCII, over-long, empty, control characters."""
        r = self.rng
        # 256 characters pass a length check in characters, but take 512-1024 bytes in UTF-8.
        return r.choice(["", "x" * 300, "y" * 5000, "é" * 256, "中" * 257, "\U0001f642" * 256, "\x00", "a\x00b",
                         "a\nb", "\t", "\x1b[31m", "\x7f", "\u202eevil", "../../etc/passwd", "a b", "é中文",
                         "\ufeff", "-" * 129, "fz-" + "x" * 126])

    def string(self) -> str:
        r = self.rng
        if r.random() < 0.3:
            return self.name()
        return r.choice(["fz-0", "fz-pq", "fz-f16", "fz-tier", secrets.token_hex(r.randint(1, 8)), r.choice(SEQS)])

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
            return self.scale()
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

    def scale(self) -> float:
        r = self.rng
        return r.choice([0.0, 0.0, -1.0, -0.0, math.nan, math.inf, -math.inf, 3e38, 1e30, 1e20, 1e-30, 5e-324,
                         r.uniform(0, 2), r.uniform(-10, 10)])

    # --- plausible requests
    def tensor(self, shape, dtype=None) -> pb.Tensor:
        """Mostly fp16; fp32 and bf16 too, some with one value that overflows
        on conversion to the cache dtype (or NaN)."""
        import numpy as np
        import torch
        r = self.rng
        if dtype is None:
            dtype = pb.FLOAT16 if self.clean else r.choices([pb.FLOAT16, pb.FLOAT32, pb.BFLOAT16], [6, 3, 1])[0]
        n = math.prod(shape) * (4 if dtype == pb.FLOAT32 else 2)
        if self.buffer_id and not self.clean and r.random() < 0.3 and n <= SHM_BYTES:
            return pb.Tensor(shape=list(shape), dtype=dtype,
                             ref=pb.BufferRef(buffer_id=self.buffer_id, offset=r.choice([0, 64, SHM_BYTES - n])))
        data = np.random.default_rng(r.randint(0, 2**31)).standard_normal(math.prod(shape)).astype(np.float32)
        if data.size and dtype != pb.FLOAT16 and r.random() < 0.4:
            data[r.randrange(data.size)] = r.choice([1e5, 7e4, -65520.0, 65519.0, -3.4e38, 3.4e38, 1e10, math.nan])
        x = torch.from_numpy(data).to({pb.FLOAT16: torch.float16, pb.FLOAT32: torch.float32,
                                       pb.BFLOAT16: torch.bfloat16}[dtype])
        raw = x.view(torch.int16 if x.element_size() == 2 else torch.int32).numpy().tobytes() if data.size else b""
        return pb.Tensor(shape=list(shape), dtype=dtype, inline=raw)

    def out_ref(self):
        return pb.OutputRef(buffer_id=self.buffer_id, offset=self.rng.choice([0, 128, SHM_BYTES - 8]))

    def base(self, method: str):
        method = STREAMS.get(method, method)       # a stream carries the unary call's requests
        r = self.rng
        cache = r.choice(CACHES) if self.clean or r.random() < 0.85 else r.choice(("fz-new", "nope", self.name()))
        if self.clean and method != "Allocate":     # a cache with live sequences to name
            cache = r.choice([c for c in CACHES if self.live[c]] or [cache])
        # The default tenant names its anchors only in calls that cannot change them.
        names = SEQS + ANCHORS if self.other else SEQS
        sid = r.choice(SEQS + ANCHORS if self.other or method in ("SequenceInfo", "Retrieve", "Fork") else SEQS)
        if method in ("Allocate", "SequenceInfo") and r.random() < 0.1:
            sid = self.name()
        ids = r.sample(names, r.randint(1, 3))
        live = sorted(self.live.get(cache, ()))
        if live and not self.other and method != "Allocate" and (self.clean or r.random() < 0.7):
            sid = r.choice(live)
            ids = r.sample(live, r.randint(1, min(3, len(live))))
        b = len(ids)
        if method == "CreateCache":
            odd = r.random() < 0.2
            spec = pb.CacheSpec(name=self.name() if odd and r.random() < 0.5 else r.choice(
                                    ["fz-new", "fz-pq", f"fz-c{r.randint(0, 3)}"]),
                                model_id=self.name() if odd else "fuzz",
                                geometry=pb.Geometry(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D),
                                codec=r.choice(["pq", "fp16"]), block_size=BS, num_blocks=r.randint(1, 32),
                                max_sequences=r.randint(1, 8))
            if r.random() < 0.2:    # learned sink logits: the right count or one off, odd values among them
                n = max(0, L * HQ + r.choice([0, 0, -1, 1]))
                spec.sink_logits.extend(r.choice([0.5, -2.0, 1e30, float("-inf"), float("inf"), float("nan")])
                                        for _ in range(n))
            return pb.CreateCacheRequest(spec=spec, exist_ok=r.random() < 0.5)
        if method in ("GetCache", "GetCodebooks"):
            return getattr(pb, f"{method}Request")(cache=cache)
        if method == "DeleteCache":     # the default tenant only ever deletes caches outside CACHES (fuzz.py)
            return pb.DeleteCacheRequest(cache=cache if self.other or cache not in CACHES else "fz-new",
                                         force=r.random() < 0.5)
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
            layer = None if self.clean and r.random() < 0.8 else r.choice([None, 0, 1])
            shape = (sum(counts), HKV, D) if layer is not None else (L, sum(counts), HKV, D)
            req = pb.AppendRequest(cache=cache, sequence_ids=ids, counts=counts, k=self.tensor(shape),
                                   v=self.tensor(shape))
            if layer is not None:
                req.layer = layer
            elif r.random() < 0.5 and not self.clean:     # ids that differ from the prompt's are refused
                req.token_ids.extend(pb.TokenIds(ids=[r.randint(0, 20) for _ in range(c)]) for c in counts)
            return req
        if method in ("Attend", "AppendAttend"):
            req = (pb.AttendRequest if method == "Attend" else pb.AppendAttendRequest)(
                cache=cache, layer=r.randint(0, L - 1), sequence_ids=ids, q=self.tensor((b, HQ, D)),
                scale=self.scale() if not self.clean and r.random() < 0.5 else 0.0)
            if method == "AppendAttend":
                req.k.CopyFrom(self.tensor((b, HKV, D)))
                req.v.CopyFrom(self.tensor((b, HKV, D)))
                if r.random() < 0.3:      # ids of the new tokens; a wrong count is refused
                    req.token_ids.extend(r.randint(0, 20) for _ in range(b + (0 if self.clean else r.randint(-1, 1))))
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
            return pb.ForkRequest(cache=cache, sequence_id=sid,
                                  new_sequence_id=self.name() if r.random() < 0.1 else r.choice(SEQS))
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
