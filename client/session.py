"""The session a client calls in: the metadata every call carries (its session
id, token, and the daemon instance its sequence ids are from), the heartbeat
that renews its lease, and what tells a restart from a lapsed lease."""
from __future__ import annotations

import logging
import threading
import time

import grpc

from kvstore.protocol.channel import INSTANCE_KEY, SESSION_KEY
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.client")
# The daemon gone or going away: a call in flight when it stops may end CANCELLED (gRPC's own
# cancellation) as well as UNAVAILABLE, and neither says whether the call took effect.
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def restarted(e: grpc.RpcError) -> bool:
    """The daemon refused a call naming sequences of its instance before a restart."""
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith(INSTANCE_KEY + ":")


class _Metadata(grpc.UnaryUnaryClientInterceptor):
    """Adds the session's metadata to a control call, and shows the session its error."""

    def __init__(self, session: "Session"):
        self.session = session

    def intercept_unary_unary(self, continuation, details, request):
        md = list(details.metadata or []) + self.session.metadata
        outcome = continuation(details._replace(metadata=md), request)
        if outcome.done() and isinstance(err := outcome.exception(), grpc.RpcError):
            self.session.fenced(err)
        return outcome


class Session:
    """metadata: what a call sends (a list for the interceptor, `md` the same as a
    tuple for the tensor calls, which pass it themselves: a Python client interceptor
    costs tens of µs per call); on_metadata(md) hears of a change (the stream's next
    opening)."""

    def __init__(self, session_id: str, token: str | None):
        self.id = session_id
        self._base = [(SESSION_KEY, session_id)] + ([("authorization", f"Bearer {token}")] if token else [])
        self.metadata = list(self._base)
        self.md = tuple(self._base)
        self.on_metadata = None
        self.interceptor = _Metadata(self)
        self._stop = threading.Event()
        # What tells a restart from a lapsed lease when the daemon has dropped our buffers
        # (dropped_why): the lease timeout, when the lease was last renewed, whether it
        # was renewed in time every time since the buffers were registered, and whether
        # the daemon was unreachable meanwhile.
        self.lease_s = 0.0
        self._renewed = 0.0
        self._renewed_in_time = False
        self.unreachable = False
        # The daemon process this session's sequence ids are from (the daemon's fence.py):
        # None until a Heartbeat reply tells it, "" for a daemon without one. A later reply
        # naming another instance is not taken: the next call naming sequences is refused
        # and raises, so that the caller learns of the restart, and then it is (fenced).
        self.instance: str | None = None
        self._instance_changed = False

    # ------------------------------------------------------------ heartbeat
    def start_heartbeat(self, stub) -> None:
        threading.Thread(target=self._beat, args=(stub,), name="kvstore-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self, stub) -> None:
        # A third of the daemon's lease timeout (learned from the first reply),
        # so two beats can be lost before the lease lapses.
        period = 0.0     # beat at once: the reply says how often to beat
        while not self._stop.wait(period):
            period = 5.0
            try:
                r = stub.Heartbeat(pb.HeartbeatRequest(), timeout=max(1.0, period))
                self.replied(r)
                if r.lease_timeout_s > 0:
                    period = max(0.2, min(10.0, r.lease_timeout_s / 3))
            except grpc.RpcError as e:
                if e.code() in UNREACHABLE:
                    self.unreachable = True
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                    return     # an older daemon, or one that will never take us
            except ValueError:
                return         # the channel was closed under us

    def replied(self, r: pb.HeartbeatReply) -> None:
        """A Heartbeat reply: the lease renewed, and the instance learned (the first time)."""
        if self.instance is None:
            self._set_instance(r.instance)
        elif r.instance != self.instance:
            self._instance_changed = True
        self.renew(r.lease_timeout_s)

    # ---------------------------------------------------------------- lease
    def renew(self, lease_s: float) -> None:
        now = time.monotonic()
        if self.lease_s and now - self._renewed > self.lease_s:
            self._renewed_in_time = False
        self.lease_s, self._renewed = lease_s, now

    def registered(self) -> None:
        """A buffer was registered: the lease is renewed, and in time from here on."""
        self.renew(self.lease_s)
        self._renewed_in_time, self.unreachable = True, False

    def dropped_why(self) -> str:
        """Why the daemon holds none of our buffers, as far as this client can tell: the
        lease cannot have lapsed if it was renewed within its timeout every time since."""
        if self._instance_changed:
            return "it restarted (its instance changed)"
        if self.unreachable:
            return "it restarted (this client lost its connection to it meanwhile)"
        if self._renewed_in_time and self.lease_s and time.monotonic() - self._renewed <= self.lease_s:
            return "it restarted (this session's lease was renewed in time throughout)"
        return ("it restarted, or this session's lease lapsed while the process was stopped or "
                "starved past the lease timeout")

    # ------------------------------------------------------------- instance
    def _set_instance(self, instance: str) -> None:
        md = self._base + ([(INSTANCE_KEY, instance)] if instance else [])
        self.instance, self._instance_changed = instance, False
        self.metadata, self.md = md, tuple(md)
        if self.on_metadata is not None:
            self.on_metadata(md)

    def fenced(self, e: grpc.RpcError) -> bool:
        """The daemon refused a call naming sequences of the instance before its restart:
        take the new one (the error still reaches the caller), so that the next call goes."""
        if not restarted(e):
            return False
        new = dict(e.trailing_metadata() or ()).get(INSTANCE_KEY)
        if new is None:
            return False
        log.warning("kvstore: the daemon restarted (instance %s; this client's sequences were of %s): "
                    "the sequences it did not restore from disk are gone", new, self.instance)
        self._set_instance(new)
        return True
