"""The restart fence: a call naming sequences for an earlier daemon process is
refused before it runs.

Sequence ids are names the callers choose, and a restart frees every one the
daemon did not restore from disk: without a fence, a worker that names its
sequence after a restart reaches whatever another worker of its tenant has
allocated under that name since, and appends to it or attends over it. A
caller that sends `x-kvstore-instance` (HeartbeatReply.instance) is told
instead, once, with the new instance in the trailing metadata.
"""
from __future__ import annotations

import secrets

import grpc

from kvstore.errors import quote
from kvstore.protocol.channel import INSTANCE_KEY, SERVICE

# The RPCs that name sequences, and RegisterBuffer, whose reply opens the doorbell (its
# calls name sequences and pass no gRPC metadata). The others (caches, stats) mean the
# same on any instance, and Heartbeat is where a caller learns the current one.
FENCED = frozenset(f"/{SERVICE}/{m}" for m in (
    "Allocate", "Reserve", "Append", "Attend", "AppendAttend", "AppendAttendStream", "Retrieve",
    "Fork", "Free", "Offload", "Prefetch", "SequenceInfo", "RegisterBuffer"))


def new_instance() -> str:
    """This daemon process's id: random, so that no later start repeats it."""
    return secrets.token_hex(8)


def check(context, instance: str) -> None:
    """Abort the call FAILED_PRECONDITION if it names another instance than this one."""
    for k, v in context.invocation_metadata() or ():
        if k == INSTANCE_KEY:
            if v != instance:
                context.set_trailing_metadata(((INSTANCE_KEY, instance),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{INSTANCE_KEY}: the call names sequences of daemon instance {quote(v)}, and this "
                              f"is instance {instance!r}: the daemon restarted since, and holds only what it "
                              "restored from disk (AllocateRequest.persist); an id from before the restart may "
                              "name a sequence allocated since. Send the new instance (HeartbeatReply.instance, "
                              "or this reply's trailing metadata) to go on")
            return
