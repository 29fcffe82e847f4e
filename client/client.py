"""A typed client for the kvstore daemon.

    kv = KVStoreClient()                      # default Unix socket
    kv.create_cache("llama", "meta-llama/Llama-3-8B", num_layers=32, num_q_heads=32,
                    num_kv_heads=8, head_dim=128, codec="fp16", num_blocks=4096)
    hit = kv.allocate("llama", "req-1", prompt_ids)           # tokens already cached
    kv.append("llama", ["req-1"], k, v, token_ids=[prompt_ids[hit:]])   # k, v [L, n, Hkv, d]
    out = kv.append_attend("llama", layer, ["req-1"], k1, v1, q)        # per layer, decode

Tensors cross through a POSIX shared-memory buffer registered once when the
daemon is local (Unix socket), as inline bytes otherwise; `transport` says
which. Errors are grpc.RpcError with the daemon's status code and message.

On a Unix socket append_attend goes over one long-lived stream per client
(AppendAttendStream, client/stream.py): no per-call RPC setup. Its errors
are those of the unary call; `stream=False` makes it unary.

Every call carries this client's session id (`x-kvstore-session`) and, if
given, `authorization: Bearer <token>`; a background thread heartbeats so the
daemon frees this process's unpinned sequences only after it is gone.
"""
from __future__ import annotations

import math
import os
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from kvstore.cuda import runtime as cuda_rt
from kvstore.protocol import wire
from kvstore.protocol.channel import DEFAULT_MAX_MESSAGE_MB, SERVICE, SESSION_KEY, client_options, default_socket
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from .arena import CudaArena, ShmArena, StepBuffers, place
from .doorbell import BellDown, Doorbell
from .stream import CallStream, StreamRefused

STREAM_RETRY_S = 30.0      # after the daemon turned a stream away, call unary this long before trying again


@dataclass(slots=True)
class Reservation:
    slot_mapping: list[int]
    sealed_blocks: list[int]
    tail_blocks: list[int]       # sink blocks first: one fp16 table of length - len(sealed_blocks) * bs tokens
    length: int


class _Metadata(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: list[tuple[str, str]]):
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        md = list(details.metadata or []) + self.metadata
        return continuation(details._replace(metadata=md), request)


class KVStoreClient:
    def __init__(self, target: str | None = None, transport: str = "auto",
                 shm_bytes: int = 64 << 20, max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, timeout: float = 60.0,
                 token: str | None = None, tls_ca: str | bytes | None = None, session_id: str | None = None,
                 heartbeat: bool = True, stream: bool | None = None, doorbell: bool | None = None,
                 host_wait: bool = False):
        """target: "unix:///path/kvstore.sock" or "host:port" (default: the
        daemon's default socket). transport: "auto", "shm" or "inline".
        token: bearer token (default env KVSTORE_TOKEN); tls_ca: CA PEM (path
        or bytes) to reach a TLS port; session_id: default a random uuid;
        heartbeat: keep the session's lease alive from a background thread;
        stream: append_attend over one long-lived stream (default: on a Unix
        socket) instead of a unary call each; doorbell: append_attend by the
        daemon's doorbell socket once a buffer is registered, when the daemon
        offers one (default: on a Unix socket), else by gRPC. host_wait: a
        call with CUDA tensors returns once its outputs are in place (the host
        waits for the daemon's done event) instead of making the caller's
        stream wait for it: the GPU then never switches to the caller's
        context just to wait (bench/NOTES-rpc.md, session 6), but the host
        cannot queue work past the call."""
        self.target = target or f"unix://{default_socket()}"
        opts = client_options(max_message_mb)
        if tls_ca is not None:
            ca = open(tls_ca, "rb").read() if isinstance(tls_ca, str) else tls_ca
            self.channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(ca), options=opts)
        else:
            self.channel = grpc.insecure_channel(self.target, options=opts)
        self.session_id = session_id or uuid.uuid4().hex
        token = token if token is not None else os.environ.get("KVSTORE_TOKEN")
        md = [(SESSION_KEY, self.session_id)] + ([("authorization", f"Bearer {token}")] if token else [])
        self.stub = pb_grpc.KVStoreStub(grpc.intercept_channel(self.channel, _Metadata(md)))
        # The tensor calls pass the metadata themselves: a Python client
        # interceptor costs tens of µs per call.
        self._raw = pb_grpc.KVStoreStub(self.channel)
        self._md = tuple(md)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._arena: ShmArena | None = None
        self._cuda_arena: CudaArena | None = None
        self._no_cuda_buffers = False     # the daemon refused a CUDA buffer once
        self._shm_bytes = shm_bytes
        if transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {transport!r}")
        local = self.target.startswith("unix:")
        self.transport = "shm" if transport == "shm" or (transport == "auto" and local) else "inline"
        self._stream = CallStream(self.channel, f"/{SERVICE}/AppendAttendStream", md) \
            if (local if stream is None else stream) else None
        self._stream_retry_at = 0.0
        self._use_bell = local if doorbell is None else doorbell
        self._bell: Doorbell | None = None
        self._bell_addr: tuple[str, bytes] | None = None     # from RegisterBufferReply
        self._bell_retry_at = 0.0
        self._host_wait = host_wait
        self._beat_stop = threading.Event()
        if heartbeat:
            threading.Thread(target=self._beat, name="kvstore-heartbeat", daemon=True).start()

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._beat_stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.close()
            if self._bell is not None:
                self._bell.close()
            self._drop_arena()
        self.channel.close()

    def heartbeat(self) -> pb.HeartbeatReply:
        """Renew this session's lease now (any call does)."""
        return self.stub.Heartbeat(pb.HeartbeatRequest(), timeout=self.timeout)

    def _beat(self) -> None:
        # A third of the daemon's lease timeout (learned from the first reply),
        # so two beats can be lost before the lease lapses.
        period = 0.0     # beat at once: the reply says how often to beat
        while not self._beat_stop.wait(period):
            period = 5.0
            try:
                r = self.stub.Heartbeat(pb.HeartbeatRequest(), timeout=max(1.0, period))
                if r.lease_timeout_s > 0:
                    period = max(0.2, min(10.0, r.lease_timeout_s / 3))
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                    return     # an older daemon, or one that will never take us
            except ValueError:
                return         # the channel was closed under us

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _drop_arena(self) -> None:
        if self._arena is not None:
            try:
                self.stub.UnregisterBuffer(pb.UnregisterBufferRequest(buffer_id=self._arena.buffer_id),
                                           timeout=self.timeout)
            except grpc.RpcError:
                pass
            self._arena.close()
            self._arena = None

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
            except (OSError, grpc.RpcError):
                # Daemon on another host or no /dev/shm: inline bytes still work.
                if arena is not None:
                    arena.close()
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
            except grpc.RpcError:
                # A daemon without CUDA: go through host memory, and do not try
                # again on every call (a new arena costs a cudaMalloc, an IPC
                # export and an RPC: ~0.2 s a call, measured).
                self._cuda_arena = None
                self._no_cuda_buffers = True
                return None
            self._cuda_arena = a
        a.cursor = 0
        return a

    def _register(self, request: pb.RegisterBufferRequest) -> str:
        reply = self.stub.RegisterBuffer(request, timeout=self.timeout)
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

    def _call(self, method, request_fn, inputs: dict[str, torch.Tensor], out_bytes: list[int], read=None):
        """Build a request with `inputs` placed in the arena (or inline) and
        output ranges reserved, call, and run read(reply, arena) before the
        arena can be reused by another call."""
        with self._lock:
            need = sum(t.numel() * t.element_size() + 64 for t in inputs.values()) + sum(b + 64 for b in out_bytes)
            cuda = [t for t in inputs.values() if t.is_cuda]
            arena = self._cuda_arena_for(need, cuda[0].device) if cuda else None
            if arena is not None:
                return self._call_cuda(arena, method, request_fn, inputs, out_bytes, read)
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
            reply = method(request_fn(msgs, outs), timeout=self.timeout, metadata=self._md)
            return read(reply, arena) if read else reply

    def _call_cuda(self, arena: CudaArena, method, request_fn, inputs, out_bytes, read):
        msgs, outs = {}, []
        for k, t in inputs.items():
            t = t.detach()
            msgs[k] = arena.typed(place(arena, t), tuple(t.shape), t.dtype)[1]
        for b in out_bytes:
            outs.append(pb.OutputRef(buffer_id=arena.buffer_id, offset=arena.alloc(b)))
        stream = cuda_rt.current_stream(arena.view.device)
        arena.ready.record(stream)
        reply = method(request_fn(msgs, outs), timeout=self.timeout, metadata=self._md)
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
        the daemon turns streams away (it read nothing of the refused call)."""
        if self._stream is not None and time.monotonic() >= self._stream_retry_at:
            try:
                return pb.AttendReply.FromString(self._stream(request.SerializeToString(), timeout))
            except StreamRefused:
                self._stream_retry_at = time.monotonic() + STREAM_RETRY_S
        return self._raw.AppendAttend(request, timeout=timeout, metadata=metadata)

    @property
    def doorbell_handler_us(self) -> int:
        """The daemon's time in the last doorbell call, µs (0 before one)."""
        return self._bell.last_handler_us if self._bell is not None else 0

    def _tensor(self, t: pb.Tensor, arena: ShmArena | None) -> torch.Tensor:
        if t.WhichOneof("data") == "ref":
            return arena.typed(t.ref.offset, tuple(t.shape), wire.TO_TORCH[t.dtype])[0].clone()
        return wire.from_proto(t, None, "reply")

    # --------------------------------------------------------------- caches
    def create_cache(self, name: str, model_id: str, *, num_layers: int, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, dtype: str = "float16", codec: str = "pq", num_subvectors: int = 0,
                     block_size: int = 16, residual: int = 128, num_blocks: int = 0, pool_bytes: int = 0,
                     max_sequences: int = 256, exist_ok: bool = False, host_bytes: int = 0,
                     low_watermark: float = 0.0, sink_tokens: int = 0, **spec_fields) -> pb.CacheInfo:
        """Create (or, with exist_ok, find) a cache. host_bytes adds a pinned host
        tier; sink_tokens keeps the first tokens of every sequence in fp16 (codec
        pq; a multiple of block_size); other CacheSpec fields pass through spec_fields."""
        spec = pb.CacheSpec(name=name, model_id=model_id, codec=codec, num_subvectors=num_subvectors,
                            block_size=block_size, residual=residual, sink_tokens=sink_tokens, num_blocks=num_blocks,
                            pool_bytes=pool_bytes, max_sequences=max_sequences, host_bytes=host_bytes,
                            low_watermark=low_watermark, **spec_fields,
                            geometry=pb.Geometry(num_layers=num_layers, num_q_heads=num_q_heads,
                                                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype))
        return self.stub.CreateCache(pb.CreateCacheRequest(spec=spec, exist_ok=exist_ok), timeout=self.timeout)

    def get_cache(self, name: str) -> pb.CacheInfo:
        return self.stub.GetCache(pb.GetCacheRequest(cache=name), timeout=self.timeout)

    def set_codebooks(self, name: str, safetensors_bytes: bytes) -> str:
        return self.stub.SetCodebooks(pb.SetCodebooksRequest(cache=name, safetensors=safetensors_bytes),
                                      timeout=self.timeout).sha256

    def train_codebooks(self, name: str, k_samples: torch.Tensor, v_samples: torch.Tensor, niter: int = 20) -> str:
        """k_samples, v_samples: [L, N, Hkv, d] (K after RoPE)."""
        reply = self._call(self._raw.TrainCodebooks, lambda m, o: pb.TrainCodebooksRequest(
            cache=name, k_samples=m["k"], v_samples=m["v"], niter=niter), {"k": k_samples, "v": v_samples}, [])
        return reply.sha256

    # ------------------------------------------------------------ sequences
    def allocate(self, cache: str, seq_id: str, prompt_token_ids: list[int], pinned: bool = False,
                 persist: bool = False) -> int:
        """Create a sequence; returns how many prompt tokens are already cached.
        pinned: it outlives this client's session (freed only by free());
        persist: when the session's lease lapses, offload it instead of freeing."""
        return self.stub.Allocate(pb.AllocateRequest(cache=cache, sequence_id=seq_id,
                                                     prompt_token_ids=list(prompt_token_ids),
                                                     pinned=pinned, persist=persist),
                                  timeout=self.timeout).cached_tokens

    def reserve(self, cache: str, seq_id: str, num_tokens: int) -> Reservation:
        r = self.stub.Reserve(pb.ReserveRequest(cache=cache, sequence_id=seq_id, num_tokens=num_tokens),
                              timeout=self.timeout)
        return Reservation(list(r.slot_mapping), list(r.sealed_blocks), list(r.tail_blocks), r.length)

    def append(self, cache: str, seq_ids: list[str], k: torch.Tensor, v: torch.Tensor,
               counts: list[int] | None = None, layer: int | None = None,
               token_ids: list[list[int]] | None = None) -> None:
        """k, v: [L, n, Hkv, d] for all layers, or [n, Hkv, d] with `layer`.
        counts: tokens per sequence (default: n split evenly)."""
        n = k.shape[0] if layer is not None else k.shape[1]
        if counts is None:
            counts = [n // max(1, len(seq_ids))] * len(seq_ids)

        def req(m, _o):
            r = pb.AppendRequest(cache=cache, sequence_ids=seq_ids, counts=counts, k=m["k"], v=m["v"],
                                 token_ids=[pb.TokenIds(ids=t) for t in token_ids or []])
            if layer is not None:
                r.layer = layer
            return r
        self._call(self._raw.Append, req, {"k": k, "v": v}, [])

    def attend(self, cache: str, layer: int, seq_ids: list[str], q: torch.Tensor, scale: float = 0.0) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d]."""
        return self._call(self._raw.Attend, lambda m, o: pb.AttendRequest(
            cache=cache, layer=layer, sequence_ids=seq_ids, q=m["q"], scale=scale, out=o[0]),
            {"q": q}, [q.numel() * 2], lambda r, a: self._tensor(r.out, a))

    def append_attend(self, cache: str, layer: int, seq_ids: list[str], k: torch.Tensor, v: torch.Tensor,
                      q: torch.Tensor, scale: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """k, v [B, Hkv, d] (the new token), q [B, Hq, d] -> out [B, Hq, d].
        Inputs that are step_buffers() views cross without a copy; `out`: the
        result goes there (read in place if it is the step_buffers() out)."""
        if self._use_bell:
            with self._lock:
                res = self._append_attend_bell(cache, layer, seq_ids, k, v, q, scale, out)
            if res is not None:
                return res
        res = self._call(self._append_attend, lambda m, o: pb.AppendAttendRequest(
            cache=cache, layer=layer, sequence_ids=seq_ids, k=m["k"], v=m["v"], q=m["q"], scale=scale, out=o[0]),
            {"k": k, "v": v, "q": q}, [q.numel() * 2], lambda r, a: self._tensor(r.out, a))
        return res if out is None else out.copy_(res)

    def _append_attend_bell(self, cache, layer, seq_ids, k, v, q, scale, out) -> torch.Tensor | None:
        """append_attend by the doorbell (under the lock) -> out, or None: send
        it by gRPC (no doorbell, inputs it cannot name, or it went down before
        taking the request)."""
        if not (k.dim() == v.dim() == q.dim() == 3 and k.dtype == v.dtype == q.dtype
                and k.device == v.device == q.device) or q.dtype not in wire.TO_PROTO:
            return None
        ts = (k, v, q)
        out_bytes = q.numel() * 2
        need = (k.numel() + v.numel() + q.numel()) * q.element_size() + out_bytes + 256
        arena = self._cuda_arena_for(need, q.device) if q.is_cuda else None
        arena = arena or self._arena_for(need)
        bell = self._doorbell() if arena is not None else None
        if bell is None:
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
                                       (*offs, out_off), (*k.shape, *v.shape, *q.shape), scale)
        except BellDown:
            bell.close()
            return None
        finally:
            if cuda:
                self._wait_done(arena, stream)    # also after an error: the daemon may have queued work
        res = arena.typed(out_off, tuple(q.shape), wire.TO_TORCH[dtype])[0]
        if out is None:
            return res.clone()
        return out if out.data_ptr() == res.data_ptr() and out.dtype == res.dtype else out.copy_(res)

    def step_buffers(self, cache: str, batch: int, device: torch.device | str = "cuda") -> StepBuffers:
        """k, v, q and out of a decode step of `batch` sequences as views of this
        client's registered buffer (plain tensors when it has none, e.g. a
        remote daemon): see StepBuffers. Views stay valid; a later arena (one
        grown for a larger call) only makes them cross by copy again."""
        g = self.get_cache(cache).spec.geometry
        dtype = wire.TO_TORCH[pb.DType.Value(g.dtype.upper())] if g.dtype else torch.float16
        shapes = ((batch, g.num_kv_heads, g.head_dim),) * 2 + ((batch, g.num_q_heads, g.head_dim),) * 2
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        nbytes = [math.prod(s) * dtype.itemsize for s in shapes]
        with self._lock:
            need = sum(n + 64 for n in nbytes)
            arena = self._cuda_arena_for(need, device) if device.type == "cuda" else self._arena_for(need)
            if arena is None or arena.top - need < (arena.size >> 1):    # keep half the buffer for staging
                return StepBuffers(*(torch.empty(s, dtype=dtype, device=device) for s in shapes))
            return StepBuffers(*(arena.view[(off := arena.reserve(n)):off + n].view(dtype).view(s)
                                 for n, s in zip(nbytes, shapes)))

    def retrieve(self, cache: str, seq_id: str, start: int, end: int, layer_start: int = 0,
                 layer_end: int = 0, out_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [layers, end - start, Hkv, d] (sealed tokens dequantized)."""
        if not out_bytes:
            info = self.get_cache(cache).spec.geometry
            nl = (layer_end or info.num_layers) - layer_start
            out_bytes = max(0, nl * (end - start) * info.num_kv_heads * info.head_dim * 2)
        return self._call(self._raw.Retrieve, lambda m, o: pb.RetrieveRequest(
            cache=cache, sequence_id=seq_id, start=start, end=end, layer_start=layer_start, layer_end=layer_end,
            k_out=o[0], v_out=o[1]), {}, [out_bytes, out_bytes],
            lambda r, a: (self._tensor(r.k, a), self._tensor(r.v, a)))

    def fork(self, cache: str, seq_id: str, new_seq_id: str) -> None:
        self.stub.Fork(pb.ForkRequest(cache=cache, sequence_id=seq_id, new_sequence_id=new_seq_id),
                       timeout=self.timeout)

    def offload(self, cache: str, seq_ids: list[str]) -> None:
        """Move sequences to the daemon's disk tier; returns once durable."""
        self.stub.Offload(pb.OffloadRequest(cache=cache, sequence_ids=list(seq_ids)), timeout=self.timeout)

    def prefetch(self, cache: str, seq_ids: list[str]) -> None:
        """Page sequences back into GPU memory ahead of use."""
        self.stub.Prefetch(pb.PrefetchRequest(cache=cache, sequence_ids=list(seq_ids)), timeout=self.timeout)

    def free(self, cache: str, seq_ids: list[str]) -> None:
        self.stub.Free(pb.FreeRequest(cache=cache, sequence_ids=list(seq_ids)), timeout=self.timeout)

    # ---------------------------------------------------------------- stats
    def stats(self, cache: str = "") -> pb.StatsReply:
        return self.stub.Stats(pb.StatsRequest(cache=cache), timeout=self.timeout)

    def sequence_info(self, cache: str, seq_id: str) -> pb.SequenceInfoReply:
        return self.stub.SequenceInfo(pb.SequenceInfoRequest(cache=cache, sequence_id=seq_id), timeout=self.timeout)

    def list_sequences(self, cache: str) -> list[pb.SequenceInfoReply]:
        return list(self.stub.ListSequences(pb.ListSequencesRequest(cache=cache), timeout=self.timeout).sequences)
