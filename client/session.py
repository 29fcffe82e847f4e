"""The session a client calls in: the metadata every call carries (its session
id, token, and the daemon instance its sequence ids are from), the heartbeat
that renews its lease, and what tells a restart from a lapsed lease."""
from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from kvstore.errors import quote
from kvstore.protocol.channel import INSTANCE_KEY, SESSION_KEY
from kvstore.v1 import kvstore_pb2 as pb

from .stream import rpc_error

log = logging.getLogger("kvstore.client")
# The sequence ids a session remembers having named under the current daemon instance,
# the least recently named forgotten first: after a restart each of these raises once.
NAMED_MAX = 1 << 20
# The daemon instances a session remembers having seen replaced (the newest kept).
RETIRED_MAX = 64
# The daemon gone or going away: a call in flight when it stops may end CANCELLED (gRPC's own
# cancellation) as well as UNAVAILABLE, and neither says whether the call took effect.
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_forks = 0      # fork() children this process descends from: a client of an ancestor is not its own


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def restarted(e: grpc.RpcError) -> bool:
    """The daemon refused a call naming sequences of its instance before a restart."""
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith(INSTANCE_KEY + ":")


class _Metadata(grpc.UnaryUnaryClientInterceptor):
    """Adds the session's metadata to a control call, and shows the session its error."""

    def __init__(self, session: "Session"):
        self.session = session

    def intercept_unary_unary(self, continuation, details, request):
        self.session.check_process()
        # A call naming sequences brings its own: the metadata naming() gave it.
        named = bool(details.metadata)
        md = list(details.metadata if named else self.session.metadata)
        outcome = continuation(details._replace(metadata=md), request)
        if outcome.done() and isinstance(err := outcome.exception(), grpc.RpcError):
            self.session.fenced(err, named)
        return outcome


class Session:
    """metadata: what a call sends (a list for the interceptor, `md` the same as a
    tuple for the tensor calls, which pass it themselves: a Python client interceptor
    costs tens of µs per call).

    The restart fence, per sequence (cache, id: ids are a cache's own, and one id may
    name sequences of several caches): those this session named under the daemon
    instance it knows are remembered; once it learns of a restart (a Heartbeat reply
    naming another instance, or the daemon refusing a call for the old one) each of
    them raises FAILED_PRECONDITION the next time a call names it, once, whichever
    thread or request names it, and every lane (the doorbell's calls carry no
    metadata) is checked here before it sends."""

    def __init__(self, session_id: str, token: str | None):
        self.id = session_id
        self.pid, self._forks = os.getpid(), _forks
        # "": no session id: the daemon keeps no lease for these calls (session_of, leases.py).
        self._base = ([(SESSION_KEY, session_id)] if session_id else []) + \
            ([("authorization", f"Bearer {token}")] if token else [])
        self.metadata = list(self._base)
        self.md = tuple(self._base)
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
        # Instances replaced since: a daemon's instance is random at each start, so one of
        # these named again is a late reply of a daemon that has since stopped (a call in
        # flight across two restarts), not a third restart: it is not taken.
        self._retired: dict[str, None] = {}
        self._seq_lock = threading.Lock()
        self._named: dict[tuple[str, str], None] = {}     # (cache, id) named under `instance`, oldest first
        self._stale: dict[tuple[str, str], str] = {}      # (cache, id) named before a restart -> its instance
        self._calling = threading.local()     # (cache, id) of this thread's last call naming sequences

    # ------------------------------------------------------------- process
    @property
    def forked(self) -> bool:
        """This is a fork() child of the process that made the client."""
        return self._forks != _forks

    def check_process(self) -> None:
        """FAILED_PRECONDITION in a fork() child: the client's doorbell socket, shared
        buffer and session are its parent's, and calls of both processes through them
        would read each other's inputs and replies."""
        if self.forked:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, (
                f"KVStoreClient: made in process {self.pid}, called in a fork() child of it ({os.getpid()}): "
                "its doorbell, shared buffer and session are the parent's; make a new KVStoreClient in the child"))

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
        """A Heartbeat reply: the lease renewed, and the instance learned; another one
        than before is a restart (the sequences named so far are stale)."""
        self._set_instance(r.instance)
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
        self._renewed_in_time, self.unreachable, self._instance_changed = True, False, False

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
        """Take `instance` as the daemon's. Another than the one known is a restart: the
        sequences named so far are stale."""
        md = self._base + ([(INSTANCE_KEY, instance)] if instance else [])
        with self._seq_lock:
            if instance == self.instance or instance in self._retired:
                return
            if self.instance is not None:
                log.warning("kvstore: the daemon restarted (instance %s; this client's sequences were of %s): "
                            "the sequences it did not restore from disk are gone", instance, self.instance)
                self._instance_changed = True
                for i in self._named:
                    self._stale.setdefault(i, self.instance)
                self._named.clear()
                while len(self._stale) > NAMED_MAX:       # the oldest first
                    del self._stale[next(iter(self._stale))]
                if self.instance:                          # "": a daemon without one
                    self._retired[self.instance] = None
                    if len(self._retired) > RETIRED_MAX:
                        del self._retired[next(iter(self._retired))]
            self.instance = instance
            self.metadata, self.md = md, tuple(md)

    def _remember(self, ids) -> None:
        named = self._named
        for i in ids:
            self._stale.pop(i, None)
            named.pop(i, 0)            # to the back: the least recently named are forgotten first
            named[i] = None
            if len(named) > NAMED_MAX:
                del named[next(iter(named))]

    def naming(self, cache: str, ids, new=()) -> tuple[tuple, bool]:
        """A call about to name sequences `ids` of `cache` and create `new` (Allocate, Fork) -> (the
        metadata to send it with: the instance they were checked under, so that a restart
        learned meanwhile (another thread) has the daemon refuse it; whether this session
        named none of `ids` before). FAILED_PRECONDITION, before anything is sent, for
        ids named before a restart this session learned of, once each (they are taken as
        told from then on)."""
        self.check_process()
        ids, new = [(cache, i) for i in ids], [(cache, i) for i in new]
        with self._seq_lock:
            stale = {i: self._stale[i] for i in ids if i in self._stale}
            fresh = not stale and not any(i in self._named for i in ids)
            self._remember(ids)
            self._remember(new)
            md = self.md
            self._calling.ids = (*ids, *new)
        if stale:
            names = ", ".join(quote(i) for _, i in list(stale)[:4]) + (f" and {len(stale) - 4} more"
                                                                       if len(stale) > 4 else "")
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, (
                f"{INSTANCE_KEY}: sequence {names} of cache {quote(cache)} was named before the daemon restarted "
                f"(instance {next(iter(stale.values()))!r}, now {self.instance!r}): it is gone unless it was persist "
                "or on disk, offloaded (ListSequences lists it), and its id may name a sequence allocated since. "
                "Raised once for each such sequence")[:1024], ((INSTANCE_KEY, self.instance or ""),))
        return md, fresh

    def forget(self, cache: str, ids) -> None:
        """Sequences of `cache` freed: nothing to fence for them any more."""
        with self._seq_lock:
            for i in ((cache, i) for i in ids):
                self._named.pop(i, None)
                self._stale.pop(i, None)

    def fenced(self, e: grpc.RpcError, named: bool = False) -> bool:
        """The daemon refused a call for the instance before its restart: take the new one
        (the error still reaches the caller); the sequences named before are stale, but
        for those of the refused call if it named sequences (`named`: sent with the
        metadata naming() gave): its error told the caller of them."""
        if not restarted(e):
            return False
        new = dict(e.trailing_metadata() or ()).get(INSTANCE_KEY)
        if new is None:
            return False
        self._set_instance(new)
        if named:
            with self._seq_lock:
                self._remember(getattr(self._calling, "ids", ()))
        return True
