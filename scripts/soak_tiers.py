"""The tier-pressure client of scripts/soak.py (`--tiers`): GPU pools small
enough that sequences keep moving to the host and to LMDB (which is bounded),
prefix blocks spilled and hit from below, Offload / Prefetch, and every read
checked.

K/V are what a model would give: a function of the token prefix (a seeded
draw per chained token hash), so a prefix hit serves exactly what the client
would have written, whichever client wrote it. Checks:
- Retrieve, codec fp16: bit-identical to the K/V written.
- Retrieve, codec pq: every token bit-identical either to the K/V written
  (fp16 sinks and tail) or to its PQ codes dequantized (sealed), computed here
  with the reference encoder and the codebooks the soak set (the CPU daemon
  runs the same reference code); the sink tokens exact, then the sealed
  tokens first. One pq cache keeps sink tokens, with a tail pool small enough
  that its cached fp16 blocks are evicted and served from below.
- Attend: bit-identical before and after the sequence's round trip through
  the disk (Offload, then the page-in of the next Attend), and within 2e-3 of
  an fp64 attention over the K/V just retrieved and checked (attention is
  computed, not stored: its rounding is the daemon's).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import time

import numpy as np

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 16
# name -> (codec, sink tokens, max_sequences: the tail pool's size for pq)
CACHES = {"soak-pq": ("pq", 0, 96), "soak-f16": ("fp16", 0, 96), "soak-pq-sinks": ("pq", 16, 12)}
NUM_BLOCKS = 48                    # GPU main pool of each cache: about 5 of the 48 live sequences
HOST_BLOCKS = 64                   # host pools (main and tail), blocks each
LMDB_MAX_BYTES = 1 << 19           # the disk bound: Offload and pressure moves past it are refused
MAX_LIVE, MAX_LEN = 6, 200
PREFIXES = [list(range(1000 * i, 1000 * i + 48)) for i in range(4)]


def cache_kwargs(name: str) -> dict:
    codec, sinks, max_sequences = CACHES[name]
    main = 2 * L * HKV * BS * (D // 2 if codec == "pq" else 2 * D)     # bytes of one block
    fp16 = 2 * L * HKV * BS * 2 * D
    return dict(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec, block_size=BS,
                residual=R, num_blocks=NUM_BLOCKS, max_sequences=max_sequences, sink_tokens=sinks,
                host_bytes=HOST_BLOCKS * (main + fp16))


class Shadow:
    """A sequence as the client wrote it: token ids, chained hashes, K/V."""

    def __init__(self, tokens=(), parent=None):
        self.tokens, self.hashes, self.k, self.v = [], [], [], []
        if parent is not None:
            self.tokens, self.hashes = list(parent.tokens), list(parent.hashes)
            self.k, self.v = list(parent.k), list(parent.v)
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            h = hashlib.sha256((self.hashes[-1] if self.hashes else b"") + int(t).to_bytes(4, "little")).digest()
            x = np.random.default_rng(int.from_bytes(h[:8], "little")).standard_normal((2, L, HKV, D))
            self.tokens.append(int(t))
            self.hashes.append(h)
            self.k.append(x[0].astype(np.float16))
            self.v.append(x[1].astype(np.float16))

    def kv(self, start: int, end: int, layer: int | None = None):
        """-> torch K, V [L, n, Hkv, d] (or [n, Hkv, d] of one layer) of tokens [start, end)."""
        import torch
        k = torch.from_numpy(np.stack(self.k[start:end], axis=1))
        v = torch.from_numpy(np.stack(self.v[start:end], axis=1))
        return (k, v) if layer is None else (k[layer], v[layer])


def dequantized(k, v, codebooks):
    """K, V [L, n, Hkv, d] fp16 -> their PQ codes dequantized, fp16, as the daemon seals them."""
    import torch
    from kvstore.kernels import reference as ref
    out = []
    for x, cb in ((k, codebooks.k), (v, codebooks.v)):
        out.append(torch.stack([ref.pq_dequantize(ref.pq_encode(x[layer], cb[layer]), cb[layer]).half()
                                for layer in range(x.shape[0])]))
    return out


def check_read(got, want, dq, sinks: int = 0) -> str | None:
    """got, want (and dq for pq): K, V [L, n, Hkv, d] -> None, or what is wrong.
    sinks: how many of the tokens read are sink tokens (exact)."""
    import torch
    exact = torch.stack([(g == w).flatten(start_dim=2).all(-1).all(0) for g, w in zip(got, want)]).all(0)
    if dq is None:
        return None if bool(exact.all()) else f"tokens {exact.logical_not().nonzero().flatten()[:8].tolist()} differ"
    if not bool(exact[:sinks].all()):
        return f"sink tokens {exact[:sinks].logical_not().nonzero().flatten()[:8].tolist()} differ"
    exact[:sinks] = False          # the order rule below is for the tokens after them
    sealed = torch.stack([(g == w).flatten(start_dim=2).all(-1).all(0) for g, w in zip(got, dq)]).all(0)
    sealed[:sinks] = True
    if not bool((exact | sealed).all()):
        bad = (exact | sealed).logical_not().nonzero().flatten()[:8].tolist()
        return f"tokens {bad} are neither what was written nor its codes"
    only_sealed = (sealed & ~exact).nonzero().flatten()
    only_exact = (exact & ~sealed).nonzero().flatten()
    if len(only_sealed) and len(only_exact) and int(only_sealed.max()) > int(only_exact.min()):
        return "a sealed token after an fp16 one"
    return None


def worker(target: str, idx: int, seconds: float, seed: int, crash_after: float, codebooks_path: str) -> None:
    import grpc
    import torch
    from kvstore.client import KVStoreClient
    from kvstore.codec.codebooks import Codebooks
    from kvstore.kernels import reference as ref
    rng = random.Random(seed)
    torch.manual_seed(seed)
    codebooks = Codebooks.load(codebooks_path)
    kv = KVStoreClient(target)
    live: dict[str, tuple[str, Shadow]] = {}
    ops: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    t0, n = time.time(), 0

    def verify(cache, sid, start, end, layer=None):
        """Retrieve tokens [start, end) (all layers, or one) and check them -> K, V."""
        layers = (0, L) if layer is None else (layer, layer + 1)
        k, v = kv.retrieve(cache, sid, start, end, *layers, out_bytes=(layers[1] - layers[0]) * (end - start) * HKV * D * 2)
        want = tuple(t[layers[0]:layers[1]] for t in live[sid][1].kv(start, end))
        dq, sinks = None, max(0, min(end, CACHES[cache][1]) - start)
        if CACHES[cache][0] == "pq":
            dq = dequantized(*want, Codebooks(codebooks.k[layers[0]:layers[1]], codebooks.v[layers[0]:layers[1]]))
        bad = check_read((k, v), want, dq, sinks)
        if bad:
            errors[f"mismatch: {cache} {sid} [{start}, {end}): {bad}"] += 1
        return k, v

    while time.time() - t0 < seconds:
        if crash_after and time.time() - t0 > crash_after:
            os._exit(3)     # a crash: nothing freed; the lease frees what it held, in whatever tier
        n += 1
        op = rng.choices(["allocate", "decode", "append", "read", "attend", "fork", "offload", "prefetch", "free"],
                         [3, 4, 2, 3, 2, 1, 1, 1, 2])[0]
        if op in ("allocate", "fork") and len(live) >= MAX_LIVE or op != "allocate" and not live:
            op = "free" if live else "allocate"
        sid = rng.choice(sorted(live)) if live else None
        new = f"t{idx}-{seed}-{n}"
        touched = {new} | ({sid} if op in ("decode", "append") else set())   # what a refusal leaves unlike its shadow
        try:
            if op == "allocate":
                cache = rng.choice(sorted(CACHES))
                prompt = rng.choice(PREFIXES) + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
                shadow = Shadow(prompt)
                cached = kv.allocate(cache, new, prompt)
                live[new] = (cache, shadow)
                k, v = shadow.kv(cached, len(prompt))
                kv.append(cache, [new], k, v, token_ids=[prompt[cached:]])
            elif op in ("decode", "append"):
                cache = live[sid][0]
                ids = [sid]
                if op == "decode":
                    same = [s for s, (c, _) in live.items() if c == cache and s != sid]
                    ids += rng.sample(same, min(len(same), rng.randrange(2)))
                    touched |= set(ids)
                    for s in ids:
                        live[s][1].extend([rng.randrange(50_000)])
                    for layer in range(L):
                        kk = torch.cat([live[s][1].kv(len(live[s][1].tokens) - 1, len(live[s][1].tokens), layer)[0]
                                        for s in ids])
                        vv = torch.cat([live[s][1].kv(len(live[s][1].tokens) - 1, len(live[s][1].tokens), layer)[1]
                                        for s in ids])
                        kv.append_attend(cache, layer, ids, kk, vv, torch.randn(len(ids), HQ, D).half())
                else:
                    shadow, m = live[sid][1], rng.randint(1, 24)
                    start = len(shadow.tokens)
                    shadow.extend([rng.randrange(50_000) for _ in range(m)])
                    k, v = shadow.kv(start, start + m)
                    kv.append(cache, [sid], k, v, token_ids=[shadow.tokens[start:]])
            elif op == "read":
                length = len(live[sid][1].tokens)
                start = rng.randrange(length) if rng.random() < 0.5 else 0
                verify(live[sid][0], sid, start, length)
            elif op == "attend":
                cache, shadow = live[sid]
                layer, q = rng.randrange(L), torch.randn(1, HQ, D).half()
                out = kv.attend(cache, layer, [sid], q)
                try:
                    kv.offload(cache, [sid])          # a round trip through the disk changes no bit
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                if not torch.equal(kv.attend(cache, layer, [sid], q), out):
                    errors[f"attend: {cache} {sid}: another result after a round trip to disk"] += 1
                k, v = verify(cache, sid, 0, len(shadow.tokens), layer)
                want, _ = ref.attention_dense(q[0].double(), k[0].double(), v[0].double(), 1 / D ** 0.5)
                err = float((out[0].double() - want).abs().max())
                if err > 2e-3:
                    errors[f"attend: {cache} {sid}: off by {err:.2e}"] += 1
            elif op == "fork":
                kv.fork(live[sid][0], sid, new)
                live[new] = (live[sid][0], Shadow(parent=live[sid][1]))
            elif op == "offload":
                kv.offload(live[sid][0], [sid])
            elif op == "prefetch":
                kv.prefetch(live[sid][0], [sid])
            elif op == "free":
                kv.free(live.pop(sid)[0], [sid])
            ops[op] += 1
            if sid in live and len(live[sid][1].tokens) > MAX_LEN:
                kv.free(live.pop(sid)[0], [sid])
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                errors[f"{op}: {e.code().name}: {e.details()[:100]}"] += 1
                continue
            # A full tier is a normal answer. A refused call changed nothing, but
            # its shadow may be ahead (and a decode refused at layer 1 left layer
            # 0's token counted): drop what it touched.
            errors["RESOURCE_EXHAUSTED"] += 1
            for s in touched & set(live):
                kv.free(live.pop(s)[0], [s])
    for s in list(live):
        kv.free(live.pop(s)[0], [s])
    kv.close()
    print(json.dumps({"ops": dict(ops), "errors": dict(errors)}), flush=True)
