"""The work of a call whichever transport brought it: the gRPC servicer and
the doorbell (doorbell.py) both run requests through these, so a call gets
the same checks, errors, leases and results either way.

What a request names (tensors inline or in the caller's registered buffers,
its output range) is resolved here; a call naming a CUDA buffer runs on the
daemon's own stream, after the caller's ready event and before its done
event (cuda/scope.py); then the engine does the work. `buffers` is the
calling tenant's view of the registered buffers (buffers.py), None for
remote callers."""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass

from kvstore.cuda.scope import CudaScope, Fences
from kvstore.engine import checks
from kvstore.engine.storage import TORCH_DTYPES
from kvstore.errors import Unavailable, quote
from kvstore.protocol import wire

from .auth import DEFAULT_TENANT, PermissionDenied

log = logging.getLogger("kvstore.servicer")


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
    shm: tuple = ()          # the buffers it names, whose files are checked again at each reuse


class Handlers:
    """engine: the Engine (set later when the daemon builds it after the
    server); buffer_table: TenantBuffers; leases: the LeaseManager whose
    sessions a doorbell call renews; debug_invariants: check the pools after
    every doorbell call (the servicer does after every gRPC call)."""

    def __init__(self, engine, buffer_table, leases=None, debug_invariants: bool = False):
        self.engine = engine
        self.buffer_table = buffer_table
        self.leases = leases
        self.debug_invariants = debug_invariants
        self._streams: dict = {}     # the daemon's own CUDA stream per device
        self._streams_lock = threading.Lock()   # calls on different caches run at once
        self._fences = Fences()

    def tensor(self, t, buffers, field: str):
        return wire.from_proto(t, buffers, field)

    def cuda_scope(self, request, buffers):
        """For calls naming a CUDA buffer: run on the daemon's stream after the
        client's ready event, record the done event after the outputs; no host
        synchronisation. A no-op context otherwise."""
        if buffers is None or not self.buffer_table.registry.cuda_buffers:
            return contextlib.nullcontext()
        ids = named_buffers(request)
        if getattr(request, "buffer_id", ""):
            ids.add(request.buffer_id)
        for bid in ids:
            events = buffers.cuda_events(bid)
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

    def out_view(self, request, n_seqs: int, buffers):
        """Check the request's output range; -> (its OutputRef or None, a view of
        it the kernels may write straight into (the engine checks it fits) or None)."""
        ref = request.out if request.HasField("out") else None
        g = self.engine.config(request.cache).geometry
        shape = (n_seqs, g.num_q_heads, g.head_dim)
        dtype = TORCH_DTYPES[g.dtype]
        wire.check_output(buffers, ref, n_seqs * g.num_q_heads * g.head_dim * dtype.itemsize,
                          dtype.itemsize, "out")
        if ref is None or not ref.buffer_id or n_seqs == 0:
            return ref, None
        return ref, buffers.view(ref.buffer_id, ref.offset, shape, dtype)

    def retrieve_outputs(self, request, tenant: str, buffers) -> tuple[int, object, object]:
        """A Retrieve's end (0: the sequence's length now; the sequence only
        grows, so the range stays valid) and its output ranges, checked to fit
        before anything is read or paged in. -> (end, k_out, v_out)."""
        cfg = self.engine.config(request.cache)
        g = cfg.geometry
        nl = checks.layer_range(cfg, request.layer_start, request.layer_end) - request.layer_start
        length = self.engine.length(request.cache, tenant, request.sequence_id)
        end = request.end or length
        checks.token_range(request.sequence_id, request.start, end, length)
        itemsize = TORCH_DTYPES[g.dtype].itemsize
        nbytes = nl * (end - request.start) * g.num_kv_heads * g.head_dim * itemsize
        k_out = request.k_out if request.HasField("k_out") else None
        v_out = request.v_out if request.HasField("v_out") else None
        wire.check_output(buffers, k_out, nbytes, itemsize, "k_out")
        wire.check_output(buffers, v_out, nbytes, itemsize, "v_out")
        return end, k_out, v_out

    def delete_cache(self, name: str, tenant: str, force: bool):
        """DeleteCache: only the default tenant (caches are shared by every
        tenant, and this drops all of their sequences); sequences of sessions
        whose lease is current refuse it unless force."""
        if tenant != DEFAULT_TENANT:
            raise PermissionDenied("cache", f"DeleteCache: caches are shared by every tenant: only tenant "
                                   f"{DEFAULT_TENANT!r} may delete one, not {quote(tenant)}")
        live = self.leases.is_live if self.leases is not None else None
        r = self.engine.delete_cache(name, force=force, live=live)
        # Other workers' sequences went with it: their next call is NOT_FOUND, and the log says why.
        log.info("DeleteCache %s%s: dropped %d sequences (%d of live sessions, %d pinned, %d with a disk copy)",
                 quote(name), " (force)" if force else "", r.sequences, r.leased_sequences, r.pinned_sequences,
                 r.disk_sequences)
        return r

    def resolve(self, request, buffers) -> Resolved:
        """What an AppendAttend's tensor fields name, checked in the order its
        errors are reported (out, k, v, q), and its CUDA scope."""
        cfg = self.engine.config(request.cache)
        # B * T output rows: T checked first, so a wrong one is named before out's size is
        t = checks.query_tokens(cfg, request.layer, request.query_tokens) if 0 <= request.layer < \
            cfg.geometry.num_layers else 1
        ref, view = self.out_view(request, len(request.sequence_ids) * t, buffers)
        return Resolved(self.tensor(request.k, buffers, "k"), self.tensor(request.v, buffers, "v"),
                        self.tensor(request.q, buffers, "q"), ref, view, self.cuda_scope(request, buffers),
                        tuple(named_buffers(request)))

    def append_attend(self, request, tenant: str, buffers, finish, resolved: Resolved | None = None):
        """AppendAttend's work: -> finish(out, its OutputRef), run inside the
        CUDA scope so that a copy into the output range comes before the done
        event. resolved: this request's resolve(), still valid (the doorbell
        keeps it per descriptor, and has checked its files)."""
        r = resolved or self.resolve(request, buffers)
        with r.scope:
            out = self.engine.append_attend(request.cache, tenant, request.layer, list(request.sequence_ids),
                                            r.k, r.v, r.q, request.scale, out=r.out_view,
                                            token_ids=request.token_ids, query_tokens=request.query_tokens)
            return finish(out, r.out_ref)

    def doorbell_append_attend(self, request, tenant: str, session: str, buffers,
                               resolved: Resolved | None = None) -> tuple[int, Resolved]:
        """An AppendAttend that came by the doorbell from a local caller of
        (tenant, session): the lease, buffer view and invariant checks of a
        gRPC call; engine errors propagate for the doorbell to report.
        resolved: this request's from an earlier call on this thread (its CUDA
        scope holds the thread's fence), if no buffer was unregistered since
        (BufferRegistry.generation).
        -> (the output's dtype (pb.DType), resolved); the output is in request.out's range."""
        if self.engine is None:
            raise Unavailable("engine", "is starting")
        if self.leases is not None:
            self.leases.enter(tenant, session)
        try:
            for bid in resolved.shm if resolved is not None else ():    # kept views: their files may have shrunk
                buffers.check_size(bid)
            r = resolved or self.resolve(request, buffers)

            def finish(out, ref):       # ref: never None, every descriptor names its output range
                if out is not r.out_view:   # else the kernels wrote it there, into the range resolve() checked
                    wire.place(out, buffers, ref)
                return wire.TO_PROTO[out.dtype]
            return self.append_attend(request, tenant, buffers, finish, r), r
        finally:
            if self.leases is not None:
                self.leases.leave(tenant, session)
            if self.debug_invariants:
                self.engine.check_invariants()


_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _field_names(request) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(Tensor fields, OutputRef fields) of a request type, found once."""
    d = request.DESCRIPTOR
    names = _FIELDS.get(d.full_name)
    if names is None:
        def of(kind):
            return tuple(f.name for f in d.fields if f.message_type is not None and f.message_type.name == kind)
        names = _FIELDS[d.full_name] = (of("Tensor"), of("OutputRef"))
    return names


def tensor_fields(request):
    return [getattr(request, n) for n in _field_names(request)[0] if request.HasField(n)]


def output_fields(request):
    return [getattr(request, n) for n in _field_names(request)[1] if request.HasField(n)]


def named_buffers(request) -> set[str]:
    """The registered buffers a request's tensor and output fields name."""
    ids = {t.ref.buffer_id for t in tensor_fields(request) if t.WhichOneof("data") == "ref"}
    return ids | {o.buffer_id for o in output_fields(request) if o.buffer_id}
