"""Which cache a sequence's disk copy fits: the spec fields beyond the
fingerprint that its blocks depend on, as its manifest names them (policy.py
adopts a copy at restore only into a cache that has the same).

Manifests written before they named these fields carry none; what such a copy
itself shows decides instead (legacy_layout): sealed blocks that another
residual sealed, holes a window left where this cache's window would not, a
first block hash seeded for another tenant sharing. What it cannot show is
taken as this cache's: with no block freed, windows change nothing of what
it holds."""
from __future__ import annotations

from kvstore.core.hashing import chain_hashes, tenant_root
from kvstore.core.sequence import Sequence


def layout(cfg) -> dict:
    """The spec fields, beyond the fingerprint's, that a sequence's disk copy
    depends on: how its blocks lie (residual; windows and chunks free blocks),
    and whose its hashes are (the tenant seeds them unless shared)."""
    return dict(residual=cfg.residual, share_prefixes_across_tenants=cfg.share_prefixes_across_tenants,
                layer_windows=list(cfg.layer_windows), layer_chunks=list(cfg.layer_chunks))


def legacy_layout(c, m: dict) -> dict:
    """The layout of cache c as far as manifest m (one without "layout") does
    not show another: each field it shows to differ holds a description of
    what the copy was written with instead."""
    out, freed = layout(c.cfg), m.get("freed", 0)
    sealed = len(m["sealed_hashes"]) + freed
    if sealed != c.sealed_count(m["length"]):
        out["residual"] = f"one that sealed {sealed} blocks of {m['length']} tokens"
    elif freed:       # holes exactly where this cache's window makes them, or it reads one
        probe = Sequence(m["seq_id"], m["tenant"], c.cfg.geometry.num_layers, length=m["length"], sealed=[0] * sealed)
        if c.out_of_window(probe) != freed:
            out["layer_windows"] = f"a window that freed {freed} of its {sealed} sealed blocks"
    bs, ids, hashes = c.cfg.block_size, m.get("token_ids", []), m.get("hashes", [])
    if hashes and len(ids) >= bs:
        root = tenant_root(m["tenant"], c.cfg.share_prefixes_across_tenants)
        if chain_hashes(ids[:bs], bs, c.fingerprint, root)[0].hex() != hashes[0]:
            out["share_prefixes_across_tenants"] = not c.cfg.share_prefixes_across_tenants
    return out
