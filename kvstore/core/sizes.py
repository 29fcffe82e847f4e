"""Byte sizes as people write them: 1073741824, 512MB, 40GiB, 1.5T. A leaf
module: it imports nothing of kvstore."""
from __future__ import annotations

import re
from fractions import Fraction

# K, M, G, T: powers of 1000; Ki, Mi, Gi, Ti: powers of 1024. A trailing B is optional.
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'40GiB' -> 42949672960. ValueError for anything else than a number
    with an optional unit."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a byte size: {text!r} (e.g. 1073741824, 512MB, 40GiB)")
    return int(Fraction(m.group(1)) * UNITS[(m.group(2) or "").lower()])
