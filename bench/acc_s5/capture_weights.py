"""Capture calibration samples plus per-row attention weights (scratch, session 5)."""
import os, sys, torch, math
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kvstore.tools import calibrate as C, models, text

class WSampler(C.Sampler):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        L = self.g.num_layers
        self.w = {k: [[] for _ in range(L)] for k in ("mass", "p2", "p2v")}
        d = self.g.head_dim
        self.qw = {k: torch.zeros(L, self.g.num_kv_heads, d, d, dtype=torch.float64) for k in ("p2", "p2v")}

    def __call__(self, layer, q, k, v, scaling):
        out = super().__call__(layer, q, k, v, scaling)
        rows = self._rows
        n = k.shape[2]
        hkv, groups = self.g.num_kv_heads, q.shape[1] // self.g.num_kv_heads
        qf = q[0].float().reshape(hkv, groups * n, -1)
        kf, vf = k[0].float(), v[0].float()
        s = (qf @ kf.transpose(1, 2)) * scaling                   # [Hkv, g*n, n]
        causal = torch.ones(n, n, dtype=torch.bool).tril().repeat(groups, 1)
        s.masked_fill_(~causal, float("-inf"))
        p = s.softmax(-1)
        o = p @ vf                                                # [Hkv, g*n, d]
        pr = p[:, :, rows]                                        # [Hkv, g*n, r]
        p2 = pr * pr
        vr = vf[:, rows]                                          # [Hkv, r, d]
        t1 = (vr * vr).sum(-1) * p2.sum(1)
        t2 = (p2 * (o @ vr.transpose(1, 2))).sum(1)
        t3 = (p2 * (o * o).sum(-1, keepdim=True)).sum(1)
        P2 = p * p                                                # [Hkv, g*n, n]
        cq_p2 = P2.sum(-1)                                        # [Hkv, g*n]
        cq_p2v = (P2 @ (vf * vf).sum(-1, keepdim=True)).squeeze(-1) - 2 * ((P2 @ vf) * o).sum(-1) \
            + cq_p2 * (o * o).sum(-1)
        qd = qf.double()
        self.qw["p2"][layer] += (qd * cq_p2.double()[..., None]).transpose(1, 2) @ qd
        self.qw["p2v"][layer] += (qd * cq_p2v.clamp_min(0).double()[..., None]).transpose(1, 2) @ qd
        self.w["mass"][layer].append(pr.sum(1).T.contiguous())   # [r, Hkv]
        self.w["p2"][layer].append(p2.sum(1).T.contiguous())
        self.w["p2v"][layer].append((t1 - 2 * t2 + t3).clamp_min(0).T.contiguous())
        return out

if __name__ == "__main__":
    torch.set_num_threads(2)
    model, tok = models.load_smollm2()
    text = text.read_text(text.CALIB_DIRS)
    ids = tok(text).input_ids
    all_w = text.windows(ids, 2048)
    nwin = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    step = max(1, len(all_w) // nwin)
    chosen = all_w[::step][:nwin]
    s = WSampler(models.geometry_of(model), 512, 16, 0)
    from kvstore.tools.hooks import attention_handler
    from tqdm import tqdm
    with torch.no_grad(), attention_handler(model, s):
        for w in tqdm(chosen):
            model.model(input_ids=torch.tensor([w]), use_cache=False)
    K, V = s.samples()
    W = {k: torch.stack([torch.cat(x) for x in v]) for k, v in s.w.items()}
    torch.save({"k": K, "v": V, "qq": s.qq, "qw": s.qw, "w": W}, "capw.pt")
    print("saved", K.shape, {k: v.shape for k, v in W.items()})
