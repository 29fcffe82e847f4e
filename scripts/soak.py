#!/usr/bin/env python3
"""Soak a live daemon: client processes doing random allocate / append /
decode (append-attend) / attend / retrieve / fork / free for N minutes.

    python scripts/soak.py --minutes 5 --clients 8

One client crashes on purpose now and then (os._exit, nothing freed) and is
respawned: the daemon's lease reaper must free what it held. At the end every
block must be accounted for (used == 0 in every pool once all clients are
gone), no sequence or buffer left behind, pool invariants checked after every
call (KVSTORE_DEBUG_INVARIANTS=1), and the daemon's RSS flat after warm-up.
Prints ops/s, errors, blocks leaked and RSS start/end.

    python scripts/soak.py --tiers --minutes 10

--tiers: tier pressure (scripts/soak_tiers.py): both codecs (pq also with sinks) on GPU pools so
small that sequences keep moving to a host tier and a bounded LMDB, Offload
and Prefetch among the ops, every Retrieve and Attend checked against what
was written; at the end nothing is held in any tier (host pools and the
disk's held bytes included) and LMDB is within its bound.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import soak_tiers  # noqa: E402

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 16
CACHES = ("soak-pq", "soak-f16")
MAX_LIVE, MAX_LEN = 6, 256
PREFIXES = [list(range(1000 * i, 1000 * i + 48)) for i in range(4)]   # shared system prompts: prefix hits


# ------------------------------------------------------------------ worker
def worker(target: str, idx: int, seconds: float, seed: int, crash_after: float) -> None:
    import grpc
    import torch
    from kvstore.client import KVStoreClient
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv = KVStoreClient(target)
    live: dict[str, list] = {}          # seq id -> [cache, length]
    ops: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    t0 = time.time()
    n = 0

    def rnd(*shape):
        return torch.randn(*shape).half()

    def drop(sid):
        cache, _ = live.pop(sid)
        kv.free(cache, [sid])

    while time.time() - t0 < seconds:
        if crash_after and time.time() - t0 > crash_after:
            os._exit(3)     # a crash: nothing freed, no goodbye; the lease must clean up
        n += 1
        op = rng.choices(["allocate", "decode", "attend", "append", "fork", "free", "retrieve"],
                         [3, 6, 2, 2, 1, 2, 1])[0]
        if op in ("allocate", "fork") and len(live) >= MAX_LIVE or op != "allocate" and not live:
            op = "free" if live else "allocate"
        sid = rng.choice(sorted(live)) if live else None
        try:
            if op == "allocate":
                new, cache = f"w{idx}-{seed}-{n}", rng.choice(CACHES)
                prompt = rng.choice(PREFIXES) + [rng.randrange(50_000) for _ in range(rng.randint(0, 40))]
                cached = kv.allocate(cache, new, prompt)
                live[new] = [cache, cached]
                rest = len(prompt) - cached
                kv.append(cache, [new], rnd(L, rest, HKV, D), rnd(L, rest, HKV, D), token_ids=[prompt[cached:]])
                live[new][1] = len(prompt)
            elif op == "decode":
                cache = live[sid][0]
                same = [s for s, (c, _) in live.items() if c == cache]
                ids = rng.sample(same, min(len(same), 1 + rng.randrange(2)))
                for layer in range(L):
                    kv.append_attend(cache, layer, ids, rnd(len(ids), HKV, D), rnd(len(ids), HKV, D),
                                     rnd(len(ids), HQ, D))
                for s in ids:
                    live[s][1] += 1
            elif op == "attend":
                kv.attend(live[sid][0], rng.randrange(L), [sid], rnd(1, HQ, D))
            elif op == "append":
                k = rng.randint(1, 24)
                kv.append(live[sid][0], [sid], rnd(L, k, HKV, D), rnd(L, k, HKV, D))
                live[sid][1] += k
            elif op == "fork":
                new = f"w{idx}-{seed}-{n}f"
                kv.fork(live[sid][0], sid, new)
                live[new] = list(live[sid])
            elif op == "retrieve":
                cache, length = live[sid]
                s = rng.randrange(length)
                kv.retrieve(cache, sid, s, min(length, s + rng.randint(1, 32)))
            elif op == "free":
                drop(sid)
            ops[op] += 1
            if sid in live and live[sid][1] > MAX_LEN:
                drop(sid)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A full pool is a normal answer: give back what this op touched.
                errors["RESOURCE_EXHAUSTED"] += 1
                for s in [s for s in (sid, f"w{idx}-{seed}-{n}", f"w{idx}-{seed}-{n}f") if s in live]:
                    drop(s)
            else:
                errors[f"{op}: {e.code().name}: {e.details()[:100]}"] += 1
    for s in list(live):
        drop(s)
    kv.close()
    print(json.dumps({"ops": dict(ops), "errors": dict(errors)}), flush=True)


# ------------------------------------------------------------------ parent
def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def start_daemon(tmp: str, lease_timeout: float, debug: bool, extra: list[str] = ()):
    sock = os.path.join(tmp, "run", "kv.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTORE_DEBUG_INVARIANTS="1" if debug else "0")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cpu",
                          "--lease-timeout", str(lease_timeout), "--metrics-port", "0", "--log-level", "WARNING",
                          *extra],
                         stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "daemon.log"), "w"), text=True, env=env)
    line = p.stdout.readline()
    m = re.search(r"metrics on (http://\S+)", line)
    if not m:
        p.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return p, f"unix://{sock}", m.group(1)


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def usage(kv) -> dict:
    """Blocks used in every pool of every tier, sequences, and bytes sequences hold on disk."""
    caches = kv.stats().caches
    used = {f"{c.cache}.{t}": getattr(c, t).used for c in caches for t in ("main", "tail", "host", "host_tail")}
    return dict(used=used, blocks=sum(used.values()), sequences=sum(c.sequences for c in caches),
                disk_held=max((c.disk_held_bytes for c in caches), default=0), caches=caches)


def run(minutes: float, clients: int = 8, lease_timeout: float = 3.0, seed: int = 0, crash: bool = True,
        debug: bool = True, verbose: bool = True, tiers: bool = False) -> dict:
    import torch
    from kvstore.client import KVStoreClient
    from kvstore.codec.codebooks import Codebooks
    seconds = minutes * 60
    tmp = tempfile.mkdtemp(prefix="kvstore-soak-")
    extra = ["--lmdb", os.path.join(tmp, "lmdb"), "--lmdb-max-bytes", str(soak_tiers.LMDB_MAX_BYTES)] if tiers else []
    proc, target, metrics_url = start_daemon(tmp, lease_timeout, debug, extra)
    kv = KVStoreClient(target, transport="inline")
    failures: list[str] = []
    codebooks = os.path.join(tmp, "codebooks.safetensors")
    try:
        if tiers:
            for name in soak_tiers.CACHES:
                kv.create_cache(name, "soak-model", **soak_tiers.cache_kwargs(name))
        else:
            for name, codec in zip(CACHES, ("pq", "fp16")):
                kv.create_cache(name, "soak-model", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                codec=codec, block_size=BS, residual=R, num_blocks=768, max_sequences=96)
        g = torch.Generator().manual_seed(seed)
        if tiers:    # the clients compute the codes of what they wrote: they need the codebooks
            Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                      v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)).save(codebooks)
            with open(codebooks, "rb") as f:
                data = f.read()
            for name, (codec, _, _) in soak_tiers.CACHES.items():
                if codec == "pq":
                    kv.set_codebooks(name, data)
        else:
            kv.train_codebooks("soak-pq", torch.randn(L, 512, HKV, D, generator=g),
                               torch.randn(L, 512, HKV, D, generator=g), niter=4)
        rng = random.Random(seed)
        t0 = time.time()

        def spawn(i: int, crash_after: float = 0.0):
            left = max(1.0, seconds - (time.time() - t0))
            return subprocess.Popen([sys.executable, __file__, "--tier-worker" if tiers else "--worker", target, str(i),
                                     str(left), str(rng.randrange(1 << 30)), str(crash_after), codebooks],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        crash_next = lambda: rng.uniform(10, 25) if crash else 0.0  # noqa: E731
        procs = {i: spawn(i, crash_next() if i == 0 else 0.0) for i in range(clients)}
        results, crashes, crashed_pids = [], 0, []
        samples = []     # (t, rss kB, used blocks, sequences)
        while procs:
            time.sleep(1.0)
            t = time.time() - t0
            u = usage(kv)
            samples.append((t, rss_kb(proc.pid), u["blocks"], u["sequences"]))
            for i, p in list(procs.items()):
                if p.poll() is None:
                    continue
                out, err = p.communicate()
                del procs[i]
                if p.returncode == 3:
                    crashes += 1
                    crashed_pids.append(p.pid)
                    if t < seconds - 5:
                        procs[i] = spawn(i, crash_next())
                elif p.returncode != 0:
                    failures.append(f"client {i} exited {p.returncode}: {err[-500:]}")
                else:
                    results.append(json.loads(out.strip().splitlines()[-1]))
            if proc.poll() is not None:
                failures.append(f"daemon died with exit code {proc.returncode}")
                break
            if verbose and int(t) % 15 == 0:
                print(f"  t={t:5.0f}s rss={samples[-1][1] / 1024:.0f} MiB used blocks={u['blocks']} "
                      f"sequences={u['sequences']} crashes={crashes}", flush=True)
        elapsed = time.time() - t0
        # Crashed clients' sessions lapse after the lease timeout; then nothing may be held.
        deadline = time.time() + 3 * lease_timeout + 10
        while time.time() < deadline and usage(kv)["sequences"]:
            time.sleep(0.5)
        end = usage(kv)
        m = scrape(metrics_url)
        for pid in crashed_pids:     # a crashed client leaves its /dev/shm arena behind; the daemon has unmapped it
            for path in glob.glob(f"/dev/shm/kvstore-{pid}-*"):
                os.unlink(path)
        ops = collections.Counter()
        errors = collections.Counter()
        for r in results:
            ops.update(r["ops"])
            errors.update(r["errors"])
        # Warm-up: clients take a while to import torch; measure from first traffic plus a quarter of the run.
        first = next((s[0] for s in samples if s[3]), 0.0)
        warm = [s for s in samples if s[0] >= first + min(30.0, seconds * 0.25)] or samples
        rss_start, rss_end = warm[0][1], rss_kb(proc.pid)
        half = len(warm) // 2
        used_first = sum(s[2] for s in warm[:half]) / max(1, half)
        used_second = sum(s[2] for s in warm[half:]) / max(1, len(warm) - half)
        unexpected = {k: v for k, v in errors.items() if k != "RESOURCE_EXHAUSTED"}
        if unexpected:
            failures.append(f"unexpected errors: {unexpected}")
        if end["blocks"]:
            failures.append(f"{end['blocks']} blocks still used after every client is gone: {end['used']}")
        if end["sequences"]:
            failures.append(f"{end['sequences']} sequences leaked")
        if end["disk_held"]:
            failures.append(f"{end['disk_held']} bytes still held on disk after every client is gone")
        disk_over = [f"{c.cache}: {c.disk_used_bytes} > {c.disk_max_bytes}" for c in end["caches"]
                     if c.disk_max_bytes and c.disk_used_bytes > c.disk_max_bytes]
        if disk_over:
            failures.append(f"LMDB over its bound: {disk_over}")
        tier = {k: sum(getattr(c, k) for c in end["caches"]) for k in (
            "offloads_host", "offloads_disk", "page_ins_host", "page_ins_disk", "prefix_hit_blocks_host",
            "prefix_hit_blocks_disk", "spilled_blocks")}
        for k in ("disk_used_bytes", "disk_max_bytes", "disk_evictions", "disk_skipped_spills"):
            tier[k] = getattr(end["caches"][0], k)                    # one store: every cache reports it
        reads = sum(ops.get(k, 0) for k in ("read", "attend", "retrieve"))
        if m.get("kvstore_registered_buffers", 0):
            failures.append(f"{m['kvstore_registered_buffers']:.0f} buffers still registered")
        result = dict(
            seconds=round(elapsed, 1), clients=clients, ops=sum(ops.values()),
            ops_per_s=round(sum(ops.values()) / elapsed, 1), ops_by_kind=dict(ops), resource_exhausted=errors.get(
                "RESOURCE_EXHAUSTED", 0), crashes=crashes,
            lease_freed_sequences=int(m.get("kvstore_lease_freed_sequences_total", 0)),
            lease_released_buffers=int(m.get("kvstore_lease_released_buffers_total", 0)),
            blocks_leaked=end["blocks"], sequences_leaked=end["sequences"], disk_held_bytes=end["disk_held"],
            checked_reads=reads, tiers=tier if tiers else None,
            rss_start_mib=round(rss_start / 1024, 1), rss_end_mib=round(rss_end / 1024, 1),
            rss_growth_mib=round((rss_end - rss_start) / 1024, 1),
            used_blocks_mean_first_half=round(used_first, 1), used_blocks_mean_second_half=round(used_second, 1),
            failures=failures, ok=not failures, log=os.path.join(tmp, "daemon.log"))
        return result
    finally:
        kv.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--tier-worker"):
        target, idx, seconds, seed, crash_after, codebooks = sys.argv[2:8]
        if sys.argv[1] == "--worker":
            worker(target, int(idx), float(seconds), int(seed), float(crash_after))
        else:
            soak_tiers.worker(target, int(idx), float(seconds), int(seed), float(crash_after), codebooks)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--lease-timeout", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-crash", action="store_true", help="no client crashes on purpose")
    p.add_argument("--no-debug-invariants", action="store_true", help="skip the per-call invariant check")
    p.add_argument("--tiers", action="store_true",
                   help="tier pressure: tiny GPU pools over a host tier and a bounded LMDB, every read checked")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run(args.minutes, args.clients, args.lease_timeout, args.seed, not args.no_crash,
              not args.no_debug_invariants, verbose=not args.json, tiers=args.tiers)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"soak: {res['seconds']}s, {res['clients']} clients, {res['ops']} ops ({res['ops_per_s']} ops/s), "
              f"{res['resource_exhausted']} RESOURCE_EXHAUSTED, {res['crashes']} crashes "
              f"(lease reaper freed {res['lease_freed_sequences']} sequences, {res['lease_released_buffers']} buffers)")
        print(f"  blocks leaked {res['blocks_leaked']}, sequences leaked {res['sequences_leaked']}; "
              f"daemon RSS {res['rss_start_mib']} -> {res['rss_end_mib']} MiB after warm-up "
              f"({res['rss_growth_mib']:+} MiB); used blocks mean {res['used_blocks_mean_first_half']} -> "
              f"{res['used_blocks_mean_second_half']}")
        if res["tiers"] is not None:
            print(f"  tiers: {res['checked_reads']} reads checked; " + ", ".join(f"{k} {v}" for k, v in res["tiers"].items())
                  + f"; disk held after: {res['disk_held_bytes']} bytes")
        for f in res["failures"]:
            print("FAIL", f)
        print("PASS" if res["ok"] else f"FAIL (daemon log: {res['log']})")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
