"""Codebook images: one layer's K and V codebooks laid out as the attention kernel keeps
them in shared memory, so that on sm_90 a block takes them as bulk (TMA) copies.

Derived data with an owner: whoever owns the codebooks (the engine's storage, through
router.codebook_images) builds the images and rebuilds them in place whenever the
codebooks change, and passes each layer's to run_pq(codebook_image=). The kernels keep no
copy of their own: a copy could not see an in-place update replayed under a CUDA graph,
nor a write by another process into a mapped pool.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import tunables
from . import build

IMG_WORDS = 32768     # attention.cuh IMG_BYTES / 4: one KV head's image


def group(g: int, dsub: int) -> int:
    """GP of the attention kernel for a GQA group of g query heads: query heads per row
    group of the MMA's A operand in the conflict-free layouts (dsub 2: the 16 rows hold
    16 / GP rotated copies), 0 for dsub 4 (attention.cu's GP = 0 layouts)."""
    if dsub != 2:
        return 0
    return 2 if g <= 2 else 4 if g <= 4 else 8


def image_layout(num_qo_heads: int, num_kv_heads: int, dsub: int) -> int | None:
    """The V layout (attention.cu VG) of the image the bulk-copy build reads for this
    geometry, or None: that build never runs for it (dsub 4)."""
    gp = group(num_qo_heads // num_kv_heads, dsub)
    return None if gp == 0 else (gp if gp < 8 else 0)


@functools.lru_cache(maxsize=None)
def _image_index(m: int, vg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word positions in a head's image of K / V codebook word (m, code), flat m*256 + code
    (attention.cu, the CF layouts): K word at code*64 + 32hh + 4i + c for m = c*MQ + 8hh + i;
    V (vg > 0) at 16384 + code*64 + m, else (GP 8) 16384 + (m/8)*2048 + code*8 + m%8."""
    mm = torch.arange(m).unsqueeze(1)
    code = torch.arange(256).unsqueeze(0)
    mq = m // 4
    c, r = mm // mq, mm % mq
    k = code * 64 + 32 * (r // 8) + 4 * (r % 8) + c
    v = 16384 + (code * 64 + mm if vg else (mm // 8) * 2048 + code * 8 + mm % 8)
    return k.reshape(-1), v.reshape(-1)


def build_codebook_image(k_codebook: torch.Tensor, v_codebook: torch.Tensor, vg: int) -> torch.Tensor:
    """k/v_codebook [Hkv, M, 256, 2] fp16/bf16 -> int32 [Hkv, IMG_WORDS]: per KV head, the
    bytes the CF kernel keeps in shared memory (its first 128 KiB); unused words are 0."""
    hkv, m = k_codebook.shape[:2]
    ik, iv = (t.to(k_codebook.device) for t in _image_index(m, vg))
    img = torch.zeros(hkv, IMG_WORDS, dtype=torch.int32, device=k_codebook.device)
    img[:, ik] = k_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
    img[:, iv] = v_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
    return img


@dataclass(slots=True, frozen=True)
class CodebookImage:
    """One layer's image: words int32 [Hkv, IMG_WORDS] (build_codebook_image), layout the
    V layout they were built for (image_layout)."""
    words: torch.Tensor
    layout: int


def codebook_images(k_codebooks: torch.Tensor, v_codebooks: torch.Tensor, num_qo_heads: int,
                    words: torch.Tensor | None = None) -> torch.Tensor | None:
    """k/v_codebooks [L, Hkv, M, 256, dsub] fp16/bf16 on a GPU -> int32 [L, Hkv, IMG_WORDS]
    of every layer's image, written into `words` when given (same address: graphs
    captured with it read the new codebooks), or None when no kernel here would read it
    (no Hopper GPU, bulk copies off (tunables.TMA_MAX_ITEM_TOKENS = 0), a layout without
    one). The router calls it only where the CUDA kernels are available."""
    if tunables.TMA_MAX_ITEM_TOKENS <= 0:
        return None
    if build.capability(build.index(k_codebooks.device)) < (9, 0):
        return None
    nl, hkv, m, _, dsub = k_codebooks.shape
    vg = image_layout(num_qo_heads, hkv, dsub)
    if vg is None or m * dsub not in (64, 128):
        return None
    imgs = torch.stack([build_codebook_image(k_codebooks[i], v_codebooks[i], vg) for i in range(nl)])
    if words is None or words.shape != imgs.shape or words.device != imgs.device:
        return imgs
    return words.copy_(imgs)


def layer_images(words: torch.Tensor, num_qo_heads: int, dsub: int) -> list[CodebookImage]:
    """The per-layer images (run_pq's codebook_image) of codebook_images' result."""
    layout = image_layout(num_qo_heads, words.shape[1], dsub)
    return [CodebookImage(words[i], layout) for i in range(words.shape[0])]
