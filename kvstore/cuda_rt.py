"""cupy's CUDA runtime bindings, for the few per-call CUDA calls of the
daemon's hot path (stream query, event record and wait, the meta copy) made
on raw handles: ~1-2 µs each where torch's Python API takes several times
that (bench/NOTES-rpc.md, sessions 6-7). The handles are torch's
(`Stream.cuda_stream`, `Event.cuda_event`): both libraries work in the
device's primary context.

runtime() is None where cupy does not import (CPU machines) or with
KVSTORE_CUDA_RT=0: callers keep torch's calls then."""
from __future__ import annotations

import os

_rt = None


def runtime():
    global _rt
    if _rt is None:
        _rt = False
        if os.environ.get("KVSTORE_CUDA_RT", "1") != "0":
            try:
                from cupy.cuda import runtime as rt
                _rt = rt
            except Exception:   # noqa: BLE001 - no cupy, or no CUDA libraries for it
                pass
    return _rt or None
