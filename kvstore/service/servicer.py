"""The gRPC servicer: one method per RPC, each a thin translation between
protos and engine calls (convert.py builds the messages; handlers.py holds
the work the doorbell shares). Engine errors become status codes here and
nowhere else."""
from __future__ import annotations

import functools
import logging
import os
import threading

import grpc

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, quote
from kvstore.protocol import wire
from kvstore.protocol.channel import SESSION_KEY, STREAM_KEY
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from . import buildinfo, convert
from .auth import DEFAULT_TENANT, Authenticator, PermissionDenied, is_local
from .buffers import BufferRegistry, TenantBuffers
from .handlers import Handlers
from .leases import LeaseManager, session_of

log = logging.getLogger("kvstore.servicer")
MAX_NITER = 1000
DEFAULT_MAX_STREAMS = 64
# Bytes of a status message sent. gRPC carries it in a header, percent-encoded
# (up to 3 bytes per byte), under a 16 KiB limit on all metadata; past that the
# client gets RESOURCE_EXHAUSTED "Stream removed" instead of our status.
MAX_STATUS_BYTES = 1024
READ_ONLY = frozenset({"Heartbeat", "Stats", "GetCache", "GetCodebooks", "SequenceInfo", "ListSequences"})


def status_message(message: str) -> str:
    """message, cut to MAX_STATUS_BYTES of UTF-8 (values come quoted short: this bounds the rest)."""
    raw = message.encode("utf-8", "replace")
    if len(raw) <= MAX_STATUS_BYTES:
        return message
    tail = f"... ({len(raw)} bytes)"
    return raw[:MAX_STATUS_BYTES - len(tail)].decode("utf-8", "ignore") + tail


def _rpc(fn):
    """Map engine errors to status codes; any other exception is INTERNAL and
    logged, and the daemon keeps serving."""
    @functools.wraps(fn)
    def wrapper(self, request, context):
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is starting")
        try:
            self._begin(context)
            reply = fn(self, request, context)
        except KVStoreError as e:
            self._check_invariants(context, fn.__name__)
            context.abort(getattr(grpc.StatusCode, e.code), status_message(str(e)))
        except Exception as e:  # noqa: BLE001 - a bad request must not take the daemon down
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, status_message(f"{type(e).__name__}: {e}"))
        finally:
            self._end()
        self._check_invariants(context, fn.__name__)
        return reply
    return wrapper


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, engine: Engine | None, buffers: BufferRegistry, auth: Authenticator | None = None,
                 leases: LeaseManager | None = None, max_streams: int = DEFAULT_MAX_STREAMS):
        self.auth = auth or Authenticator()
        self.leases = leases
        self.buffer_table = TenantBuffers(buffers)
        # Debug builds (fuzz, soak) check pool invariants after every call that can change them.
        self.handlers = Handlers(engine, self.buffer_table, leases,
                                 debug_invariants=os.environ.get("KVSTORE_DEBUG_INVARIANTS") == "1")
        self._call = threading.local()
        self.max_pool_bytes = 0      # all caches' pools together; 0: unlimited (set by the daemon)
        # An open stream holds a server thread for its life (the daemon sizes
        # its pool as workers + max_streams): past the limit, turn it away.
        self.max_streams = max_streams
        self._stream_slots = threading.BoundedSemaphore(max_streams)
        self.stopping = False       # a stream's next message is then refused, as a new call is
        self._streams_busy = 0      # stream messages being answered (daemon.cut_idle_streams)
        self._streams_lock = threading.Lock()
        self.doorbell = None         # the per-step fast lane (doorbell.py), set by the daemon
        self.instance = ""           # this daemon process's id (fence.py), set by the daemon

    @property
    def engine(self) -> Engine | None:
        return self.handlers.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.handlers.engine = engine

    @property
    def buffers(self):
        """The calling tenant's view of the registered buffers; None for remote
        callers, who cannot name shared memory. Set per call by _begin (a call
        runs on one thread from start to end)."""
        return getattr(self._call, "buffers", None)

    def _tenant(self, context) -> str:
        return self.auth.tenant(context)     # remembered on the context: cheap after _begin

    def _begin(self, context) -> None:
        # Who is calling, worked out once per context: once per call, and once
        # per stream for all of its messages. Every message renews the lease.
        self._call.who = None
        who = getattr(context, "_kvstore_who", None)
        if who is None:
            tenant, session = self.auth.tenant(context), session_of(context)
            who = (tenant, session, self.buffer_table.view(tenant, session) if is_local(context) else None)
            try:
                context._kvstore_who = who
            except AttributeError:     # a context type that takes no attributes
                pass
        if self.leases is not None:
            self.leases.enter(who[0], who[1])
        self._call.buffers, self._call.who = who[2], who[:2]

    def _end(self) -> None:
        # The session is live while a call of it runs, however long (LeaseManager.enter):
        # a call that waited behind a cache's lock past the lease timeout must not find
        # its session's sequences freed the moment it returns.
        who, self._call.who = getattr(self._call, "who", None), None
        if self.leases is not None and who is not None:
            self.leases.leave(*who)

    def _check_invariants(self, context, method: str) -> None:
        # Not after calls that change nothing: the check takes every cache's lock, and a
        # heartbeat queued behind a long call would let its session's lease lapse.
        if not self.handlers.debug_invariants or method in READ_ONLY:
            return
        try:
            self.engine.check_invariants()
        except AssertionError as e:
            log.error("invariant broken after %s: %s", method, e)
            context.abort(grpc.StatusCode.INTERNAL, status_message(f"invariant broken after {method}: {e}"))

    def _t(self, t: pb.Tensor, field: str):
        return self.handlers.tensor(t, self.buffers, field)

    def _cuda(self, request):
        return self.handlers.cuda_scope(request, self.buffers)

    # ---------------------------------------------------------------- caches
    @_rpc
    def CreateCache(self, request, context):
        with convert.spec_fields_named():
            cfg = convert.spec_to_config(request.spec, self.engine.device)
            info = self.engine.create_cache(cfg, exist_ok=request.exist_ok, max_pool_bytes=self.max_pool_bytes)
        return convert.cache_info(info)

    @_rpc
    def DeleteCache(self, request, context):
        return convert.delete_reply(self.handlers.delete_cache(request.cache, self._tenant(context), request.force))

    @_rpc
    def GetCache(self, request, context):
        return convert.cache_info(self.engine.cache_info(request.cache))

    @_rpc
    def SetCodebooks(self, request, context):
        self.engine.require_pq(request.cache)
        cb = Codebooks.from_bytes(request.safetensors)
        return pb.CodebooksReply(sha256=self.engine.set_codebooks(request.cache, cb, self._may_replace("SetCodebooks",
                                                                                                       context)))

    @_rpc
    def GetCodebooks(self, request, context):
        cb = self.engine.codebooks(request.cache)
        return pb.GetCodebooksReply(safetensors=cb.to_bytes(), sha256=cb.sha256())

    @_rpc
    def TrainCodebooks(self, request, context):
        self.engine.require_pq(request.cache)
        k = self._t(request.k_samples, "k_samples")
        v = self._t(request.v_samples, "v_samples")
        if request.niter > MAX_NITER:   # unbounded, one call could hold a worker thread for hours
            raise InvalidArgument("niter", f"must be <= {MAX_NITER}, got {request.niter}")
        return pb.CodebooksReply(sha256=self.engine.train_codebooks(request.cache, k, v, niter=request.niter or 20,
                                                                    may_replace=self._may_replace("TrainCodebooks",
                                                                                                  context)))

    def _may_replace(self, rpc: str, context):
        """Codebooks a cache has change it for every tenant (its blocks' hashes, every
        sequence's next codes): replacing them is the default tenant's, as DeleteCache."""
        tenant = self._tenant(context)

        def check(name: str) -> None:
            if tenant != DEFAULT_TENANT:
                raise PermissionDenied("codebooks", f"{rpc}: cache {quote(name)} has codebooks, and caches are "
                                                    f"shared by every tenant: only tenant {DEFAULT_TENANT!r} may "
                                                    f"replace them, not {quote(tenant)}")
        return check

    # ------------------------------------------------------------- sequences
    @_rpc
    def Allocate(self, request, context):
        # The repeated field itself: the engine bounds its length before copying it.
        r = self.engine.allocate(request.cache, self._tenant(context), request.sequence_id,
                                 request.prompt_token_ids, owner=session_of(context),
                                 pinned=request.pinned, persist=request.persist)
        return pb.AllocateReply(cached_tokens=r.cached_tokens, hit_blocks=r.hit_blocks)

    # --------------------------------------------------- mapped attend (§5)
    @staticmethod
    def _local_mapper(context, rpc: str) -> None:
        """MapPool and Reserve are for clients that write the pool themselves
        (mapped attend): local ones, since the pool is mapped by IPC handle."""
        if not is_local(context):
            raise PermissionDenied("cache", f"{rpc}: only for callers on the Unix socket, which map the pool "
                                   "(MapPool); remote callers write with Append/AppendAttend")

    def _mappable(self, context, name: str, rpc: str) -> None:
        """Whether the (local) caller may map the cache's pool and take slots
        in it: its handles expose every tenant's K/V, so only the default
        tenant's, or any tenant's if the cache shares prefixes across tenants;
        and only a CUDA pool, the one kind a client can map. Reserve follows
        MapPool: its slots commit whatever the client wrote into them, so they
        are for no one who cannot write the pool."""
        cfg = self.engine.config(name)
        if not cfg.share_prefixes_across_tenants and self._tenant(context) != DEFAULT_TENANT:
            raise PermissionDenied("cache", f"{rpc}: mapping a pool is only for the default tenant, or caches "
                                   "created with share_prefixes_across_tenants; other tenants write with "
                                   "Append/AppendAttend")
        if not cfg.device.startswith("cuda"):
            raise FailedPrecondition("cache", f"cache {quote(name)} lives on {cfg.device}: mapped attend "
                                     "(MapPool, Reserve) needs a CUDA pool; use Append/AppendAttend")

    @_rpc
    def Reserve(self, request, context):
        self._local_mapper(context, "Reserve")
        if len(request.known_sealed) != len(request.known_epochs):
            raise InvalidArgument("known_epochs", f"{len(request.known_epochs)} epochs for "
                                  f"{len(request.known_sealed)} known_sealed counts")
        known = list(zip(request.known_sealed, request.known_epochs)) or None
        n_seqs = len(request.sequence_ids) or 1
        if known is not None and len(known) != n_seqs:
            raise InvalidArgument("known_sealed", f"{len(known)} entries for {n_seqs} sequence(s)")
        self._mappable(context, request.cache, "Reserve")
        if request.sequence_ids:
            entered = []

            def scope():
                entered.append(True)
                return self._cuda(request)
            rs = self.engine.reserve_batch(request.cache, self._tenant(context), list(request.sequence_ids),
                                           request.num_tokens, gpu_scope=scope, known=known)
            return pb.ReserveReply(reservations=[pb.Reservation(sequence_id=sid, **convert.reservation(r))
                                                 for sid, r in zip(request.sequence_ids, rs)], gpu_idle=not entered)
        with self._cuda(request):
            r = self.engine.reserve(request.cache, self._tenant(context), request.sequence_id, request.num_tokens,
                                    known[0] if known else (0, 0))
        return pb.ReserveReply(**convert.reservation(r))

    @_rpc
    def Append(self, request, context):
        self.engine.config(request.cache)
        token_ids = [t.ids for t in request.token_ids] if request.token_ids else None   # bounded, then copied
        with self._cuda(request):
            self.engine.append(request.cache, self._tenant(context), list(request.sequence_ids),
                               self._t(request.k, "k"), self._t(request.v, "v"), list(request.counts),
                               layer=request.layer if request.HasField("layer") else None, token_ids=token_ids)
        return pb.AppendReply()

    @_rpc
    def Attend(self, request, context):
        ref, view = self.handlers.out_view(request, len(request.sequence_ids), self.buffers)
        with self._cuda(request):
            out = self.engine.attend(request.cache, self._tenant(context), request.layer,
                                     list(request.sequence_ids), self._t(request.q, "q"), request.scale, out=view)
            return pb.AttendReply(out=wire.to_proto(out, self.buffers, ref))

    @_rpc
    def AppendAttend(self, request, context):
        buffers = self.buffers
        return self.handlers.append_attend(request, self._tenant(context), buffers,
                                           lambda out, ref: pb.AttendReply(out=wire.to_proto(out, buffers, ref)))

    def AppendAttendStream(self, requests, context):
        """AppendAttend, one reply per request in order, on one long-lived
        stream. A rejected request ends the stream with AppendAttend's status."""
        try:
            session_of(context)         # checked at the start, as a call's is, not at the first message
        except KVStoreError as e:
            context.abort(getattr(grpc.StatusCode, e.code), status_message(str(e)))
        if not self._stream_slots.acquire(blocking=False):
            context.set_trailing_metadata(((STREAM_KEY, "refused"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"streams: all {self.max_streams} are open (daemon --max-streams); call AppendAttend")
        try:
            for request in requests:
                if self.stopping:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping (its next call: another "
                                                               "daemon's, or this one's after its restart)")
                with self._streams_lock:
                    self._streams_busy += 1
                try:
                    reply = self.AppendAttend(request, context)
                finally:
                    with self._streams_lock:
                        self._streams_busy -= 1
                yield reply
        finally:
            self._stream_slots.release()

    def streams_idle(self) -> bool:
        """No stream message is being answered (open streams wait for their next)."""
        return self._streams_busy == 0

    @_rpc
    def Retrieve(self, request, context):
        tenant = self._tenant(context)
        end, k_out, v_out = self.handlers.retrieve_outputs(request, tenant, self.buffers)
        with self._cuda(request):
            k, v = self.engine.retrieve(request.cache, tenant, request.sequence_id,
                                        request.start, end, request.layer_start, request.layer_end)
            return pb.RetrieveReply(k=wire.to_proto(k, self.buffers, k_out, "k_out"),
                                    v=wire.to_proto(v, self.buffers, v_out, "v_out"))

    @_rpc
    def Fork(self, request, context):
        self.engine.fork(request.cache, self._tenant(context), request.sequence_id, request.new_sequence_id,
                         owner=session_of(context))
        return pb.ForkReply()

    @_rpc
    def Free(self, request, context):
        self.engine.free(request.cache, self._tenant(context), list(request.sequence_ids))
        return pb.FreeReply()

    @_rpc
    def Offload(self, request, context):
        self.engine.offload(request.cache, self._tenant(context), list(request.sequence_ids))
        return pb.OffloadReply()

    @_rpc
    def Prefetch(self, request, context):
        self.engine.prefetch(request.cache, self._tenant(context), list(request.sequence_ids))
        return pb.PrefetchReply()

    @_rpc
    def MapPool(self, request, context):
        self._local_mapper(context, "MapPool")
        from kvstore.cuda import ipc as cuda_ipc
        self._mappable(context, request.cache, "MapPool")
        pool = self.engine.map_pool(request.cache, (self._tenant(context), session_of(context)))
        uuid = cuda_ipc.device_uuid(pool.device.index or 0)
        if request.device_uuid and request.device_uuid != uuid:
            raise FailedPrecondition("device_uuid", f"the pool lives on GPU {uuid}, not {request.device_uuid}")
        reply = pb.MapPoolReply(spec=convert.config_to_spec(pool.cfg), device_uuid=uuid)
        for name, t in pool.tensors.items():
            h = cuda_ipc.export_tensor(t)
            reply.tensors.add(name=name, ipc_handle=h.handle, offset=h.offset, shape=list(t.shape),
                              dtype=wire.TO_PROTO[t.dtype])
        return reply

    # --------------------------------------------------------------- buffers
    @_rpc
    def RegisterBuffer(self, request, context):
        if not is_local(context):
            raise PermissionDenied("kind", "RegisterBuffer: buffers are only for callers on the Unix socket")
        if request.kind == pb.SHM:
            reply = pb.RegisterBufferReply(buffer_id=self.buffers.register_shm(request.name, request.size))
        elif request.kind == pb.CUDA_IPC:
            reply = pb.RegisterBufferReply(buffer_id=self.buffers.register_cuda(
                request.ipc_handle, request.offset, request.size, request.device_uuid,
                request.ready_event, request.done_event))
        else:
            raise InvalidArgument("kind", "must be SHM or CUDA_IPC")
        if self.doorbell is not None:
            reply.doorbell_path = self.doorbell.path
            reply.doorbell_token = self.doorbell.token_for(self.buffers.tenant, self.buffers.session)
        return reply

    @_rpc
    def UnregisterBuffer(self, request, context):
        if self.buffers is None:
            raise PermissionDenied("buffer_id", "UnregisterBuffer: buffers are only for callers on the Unix socket")
        self.buffers.unregister(request.buffer_id)
        return pb.UnregisterBufferReply()

    # ----------------------------------------------------------------- stats
    @_rpc
    def Stats(self, request, context):
        return convert.stats_reply(self.engine.stats(request.cache or None), self._tenant(context) == DEFAULT_TENANT,
                                   self.engine.disk_stats())

    @_rpc
    def SequenceInfo(self, request, context):
        tenant = self._tenant(context)
        return self._info(tenant, self.engine.sequence_info(request.cache, tenant, request.sequence_id))

    @_rpc
    def ListSequences(self, request, context):
        tenant = self._tenant(context)
        return pb.ListSequencesReply(sequences=[self._info(tenant, i) for i in
                                                self.engine.list_sequences(request.cache, tenant)])

    def _info(self, tenant: str, i) -> pb.SequenceInfoReply:
        # A pinned or persist sequence outlives its session's lapse: it names the session
        # only while that session's lease is current (the proto: whose lease holds it).
        return convert.sequence_info(i, self.leases is None or not i.owner or self.leases.is_live(tenant, i.owner))

    # ---------------------------------------------------------------- leases
    @_rpc
    def Heartbeat(self, request, context):
        session = session_of(context)
        if not session:
            raise InvalidArgument(SESSION_KEY, "missing: a Heartbeat renews the lease of the session it names")
        tenant = self._tenant(context)
        held = sum(len(v) for v in self.engine.owned_sequences(tenant, session, wait=False).values())
        return pb.HeartbeatReply(session_id=session, tenant=tenant, sequences=held, instance=self.instance,
                                 lease_timeout_s=self.leases.timeout_s if self.leases is not None else 0.0,
                                 version=buildinfo.version())
