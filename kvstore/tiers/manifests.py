"""Which cache a sequence's disk copy fits: the spec fields beyond the
fingerprint that its blocks depend on, as its manifest names them (policy.py
adopts a copy at restore only into a cache that has the same).

Manifests written before they named these fields carry none; what such a copy
itself shows decides instead (legacy_layout): sealed blocks that another
residual sealed, holes a window left where this cache's window would not, a
first block hash seeded for another tenant sharing. What it cannot show is
taken as this cache's: with no block freed, windows change nothing of what
it holds.

The fingerprint's own fields (made_with) are in the manifest too: a cache of the
same name but another fingerprint lists none of its copies, and says which field
differs (unlisted_elsewhere)."""
from __future__ import annotations

import json
import logging

from kvstore.core.hashing import chain_hashes, tenant_root
from kvstore.core.sequence import Sequence

from .disk_keys import FP_BYTES, names

log = logging.getLogger("kvstore.tiers")


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


def made_with(c) -> dict:
    """What cache c's fingerprint is made of (codebooks.fingerprint), field by field."""
    cfg, g = c.cfg, c.cfg.geometry
    return dict(model_id=cfg.model_id, num_layers=g.num_layers, num_q_heads=g.num_q_heads,
                num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype, codec=cfg.codec.kind,
                num_subvectors=cfg.m if cfg.codec.kind == "pq" else 0, block_size=cfg.block_size,
                sink_tokens=cfg.sinks, codebooks_sha256=c.codebooks_sha)


def unlisted_elsewhere(c, store) -> None:
    """A WARNING for the sequences on disk under cache c's name that a cache of another
    fingerprint wrote (another model id, geometry, codec, block size, sinks or codebooks),
    naming the field: not listed here, they stay on disk for a cache made as theirs was."""
    keys = [k for k in store.keys(b"M") if k[1:1 + FP_BYTES] != c.fingerprint and names(k)[0] == c.cfg.name]
    mine, other = made_with(c), {}
    for k, v in zip(keys, store.get_many(keys)):
        theirs = json.loads(v).get("made_with") if v is not None else None
        f = next((f for f in mine if theirs is not None and theirs.get(f) != mine[f]), None)
        if f is None:       # written before manifests carried it, or unreadable
            f, was, now = "fingerprint", "another model id, geometry, codec, block size, sinks or codebooks", "its own"
        else:
            was, now = repr(theirs.get(f))[:64], repr(mine[f])[:64]
        other.setdefault((f, was, now), []).append(names(k)[2])
    for (f, was, now), ids in other.items():
        warn_unlisted(c.cfg.name, ids, f, was, now)


def warn_unlisted(cache: str, ids: list[str], field: str, theirs: str, ours: str) -> None:
    """The WARNING for sequences on disk that a cache of this name but another spec wrote."""
    log.warning("cache %r: %d sequences on disk (%s) were written by a cache with %s=%s, this one has %s: not listed "
                "here (they stay on disk for a cache created with their spec)", cache, len(ids),
                ", ".join(map(repr, ids[:3])) + (" ..." if len(ids) > 3 else ""), field, theirs, ours)
