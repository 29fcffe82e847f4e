"""The gRPC servicer: a thin translation between protos and the engine.
Engine errors become status codes here and nowhere else."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass

import grpc

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.cuda.scope import CudaScope, Fences, output_fields, tensor_fields
from kvstore.engine.engine import Engine
from kvstore.engine.engine import SequenceInfo as SeqInfo
from kvstore.engine.storage import TORCH_DTYPES
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, ResourceExhausted, Unavailable, quote
from kvstore.protocol import wire
from kvstore.protocol.channel import SESSION_KEY, STREAM_KEY
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from .auth import DEFAULT_TENANT, Authenticator, PermissionDenied, is_local
from .buffers import BufferRegistry, TenantBuffers
from .leases import LeaseManager, session_of

log = logging.getLogger("kvstore.servicer")
MAX_NITER = 1000
DEFAULT_MAX_STREAMS = 64
# Bytes of a status message sent. gRPC carries it in a header, percent-encoded
# (up to 3 bytes per byte), under a 16 KiB limit on all metadata; past that the
# client gets RESOURCE_EXHAUSTED "Stream removed" instead of our status.
MAX_STATUS_BYTES = 1024


def status_message(message: str) -> str:
    """message, cut to MAX_STATUS_BYTES of UTF-8 (values are quoted short
    already, errors.quote; this bounds whatever else a message holds)."""
    raw = message.encode("utf-8", "replace")
    if len(raw) <= MAX_STATUS_BYTES:
        return message
    return f"{raw[:MAX_STATUS_BYTES].decode('utf-8', 'ignore')}... ({len(raw)} bytes)"


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
        self._check_invariants(context, fn.__name__)
        return reply
    return wrapper


def spec_to_config(spec: pb.CacheSpec, device: str) -> CacheConfig:
    g = spec.geometry
    return CacheConfig(
        name=spec.name, model_id=spec.model_id,
        geometry=ModelGeometry(g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.dtype or "float16"),
        codec=CodecConfig(kind=spec.codec or "pq", num_subvectors=spec.num_subvectors),
        block_size=spec.block_size or 16,
        residual=spec.residual if spec.HasField("residual") else 128, sink_tokens=spec.sink_tokens,
        num_blocks=spec.num_blocks, pool_bytes=spec.pool_bytes,
        max_sequences=spec.max_sequences or 256, device=device, host_bytes=spec.host_bytes,
        low_watermark=spec.low_watermark, share_prefixes_across_tenants=spec.share_prefixes_across_tenants)


def config_to_spec(cfg: CacheConfig) -> pb.CacheSpec:
    g = cfg.geometry
    return pb.CacheSpec(
        name=cfg.name, model_id=cfg.model_id,
        geometry=pb.Geometry(num_layers=g.num_layers, num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads,
                             head_dim=g.head_dim, dtype=g.dtype),
        codec=cfg.codec.kind, num_subvectors=cfg.m if cfg.codec.kind == "pq" else 0,
        block_size=cfg.block_size, residual=cfg.residual, sink_tokens=cfg.sink_tokens,
        num_blocks=cfg.num_blocks, pool_bytes=cfg.pool_bytes,
        max_sequences=cfg.max_sequences, host_bytes=cfg.host_bytes, low_watermark=cfg.low_watermark,
        share_prefixes_across_tenants=cfg.share_prefixes_across_tenants)


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, engine: Engine | None, buffers: BufferRegistry, auth: Authenticator | None = None,
                 leases: LeaseManager | None = None, max_streams: int = DEFAULT_MAX_STREAMS):
        self.engine = engine
        self.auth = auth or Authenticator()
        self.leases = leases
        self.buffer_table = TenantBuffers(buffers)
        self._call = threading.local()
        # Debug builds (fuzz, soak) check pool invariants after every call.
        self.debug_invariants = os.environ.get("KVSTORE_DEBUG_INVARIANTS") == "1"
        self.max_pool_bytes = 0      # all caches' pools together; 0: unlimited (set by the daemon)
        self._streams: dict = {}     # the daemon's own CUDA stream per device
        self._streams_lock = threading.Lock()   # calls on different caches run at once
        self._fences = Fences()
        # An open stream holds a server thread for its life (the daemon sizes
        # its pool as workers + max_streams): past the limit, turn it away.
        self.max_streams = max_streams
        self._stream_slots = threading.BoundedSemaphore(max_streams)
        self.doorbell = None         # the per-step fast lane (doorbell.py), set by the daemon

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
        who = getattr(context, "_kvstore_who", None)
        if who is None:
            tenant, session = self.auth.tenant(context), session_of(context)
            who = (tenant, session, self.buffer_table.view(tenant, session) if is_local(context) else None)
            try:
                context._kvstore_who = who
            except AttributeError:     # a context type that takes no attributes
                pass
        if self.leases is not None:
            self.leases.touch(who[0], who[1])
        self._call.buffers = who[2]

    def _check_invariants(self, context, method: str) -> None:
        if not self.debug_invariants:
            return
        try:
            self.engine.check_invariants()
        except AssertionError as e:
            log.error("invariant broken after %s: %s", method, e)
            context.abort(grpc.StatusCode.INTERNAL, status_message(f"invariant broken after {method}: {e}"))

    def _t(self, t: pb.Tensor, field: str):
        return wire.from_proto(t, self.buffers, field)

    def _info(self, name: str) -> pb.CacheInfo:
        c = self.engine.cache(name)
        with c.lock:        # codebooks and fingerprint change together
            return self._info_locked(c)

    @staticmethod
    def _info_locked(c) -> pb.CacheInfo:
        return pb.CacheInfo(spec=config_to_spec(c.cfg), has_codebooks=c.codebooks is not None,
                            codebooks_sha256=c.codebooks.sha256() if c.codebooks is not None else "",
                            fingerprint=c.fingerprint, capacity_blocks=c.main_pool.capacity,
                            tail_capacity_blocks=c.tail_pool.capacity if c.is_pq else 0,
                            bytes_per_token=c.cfg.bytes_per_token(),
                            compression_ratio=c.cfg.fp16_bytes_per_token() / c.cfg.bytes_per_token())

    # ---------------------------------------------------------------- caches
    @_rpc
    def CreateCache(self, request, context):
        cfg = spec_to_config(request.spec, self.engine.device)
        with self.engine.lock:
            if self.max_pool_bytes and cfg.name not in self.engine.caches:
                # Refuse before allocating: a pool past memory gets the daemon OOM-killed.
                held = sum(_pool_bytes(c.cfg) for c in self.engine.caches.values())
                if held + _pool_bytes(cfg) > self.max_pool_bytes:
                    raise ResourceExhausted("spec.num_blocks", f"the cache needs {_pool_bytes(cfg)} bytes; "
                                            f"{self.max_pool_bytes - held} of the daemon's --max-pool-bytes are left")
            self.engine.create_cache(cfg, exist_ok=request.exist_ok)
        return self._info(cfg.name)

    @_rpc
    def GetCache(self, request, context):
        return self._info(request.cache)

    @_rpc
    def SetCodebooks(self, request, context):
        self.engine.cache(request.cache)
        return pb.CodebooksReply(sha256=self.engine.set_codebooks(request.cache, Codebooks.from_bytes(request.safetensors)))

    @_rpc
    def TrainCodebooks(self, request, context):
        self.engine.cache(request.cache)
        k = self._t(request.k_samples, "k_samples")
        v = self._t(request.v_samples, "v_samples")
        if request.niter > MAX_NITER:   # unbounded, one call could hold a worker thread for hours
            raise InvalidArgument("niter", f"must be <= {MAX_NITER}, got {request.niter}")
        return pb.CodebooksReply(sha256=self.engine.train_codebooks(request.cache, k, v, niter=request.niter or 20))

    # ------------------------------------------------------------- sequences
    @_rpc
    def Allocate(self, request, context):
        # The repeated field itself: the engine bounds its length before copying it.
        r = self.engine.allocate(request.cache, self._tenant(context), request.sequence_id,
                                 request.prompt_token_ids, owner=session_of(context),
                                 pinned=request.pinned, persist=request.persist)
        return pb.AllocateReply(cached_tokens=r.cached_tokens, hit_blocks=r.hit_blocks)

    def _cuda(self, request):
        """For calls naming a CUDA buffer: run on the daemon's stream after the
        client's ready event, record the done event after the outputs; no host
        synchronisation. A no-op context otherwise."""
        if self.buffers is None or not self.buffer_table.registry.cuda_buffers:
            return contextlib.nullcontext()
        ids = {t.ref.buffer_id for t in tensor_fields(request) if t.WhichOneof("data") == "ref"}
        ids |= {o.buffer_id for o in output_fields(request) if o.buffer_id}
        if getattr(request, "buffer_id", ""):
            ids.add(request.buffer_id)
        for bid in ids:
            events = self.buffers.cuda_events(bid) if self.buffers is not None else None
            if events is not None:
                stream = self._stream(events[0])
                return CudaScope(stream, *events, self._fences.get(stream.device))
        return contextlib.nullcontext()

    def _stream(self, event):
        import torch
        dev = torch.cuda.current_device() if not hasattr(event, "device") else event.device
        key = str(dev)
        stream = self._streams.get(key)
        if stream is None:
            with self._streams_lock, torch.cuda.device(dev):   # one stream per device, whoever asks first
                stream = self._streams.get(key)
                if stream is None:
                    stream = self._streams[key] = torch.cuda.Stream()
        return stream

    # --------------------------------------------------- mapped attend (§5)
    @staticmethod
    def _local_mapper(context, rpc: str) -> None:
        """MapPool and Reserve are for clients that write the pool themselves
        (mapped attend): local ones, since the pool is mapped by IPC handle."""
        if not is_local(context):
            raise PermissionDenied(rpc, "only for callers on the Unix socket, which map the pool (MapPool); "
                                   "remote callers write with Append/AppendAttend")

    def _mappable(self, context, name: str, rpc: str):
        """The cache whose pool the (local) caller may map and take slots in:
        its handles expose every tenant's K/V, so only the default tenant's,
        or any tenant's if the cache shares prefixes across tenants; and only
        a CUDA pool, the one kind a client can map. Reserve follows MapPool:
        its slots commit whatever the client wrote into them, so they are for
        no one who cannot write the pool. -> the Cache."""
        c = self.engine.cache(name)
        if not c.cfg.share_prefixes_across_tenants and self._tenant(context) != DEFAULT_TENANT:
            raise PermissionDenied(rpc, "mapping a pool is only for the default tenant, or caches created with "
                                   "share_prefixes_across_tenants; other tenants write with Append/AppendAttend")
        if not c.cfg.device.startswith("cuda"):
            raise FailedPrecondition("cache", f"cache {quote(name)} lives on {c.cfg.device}: mapped attend "
                                     "(MapPool, Reserve) needs a CUDA pool; use Append/AppendAttend")
        return c

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
            return pb.ReserveReply(reservations=[
                pb.Reservation(sequence_id=sid, slot_mapping=r.slot_mapping, sealed_blocks=r.sealed_blocks,
                               tail_blocks=r.tail_blocks, length=r.length, sealed_start=r.sealed_start,
                               table_epoch=r.table_epoch)
                for sid, r in zip(request.sequence_ids, rs)], gpu_idle=not entered)
        with self._cuda(request):
            r = self.engine.reserve(request.cache, self._tenant(context), request.sequence_id, request.num_tokens,
                                    known[0] if known else (0, 0))
        return pb.ReserveReply(slot_mapping=r.slot_mapping, sealed_blocks=r.sealed_blocks,
                               tail_blocks=r.tail_blocks, length=r.length, sealed_start=r.sealed_start,
                               table_epoch=r.table_epoch)

    @_rpc
    def Append(self, request, context):
        self.engine.cache(request.cache)
        token_ids = [t.ids for t in request.token_ids] if request.token_ids else None   # bounded, then copied
        with self._cuda(request):
            self.engine.append(request.cache, self._tenant(context), list(request.sequence_ids),
                               self._t(request.k, "k"), self._t(request.v, "v"), list(request.counts),
                               layer=request.layer if request.HasField("layer") else None, token_ids=token_ids)
        return pb.AppendReply()

    def _out_view(self, request, n_seqs: int):
        """Check the request's output range; -> (its OutputRef or None, a view of
        it the kernels may write straight into (the engine checks it fits) or None)."""
        ref = request.out if request.HasField("out") else None
        c = self.engine.cache(request.cache)
        g = c.cfg.geometry
        shape = (n_seqs, g.num_q_heads, g.head_dim)
        dtype = TORCH_DTYPES[g.dtype]
        wire.check_output(self.buffers, ref, n_seqs * g.num_q_heads * g.head_dim * dtype.itemsize,
                          dtype.itemsize, "out")
        if ref is None or not ref.buffer_id or n_seqs == 0:
            return ref, None
        return ref, self.buffers.view(ref.buffer_id, ref.offset, shape, dtype)

    @_rpc
    def Attend(self, request, context):
        ref, view = self._out_view(request, len(request.sequence_ids))
        with self._cuda(request):
            out = self.engine.attend(request.cache, self._tenant(context), request.layer,
                                     list(request.sequence_ids), self._t(request.q, "q"), request.scale, out=view)
            return pb.AttendReply(out=wire.to_proto(out, self.buffers, ref))

    @_rpc
    def AppendAttend(self, request, context):
        return self._append_attend(request, self._tenant(context),
                                   lambda out, ref: pb.AttendReply(out=wire.to_proto(out, self.buffers, ref)))

    def _append_attend(self, request, tenant: str, finish, resolved: Resolved | None = None):
        """AppendAttend's work, for the gRPC handler and the doorbell alike:
        -> finish(out, its OutputRef), run inside the CUDA scope so that a copy
        into the output range comes before the done event. resolved: this
        request's resolve(), still valid (the doorbell keeps it per descriptor)."""
        r = resolved or self.resolve(request)
        with r.scope:
            out = self.engine.append_attend(request.cache, tenant, request.layer, list(request.sequence_ids),
                                            r.k, r.v, r.q, request.scale, out=r.out_view)
            return finish(out, r.out_ref)

    def resolve(self, request) -> Resolved:
        """What an AppendAttend's tensor fields name, checked in the order its
        errors are reported (out, k, v, q), and its CUDA scope."""
        ref, view = self._out_view(request, len(request.sequence_ids))
        return Resolved(self._t(request.k, "k"), self._t(request.v, "v"), self._t(request.q, "q"), ref, view,
                        self._cuda(request))

    def doorbell_append_attend(self, request, tenant: str, session: str, buffers,
                               resolved: Resolved | None = None) -> tuple[int, Resolved]:
        """An AppendAttend that came by the doorbell (doorbell.py) from a local
        caller of (tenant, session): the lease, buffer view and invariant checks
        of a gRPC call; engine errors propagate for the doorbell to report.
        resolved: this request's from an earlier call on this thread (its CUDA
        scope holds the thread's fence), if no buffer was unregistered since
        (BufferRegistry.generation).
        -> (the output's dtype (pb.DType), resolved); the output is in request.out's range."""
        if self.engine is None:
            raise Unavailable("engine", "is starting")
        if self.leases is not None:
            self.leases.touch(tenant, session)
        self._call.buffers = buffers
        r = resolved or self.resolve(request)

        def finish(out, ref):       # ref: never None, every descriptor names its output range
            if out is not r.out_view:   # else the kernels wrote it there, into the range resolve() checked
                wire.place(out, buffers, ref)
            return wire.TO_PROTO[out.dtype]
        try:
            return self._append_attend(request, tenant, finish, r), r
        finally:
            if self.debug_invariants:
                self.engine.check_invariants()

    def AppendAttendStream(self, requests, context):
        """AppendAttend, one reply per request in order, on one long-lived
        stream. A rejected request ends the stream with AppendAttend's status."""
        if not self._stream_slots.acquire(blocking=False):
            context.set_trailing_metadata(((STREAM_KEY, "refused"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"streams: all {self.max_streams} are open (daemon --max-streams); call AppendAttend")
        try:
            for request in requests:
                yield self.AppendAttend(request, context)
        finally:
            self._stream_slots.release()

    @_rpc
    def Retrieve(self, request, context):
        c = self.engine.cache(request.cache)
        g = c.cfg.geometry
        nl = (request.layer_end or g.num_layers) - request.layer_start
        n = max(0, request.end - request.start)
        nbytes = max(0, nl) * n * g.num_kv_heads * g.head_dim * 2
        k_out = request.k_out if request.HasField("k_out") else None
        v_out = request.v_out if request.HasField("v_out") else None
        wire.check_output(self.buffers, k_out, nbytes, 2, "k_out")
        wire.check_output(self.buffers, v_out, nbytes, 2, "v_out")
        with self._cuda(request):
            k, v = self.engine.retrieve(request.cache, self._tenant(context), request.sequence_id,
                                        request.start, request.end, request.layer_start, request.layer_end)
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
        c = self._mappable(context, request.cache, "MapPool")
        tensors = self.engine.pool_tensors(request.cache)
        uuid = cuda_ipc.device_uuid(tensors["k_codes" if c.is_pq else "k"].device.index or 0)
        if request.device_uuid and request.device_uuid != uuid:
            raise FailedPrecondition("device_uuid", f"the pool lives on GPU {uuid}, not {request.device_uuid}")
        reply = pb.MapPoolReply(spec=config_to_spec(c.cfg), device_uuid=uuid)
        for name, t in tensors.items():
            h = cuda_ipc.export_tensor(t)
            reply.tensors.add(name=name, ipc_handle=h.handle, offset=h.offset, shape=list(t.shape),
                              dtype=wire.TO_PROTO[t.dtype])
        return reply

    # --------------------------------------------------------------- buffers
    @_rpc
    def RegisterBuffer(self, request, context):
        if not is_local(context):
            raise PermissionDenied("RegisterBuffer", "buffers are only for callers on the Unix socket")
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
            raise PermissionDenied("UnregisterBuffer", "buffers are only for callers on the Unix socket")
        self.buffers.unregister(request.buffer_id)
        return pb.UnregisterBufferReply()

    # ----------------------------------------------------------------- stats
    @_rpc
    def Stats(self, request, context):
        out = pb.StatsReply()
        for name, s in self.engine.stats(request.cache or None).items():
            msg = out.caches.add(cache=name, **{k: v for k, v in s.items()
                                                if k not in ("main", "tail", "tiers", "redis")})
            msg.main.CopyFrom(_pool(s["main"]))
            if s["tail"] is not None:
                msg.tail.CopyFrom(_pool(s["tail"]))
            if s["tiers"] is not None:
                _tier_stats(msg, s["tiers"])
            if s["redis"] is not None:
                _redis_stats(msg, s["redis"])
        return out

    def _seq_reply(self, name: str, i: SeqInfo) -> pb.SequenceInfoReply:
        c = self.engine.cache(name)
        # Block ids index the pools of the tier the sequence lives in.
        pools = ((c.tiering.host.main_pool, c.tiering.host.tail_pool) if i.tier == "host"
                 else (c.main_pool, c.tail_pool))
        return pb.SequenceInfoReply(
            sequence_id=i.seq_id, length=i.length, sealed_blocks=i.sealed_blocks,
            sealed_block_refs=[pools[0].blocks[b].ref_cnt for b in i.sealed_blocks],
            tail_blocks=i.tail_blocks, tail_block_refs=[pools[1].blocks[b].ref_cnt for b in i.tail_blocks],
            pending=i.pending, reserved=i.reserved, known_token_ids=i.known_token_ids,
            block_hashes=i.block_hashes, tier=i.tier, owner_session=i.owner, pinned=i.pinned, persist=i.persist,
            sink_blocks=i.sink_blocks)

    @_rpc
    def SequenceInfo(self, request, context):
        with self.engine.cache(request.cache).lock:     # the ref counts must match the info
            return self._seq_reply(request.cache, self.engine.sequence_info(
                request.cache, self._tenant(context), request.sequence_id))

    @_rpc
    def ListSequences(self, request, context):
        with self.engine.cache(request.cache).lock:
            infos = self.engine.list_sequences(request.cache, self._tenant(context))
            return pb.ListSequencesReply(sequences=[self._seq_reply(request.cache, i) for i in infos])

    # ---------------------------------------------------------------- leases
    @_rpc
    def Heartbeat(self, request, context):
        session = session_of(context)
        if not session:
            raise InvalidArgument(SESSION_KEY, "missing: a Heartbeat renews the lease of the session it names")
        tenant = self._tenant(context)
        held = sum(len(v) for v in self.engine.owned_sequences(tenant, session).values())
        return pb.HeartbeatReply(session_id=session, tenant=tenant, sequences=held,
                                 lease_timeout_s=self.leases.timeout_s if self.leases is not None else 0.0)


@dataclass(slots=True)
class Resolved:
    """An AppendAttend request's tensors, output range and CUDA scope; reusable
    (CudaScope keeps no state from one call to the next)."""
    k: object
    v: object
    q: object
    out_ref: object
    out_view: object
    scope: object


def _tier_stats(msg: pb.CacheStats, t: dict) -> None:
    for key in ("sequences_host", "sequences_disk", "offloads_host", "offloads_disk", "page_ins_host",
                "page_ins_disk", "bytes_down", "bytes_up", "spilled_blocks"):
        setattr(msg, key, t[key])
    msg.prefix_hit_blocks_host = t["prefix_hits_host"]
    msg.prefix_hit_blocks_disk = t["prefix_hits_disk"]
    msg.host_tier_bytes = t.get("host_bytes", 0)
    if "host_main" in t:
        msg.host.CopyFrom(_pool(t["host_main"]))
        msg.host_tail.CopyFrom(_pool(t["host_tail"]))
    if "disk" in t:
        d = t["disk"]
        msg.disk_bytes = d["bytes"]
        msg.disk_entries = d["entries"]
        msg.disk_used_bytes, msg.disk_max_bytes, msg.disk_held_bytes = d["used_bytes"], d["max_bytes"], d["held_bytes"]
        msg.disk_evictions, msg.disk_evicted_bytes = d["evictions"], d["evicted_bytes"]
        msg.disk_skipped_spills = d["skipped_spills"]


def _redis_stats(msg: pb.CacheStats, r: dict) -> None:
    msg.redis_state, msg.redis_last_error, msg.prefix_hit_blocks_redis = r["state"], r["last_error"], r["prefix_hits"]
    for key in ("blocks_out", "bytes_out", "bytes_in", "misses", "refused", "dropped_puts", "errors"):
        setattr(msg, "redis_" + key, r[key])


def _pool_bytes(cfg: CacheConfig) -> int:
    """Memory a cache's pools take: main, fp16 tail (PQ) and host tier."""
    n = cfg.capacity_blocks() * cfg.bytes_per_block() + cfg.host_bytes
    if cfg.codec.kind == "pq":
        n += cfg.tail_capacity_blocks() * cfg.block_size * cfg.fp16_bytes_per_token()
    return n


def _pool(p) -> pb.PoolStats:
    return pb.PoolStats(capacity=p.capacity, used=p.used, cached=p.cached, free=p.free, evictions=p.evictions)
