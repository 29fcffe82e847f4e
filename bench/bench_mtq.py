"""Multi-token queries from PQ codes (T query tokens per sequence, causal among them).

(a) kernel: the multi-token plans over PQ codes (4-bit M = d/2 and 2-bit M = d/4), the
    CUDA C++ kernel and Triton's (the router's choice from tunables.MTQ_TRITON_ROWS query
    rows a KV head: --tokens 64 and more),
    B=8, L=32K, T=8, Hq 32, Hkv 8, d 128, a 128-token fp16 tail holding the T new
    tokens, against SDPA flash over contiguous fp16 K/V [B, Hkv, L, d] (enable_gqa, mask
    causal over the last T: causal_lower_right) in the same run; median over CUDA-graph
    replays with L2 flushed before each (bench_attention.bench).
(b) time to first token of a 1K-token suffix (--suffix: one or more lengths, one daemon)
    after a 32K-token cached prefix through the HF adapter (codec pq, random codebooks: timing only), the multi-token path
    (prefix_path="codes") against the Retrieve path and against no cache (model.generate
    running the whole prompt), alternated in the same run, median of --reps. The model is a random Llama with Llama-3-8B's per-layer geometry
    (hidden 4096, Hq 32, Hkv 8, d 128) and --layers layers (default 8), fp16, with a
    daemon of its own (server.py, a socket in a temporary directory) on the same GPU.

(c) engine: the engine's AppendAttend of --tokens query tokens (default here 128, a
    prefill chunk) after an --context-token prefix, B=1, --layers layers of Llama-3-8B's
    per-layer geometry, token ids at layer 0 as the adapter sends them; median of --reps
    rounds of one chunk through every layer, GPU included. In process (Engine): ms a call
    with the router's choice against the CUDA plan (tunables.MTQ_TRITON_ROWS = 0),
    interleaved in the same run. Then through a daemon of its own (the client's
    doorbell): ms a call with the GPU, and the round trips of the first, middle and last
    layers apart.

    python bench/bench_mtq.py                 # all three, on a CUDA GPU
    python bench/bench_mtq.py --only kernel   # (a); --only ttft: (b); --only engine: (c)
    TRITON_INTERPRET=1 python bench/bench_mtq.py --smoke    # tiny shapes on a CPU: checks it runs
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvstore import kernels  # noqa: E402
from kvstore.kernels import reference  # noqa: E402


def pq_case(b, L, t, hq, hkv, d, dsub, bs, tail, dev):
    """Random codes, codebooks and an fp16 tail of `tail` tokens (its last t the new ones)."""
    m = d // dsub
    ns = (L - tail) // bs * bs
    nblk = ns // bs
    nt = math.ceil(tail / bs)
    g = torch.Generator(device=dev).manual_seed(0)
    c = dict(k_codes=torch.randint(0, 256, (b * nblk, hkv, bs, m), dtype=torch.uint8, device=dev, generator=g),
             v_codes=torch.randint(0, 256, (b * nblk, hkv, m, bs), dtype=torch.uint8, device=dev, generator=g),
             k_codebook=torch.randn(hkv, m, 256, dsub, device=dev, generator=g).half(),
             v_codebook=torch.randn(hkv, m, 256, dsub, device=dev, generator=g).half(),
             sealed_tables=torch.randperm(b * nblk, device=dev, generator=g).int().view(b, nblk),
             tail_k=torch.randn(b * nt, hkv, bs, d, device=dev, generator=g).half(),
             tail_v=torch.randn(b * nt, hkv, bs, d, device=dev, generator=g).half(),
             tail_tables=torch.randperm(b * nt, device=dev, generator=g).int().view(b, nt))
    return c, [ns] * b, [tail] * b


def sdpa_fn(q, k, v):
    """SDPA over q [B, Hq, T, d], k/v [B, Hkv, L, d], causal over the last T -> (fn, which)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    f = torch.nn.functional.scaled_dot_product_attention
    mask = causal_lower_right(q.shape[2], k.shape[2])
    tries = [("flash, causal_lower_right", [SDPBackend.FLASH_ATTENTION], mask),
             # the mask covers T x T of T x L scores: timing the unmasked call is the same work
             ("flash, unmasked", [SDPBackend.FLASH_ATTENTION], None),
             ("default backend, causal_lower_right", None, mask)]
    for which, backends, m in tries:
        def fn(backends=backends, m=m):
            if backends is None:
                return f(q, k, v, attn_mask=m, enable_gqa=True)
            with sdpa_kernel(backends):
                return f(q, k, v, attn_mask=m, enable_gqa=True)
        try:
            fn()
            return fn, which
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def kernel(args):
    dev = "cpu" if args.smoke else "cuda"
    b, L, t, hq, hkv, d, bs, tail = (2, 160, 5, 4, 2, 64, 16, 32) if args.smoke else \
        (args.batch, args.context, args.tokens or 8, 32, 8, 128, 16, 128)
    scale = d ** -0.5
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(b, t, hq, d, device=dev, generator=gen).half()
    k = torch.randn(b, hkv, L, d, device=dev, generator=gen).half()
    fn, which = sdpa_fn(q.transpose(1, 2), k, torch.randn_like(k))
    if not args.smoke:
        import bench_attention as ba
        t_sdpa = ba.bench(fn)
        print(f"B={b} L={L} T={t} Hq {hq} Hkv {hkv} d {d}; SDPA ({which}) {t_sdpa:.1f} us")
    backends = ("triton",) if args.smoke else ("cuda", "triton")
    if not args.smoke:
        print("  the router's choice: " + kernels.decode_backend(
            "pq", device=dev, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=q.dtype,
            query_tokens=t) + " (tunables.MTQ_TRITON_ROWS: Triton from that many query rows a KV head)")
    for (bits, dsub), backend in ((x, y) for x in ((4, 2), (2, 4)) for y in backends):
        c, sl, tl_ = pq_case(b, L, t, hq, hkv, d, dsub, bs, tail, dev)
        plan = kernels.plan_decode("pq", sl, tl_, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                   tail_block_size=bs, device=dev, dtype=q.dtype, query_tokens=t,
                                   backend=backend)
        out = torch.empty_like(q)
        lse = torch.empty(b, t, hq, device=dev)
        args_ = [c[n] for n in ("k_codes", "v_codes", "k_codebook", "v_codebook", "sealed_tables", "tail_k",
                                "tail_v", "tail_tables")]
        run = lambda: plan.run_pq(q, *args_, scale, out=out, lse=lse)   # noqa: E731
        run()
        # check against the reference on one sequence (the reference is slow at 32K)
        one = {n: (x[:1] if n.endswith("tables") else x) for n, x in c.items()}
        c64 = {n: (x.cpu().double() if x.is_floating_point() else x.cpu()) for n, x in one.items()}
        ro, _ = reference.pq_multi_attention(q[:1].cpu().double(), **c64, sealed_lens=torch.tensor(sl[:1]),
                                             tail_lens=torch.tensor(tl_[:1]), scale=scale)
        err = ((out[:1].cpu().double() - ro).norm() / ro.norm()).item()
        assert err < 1e-2, f"{bits}-bit: relative error {err:.2e} against the reference"
        if args.smoke:
            print(f"smoke {bits}-bit: B={b} L={L} T={t} d {d}: matches the reference (rel err {err:.1e}); "
                  f"SDPA ({which}) ran")
            continue
        import bench_attention as ba
        t_pq = ba.bench(run)
        print(f"  PQ {bits}-bit multi-token, {backend}: {t_pq:.1f} us = {t_sdpa / t_pq:.2f}x SDPA "
              f"(rel err vs reference {err:.1e})")


@contextlib.contextmanager
def daemon(dev):
    """A daemon of its own (server.py, a socket in a temporary directory) -> its target."""
    import subprocess

    from kvstore.tools.demo import wait_serving
    with tempfile.TemporaryDirectory() as tmp:
        target = "unix://" + os.path.join(tmp, "kv.sock")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        server = subprocess.Popen([sys.executable, os.path.join(root, "server.py"), "--socket", target[7:],
                                   "--device", dev, "--log-level", "WARNING"])
        try:
            wait_serving(target, server)
            yield target
        finally:
            server.terminate()
            server.wait()


def ttft(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstore.client.hf import KVStoreAdapter
    from kvstore.codec.codebooks import Codebooks
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:
        geo = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=128)
        prefix, suffixes, reps = 96, [40], 1
    else:
        geo = dict(num_hidden_layers=args.layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=14336, vocab_size=32000)
        prefix, suffixes, reps = args.context, args.suffix, args.reps
    torch.manual_seed(0)
    cfg = LlamaConfig(**geo, max_position_embeddings=prefix + max(suffixes) + 64, attn_implementation="sdpa")
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.float16 if dev == "cuda" else torch.float32).eval()
    hkv, d, nl = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(nl, hkv, d // 2, 256, 2, generator=g), v=torch.randn(nl, hkv, d // 2, 256, 2, generator=g))
    head = torch.randint(3, cfg.vocab_size, (1, prefix), generator=g)

    def prompt(suffix):     # the cached prefix and a suffix never seen before: only the prefix hits
        return torch.cat([head, torch.randint(3, cfg.vocab_size, (1, suffix), generator=g)], 1).to(dev)
    with daemon(dev) as target:
        blocks = 2 * (prefix + max(suffixes)) // 16 + 512
        kw = dict(cache="mtq", codec="pq", codebooks=cb.to_bytes(), transform="none", num_blocks=blocks,
                  max_sequences=4)
        ads = {p: KVStoreAdapter(model, target, prefix_path=p, **kw) for p in ("codes", "retrieve")}
        gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
        med = {}
        with torch.no_grad():
            ads["retrieve"].generate(head.to(dev), **gen)            # the cached prefix
            for suffix in suffixes:
                times = {p: [] for p in (*ads, "none")}
                for _ in range(reps + 1):                             # the first round warms up
                    for p in times:
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        ids = prompt(suffix)
                        t0 = time.perf_counter()
                        (ads[p].generate if p in ads else model.generate)(ids, **gen)   # none: the whole prompt
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        times[p].append(time.perf_counter() - t0)
                med[suffix] = {p: statistics.median(v[1:] if len(v) > 1 else v) for p, v in times.items()}
            hit = ads["codes"].stats().prefix_hit_tokens
            ads["codes"].generate(prompt(suffixes[0]), **gen)
            hit = ads["codes"].stats().prefix_hit_tokens - hit      # one request's
        # a request that fell back in-process, or missed the prefix, times something else
        assert all(ad.fallbacks == 0 for ad in ads.values()), "the adapter fell back in-process"
        # (the newest residual tokens of the prefix stay in fp16, unshared, until a longer
        # request seals them)
        assert hit >= prefix - 128 - 16, f"a request hit {hit} tokens of the {prefix}-token prefix"
        for ad in ads.values():
            ad.close()
    print(f"TTFT after a {prefix}-token cached prefix (a request hits {hit}), "
          f"random Llama {nl} layers x (hidden {cfg.hidden_size}, Hq {cfg.num_attention_heads}, Hkv {hkv}, d {d}), "
          f"codec pq 4-bit, {dev}, median of {max(1, reps)}:")
    for suffix, m in med.items():
        print(f"  {suffix:>5}-token suffix: multi-token path {1e3 * m['codes']:.1f} ms, Retrieve path "
              f"{1e3 * m['retrieve']:.1f} ms: {m['retrieve'] / m['codes']:.2f}x; no cache (the whole prompt "
              f"in-process) {1e3 * m['none']:.1f} ms")


def engine(args):

    from kvstore.client import KVStoreClient
    from kvstore.codec.codebooks import Codebooks
    from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
    from kvstore.engine.engine import Engine
    from kvstore.kernels import tunables
    dev = "cpu" if args.smoke else "cuda"
    nl, hq, hkv, d, bs = (3, 4, 2, 64, 16) if args.smoke else (args.layers, 32, 8, 128, 16)
    if nl < 3:
        sys.exit("--layers: the engine bench times a first, a middle and a last layer: give 3 or more")
    prefix, t, reps = (320, 4, 1) if args.smoke else (args.context, args.tokens or 128, args.reps)
    rounds = 2 * (reps + 2)
    blocks = (prefix + rounds * t) // bs + 64
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(nl, hkv, d // 2, 256, 2, generator=g), v=torch.randn(nl, hkv, d // 2, 256, 2, generator=g))
    kn = torch.randn(t, hkv, d, device=dev, dtype=torch.float16)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.float16)
    out = torch.empty_like(q)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def fill(append):       # the prefix, 4K tokens a call, with ids (hashed as the adapter's are)
        for lo in range(0, prefix, 4096):
            n = min(4096, prefix - lo)
            k = torch.randn(nl, n, hkv, d, device=dev, dtype=torch.float16)
            append(k, [list(range(lo, lo + n))])
        return prefix

    def chunk(call, pos):   # one prompt chunk through every layer -> [seconds a call] + [the wait for the GPU after]
        ids, took = list(range(pos, pos + t)), []
        sync()
        for layer in range(nl):
            t0 = time.perf_counter()
            call(layer, ids if layer == 0 else None)
            took.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sync()
        return took + [time.perf_counter() - t0]

    # in process: the router's choice against the CUDA plan
    cfg = CacheConfig(name="c", model_id="llama-3-8b-geometry", geometry=ModelGeometry(nl, hq, hkv, d),
                      codec=CodecConfig("pq"), block_size=bs, residual=128, sink_tokens=32,
                      num_blocks=blocks, max_sequences=2, device=dev)
    e = Engine(device=dev)
    e.create_cache(cfg)
    e.set_codebooks("c", cb)
    e.allocate("c", "t", "s", [])
    pos = fill(lambda k, ids: e.append("c", "t", ["s"], k, k, [k.shape[1]], token_ids=ids))

    def local(layer, ids):
        e.append_attend("c", "t", layer, ["s"], kn, kn, q, query_tokens=t, out=out, token_ids=ids)
    rows, chosen = tunables.MTQ_TRITON_ROWS, kernels.decode_backend(
        "pq", device=dev, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        dtype=torch.float16, query_tokens=t)
    times = {"router": [], "cuda": []}
    # two warm-up rounds each, then pairs in alternating order (router, cuda, cuda, router,
    # ...): the engine's host work repeats with a period of rounds (blocks seal and encode
    # in batches), which a plain alternation would charge to one side
    order = ["router", "cuda"] * 2 + [w for i in range(reps) for w in (("router", "cuda"), ("cuda", "router"))[i % 2]]
    try:
        for i, which in enumerate(order):
            tunables.MTQ_TRITON_ROWS = rows if which == "router" else 0
            took = sum(chunk(local, pos))
            pos += t
            if i >= 4:
                times[which].append(took)
    finally:
        tunables.MTQ_TRITON_ROWS = rows
    del e

    # the same chunks through a daemon (the doorbell): each call's round trip by its layer
    with daemon(dev) as target, KVStoreClient(target) as c:
        c.create_cache("c", "llama-3-8b-geometry", num_layers=nl, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs, residual=128, sink_tokens=32, num_blocks=blocks, max_sequences=2)
        c.set_codebooks("c", cb.to_bytes())
        c.allocate("c", "s", [])
        pos = fill(lambda k, ids: c.append("c", ["s"], k, k, token_ids=ids))

        def remote(layer, ids):
            c.append_attend("c", layer, ["s"], kn, kn, q, out=out, query_tokens=t, token_ids=ids)
        calls = []
        for i in range(reps + 2):
            took = chunk(remote, pos)
            pos += t
            if i >= 2:
                calls.append(took)
    if args.smoke:
        print("smoke engine (CPU times, not the GPU's):")
    a, b = (statistics.median(times[w]) / nl for w in ("router", "cuda"))
    print(f"AppendAttend of T={t} after {prefix} tokens, B=1, {nl} layers (Hq {hq} Hkv {hkv} d {d}, pq 4-bit), "
          f"median of {reps}:")
    print(f"  in process: the router's choice ({chosen}) {1e3 * a:.3f} ms a call, the CUDA plan {1e3 * b:.3f} ms: "
          f"{b / a:.2f}x")
    med = [statistics.median(x[j] for x in calls) for j in range(nl + 1)]
    print(f"  through the daemon (router's choice): {1e3 * statistics.median(map(sum, calls)) / nl:.3f} ms a call "
          f"with the GPU; round trips: the first layer {1e3 * med[0]:.3f} ms (it plans), the middle ones "
          f"{1e3 * statistics.median(med[1:nl - 1]):.3f}, the last {1e3 * med[nl - 1]:.3f} (its commit seals and "
          f"encodes the chunk's blocks); the GPU's work left after the last {1e3 * med[nl]:.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("kernel", "ttft", "engine"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (set TRITON_INTERPRET=1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tokens", type=int, help="query tokens per sequence (kernel: default 8; engine: 128)")
    ap.add_argument("--suffix", type=int, nargs="+", default=[1024],
                    help="prompt tokens after the cached prefix (ttft), one or more")
    ap.add_argument("--layers", type=int, default=8, help="layers of the random Llama (ttft) and of the engine (engine)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    if not args.smoke:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.only in (None, "kernel"):
        kernel(args)
    if args.only in (None, "ttft"):
        ttft(args)
    if args.only in (None, "engine"):
        engine(args)


if __name__ == "__main__":
    main()
