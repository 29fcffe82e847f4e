"""Allocate's prefix search (docs/design.md, Prefix sharing): how many leading
blocks of a prompt some tier holds, and where each one is.

A prompt's blocks fall in ranges, each searched until its first miss, and a
range is searched only if the one before it hit whole:
  sinks   (pq) blocks [0, S/bs): fp16, in the tail pool, else their fp16 form
          below the GPU (tiers/below.py), else in Redis
  sealed  (pq) the blocks the prompt's length seals: PQ codes in the main
          pool, else another sequence's fp16 copy (encoded), else below (PQ
          codes, else its fp16 form, encoded), else Redis (the same two forms)
  tail    (pq) the rest: as the sinks
  every   (fp16 codec) every full block: the one pool, else below, else Redis
A hit is (kind, x):
  ("main", id)    a main-pool block, shared
  ("tail", id)    a tail-pool block (every block of the fp16 codec), shared
  ("encode", id)  a tail-pool block whose content seals here: encoded into a new main block
  ("below", j)    row j of `rows`, read from host, disk or Redis: into a new main block
  ("fp16", j)     row j of `fp16_rows`, an fp16 block read from below: into a new tail block
  ("encode16", j) row j of `fp16_rows`, whose content seals here: encoded into a new main block
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Prefix:
    hits: list[tuple[str, object]] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)        # parts of the main-width rows, in order
    tiers: list[str] = field(default_factory=list)                # the tier each row came from
    fp16_rows: list[torch.Tensor] = field(default_factory=list)
    fp16_tiers: list[str] = field(default_factory=list)


def search(c, hashes: list[bytes], n_sealed: int) -> Prefix:
    """The hits of a prompt's chained block hashes; n_sealed: the blocks its length seals."""
    p = Prefix()
    if not c.is_pq:
        _range(c, p, hashes, 0, len(hashes), "every")
        return p
    sb, n = c.sink_blocks, len(hashes)
    for lo, hi, kind in ((0, min(sb, n), "sinks"), (sb, min(sb + n_sealed, n), "sealed"), (sb + n_sealed, n, "tail")):
        if lo < hi and not _range(c, p, hashes, lo, hi, kind):
            break
    return p


def _range(c, p: Prefix, hashes: list[bytes], lo: int, hi: int, kind: str) -> bool:
    """Append the hits of blocks [lo, hi) (len(p.hits) == lo) up to the first
    miss; whether all hit."""
    fp16 = kind in ("sinks", "tail")
    found = {False: [], True: []}           # lookups below the GPU to read, by form (fp16 or not)
    for i in range(lo, hi):
        h = hashes[i]
        if kind == "sealed":
            bid = c.main_pool.lookup(h)
            if bid is not None:
                p.hits.append(("main", bid))
                continue
            tb = c.tail_pool.lookup(h)      # another sequence still holds it in fp16
            if tb is not None:
                p.hits.append(("encode", tb))
                continue
        else:
            bid = c.tail_pool.lookup(h)
            if bid is not None:
                p.hits.append(("tail", bid))
                continue
        form, where = fp16, c.tiering.lookup_below(h, fp16) if c.tiering is not None else None
        if where is None and kind == "sealed" and c.tiering is not None:
            form, where = True, c.tiering.lookup_below(h, True)    # its fp16 form: encoded here
        if where is None:
            break
        p.hits.append((_tag(form, fp16), len(_tiers(p, form)) + len(found[form])))
        found[form].append(where)
    for form in (False, True):              # one batched read per tier and form
        if found[form]:
            rows, tiers = _rows(p, form), _tiers(p, form)
            got = c.tiering.fetch_below(found[form], _device(c, form), form)
            if len(got) < len(found[form]):     # a disk block went since its lookup: the prefix ends there
                gone = len(tiers) + len(got)
                del p.hits[next((j for j in range(lo, len(p.hits)) if p.hits[j][0] in _TAGS[form]
                                 and p.hits[j][1] == gone), len(p.hits)):]
            rows.append(got)
            tiers += [t for t, _ in found[form][:len(got)]]
    if c.redis is not None:
        _from_redis(c, p, hashes, hi, kind)
    return len(p.hits) == hi


def _from_redis(c, p: Prefix, hashes: list[bytes], hi: int, kind: str) -> None:
    """Append what Redis holds of blocks [len(p.hits), hi), one batch per form.
    In the sealed range a block whose PQ form Redis lacks is asked again in its
    fp16 form (encoded here): a block that spilled from another host's fp16
    tail before it sealed anywhere (a chat's next turn on another host) went up
    in that form only. The forms alternate while each finds the next block."""
    fp16, sealed = kind in ("sinks", "tail"), kind == "sealed"
    first = len(p.hits)
    end = min(hi, first + (c.tail_pool if fp16 else c.main_pool).num_allocatable())
    form, ends = fp16, {}                # how the reads of each form asked at `first` ended there
    while first < end and len(ends) < (2 if sealed else 1) and "error" not in ends.values():
        got, ended = c.redis.get_prefix(hashes[first:end], _device(c, form), form)
        if len(got):
            ends = {}
            p.hits += [(_tag(form, fp16), len(_tiers(p, form)) + j) for j in range(len(got))]
            _tiers(p, form).extend(["redis"] * len(got))
            _rows(p, form).append(got)
            first += len(got)
        if ended is None:
            break
        ends[form] = ended
        if sealed:
            form = not form
    if ends and all(e == "miss" for e in ends.values()):
        c.redis.missed()                 # one a block, however many forms were asked


_TAGS = {False: ("below",), True: ("fp16", "encode16")}       # the hits that name rows of each form


def _tag(form: bool, fp16_range: bool) -> str:
    """The hit of a row read from below in its fp16 form (form) or sealed form, in a
    range of fp16 blocks (sinks, tail) or not: an fp16 row where a block seals is encoded."""
    return ("fp16" if fp16_range else "encode16") if form else "below"


def _rows(p: Prefix, fp16: bool) -> list[torch.Tensor]:
    return p.fp16_rows if fp16 else p.rows


def _tiers(p: Prefix, fp16: bool) -> list[str]:
    return p.fp16_tiers if fp16 else p.tiers


def _device(c, fp16: bool):
    return c.tail_io.device if fp16 else c.main_device


def cat(rows: list[torch.Tensor]) -> torch.Tensor | None:
    return None if not rows else rows[0] if len(rows) == 1 else torch.cat(rows)
