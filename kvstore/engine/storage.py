"""The tensors behind the block pools. The pools (core/block_pool.py) hold only
metadata; this module owns the memory and moves tokens in and out of slots.

main pool, codec pq    k_codes [L, nb, Hkv, bs, M] uint8
                       v_codes [L, nb, Hkv, M, bs] uint8 (transposed: P·V reads rows)
main pool, codec fp16  k, v    [L, nb, Hkv, bs, d]   (the tail pool IS this pool)
tail pool (pq only)    k, v    [L, nt, Hkv, bs, d]
One block id addresses the same slot in every layer.
"""
from __future__ import annotations

import torch

from kvstore import kernels
from kvstore.cuda.pinned import to_device

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def ids_to(device, values, dtype=torch.long) -> torch.Tensor:
    """Host ids -> a device tensor without synchronising: a copy from pageable
    memory waits for the stream to drain (and so for every client's queued
    work behind our event waits); one from pinned memory does not."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return to_device(t, device)


class Fp16Store:
    """Paged fp16 (or bf16) K/V: [L, nb, Hkv, bs, d]."""

    def __init__(self, cfg: CacheConfig, num_blocks: int):
        g = cfg.geometry
        self.bs = cfg.block_size
        shape = (g.num_layers, num_blocks, g.num_kv_heads, cfg.block_size, g.head_dim)
        self.k = torch.zeros(shape, dtype=TORCH_DTYPES[g.dtype], device=cfg.device)
        self.v = torch.zeros_like(self.k)

    def write(self, layers: slice, blocks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [nl, n, Hkv, d] -> token i at (blocks[i], offsets[i])."""
        # [nb, bs, L, Hkv, d] view: the two advanced indices are adjacent, so
        # the indexed result is [n, nl, Hkv, d].
        self.k.permute(1, 3, 0, 2, 4)[blocks, offsets, layers] = k.permute(1, 0, 2, 3).to(self.k.dtype)
        self.v.permute(1, 3, 0, 2, 4)[blocks, offsets, layers] = v.permute(1, 0, 2, 3).to(self.v.dtype)

    def write_tokens(self, layer: int, slots: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, Hkv, d] -> token i at slots[i] = (block, offset) of one
        layer: one copy per token, for the few tokens of a decode step."""
        for i, (b, o) in enumerate(slots):
            self.k[layer, b, :, o] = k[i]
            self.v[layer, b, :, o] = v[i]

    def read_blocks(self, layers: slice, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [nl, n_blocks * bs, Hkv, d]."""
        k = self.k[layers, block_ids]                   # [nl, n, Hkv, bs, d]
        v = self.v[layers, block_ids]
        nl, n, h, bs, d = k.shape
        return (k.permute(0, 1, 3, 2, 4).reshape(nl, n * bs, h, d),
                v.permute(0, 1, 3, 2, 4).reshape(nl, n * bs, h, d))

    def payload_kv(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Payload rows [n, block_bytes()] (pack's) -> k, v [L, n * bs, Hkv, d], as
        read_blocks gives them, without writing a block."""
        layers, _, heads, bs, d = self.k.shape
        n, half = payload.shape[0], payload.shape[1] // 2
        k, v = (part.contiguous().view(self.k.dtype).view(n, layers, heads, bs, d)
                .permute(1, 0, 3, 2, 4).reshape(layers, n * bs, heads, d).to(self.k.device)
                for part in (payload[:, :half], payload[:, half:]))
        return k, v

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Clear blocks in every layer: one fill per tensor."""
        self.k.index_fill_(1, block_ids, 0)
        self.v.index_fill_(1, block_ids, 0)

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def block_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def pack(self, block_ids: torch.Tensor) -> torch.Tensor:
        """-> uint8 [n, block_bytes]: every layer's K then V of each block."""
        return _pack(self.k, self.v, block_ids)

    def unpack(self, block_ids: torch.Tensor, payload: torch.Tensor) -> None:
        _unpack(self.k, self.v, block_ids, payload)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PQStore:
    """PQ codes: K row-wise [L, nb, Hkv, bs, M], V transposed [L, nb, Hkv, M, bs]."""

    def __init__(self, cfg: CacheConfig, num_blocks: int):
        g = cfg.geometry
        self.bs = cfg.block_size
        self.m = cfg.m
        self.dtype = TORCH_DTYPES[g.dtype]
        self.k_codes = torch.zeros((g.num_layers, num_blocks, g.num_kv_heads, cfg.block_size, cfg.m),
                                   dtype=torch.uint8, device=cfg.device)
        self.v_codes = torch.zeros((g.num_layers, num_blocks, g.num_kv_heads, cfg.m, cfg.block_size),
                                   dtype=torch.uint8, device=cfg.device)
        self.num_qo_heads = g.num_q_heads
        self.k_cb: torch.Tensor | None = None           # [L, Hkv, M, 256, dsub]
        self.v_cb: torch.Tensor | None = None
        # Per layer, the codebooks as the bulk-copy attention kernel stages them
        # (kernels/cuda/images.py CodebookImage); None where no kernel here reads one.
        self.cb_words: torch.Tensor | None = None       # int32 [L, Hkv, IMG_WORDS] (d 256: 2 x)
        self.cb_images: list | None = None

    def set_codebooks(self, cb: Codebooks) -> None:
        """New codebooks go into the same tensors as the old ones: a worker that
        mapped the pool (MapPool) reads them through its existing mapping, and a
        CUDA graph captured with their addresses reads the new values."""
        # fp32 for the CPU reference; the GPU kernels want the compute dtype.
        dt = torch.float32 if self.k_codes.device.type == "cpu" else self.dtype
        k = cb.k.to(device=self.k_codes.device, dtype=dt).contiguous()
        v = cb.v.to(device=self.k_codes.device, dtype=dt).contiguous()
        if self.k_cb is not None and self.k_cb.shape == k.shape and self.v_cb.shape == v.shape:
            self.k_cb.copy_(k)
            self.v_cb.copy_(v)
        else:
            self.release()
            self.k_cb, self.v_cb = k, v
        kernels.prepare_encode(self.k_cb)       # encoder tables now, not at the first seal
        kernels.prepare_encode(self.v_cb)
        self.cb_words = kernels.codebook_images(self.k_cb, self.v_cb, self.num_qo_heads, self.cb_words)
        self.cb_images = (None if self.cb_words is None
                          else kernels.layer_images(self.cb_words, self.num_qo_heads, self.k_cb.shape[-1]))

    def release(self) -> None:
        """What the kernels cached for these codebooks (the CUDA encoder's tables, GPU
        memory of their own) goes with them: call it before dropping them."""
        for cb in (self.k_cb, self.v_cb):
            if cb is not None:
                kernels.release_encode(cb)

    def image(self, layer: int):
        """This layer's codebook image for the attention kernels, or None."""
        return None if self.cb_images is None else self.cb_images[layer]

    def encode_blocks(self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [L, n_blocks * bs, Hkv, d] -> codes of whole blocks block_ids."""
        assert self.k_cb is not None, "encode before codebooks are set"
        n = block_ids.numel() * self.bs
        slots = (block_ids.view(-1, 1) * self.bs + torch.arange(self.bs, device=block_ids.device)).view(-1)
        slots = slots.to(torch.int32)
        # every layer in one call: on the GPU one launch each for K and V (kernels/cuda/encode.py)
        kernels.pq_encode_to_slots(k[:, :n], self.k_cb, slots, k_codes=self.k_codes)
        kernels.pq_encode_to_slots(v[:, :n], self.v_cb, slots, v_codes=self.v_codes)

    def read_blocks(self, layers: slice, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized -> k, v [nl, n_blocks * bs, Hkv, d] in the cache dtype."""
        ks, vs = [], []
        for layer in range(*layers.indices(self.k_codes.shape[0])):
            k, v = kernels.gather_pq_blocks(self.k_codes[layer], self.v_codes[layer],
                                             self.k_cb[layer], self.v_cb[layer], block_ids)
            ks.append(k.to(self.dtype))
            vs.append(v.to(self.dtype))
        return torch.stack(ks), torch.stack(vs)

    def nbytes(self) -> int:
        return self.k_codes.nbytes + self.v_codes.nbytes

    def block_bytes(self) -> int:
        return self.k_codes[:, 0].numel() + self.v_codes[:, 0].numel()

    def pack(self, block_ids: torch.Tensor) -> torch.Tensor:
        """-> uint8 [n, block_bytes]: every layer's K codes then V codes."""
        return _pack(self.k_codes, self.v_codes, block_ids)

    def unpack(self, block_ids: torch.Tensor, payload: torch.Tensor) -> None:
        _unpack(self.k_codes, self.v_codes, block_ids, payload)


def _pack(k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # [L, n, ...] -> [n, L, ...] -> bytes per block: K's bytes, then V's
    n = block_ids.numel()
    kx, vx = _slots(k), _slots(v)
    word = _word(kx.shape[2], vx.shape[2])
    kx, vx = kx.view(word), vx.view(word)
    kw = kx.shape[0] * kx.shape[2]
    out = torch.empty((n, kw + vx.shape[0] * vx.shape[2]), dtype=word, device=k.device)
    out[:, :kw].view(n, kx.shape[0], -1).copy_(kx[:, block_ids].transpose(0, 1))
    out[:, kw:].view(n, vx.shape[0], -1).copy_(vx[:, block_ids].transpose(0, 1))
    return out.view(torch.uint8)


def _unpack(k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, payload: torch.Tensor) -> None:
    n = block_ids.numel()
    kx, vx = _slots(k), _slots(v)
    if payload.stride(-1) != 1:
        payload = payload.contiguous()
    word = _word(kx.shape[2], vx.shape[2], payload)
    kx, vx, words = kx.view(word), vx.view(word), payload.view(word)
    kw = kx.shape[0] * kx.shape[2]
    kx[:, block_ids] = words[:, :kw].view(n, kx.shape[0], -1).transpose(0, 1).to(k.device, non_blocking=True)
    vx[:, block_ids] = words[:, kw:].view(n, vx.shape[0], -1).transpose(0, 1).to(v.device, non_blocking=True)


def _slots(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor [L, nb, ...] as its bytes [L, nb, bytes of one block in one layer]."""
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)


def _word(slot_bytes: int, vslot_bytes: int, payload: torch.Tensor | None = None) -> torch.dtype:
    """The widest integer that tiles a block's slot in each layer (and the
    payload's rows and start): indexing moves one element per thread, and an
    8K-token 4-bit prefix (503 blocks, 32 layers) unpacked byte by byte took
    1.76 ms on an H100, in int64 words 0.26 ms (docs/scale.md)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        size = dt.itemsize
        if slot_bytes % size or vslot_bytes % size:
            continue
        if payload is not None and (payload.storage_offset() % size or payload.stride(0) % size
                                    or payload.data_ptr() % size):
            continue
        return dt
    return torch.uint8
