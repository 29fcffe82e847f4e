"""Per-sequence bookkeeping (no tensors)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

# Table epochs: unique per process. A sequence's sealed table only grows at its end
# while the epoch stays; anything that rebuilds it (a tier move) takes a new epoch,
# so a client holding a prefix of the old table asks for the whole new one (Reserve).
_epochs = itertools.count(1)


@dataclass(slots=True)
class Sequence:
    """Tokens [0, length) are committed in every layer. With S sink tokens
    (the cache's, a multiple of block_size; 0 for the fp16 codec), tail[:S/bs]
    hold positions [0, S) in fp16 for good; the next len(sealed) * block_size
    tokens live in sealed main-pool blocks; the rest, plus any per-layer
    pending or reserved tokens, live in tail[S/bs:], which starts exactly
    where the sealed blocks end. A sequence has sealed blocks only once its
    sink blocks are complete. Keeping the sinks at the front of the tail lets
    the kernels read sinks and tail as one fp16 table (attention ignores
    token order).

    Full blocks are immutable and may be shared (ref count > 1); only the last,
    partial tail block is ever written, and it is never shared.
    """
    seq_id: str
    tenant: str
    num_layers: int
    length: int = 0
    pending: list[int] = field(default_factory=list)   # per layer, beyond length
    reserved: int = 0                                  # slots handed out by Reserve
    sealed: list[int] = field(default_factory=list)    # main-pool block ids
    tail: list[int] = field(default_factory=list)      # tail-pool block ids
    token_ids: list[int] = field(default_factory=list) # known ids from position 0
    hashes: list[bytes] = field(default_factory=list)  # hash of full block i
    hashed_upto: int = 0          # blocks [0, hashed_upto) are registered in a pool index
    last_use: float = field(default_factory=time.monotonic)
    # Leases (kvstore.leases): the session whose lapse frees this sequence
    # ("" = none, e.g. a caller that sends no session metadata), unless pinned.
    owner: str = ""
    pinned: bool = False
    persist: bool = False         # on lapse, offload instead of free (hook; frees until tiers land)
    tier: str = "gpu"             # "gpu" | "host" (ids index host pools) | "disk" (ids empty)
    manifest: dict | None = None  # what LMDB holds, while tier == "disk"
    table_epoch: int = field(default_factory=lambda: next(_epochs))

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = [0] * self.num_layers

    def rebuilt_table(self) -> None:
        """sealed was replaced, not extended: earlier prefixes no longer hold."""
        self.table_epoch = next(_epochs)

    def layer_length(self, layer: int) -> int:
        """Tokens visible to attention at this layer."""
        return self.length + self.pending[layer] + self.reserved

    def max_length(self) -> int:
        return self.length + max(self.pending) + self.reserved
