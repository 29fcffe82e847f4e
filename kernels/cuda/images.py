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

IMG_WORDS = 32768     # attention.cuh IMG_BYTES / 4: one KV head's image (d 256: two, one a CTA)
DSUB4 = 16            # image layout of the dsub 4 tables (one for every GQA group)


def group(g: int, dsub: int) -> int:
    """GP of the attention kernel for a GQA group of g query heads: query heads per row
    group of the MMA's A operand in the conflict-free layouts (the 16 rows hold 16 / GP
    rotated copies), for dsub 2 and 4 alike."""
    return 2 if g <= 2 else 4 if g <= 4 else 8


def image_layout(num_qo_heads: int, num_kv_heads: int, dsub: int) -> int:
    """The layout of the image the bulk-copy build reads for this geometry: dsub 2, the
    V layout (attention.cu VG: 2, 4, or 0 for GP 8); dsub 4, DSUB4."""
    if dsub == 4:
        return DSUB4
    gp = group(num_qo_heads // num_kv_heads, dsub)
    return gp if gp < 8 else 0


def dsub4_slots(m: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Byte offsets in a code row (256 B) of the dsub 4 tables' entries (attention.cuh
    RegStager4), for m = d/4 subspaces: K [m] (subspace c*MQ + i at 128*(i/4) + 8*(4c +
    i%4)), and V as a list of copies, each [m] (subspace 8X + r at 128*(r/4) + 8*(4X + r%4);
    at d = 64 a second copy at slots 8 further, for the lanes of cq >= 2)."""
    mm = torch.arange(m)
    mq = m // 4
    c, i = mm // mq, mm % mq
    k = 128 * (i // 4) + 8 * (4 * c + i % 4)
    x, r = mm // 8, mm % 8
    v = 128 * (r // 4) + 8 * (4 * x + r % 4)
    return k, ([v] if m // 8 == 4 else [v, v + 64])


@functools.lru_cache(maxsize=None)
def _image_index4(m: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Word positions in a head's image of dsub 4 codebook word (m, code, w), flat
    (m*256 + code)*2 + w: K at (code*256 + kslot)/4 + w, V at 16384 + (code*256 + vslot)/4
    + w for each copy (dsub4_slots)."""
    ks, vs = dsub4_slots(m)
    code = torch.arange(256).view(1, 256, 1)
    w = torch.arange(2).view(1, 1, 2)

    def words(slot, base):
        return (base + (code * 256 + slot.view(-1, 1, 1)) // 4 + w).reshape(-1)
    return words(ks, 0), [words(v, 16384) for v in vs]


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


def build_codebook_image(k_codebook: torch.Tensor, v_codebook: torch.Tensor, layout: int) -> torch.Tensor:
    """k/v_codebook [Hkv, M, 256, dsub] fp16/bf16 -> int32 [Hkv, IMG_WORDS]: per KV head, the
    bytes of the CF kernel's two codebook tables in shared memory (dsub 2: its first 128
    KiB; dsub 4: from T4_K on), in `layout` (image_layout); unused words are 0. d 256:
    [Hkv, 2 x IMG_WORDS], the images of the head's two halves of 128 coordinates, each as a
    d 128 head's (the two CTAs of the split build, attention.cu SPLIT)."""
    hkv, m, _, dsub = k_codebook.shape
    if m * dsub == 256:
        halves = [cb.reshape(2 * hkv, m // 2, 256, dsub) for cb in (k_codebook, v_codebook)]
        return build_codebook_image(*halves, layout).reshape(hkv, 2 * IMG_WORDS)
    dev = k_codebook.device
    if layout == DSUB4:
        ik, ivs = _image_index4(m)
    else:
        ik, iv = _image_index(m, layout)
        ivs = [iv]
    img = torch.zeros(hkv, IMG_WORDS, dtype=torch.int32, device=dev)
    img[:, ik.to(dev)] = k_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
    for iv in ivs:
        img[:, iv.to(dev)] = v_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
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
    (d 256: [L, Hkv, 2 x IMG_WORDS]): every layer's image, written into `words` when given
    (same address: graphs captured with it read the new codebooks), or None when no kernel
    here would read it (no Hopper GPU, bulk copies off (tunables.TMA_MAX_ITEM_TOKENS = 0), a
    head_dim the CUDA kernels do not take). The router calls it only where the CUDA kernels
    are available."""
    if tunables.TMA_MAX_ITEM_TOKENS <= 0:
        return None
    if build.capability(build.index(k_codebooks.device)) < (9, 0):
        return None
    nl, hkv, m, _, dsub = k_codebooks.shape
    if dsub not in (2, 4) or m * dsub not in (64, 128, 256):
        return None
    layout = image_layout(num_qo_heads, hkv, dsub)
    imgs = torch.stack([build_codebook_image(k_codebooks[i], v_codebooks[i], layout) for i in range(nl)])
    if words is None or words.shape != imgs.shape or words.device != imgs.device:
        return imgs
    return words.copy_(imgs)


def layer_images(words: torch.Tensor, num_qo_heads: int, dsub: int) -> list[CodebookImage]:
    """The per-layer images (run_pq's codebook_image) of codebook_images' result."""
    layout = image_layout(num_qo_heads, words.shape[1], dsub)
    return [CodebookImage(words[i], layout) for i in range(words.shape[0])]
