"""The filesystem refusing a disk-tier write (full, read-only, removed, failing) as the
errors the servicer maps to status codes, each naming the store's path: a full disk is
RESOURCE_EXHAUSTED, any other refusal UNAVAILABLE; never INTERNAL with a bare errno."""
from __future__ import annotations

import contextlib
import errno

from kvstore.errors import ResourceExhausted, Unavailable

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


@contextlib.contextmanager
def refused(path: str):
    """Around a write that leaves the store as it was when the filesystem refuses it
    (lmdb_file.DataFile allocates the file before a transaction starts, or runs it
    within the pages the file has)."""
    try:
        yield
    except OSError as e:
        why = f"{path}: {e.strerror or e}"
        if e.errno in FULL:
            raise ResourceExhausted("lmdb", f"the disk tier's filesystem is full ({why}): nothing was written") from e
        raise Unavailable("lmdb", f"the disk tier cannot write ({why}): nothing was written") from e
