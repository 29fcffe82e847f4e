"""Per-sequence bookkeeping (no tensors)."""
from __future__ import annotations

import itertools
import sys
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidArgument

MAX_TOKEN_ID = 2**31 - 1
assert array("i").itemsize == 4, "token ids are stored as 32-bit C ints"
# What one entry of a sequence's metadata takes beyond its list slot: a block
# hash is a 32-byte bytes object, a block id an int object (ids under 257 are
# shared by the interpreter: counted anyway, so the figure is an upper bound).
_HASH_OBJ = sys.getsizeof(bytes(32))
_INT_OBJ = sys.getsizeof(1 << 20)


def token_array(ids, field: str) -> array:
    """Token ids (a list, a protobuf repeated field, an array) -> array('i'),
    4 bytes an id where a list of Python ints takes ~36; InvalidArgument
    (naming field) unless every id is an integer in [0, 2^31)."""
    if isinstance(ids, array) and ids.typecode == "i":
        a = np.frombuffer(ids, dtype=np.int32) if len(ids) else np.zeros(0, np.int32)
    else:
        try:
            a = np.asarray(ids)
        except (OverflowError, ValueError, TypeError):
            raise InvalidArgument(field, "token ids must be integers in [0, 2^31)") from None
        if a.size == 0:
            return array("i")
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise InvalidArgument(field, "token ids must be a flat list of integers")
    bad = (a < 0) | (a > MAX_TOKEN_ID)
    if bad.any():
        raise InvalidArgument(field, f"token id {int(a[bad.argmax()])} outside [0, 2^31)")
    out = array("i")
    out.frombytes(a.astype(np.int32, copy=False).tobytes())
    return out

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

    In a cache whose every layer slides (engine/window.py), sealed[:freed] are
    holes: blocks released after they left the window, whose entries keep the
    table's positions and hold the cache's null block, never read and never
    counted as a reference (in any tier).
    """
    seq_id: str
    tenant: str
    num_layers: int
    length: int = 0
    pending: list[int] = field(default_factory=list)   # per layer, beyond length
    # Layers that had written a step drop_uncommitted dropped (a lease's lapse): the step
    # starts again at one of them; its other layers would write one step beside another.
    cut_step: tuple[int, ...] = ()
    cut_reserve: bool = False     # the same for slots a Reserve handed out: the next Reserve says so
    # len(token_ids) when the per-layer step in progress began (None: none is): what a drop of
    # the step keeps of them (ids known before it, from Allocate or committed tokens).
    step_ids_from: int | None = None
    reserved: int = 0                                  # slots handed out by Reserve
    sealed: list[int] = field(default_factory=list)    # main-pool block ids
    freed: int = 0                                     # leading sealed entries that are holes
    tail: list[int] = field(default_factory=list)      # tail-pool block ids
    # Main-pool blocks taken for the seals that committing the pending or reserved tokens
    # makes (kvstore.engine.room): in no table yet, held so no other caller can take them.
    seal_blocks: list[int] = field(default_factory=list)
    token_ids: array = field(default_factory=lambda: array("i"))   # known ids from position 0 (token_array)
    hashes: list[bytes] = field(default_factory=list)  # hash of full block i
    hashed_upto: int = 0          # blocks [0, hashed_upto) are registered in a pool index
    last_use: float = field(default_factory=time.monotonic)
    # Leases (kvstore.service.leases): the session whose lapse frees this sequence
    # ("" = none, e.g. a caller that sends no session metadata), unless pinned.
    owner: str = ""
    pinned: bool = False
    persist: bool = False         # on lapse and at the daemon's stop, offload instead of free
    tier: str = "gpu"             # "gpu" | "host" (ids index host pools) | "disk" (ids empty)
    manifest: dict | None = None  # what LMDB holds, while tier == "disk"
    table_epoch: int = field(default_factory=lambda: next(_epochs))

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = [0] * self.num_layers

    def rebuilt_table(self) -> None:
        """sealed was replaced, not extended: earlier prefixes no longer hold."""
        self.table_epoch = next(_epochs)

    def held_sealed(self) -> list[int]:
        """The sealed blocks the sequence holds references on (holes left out)."""
        return self.sealed[self.freed:]

    def held_sealed_count(self) -> int:
        """Sealed blocks the sequence holds, holes left out, in whichever tier it lives:
        a disk sequence holds no ids, its manifest lists them."""
        return len(self.manifest["sealed_hashes"]) if self.tier == "disk" else len(self.sealed) - self.freed

    def layer_length(self, layer: int) -> int:
        """Tokens visible to attention at this layer."""
        return self.length + self.pending[layer] + self.reserved

    def max_length(self) -> int:
        return self.length + max(self.pending) + self.reserved

    def host_bytes(self) -> int:
        """Host memory this metadata holds, roughly: token ids, block hashes,
        block tables, and the hash lists of a disk-tier manifest."""
        n = (sys.getsizeof(self.token_ids) + sys.getsizeof(self.hashes) + len(self.hashes) * _HASH_OBJ
             + sys.getsizeof(self.sealed) + sys.getsizeof(self.tail) + (len(self.sealed) + len(self.tail)) * _INT_OBJ)
        if self.manifest is not None:
            hexes = self.manifest.get("sealed_hashes", []) + self.manifest.get("tail_hashes", [])
            n += sum(sys.getsizeof(h) for h in hexes)
        return n
