"""PQ codebooks: separate K and V codebooks per layer and KV head (docs/design.md, Codec),
trained with faiss k-means (or a torch k-means on the GPU), stored as
safetensors with their sha256."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.core.config import CacheConfig
from kvstore.errors import FailedPrecondition, InvalidArgument, quote


FORMAT = "kvstore.pq.v2"        # tensors and a description (FileInfo) in the metadata
LEGACY_FORMAT = "kvstore.pq.v1"  # tensors "k", "v" only
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # what a file's tensors may be (read as fp32)
# The shell command a refusal of an old file names (kvstore/tools/codebooks.py).
CONVERT = "python -m kvstore.tools.codebooks convert OLD.safetensors --model-id ID [--transform T] --out NEW"


@dataclass(slots=True, frozen=True)
class FileInfo:
    """What a codebooks file says about itself (format kvstore.pq.v2):
    what it fits (model id, geometry, bits) and where it came from."""
    model_id: str = ""             # "": fits any model of this geometry
    num_layers: int = 0
    num_q_heads: int = 0           # 0: not recorded (K/V codebooks do not depend on it)
    num_kv_heads: int = 0
    head_dim: int = 0
    bits: int = 0                  # per K/V element: 8 bits a code over head_dim / M elements
    sink_tokens: int = 0           # the first tokens calibration left out (kept in fp16)
    calibrated_on: str = ""        # free text: the samples the centroids were trained on

    def metadata(self) -> dict[str, str]:
        return {"model_id": self.model_id, "sink_tokens": str(self.sink_tokens), "bits": str(self.bits),
                "calibrated_on": self.calibrated_on,
                "geometry": json.dumps({"num_layers": self.num_layers, "num_q_heads": self.num_q_heads,
                                        "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim})}

    @staticmethod
    def from_metadata(meta: dict[str, str]) -> "FileInfo":
        try:
            geo = json.loads(meta["geometry"])
            return FileInfo(model_id=meta.get("model_id", ""), sink_tokens=int(meta.get("sink_tokens", "0")),
                            bits=int(meta["bits"]), calibrated_on=meta.get("calibrated_on", ""),
                            **{f: int(geo.get(f, 0)) for f in ("num_layers", "num_q_heads", "num_kv_heads",
                                                               "head_dim")})
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise InvalidArgument("codebooks", f"malformed {FORMAT} metadata ({type(e).__name__}: "
                                  f"{quote(str(e))})") from None


@dataclass(slots=True)
class Codebooks:
    """K and V codebooks; for codebooks trained after a per-head transform,
    that transform's matrices (the daemon stores K' = K A_k^T; clients apply
    it, transform.py); `info` is None for a file of the old format."""
    k: torch.Tensor      # [L, Hkv, M, 256, dsub] fp32
    v: torch.Tensor      # [L, Hkv, M, 256, dsub] fp32
    transform_k: torch.Tensor | None = None    # [L, Hkv, d, d] fp32, or None
    transform_v: torch.Tensor | None = None
    info: FileInfo | None = None

    def sha256(self) -> str:
        """Of the tensors (not the description): codebooks without a transform
        hash as they always did, so fingerprints and disk keys stay."""
        h = hashlib.sha256()
        tensors = [self.k, self.v]
        if self.transform_k is not None:
            h.update(b"transform")
            tensors += [self.transform_k, self.transform_v]
        for t in tensors:
            h.update(json.dumps(list(t.shape)).encode())
            h.update(t.contiguous().cpu().numpy().tobytes())
        return h.hexdigest()

    @property
    def bits(self) -> int:
        return 8 // self.k.shape[-1]

    def describe(self, model_id: str = "", num_q_heads: int = 0, sink_tokens: int = 0,
                 calibrated_on: str = "") -> "Codebooks":
        """These codebooks with a description (FileInfo); geometry and bits from the shapes."""
        L, hkv, m, _, dsub = self.k.shape
        info = FileInfo(model_id=model_id, num_layers=L, num_q_heads=num_q_heads, num_kv_heads=hkv,
                        head_dim=m * dsub, bits=8 // dsub, sink_tokens=sink_tokens, calibrated_on=calibrated_on)
        return Codebooks(self.k, self.v, self.transform_k, self.transform_v, info)

    def layers(self, idx: list[int]) -> "Codebooks":
        """The codebooks (and transform) of these layers, in this order: the file of a
        cache that holds only them (a group of a model's layers, client/hf_groups.py)."""
        def pick(t):
            return None if t is None else t[list(idx)].contiguous()
        info = None if self.info is None else dataclasses.replace(self.info, num_layers=len(idx))
        return Codebooks(pick(self.k), pick(self.v), pick(self.transform_k), pick(self.transform_v), info)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save
        tensors = {"k": self.k.contiguous().cpu(), "v": self.v.contiguous().cpu()}
        if self.info is None:
            assert self.transform_k is None, "a transform goes with a described (v2) file"
            return save(tensors, metadata={"sha256": self.sha256(), "format": LEGACY_FORMAT})
        if self.transform_k is not None:
            tensors["transform.k"] = self.transform_k.contiguous().cpu()
            tensors["transform.v"] = self.transform_v.contiguous().cpu()
        return save(tensors, metadata={"sha256": self.sha256(), "format": FORMAT, **self.info.metadata(),
                                       "transform": "none" if self.transform_k is None else "included"})

    @staticmethod
    def from_bytes(data: bytes) -> "Codebooks":
        """A codebooks file of either format; InvalidArgument (naming
        codebooks[.field]) for bytes that are not one, or whose description
        contradicts its tensors."""
        from safetensors.torch import load
        try:
            tensors = load(data)
            meta = _metadata(data)
        except Exception as e:  # malformed user bytes: safetensors raises several types
            raise InvalidArgument("codebooks", f"not a safetensors file: {quote(str(e))}") from None
        for name, t in tensors.items():
            if t.dtype not in FLOAT_DTYPES:
                raise InvalidArgument(f"codebooks.{name}", f"dtype {str(t.dtype).removeprefix('torch.')}: "
                                      "must be float32, float16 or bfloat16")
        fmt = meta.get("format", LEGACY_FORMAT)
        if fmt == LEGACY_FORMAT:
            if set(tensors) != {"k", "v"}:
                raise InvalidArgument("codebooks", f"expected tensors 'k' and 'v', got {sorted(tensors)}")
            cb = Codebooks(k=tensors["k"].float(), v=tensors["v"].float())
            # a sha256 the file carries is checked (of the tensors as stored, or as fp32): a
            # damaged file must not be taken for good just because it is of the old format
            said = meta.get("sha256")
            if said is not None and said != cb.sha256() and said != Codebooks(k=tensors["k"], v=tensors["v"]).sha256():
                raise InvalidArgument("codebooks.sha256", f"{quote(said)} does not match the tensors "
                                      f"({cb.sha256()}): the file is damaged")
            return cb
        if fmt != FORMAT:
            raise InvalidArgument("codebooks.format", f"{quote(fmt)} is not {FORMAT} or {LEGACY_FORMAT}")
        has_t = meta.get("transform") == "included"
        want = {"k", "v"} | ({"transform.k", "transform.v"} if has_t else set())
        if set(tensors) != want or meta.get("transform") not in ("none", "included"):
            raise InvalidArgument("codebooks", f"metadata transform={quote(meta.get('transform', ''))} "
                                  f"with tensors {sorted(tensors)}")
        cb = Codebooks(k=tensors["k"].float(), v=tensors["v"].float(), info=FileInfo.from_metadata(meta),
                       transform_k=tensors["transform.k"].float() if has_t else None,
                       transform_v=tensors["transform.v"].float() if has_t else None)
        cb._check_self()
        if meta.get("sha256") != cb.sha256():
            raise InvalidArgument("codebooks.sha256", f"{quote(meta.get('sha256', ''))} does not match the "
                                  f"tensors ({cb.sha256()}): the file is damaged")
        return cb

    def _check_self(self) -> None:
        """A described file's tensors agree with its description."""
        i = self.info
        if self.k.dim() != 5 or self.k.shape[3] != 256 or self.v.shape != self.k.shape:
            raise InvalidArgument("codebooks.k", f"shapes {tuple(self.k.shape)}, {tuple(self.v.shape)}: "
                                  "need two [L, Hkv, M, 256, head_dim / M]")
        L, hkv, m, _, dsub = self.k.shape
        for name, have, want in (("num_layers", L, i.num_layers), ("num_kv_heads", hkv, i.num_kv_heads),
                                 ("head_dim", m * dsub, i.head_dim), ("bits", 8 // dsub, i.bits)):
            if have != want:
                raise InvalidArgument(f"codebooks.{name}", f"the metadata says {want}, the tensors {have}")
        if self.transform_k is not None:
            shape = (L, hkv, m * dsub, m * dsub)
            for name, t in (("transform.k", self.transform_k), ("transform.v", self.transform_v)):
                if tuple(t.shape) != shape or not torch.isfinite(t).all():
                    raise InvalidArgument(f"codebooks.{name}", f"shape {tuple(t.shape)} (need {shape}), finite")

    def save(self, path: str) -> str:
        with open(path, "wb") as f:
            f.write(self.to_bytes())
        return self.sha256()

    @staticmethod
    def load(path: str) -> "Codebooks":
        with open(path, "rb") as f:
            return Codebooks.from_bytes(f.read())

    def check_fits(self, model_id: str, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   bits: int | None = None) -> None:
        """InvalidArgument naming codebooks.<field> unless this file describes
        itself as made for this model and geometry (bits: the cache's, if it
        has one yet). An old file has only its shapes to go by (validate)."""
        i = self.info
        if i is None:
            return
        for name, want, have in (("num_layers", num_layers, i.num_layers),
                                 ("num_kv_heads", num_kv_heads, i.num_kv_heads),
                                 ("head_dim", head_dim, i.head_dim), ("bits", bits, i.bits),
                                 ("num_q_heads", num_q_heads, i.num_q_heads or num_q_heads)):
            if want is not None and want != have:
                raise InvalidArgument(f"codebooks.{name}", f"the file was made for {name} {have}, "
                                      f"this {'cache' if bits is not None else 'model'} has {want}")
        if i.model_id and model_id != i.model_id:
            raise InvalidArgument("codebooks.model_id", f"the file was calibrated on {quote(i.model_id)}, "
                                  f"this is {quote(model_id)} (codebooks of one model are wrong for another)")

    def validate(self, cfg: CacheConfig) -> None:
        g = cfg.geometry
        self.check_fits(cfg.model_id, g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim,
                        8 * cfg.m // g.head_dim)
        want = (g.num_layers, g.num_kv_heads, cfg.m, 256, g.head_dim // cfg.m)
        dtype = getattr(torch, g.dtype)
        # Centroids are the K and V the kernels read, in the cache dtype on the
        # GPU: they must stay finite there, and K within the limit that keeps
        # scores finite (config.QK_LIMITS).
        for name, t, limit in (("k", self.k, g.qk_limit), ("v", self.v, torch.finfo(dtype).max)):
            if tuple(t.shape) != want:
                raise InvalidArgument(f"codebooks.{name}", f"shape {tuple(t.shape)}, cache needs {want}")
            if not torch.isfinite(t).all():
                raise InvalidArgument(f"codebooks.{name}", "contains NaN or Inf")
            peak = float(t.to(dtype).abs().amax())
            if not peak <= limit:
                raise InvalidArgument(f"codebooks.{name}", f"a centroid of magnitude {float(t.abs().amax()):g} "
                                      f"does not fit the cache's {g.dtype} (at most {limit:g})")


def _metadata(data: bytes) -> dict[str, str]:
    """The __metadata__ of safetensors bytes (an 8-byte header length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata values must be strings")
    return meta


def train_pq(x: torch.Tensor, m: int, niter: int = 20, init: torch.Tensor | None = None,
             seed: int = 1234, max_rows_per_centroid: int = 1 << 30,
             device: torch.device | str | None = None) -> torch.Tensor:
    """x [N, d] -> centroids [m, 256, d/m]: one k-means of 256 centroids per
    subspace of d/m consecutive dims, warm-started from `init` [m, 256, d/m] if
    given (OPQ's rounds). By default over every row: faiss would cap a training
    set at 256 rows per centroid, and a larger calibration set should all count.
    device None: faiss on the CPU; a torch device: `kmeans_torch` there, all m
    subspaces at once (the GPU path: faiss-gpu does not install everywhere)."""
    n, d = x.shape
    dsub = d // m
    if device is not None:
        if n > max_rows_per_centroid * 256:       # faiss's own cap, the same way
            x = x[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_rows_per_centroid * 256]]
            n = x.shape[0]
        xs = x.to(device, torch.float32).reshape(n, m, dsub).transpose(0, 1)
        return kmeans_torch(xs, 256, niter, seed, None if init is None else init.to(device, torch.float32)).cpu()
    import faiss
    xs = x.float().reshape(n, m, dsub).numpy()
    out = np.empty((m, 256, dsub), np.float32)
    for i in range(m):
        km = faiss.Kmeans(dsub, 256, niter=niter, seed=seed, min_points_per_centroid=1,
                          max_points_per_centroid=max_rows_per_centroid, verbose=False)
        km.train(np.ascontiguousarray(xs[:, i]),
                 init_centroids=None if init is None else np.ascontiguousarray(init[i].float().numpy()))
        out[i] = km.centroids
    return torch.from_numpy(out)


def kmeans_torch(x: torch.Tensor, k: int, niter: int = 20, seed: int = 1234,
                 init: torch.Tensor | None = None, chunk_bytes: int = 1 << 28) -> torch.Tensor:
    """Batched Lloyd k-means, faiss's algorithm in torch: x [B, N, dsub] fp32 ->
    centroids [B, k, dsub] on x's device. Starts from k distinct random rows
    (or `init` [B, k, dsub]); a centroid left empty takes half of the largest
    cluster (a copy of its centroid, both nudged apart), as faiss splits them.
    Distances are computed in row chunks of at most chunk_bytes."""
    b, n, dsub = x.shape
    if n < k:
        raise InvalidArgument("x", f"need at least {k} rows for {k} centroids, got {n}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if init is None:
        c = x[:, torch.randperm(n, generator=gen)[:k].to(x.device)].clone()
    else:
        c = init.clone()
    rows = max(1, chunk_bytes // (4 * b * k))
    base = (torch.arange(b, device=x.device) * k)[:, None]           # [B, 1]: row offsets into [B * k]
    for _ in range(niter):
        cn = (c * c).sum(-1)                                          # [B, k]
        sums = torch.zeros(b * k, dsub, device=x.device, dtype=x.dtype)
        counts = torch.zeros(b * k, device=x.device, dtype=x.dtype)
        for s in range(0, n, rows):
            xc = x[:, s:s + rows]                                     # [B, r, dsub]
            flat = ((cn[:, None] - 2 * xc @ c.mT).argmin(-1) + base).reshape(-1)   # [B * r] into [B * k]
            sums.index_add_(0, flat, xc.reshape(-1, dsub))
            counts.index_add_(0, flat, torch.ones_like(flat, dtype=x.dtype))
        sums, counts = sums.view(b, k, dsub), counts.view(b, k)
        c = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], c)
        _split_empty(c, counts, gen)
    return c


def _split_empty(c: torch.Tensor, counts: torch.Tensor, gen: torch.Generator, eps: float = 1 / 1024) -> None:
    """In place: each empty centroid becomes a copy of the largest cluster's,
    the two moved apart by a random step of relative size eps (faiss moves
    them by +-eps per dimension; a random step keeps repeated splits of one
    cluster from landing on the same point); that cluster's count is halved
    between them."""
    for bi, j in (counts == 0).nonzero().tolist():
        big = int(counts[bi].argmax())
        step = eps * torch.randn(c.shape[-1], generator=gen).to(c.device) * (c[bi, big].abs().mean() + 1e-12)
        c[bi, j] = c[bi, big] + step
        c[bi, big] = c[bi, big] - step
        counts[bi, j] = counts[bi, big] = counts[bi, big] / 2


def train_codebooks(cfg: CacheConfig, k_samples: torch.Tensor, v_samples: torch.Tensor,
                    niter: int = 20, seed: int = 1234, progress=None,
                    device: torch.device | str | None = None) -> Codebooks:
    """k_samples, v_samples: [L, N, Hkv, d] (K after RoPE). One PQ per
    (layer, K/V, KV head); each trains M independent 256-centroid k-means
    (device as train_pq's: None for faiss on the CPU, else the torch k-means there)."""
    if device is None:
        try:
            # SWIG warns as faiss loads; a process that turns warnings into errors
            # (-W error, a test's filter) would have its module init crash, not raise.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                import faiss  # noqa: F401
        except ImportError:
            raise FailedPrecondition("codebooks", "training needs faiss (pip install faiss-cpu)") from None
    g = cfg.geometry
    m = cfg.m
    dsub = g.head_dim // m
    for name, s in (("k_samples", k_samples), ("v_samples", v_samples)):
        if s.dim() != 4 or s.shape[0] != g.num_layers or s.shape[2] != g.num_kv_heads or s.shape[3] != g.head_dim:
            raise InvalidArgument(name, f"shape {tuple(s.shape)}, need [{g.num_layers}, N, {g.num_kv_heads}, {g.head_dim}]")
        if s.shape[1] < 256:
            raise InvalidArgument(name, f"need at least 256 sample tokens for 256 centroids, got {s.shape[1]}")
        if not torch.isfinite(s).all():
            raise InvalidArgument(name, "contains NaN or Inf")
    out = []
    total = 2 * g.num_layers * g.num_kv_heads
    done = 0
    for samples in (k_samples, v_samples):
        cb = torch.empty(g.num_layers, g.num_kv_heads, m, 256, dsub)
        for layer in range(g.num_layers):
            for h in range(g.num_kv_heads):
                # faiss's own cap of 256 rows per centroid keeps a daemon-side call bounded
                cb[layer, h] = train_pq(samples[layer, :, h, :].cpu(), m, niter, seed=seed, max_rows_per_centroid=256,
                                        device=device)
                done += 1
                if progress:
                    progress(done, total)
        out.append(cb)
    return Codebooks(k=out[0], v=out[1]).describe(
        model_id=cfg.model_id, num_q_heads=g.num_q_heads, sink_tokens=cfg.sink_tokens,
        calibrated_on=f"TrainCodebooks: {k_samples.shape[1]} K/V samples a layer sent to the daemon, niter {niter}")


def fingerprint(cfg: CacheConfig, codebooks: Codebooks | None) -> bytes:
    """sha256 of model id, geometry, codec params (sink tokens included) and
    codebook bytes: part of every block hash, so blocks never cross models or
    codebooks."""
    g = cfg.geometry
    desc = {
        "model_id": cfg.model_id,
        "geometry": [g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.dtype],
        "codec": [cfg.codec.kind, cfg.m if cfg.codec.kind == "pq" else 0, cfg.block_size],
        "codebooks": codebooks.sha256() if codebooks is not None else "",
    }
    if cfg.sinks:
        # Sink blocks change which blocks are sealed and how a sequence lies on
        # disk. Only added when set, so fingerprints (and LMDB keys) of caches
        # without sinks stay what they were.
        desc["sinks"] = cfg.sinks
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()
