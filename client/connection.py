"""The connection under KVStoreClient (client.py): the gRPC channel and the
session it calls in (session.py: metadata, heartbeat), and how a call's tensors travel:
staged in a registered shared-memory or CUDA buffer (arena.py) when the daemon
is local, inline bytes otherwise; append_attend by the doorbell
(doorbell.py), else over one long-lived stream (stream.py), else unary."""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import grpc
import torch

from kvstore.cuda import runtime as cuda_rt
from kvstore.protocol import wire
from kvstore.protocol.channel import DEFAULT_MAX_MESSAGE_MB, SERVICE, client_options, default_socket
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from .arena import CudaArena, ShmArena, place
from .doorbell import BellDown, Doorbell, Unfit
from .session import UNREACHABLE, Session, restarted
from .stream import CallStream, StreamRefused

log = logging.getLogger("kvstore.client")
STREAM_RETRY_S = 30.0      # after the daemon turned a stream away, call unary this long before trying again


def answered(e: BaseException) -> bool:
    """A call that raised e was answered by the daemon (its outcome known), rather than
    interrupted or given up on while it may still run there."""
    return isinstance(e, grpc.RpcError) and e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                             grpc.StatusCode.CANCELLED)


class Connection:
    """KVStoreClient's plumbing: the channel and session, the heartbeat, the
    registered buffers a call's tensors cross in, and the lanes of
    append_attend (the doorbell, the stream, unary)."""

    def __init__(self, target: str | None = None, transport: str = "auto",
                 shm_bytes: int = 64 << 20, max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, timeout: float = 60.0,
                 token: str | None = None, tls_ca: str | bytes | None = None, session_id: str | None = None,
                 heartbeat: bool = True, stream: bool | None = None, doorbell: bool | None = None,
                 host_wait: bool = False):
        """target: "unix:///path/kvstore.sock" or "host:port" (default: the
        daemon's default socket). transport: "auto", "shm" or "inline".
        token: bearer token (default env KVSTORE_TOKEN); tls_ca: CA PEM (path
        or bytes) to reach a TLS port; session_id: default a random uuid; "": none,
        so the daemon keeps no lease for this client (its sequences have no owner and
        never lapse) and it has no restart fence (a Heartbeat tells the daemon's
        instance, and names a session): for callers that hold nothing, as kvstore-admin;
        heartbeat: keep the session's lease alive from a background thread;
        stream: append_attend over one long-lived stream (default: on a Unix
        socket) instead of a unary call each; doorbell: append_attend by the
        daemon's doorbell socket once a buffer is registered, when the daemon
        offers one (default: on a Unix socket), else by gRPC. host_wait: a
        call with CUDA tensors returns once its outputs are in place (the host
        waits for the daemon's done event) instead of making the caller's
        stream wait for it: the GPU then never switches to the caller's
        context just to wait (docs/rpc.md), but the host cannot queue work past the call."""
        if session_id == "" and heartbeat:
            raise ValueError("heartbeat renews a session's lease: a client without a session id beats none")
        token = token if token is not None else os.environ.get("KVSTORE_TOKEN") or None     # set empty: unset
        if token is not None and not token.strip():     # else a caller on the socket would be tenant default
            raise ValueError("token: blank (token= or KVSTORE_TOKEN); leave it unset to call without one")
        token = token and token.strip()                 # a file's newline is no part of it
        self.target = target or f"unix://{default_socket()}"
        opts = client_options(max_message_mb)
        if tls_ca is not None:
            self.channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(_pem(tls_ca)), options=opts)
        else:
            self.channel = grpc.insecure_channel(self.target, options=opts)
        self.session_id = uuid.uuid4().hex if session_id is None else session_id
        self.session = Session(self.session_id, token)
        self.stub = pb_grpc.KVStoreStub(grpc.intercept_channel(self.channel, self.session.interceptor))
        self._raw = pb_grpc.KVStoreStub(self.channel)     # the tensor calls: they pass session.md themselves
        self.timeout = timeout
        self._lock = threading.Lock()
        self._arena: ShmArena | None = None
        self._abandoned: list[str] = []     # buffers calls of unknown outcome may still read (_abandon_arena)
        self._cuda_arena: CudaArena | None = None
        self._no_cuda_buffers = False     # the daemon refused a CUDA buffer once
        self._shm_bytes = shm_bytes
        if transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {transport!r}")
        local = self.target.startswith("unix:")
        self.transport = "shm" if transport == "shm" or (transport == "auto" and local) else "inline"
        self._stream = CallStream(self.channel, f"/{SERVICE}/AppendAttendStream", self.session.md) \
            if (local if stream is None else stream) else None
        self._stream_retry_at = 0.0
        self._use_bell = local if doorbell is None else doorbell
        self._bell: Doorbell | None = None
        self._bell_addr: tuple[str, bytes] | None = None     # from RegisterBufferReply
        self._bell_retry_at = 0.0
        self._host_wait = host_wait
        if heartbeat:
            self.session.start_heartbeat(self.stub)

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        self.session.stop()
        if self.session.forked:
            # the parent's buffer and channel are its to close, not a child's; the child's
            # copy of the doorbell socket goes (the parent's connection stays open)
            if self._bell is not None:
                self._bell.close()
            return
        with self._lock:
            if self._stream is not None:
                self._stream.close()
            if self._bell is not None:
                self._bell.close()
            self._drop_arena()
        self.channel.close()

    def heartbeat(self) -> pb.HeartbeatReply:
        """Renew this session's lease now (any call does)."""
        r = self.stub.Heartbeat(pb.HeartbeatRequest(), timeout=self.timeout)
        self.session.replied(r)
        return r

    @property
    def instance(self) -> str:
        """The daemon instance this client's sequence ids are from ("": none); a Heartbeat asks it first."""
        if self.session.instance is None:
            self.heartbeat()
        return self.session.instance or ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _drop_arena(self) -> None:
        """Unregister the shared-memory arena and those abandoned before it."""
        if self._arena is not None:
            self._abandoned.append(self._arena.buffer_id)
            self._arena.close()
            self._arena = None
        for buffer_id in self._abandoned:
            try:
                self.stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=buffer_id), timeout=self.timeout)
            except grpc.RpcError:
                pass
        self._abandoned.clear()

    def _lapsed(self, e: grpc.RpcError) -> bool:
        """The daemon dropped this client's buffers (and doorbell token): it restarted,
        or the session's lease lapsed while the process was stopped or starved. It said
        so before it read anything of the call, so the call can go again once they are
        registered anew."""
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return details.startswith("doorbell_token:")
        ids = [a.buffer_id for a in (self._arena, self._cuda_arena) if a is not None and a.buffer_id]
        return code == grpc.StatusCode.NOT_FOUND and any(f"no buffer '{i}'" in details for i in ids)

    def _abandon_arena(self, arena) -> None:
        """A call whose outcome is unknown (interrupted, timed out) may still be running in
        the daemon and reading its inputs from `arena`: later calls stage theirs in a new
        buffer, so that it cannot take the next step's K/V for its own. It is unregistered
        when the next is made (a call still running keeps its view of it in the daemon).
        A CUDA arena is not the shared-memory one: its events order the daemon's reads."""
        if arena is self._arena:
            self._abandoned.append(arena.buffer_id)
            self._arena = None

    def _forget_registrations(self) -> None:
        """After a lapse: what the daemon no longer holds is not unregistered, only dropped."""
        log.warning("kvstore: the daemon no longer holds this client's buffers: %s; registering them again",
                    self.session.dropped_why())
        for a in (self._arena, self._cuda_arena):
            if a is not None:
                a.close()
        self._arena = self._cuda_arena = None
        if self._bell is not None:
            self._bell.close()
        self._bell = self._bell_addr = None

    def _arena_for(self, nbytes: int) -> ShmArena | None:
        """A registered arena of at least nbytes, or None to send inline."""
        if self.transport != "shm":
            return None
        if self._arena is None or self._arena.top < nbytes:
            self._drop_arena()
            size = max(self._shm_bytes, 1 << (nbytes - 1).bit_length())
            arena = None
            try:
                arena = ShmArena(size)
                arena.buffer_id = self._register(pb.RegisterBufferRequest(kind=pb.SHM, name=arena.name, size=size))
            except (OSError, grpc.RpcError) as e:
                if arena is not None:
                    arena.close()
                if isinstance(e, grpc.RpcError) and (e.code() in UNREACHABLE or restarted(e)):
                    raise       # a daemon away or restarted says nothing of whether it can map the buffer
                # Daemon on another host or no /dev/shm: inline bytes still work.
                self.transport = "inline"
                return None
            # Both sides have it mapped now: drop the name, so a client that dies
            # without close() leaves nothing behind in /dev/shm.
            arena.close()
            self._arena = arena
        self._arena.cursor = 0
        return self._arena

    def _cuda_arena_for(self, nbytes: int, device: torch.device) -> CudaArena | None:
        if not self.target.startswith("unix:") or self.transport == "inline" or self._no_cuda_buffers:
            return None
        a = self._cuda_arena
        if a is None or a.top < nbytes or a.view.device != device:
            if a is not None:
                self.stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=a.buffer_id), timeout=self.timeout)
            a = CudaArena(max(self._shm_bytes, 1 << (nbytes - 1).bit_length()), device)
            try:
                a.buffer_id = self._register(pb.RegisterBufferRequest(
                    kind=pb.CUDA_IPC, size=a.size, ipc_handle=a.handle.handle, offset=a.handle.offset,
                    device_uuid=a.handle.device_uuid, ready_event=a.ready.ipc_handle(),
                    done_event=a.done.ipc_handle()))
            except grpc.RpcError as e:
                self._cuda_arena = None
                if e.code() in UNREACHABLE or restarted(e):
                    raise
                # A daemon without CUDA: go through host memory, and do not try
                # again on every call (a new arena costs a cudaMalloc, an IPC
                # export and an RPC: ~0.2 s a call, measured).
                self._no_cuda_buffers = True
                return None
            self._cuda_arena = a
        a.cursor = 0
        return a

    def _register(self, request: pb.RegisterBufferRequest) -> str:
        reply = self.stub.RegisterBuffer(request, timeout=self.timeout)
        self.session.registered()
        if reply.doorbell_path:
            self._bell_addr = (reply.doorbell_path, reply.doorbell_token)
        return reply.buffer_id

    def _doorbell(self) -> Doorbell | None:
        """The open doorbell, opened on first use; None: call by gRPC."""
        if self._bell is not None and not self._bell.closed:
            return self._bell
        self._bell = None
        if self._bell_addr is None or time.monotonic() < self._bell_retry_at:
            return None
        try:
            self._bell = Doorbell(*self._bell_addr, timeout=self.timeout)
        except BellDown:
            self._bell_retry_at = time.monotonic() + STREAM_RETRY_S
        return self._bell

    def _call(self, method, request_fn, inputs: dict[str, torch.Tensor], out_bytes: list[int], read=None,
              device: torch.device | None = None, md: tuple | None = None):
        """Build a request with `inputs` placed in the arena (or inline) and
        output ranges reserved, call, and run read(reply, arena) before the
        arena can be reused by another call. The CUDA arena of the inputs'
        device, or of `device` (where the outputs are wanted) when none is on one.
        Once more, in new buffers, if the daemon dropped this client's (_lapsed).
        md: the metadata its sequences were checked under (Session.naming)."""
        self.session.check_process()
        for k, t in inputs.items():
            if t.dtype not in wire.TO_PROTO:
                raise TypeError(f"{k}: a {t.dtype} tensor cannot be sent; K, V and Q go as float16, bfloat16 "
                                "or float32 (the daemon converts them to the cache's dtype)")
        try:
            return self._call_once(method, request_fn, inputs, out_bytes, read, device, md)
        except grpc.RpcError as e:
            with self._lock:
                if not self._lapsed(e):
                    self.session.fenced(e, md is not None)
                    raise
                self._forget_registrations()
        return self._call_once(method, request_fn, inputs, out_bytes, read, device, md)

    def _call_once(self, method, request_fn, inputs, out_bytes, read, device, md):
        with self._lock:
            need = sum(t.numel() * t.element_size() + 64 for t in inputs.values()) + sum(b + 64 for b in out_bytes)
            cuda = [t.device for t in inputs.values() if t.is_cuda] or \
                ([device] if device is not None and device.type == "cuda" else [])
            arena = self._cuda_arena_for(need, cuda[0]) if cuda else None
            if arena is not None:
                return self._call_cuda(arena, method, request_fn, inputs, out_bytes, read, md)
            arena = self._arena_for(need)
            msgs, outs = {}, []
            for k, t in inputs.items():
                t = t.detach()
                if arena is None:
                    msgs[k] = wire.to_proto(t)
                else:
                    msgs[k] = arena.typed(place(arena, t), tuple(t.shape), t.dtype)[1]
            for b in out_bytes:
                outs.append(None if arena is None else pb.OutputRef(buffer_id=arena.buffer_id, offset=arena.alloc(b)))
            request = request_fn(msgs, outs)
            try:
                reply = method(request, timeout=self.timeout, metadata=md or self.session.md)
            except BaseException as e:
                if arena is not None and not answered(e):
                    self._abandon_arena(arena)
                raise
            return read(reply, arena) if read else reply

    def _call_cuda(self, arena: CudaArena, method, request_fn, inputs, out_bytes, read, md):
        msgs, outs = {}, []
        for k, t in inputs.items():
            t = t.detach()
            msgs[k] = arena.typed(place(arena, t), tuple(t.shape), t.dtype)[1]
        for b in out_bytes:
            outs.append(pb.OutputRef(buffer_id=arena.buffer_id, offset=arena.alloc(b)))
        stream = cuda_rt.current_stream(arena.view.device)
        arena.ready.record(stream)
        reply = method(request_fn(msgs, outs), timeout=self.timeout, metadata=md or self.session.md)
        self._wait_done(arena, stream)
        return read(reply, arena) if read else reply

    def _wait_done(self, arena: CudaArena, stream) -> None:
        """Order what reads the outputs after the daemon's work (see host_wait)."""
        if self._host_wait:
            arena.done.synchronize()
        else:
            stream.wait_event(arena.done)

    def _append_attend(self, request: pb.AppendAttendRequest, timeout: float, metadata) -> pb.AttendReply:
        """AppendAttend on this client's stream; unary without one, or while
        the daemon turns streams away (it read nothing of the refused call), or when
        the stream open was opened with other metadata than the call's (another daemon
        instance than its sequences were checked under: unary, the daemon refuses it)."""
        if self._stream is not None and time.monotonic() >= self._stream_retry_at and self._stream.takes(metadata):
            try:
                return pb.AttendReply.FromString(self._stream(request.SerializeToString(), timeout, metadata))
            except StreamRefused:
                self._stream_retry_at = time.monotonic() + STREAM_RETRY_S
        return self._raw.AppendAttend(request, timeout=timeout, metadata=metadata)

    @property
    def doorbell_handler_us(self) -> int:
        """The daemon's time in the last doorbell call, µs (0 before one)."""
        return self._bell.last_handler_us if self._bell is not None else 0

    def _tensor(self, t: pb.Tensor, arena, device: torch.device | None = None,
                into: torch.Tensor | None = None) -> torch.Tensor:
        """A reply's tensor, out of the arena (the next call reuses it): on `device`
        (default: where it lies), or copied into `into`."""
        ref = t.WhichOneof("data") == "ref"
        x = arena.typed(t.ref.offset, tuple(t.shape), wire.TO_TORCH[t.dtype])[0] if ref \
            else wire.from_proto(t, None, "reply")
        if into is not None:
            return into.copy_(x)
        if device is not None and x.device != device:
            return x.to(device)
        return x.clone() if ref else x

    def _append_attend_bell(self, cache, layer, seq_ids, k, v, q, scale, out, query_tokens: int = 1,
                            token_ids=(), md: tuple | None = None) -> torch.Tensor | None:
        """append_attend by the doorbell (under the lock) -> out, or None: send
        it by gRPC (no doorbell, inputs it cannot name, a request it cannot carry,
        or it went down before taking the request, or the daemon instance changed
        since the sequences were checked under md: the doorbell carries none)."""
        if not (k.dim() == v.dim() == q.dim() == 3 and k.dtype == v.dtype == q.dtype
                and k.device == v.device == q.device) or q.dtype not in wire.TO_PROTO:
            return None
        ts = (k, v, q)
        out_bytes = q.numel() * 2
        need = (k.numel() + v.numel() + q.numel()) * q.element_size() + out_bytes + 256
        arena = self._cuda_arena_for(need, q.device) if q.is_cuda else None
        arena = arena or self._arena_for(need)
        bell = self._doorbell() if arena is not None else None
        if bell is None or (md is not None and md is not self.session.md):
            return None
        offs = [place(arena, t) for t in ts]   # place() detaches what it copies
        out_off = arena.offset_of(out) if out is not None else None
        if out_off is None:
            out_off = arena.alloc(out_bytes)
        cuda = arena.view.is_cuda
        if cuda:
            stream = cuda_rt.current_stream(q.device)
            arena.ready.record(stream)
        try:
            dtype = bell.append_attend(arena.buffer_id, cache, layer, seq_ids, wire.TO_PROTO[q.dtype],
                                       (*offs, out_off), (*k.shape, *v.shape, *q.shape), scale,
                                       query_tokens, token_ids)
        except Unfit:
            return None
        except BellDown:
            bell.close()
            return None
        except grpc.RpcError as e:
            if self._lapsed(e):
                self._forget_registrations()        # the call goes by gRPC, which registers anew
                return None
            if bell.closed:                         # timed out, or its replies out of step
                self._abandon_arena(arena)
            raise
        except BaseException:
            self._abandon_arena(arena)              # interrupted: the call may run on
            raise
        finally:
            if cuda:
                self._wait_done(arena, stream)    # also after an error: the daemon may have queued work
        res = arena.typed(out_off, tuple(q.shape), wire.TO_TORCH[dtype])[0]
        if out is None:
            return res.clone()
        return out if out.data_ptr() == res.data_ptr() and out.dtype == res.dtype else out.copy_(res)


def _pem(tls_ca: str | bytes) -> bytes:
    """The CA PEM (a path or bytes); ValueError naming tls_ca, not every handshake failing."""
    if isinstance(tls_ca, str):
        try:
            with open(tls_ca, "rb") as f:
                tls_ca = f.read()
        except OSError as e:
            raise ValueError(f"tls_ca: cannot read {tls_ca}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in tls_ca:
        raise ValueError("tls_ca: holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    return tls_ca
