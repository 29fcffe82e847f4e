"""Train 4-bit codebooks from capw.pt with per-row weights (scratch, session 5).
usage: trainw.py OUT KMODE VMODE ALPHA [MIX]
  mode: none | mass | p2 | p2v ; weights -> (w/mean)^alpha, then (1-mix) + mix*w"""
import sys, os, math, torch, numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kvstore.codec.codebooks import Codebooks
from kvstore.codec.transform import Transform, transform_path
from kvstore.tools import calibrate as C, models
import faiss
torch.set_num_threads(2)
faiss.omp_set_num_threads(2)
out, kmode, vmode, alpha = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
mix = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
bits = int(os.environ.get("BITS", "4"))
cap = torch.load("capw.pt")
model, tok = models.load_smollm2()
kmet = os.environ.get("KMET", "qq")
tr0 = C.qaware_transform(model, cap["qq"] if kmet == "qq" else cap["qw"][kmet])
print("K metric", kmet, flush=True)
g = models.geometry_of(model)
m = g.head_dim // (2 if bits == 4 else 4)

def weights(mode, l, h):
    if mode == "none":
        return None
    w = cap["w"][mode][l][:, h].double()
    w = (w / w.mean()).clamp_min(1e-6) ** alpha
    w = w / w.mean()
    return ((1 - mix) + mix * w).float()

def eig_w(x, w):
    n, d = x.shape
    xd = x.double()
    ww = torch.ones(n, dtype=torch.float64) if w is None else w.double()
    mu = (ww[:, None] * xd).sum(0) / ww.sum()
    xc = xd - mu
    cov = (xc * ww[:, None]).T @ xc / ww.sum()
    ev, u = torch.linalg.eigh(cov)
    floor = ev.max().clamp_min(1e-30) * 1e-12
    dsub = d // m
    buckets = [[] for _ in range(m)]; logp = [0.0] * m
    for i in ev.argsort(descending=True).tolist():
        b = min((b for b in range(m) if len(buckets[b]) < dsub), key=lambda b: logp[b])
        buckets[b].append(i); logp[b] += math.log(max(float(ev[i]), float(floor)))
    return u[:, [i for b in buckets for i in b]].T.contiguous().float()

def kmeans_w(x, w, niter=20):
    n, d = x.shape; dsub = d // m
    xs = x.float().reshape(n, m, dsub).numpy()
    res = np.empty((m, 256, dsub), np.float32)
    for i in range(m):
        km = faiss.Kmeans(dsub, 256, niter=niter, seed=1234, min_points_per_centroid=1,
                          max_points_per_centroid=1 << 30, verbose=False)
        km.train(np.ascontiguousarray(xs[:, i]), weights=None if w is None else np.ascontiguousarray(w.numpy().astype(np.float32)))
        res[i] = km.centroids
    return torch.from_numpy(res)

cbs = {"k": [], "v": []}; trs = {"k": [], "v": []}
for l in range(g.num_layers):
    for which, mode in (("k", kmode), ("v", vmode)):
        A = getattr(tr0, which)[l].clone()
        cb = torch.empty(g.num_kv_heads, m, 256, g.head_dim // m)
        for h in range(g.num_kv_heads):
            x = cap[which][l][:, h].float() @ A[h].T
            w = weights(mode, l, h)
            r = eig_w(x, w)
            cb[h] = kmeans_w(x @ r.T, w)
            A[h] = r @ A[h]
        cbs[which].append(cb); trs[which].append(A)
    print("layer", l, flush=True)
cb = Codebooks(k=torch.stack(cbs["k"]), v=torch.stack(cbs["v"]))
cb.save(out)
Transform(k=torch.stack(trs["k"]), v=torch.stack(trs["v"])).save(transform_path(out))
print("saved", out)
