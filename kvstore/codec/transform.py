"""The per-head linear transform applied to K and V before PQ encoding (and
undone on the way out): what kvstore-calibrate learns beside the codebooks and
saves next to them; the Hugging Face adapter applies it on its side."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Transform:
    """Per (layer, KV head) invertible maps applied before PQ: K' = K A_k^T,
    V' = V A_v^T. Attention is unchanged when queries go in as q' = q A_k^-1
    and outputs come back as out = out' A_v^-T, so the fp16 tail may hold K', V'
    too. "qaware" makes ||K'-K'^||^2 the expected score error over the layer's
    queries (A_k = E[q q^T]^1/2) and ||V'-V'^||^2 the error after o_proj."""
    k: torch.Tensor          # [L, Hkv, d, d] fp32
    v: torch.Tensor
    _inv: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._inv = {"k": _inverse(self.k), "v": _inverse(self.v)}

    def forward(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """x [..., Hkv, d] -> x A^T, per head."""
        a = getattr(self, which)[layer].to(x.device)
        return torch.einsum("...hd,hed->...he", x.float(), a).to(x.dtype)

    def inverse(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        a = self._inv[which][layer].to(x.device)
        return torch.einsum("...hd,hed->...he", x.float(), a).to(x.dtype)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        save_file({"k": self.k.contiguous(), "v": self.v.contiguous()}, path,
                  metadata={"format": "kvstore.transform.v1"})

    @staticmethod
    def load(path: str) -> "Transform":
        from safetensors.torch import load_file
        t = load_file(path)
        return Transform(k=t["k"].float(), v=t["v"].float())


def _inverse(a: torch.Tensor) -> torch.Tensor:
    """a [..., d, d] invertible -> a^-1, through the Cholesky factor of a^T a
    (a^-1 = (a^T a)^-1 a^T). Not torch.linalg.inv: the CPU torch's batched LU
    (MKL getrf inside torch's own thread pool) returns invalid pivots for
    d > 128 at more than one thread and loops on MKL errors; Cholesky has no
    pivots. In float64 the squared condition number (<= 1e6 for the q-aware
    transforms, whose eigenvalues are clamped at 1e-6 of the largest before
    the square root) leaves ~1e-10 of relative error."""
    a = a.double()
    return torch.cholesky_solve(a.mT, torch.linalg.cholesky(a.mT @ a)).float()


def transform_path(codebook_path: str) -> str:
    """Where files of the old codebooks format kept their transform."""
    return codebook_path.removesuffix(".safetensors") + ".transform.safetensors"


def transform_of(cb) -> Transform | None:
    """The transform a Codebooks (codebooks.py) carries, or None."""
    return None if cb.transform_k is None else Transform(k=cb.transform_k, v=cb.transform_v)


def load_codebooks(path: str):
    """-> (Codebooks, Transform or None) of a codebooks file. A file of the old
    format (no description) takes its transform from the file beside it that
    kvstore-calibrate wrote (transform_path), if there is one."""
    from .codebooks import Codebooks
    cb = Codebooks.load(path)
    if cb.info is None:
        tp = transform_path(path)
        return cb, Transform.load(tp) if os.path.exists(tp) else None
    return cb, transform_of(cb)
