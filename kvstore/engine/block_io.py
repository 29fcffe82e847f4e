"""A pool's blocks as payloads, by lists of block ids: each block's bytes of
every layer's K then V (storage.py's pack/unpack). What the tiers move up
and down, so that they need nothing of the tensors behind a pool."""
from __future__ import annotations

import torch

from .storage import ids_to


class BlockIO:
    """store: a pool's Fp16Store or PQStore; device: where its tensors live."""

    def __init__(self, store, device: torch.device):
        self.store, self.device = store, device

    def block_bytes(self) -> int:
        return self.store.block_bytes()

    def pack(self, ids: list[int]) -> torch.Tensor:
        """-> [len(ids), block_bytes()] uint8 on the pool's device."""
        return self.store.pack(ids_to(self.device, ids))

    def unpack(self, ids: list[int], payload: torch.Tensor) -> None:
        """payload [len(ids), block_bytes()] uint8 into the blocks."""
        self.store.unpack(ids_to(self.device, ids), payload)
