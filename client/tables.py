"""The sealed block tables a client holds, kept current from Reserve replies that
list only the blocks it lacks (ReserveRequest.known_sealed / known_epochs).

    tables = SealedTables()
    counts, epochs = tables.known(seq_ids)           # what to tell Reserve
    reply = stub.Reserve(pb.ReserveRequest(..., known_sealed=counts, known_epochs=epochs))
    rows = [tables.update(sid, r) for sid, r in zip(seq_ids, reply.reservations)]

At 32K tokens a table is 2,048 ids a sequence; a step seals one block in sixteen,
so a decode step sends a few ids instead of B x 2,048 (about 15 ms of protobuf
work each way at B=64 on a 2-core host).
"""
from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


class SealedTables:
    """seq_id -> (table epoch, int32 array of the whole sealed table)."""

    def __init__(self):
        self._t: dict[str, tuple[int, np.ndarray]] = {}

    def known(self, seq_ids: list[str]) -> tuple[list[int], list[int]]:
        """(blocks held, their epoch) per sequence; (0, 0) for one never seen."""
        held = [self._t.get(sid, (0, _EMPTY)) for sid in seq_ids]
        return [len(t) for _, t in held], [e for e, _ in held]

    def update(self, seq_id: str, r) -> np.ndarray:
        """r: a Reservation (or single-sequence ReserveReply) for seq_id -> its whole
        sealed table. A reply that continues a table must continue the one held."""
        new = np.asarray(r.sealed_blocks, dtype=np.int32)
        if r.sealed_start:
            epoch, t = self._t.get(seq_id, (0, _EMPTY))
            if epoch != r.table_epoch or len(t) != r.sealed_start:
                raise RuntimeError(f"Reserve continued the table of {seq_id!r} at block {r.sealed_start} "
                                   f"(epoch {r.table_epoch}); this client holds {len(t)} (epoch {epoch})")
            if len(new):
                t = np.concatenate([t, new])
        else:
            t = new
        self._t[seq_id] = (r.table_epoch, t)
        return t

    def keep(self, seq_ids: list[str]) -> None:
        """Forget every table but these (sequences that left the batch)."""
        keep = set(seq_ids)
        if self._t.keys() - keep:
            self._t = {k: v for k, v in self._t.items() if k in keep}
