"""A typed client for the kvstore daemon.

    kv = KVStoreClient()                      # default Unix socket
    kv.create_cache("llama", "meta-llama/Llama-3-8B", num_layers=32, num_q_heads=32,
                    num_kv_heads=8, head_dim=128, codec="fp16", num_blocks=4096)
    hit = kv.allocate("llama", "req-1", prompt_ids)           # tokens already cached
    kv.append("llama", ["req-1"], k, v, token_ids=[prompt_ids[hit:]])   # k, v [L, n, Hkv, d]
    out = kv.append_attend("llama", layer, ["req-1"], k1, v1, q)        # per layer, decode

Tensors cross through a POSIX shared-memory buffer registered once when the
daemon is local (Unix socket), as inline bytes otherwise; `transport` says
which (connection.py). Errors are grpc.RpcError with the daemon's status code and message;
UNAVAILABLE and CANCELLED both mean the daemon is gone or going (a call in flight as it
stops ends with either, and may or may not have taken effect).

On a Unix socket append_attend goes over one long-lived stream per client
(AppendAttendStream, client/stream.py): no per-call RPC setup. Its errors
are those of the unary call; `stream=False` makes it unary.

Every call carries this client's session id (`x-kvstore-session`) and, if
given, `authorization: Bearer <token>`; a background thread heartbeats so the
daemon frees this process's unpinned sequences only after it is gone. Calls
naming sequences carry the daemon instance they are of (`x-kvstore-instance`):
after a restart a call naming a sequence named before raises FAILED_PRECONDITION,
once for each such sequence, instead of reaching a sequence someone allocated under
the same id since (session.py).
"""
from __future__ import annotations

import grpc
import math
from dataclasses import dataclass

import torch

from kvstore.protocol import wire
from kvstore.v1 import kvstore_pb2 as pb

from .arena import StepBuffers
from .connection import Connection
from .session import restarted

# The most bytes (K and V) one Retrieve call brings; a larger range comes in several calls
# of whole layers, so the buffer it crosses in stays this size.
RETRIEVE_CALL_BYTES = 256 << 20


def _dtype(g: pb.Geometry) -> torch.dtype:
    """The cache's K/V dtype from its geometry."""
    return wire.TO_TORCH[pb.DType.Value(g.dtype.upper())] if g.dtype else torch.float16


def _normal(device) -> torch.device | None:
    """A device as a buffer is keyed by: CUDA with its index."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_I64 = 1 << 63


def _ints(values, field: str, lo: int = -_I64, hi: int = _I64) -> list[int]:
    """values (a list or tuple of ints, a tensor or an array of them) as a flat list of
    Python ints in [lo, hi): what protobuf's integer fields take; ValueError naming the
    field for one they would not (the daemon checks what it means)."""
    if hasattr(values, "reshape"):           # a tensor or an array, whatever its shape
        values = values.reshape(-1).tolist()
    out = []
    for x in values:
        if isinstance(x, float):
            raise ValueError(f"{field}: {x} is not an integer")
        out.append(int(x))
        if not lo <= out[-1] < hi:
            raise ValueError(f"{field}: {out[-1]} outside [{lo}, {hi})")
    return out


def _check_out(out, q: torch.Tensor) -> None:
    """append_attend's `out`: the result's place, checked before the call appends anything."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out: shape {list(out.shape)}, the call's q is {list(q.shape)}")
    if not out.dtype.is_floating_point:
        raise TypeError(f"out: a floating-point tensor (the attention's output), got {out.dtype}")


@dataclass(slots=True)
class Reservation:
    slot_mapping: list[int]
    sealed_blocks: list[int]
    tail_blocks: list[int]       # sink blocks first: one fp16 table of length - len(sealed_blocks) * bs tokens
    length: int


class KVStoreClient(Connection):
    """The daemon's RPCs as methods (the constructor's arguments: Connection)."""

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

    def delete_cache(self, name: str, force: bool = False) -> pb.DeleteCacheReply:
        """Drop a cache and every tenant's sequences in it (tenant "default"
        only); force: even sequences that live sessions hold. The reply counts
        what was dropped."""
        return self.stub.DeleteCache(pb.DeleteCacheRequest(cache=name, force=force), timeout=self.timeout)

    def get_cache(self, name: str) -> pb.CacheInfo:
        return self.stub.GetCache(pb.GetCacheRequest(cache=name), timeout=self.timeout)

    def cache_model_id(self, name: str) -> str | None:
        """The model_id cache `name` was made with; None if there is no such cache."""
        try:
            return self.get_cache(name).spec.model_id
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return None

    def set_codebooks(self, name: str, safetensors_bytes: bytes) -> str:
        return self.stub.SetCodebooks(pb.SetCodebooksRequest(cache=name, safetensors=safetensors_bytes),
                                      timeout=self.timeout).sha256

    def get_codebooks(self, name: str) -> bytes:
        """The codebooks file the cache uses (what set_codebooks takes back)."""
        return self.stub.GetCodebooks(pb.GetCodebooksRequest(cache=name), timeout=self.timeout).safetensors

    def train_codebooks(self, name: str, k_samples: torch.Tensor, v_samples: torch.Tensor, niter: int = 20) -> str:
        """k_samples, v_samples: [L, N, Hkv, d] (K after RoPE)."""
        reply = self._call(self._raw.TrainCodebooks, lambda m, o: pb.TrainCodebooksRequest(
            cache=name, k_samples=m["k"], v_samples=m["v"], niter=niter), {"k": k_samples, "v": v_samples}, [])
        return reply.sha256

    # ------------------------------------------------------------ sequences
    def _named(self, cache, ids, new, send):
        """send(metadata) of a call naming sequences `ids` of `cache` (and creating `new`), checked
        first (Session.naming): the daemon instance they are of known (a Heartbeat, the
        first time), an id named before a restart refused, once. Sent again, under the
        new instance, where the daemon refused the old one and the call names no sequence
        this client named before: the restart has nothing of this client's to fence there."""
        if self.session_id:            # a Heartbeat names a session: a client without one has no fence
            try:
                self.instance          # a Heartbeat, the first time
            except grpc.RpcError:
                pass                   # the call says what is wrong
        md, fresh = self.session.naming(cache, ids, new)
        try:
            return send(md)
        except grpc.RpcError as e:
            if not (fresh and restarted(e)) or self.session.md is md:
                raise
        return send(self.session.naming(cache, ids, new)[0])

    def allocate(self, cache: str, seq_id: str, prompt_token_ids: list[int], pinned: bool = False,
                 persist: bool = False) -> int:
        """Create a sequence; returns how many prompt tokens are already cached.
        pinned: it outlives this client's session (freed only by free());
        persist: when the session's lease lapses, offload it instead of freeing.
        After the daemon restarted, a call naming a sequence this client named
        before raises FAILED_PRECONDITION ("x-kvstore-instance: ..."), once for
        each (session.py): it is gone, unless persist, and its id may name a
        sequence allocated since."""
        req = pb.AllocateRequest(cache=cache, sequence_id=seq_id,
                                 prompt_token_ids=_ints(prompt_token_ids, "prompt_token_ids"),
                                 pinned=pinned, persist=persist)
        return self._named(cache, (), (seq_id,), lambda md: self.stub.Allocate(
            req, timeout=self.timeout, metadata=md)).cached_tokens

    def reserve(self, cache: str, seq_id: str, num_tokens: int) -> Reservation:
        req = pb.ReserveRequest(cache=cache, sequence_id=seq_id, num_tokens=num_tokens)
        r = self._named(cache, (seq_id,), (), lambda md: self.stub.Reserve(req, timeout=self.timeout, metadata=md))
        return Reservation(list(r.slot_mapping), list(r.sealed_blocks), list(r.tail_blocks), r.length)

    def append(self, cache: str, seq_ids: list[str], k: torch.Tensor, v: torch.Tensor,
               counts: list[int] | None = None, layer: int | None = None,
               token_ids: list[list[int]] | None = None) -> None:
        """k, v: [L, n, Hkv, d] for all layers, or [n, Hkv, d] with `layer`.
        counts: tokens per sequence (default: n split evenly)."""
        n = k.shape[0] if layer is not None else k.shape[1]
        if counts is None:
            if seq_ids and n % len(seq_ids):
                raise ValueError(f"counts: {n} tokens do not split evenly over {len(seq_ids)} sequences; "
                                 "give each sequence's count")
            counts = [n // max(1, len(seq_ids))] * len(seq_ids)
        counts = _ints(counts, "counts", 0, 1 << 32)
        token_ids = None if token_ids is None else [_ints(t, "token_ids") for t in token_ids]

        def req(m, _o):
            r = pb.AppendRequest(cache=cache, sequence_ids=seq_ids, counts=counts, k=m["k"], v=m["v"],
                                 token_ids=[pb.TokenIds(ids=t) for t in token_ids or []])
            if layer is not None:
                r.layer = layer
            return r
        self._named(cache, seq_ids, (), lambda md: self._call(self._raw.Append, req, {"k": k, "v": v}, [], md=md))

    def attend(self, cache: str, layer: int, seq_ids: list[str], q: torch.Tensor, scale: float = 0.0) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d]."""
        return self._named(cache, seq_ids, (), lambda md: self._call(self._raw.Attend, lambda m, o: pb.AttendRequest(
            cache=cache, layer=layer, sequence_ids=seq_ids, q=m["q"], scale=scale, out=o[0]),
            {"q": q}, [q.numel() * 2], lambda r, a: self._tensor(r.out, a), md=md))

    def append_attend(self, cache: str, layer: int, seq_ids: list[str], k: torch.Tensor, v: torch.Tensor,
                      q: torch.Tensor, scale: float = 0.0, out: torch.Tensor | None = None,
                      token_ids: list[int] | None = None, query_tokens: int = 1) -> torch.Tensor:
        """k, v [B, Hkv, d] (the new token), q [B, Hq, d] -> out [B, Hq, d].
        Inputs that are step_buffers() views cross without a copy; `out`: the
        result goes there (read in place if it is the step_buffers() out).
        token_ids: the new tokens' ids [B], optional (one layer's call is
        enough): they are hashed as their blocks fill, for later prefix hits.
        query_tokens T > 1 (at most 128): T new tokens per sequence, k, v
        [B * T, Hkv, d], q and out [B * T, Hq, d], token_ids B * T; query i of a
        sequence attends causally (its earlier tokens and new tokens 0..i). Either
        goes by the doorbell as a one-token call does (gRPC without one).
        query_tokens 0 is one, as the proto reads it. token_ids may be a list, a
        tensor or an array."""
        if out is not None:
            _check_out(out, q)
        if token_ids is not None:
            token_ids = _ints(token_ids, "token_ids")
        return self._named(cache, seq_ids, (), lambda md: self._append_attend_md(
            md, cache, layer, seq_ids, k, v, q, scale, out, token_ids, query_tokens))

    def _append_attend_md(self, md, cache, layer, seq_ids, k, v, q, scale, out, token_ids, query_tokens):
        if self._use_bell:
            with self._lock:
                try:
                    res = self._append_attend_bell(cache, layer, seq_ids, k, v, q, scale, out, query_tokens,
                                                   () if token_ids is None else token_ids, md)
                except grpc.RpcError as e:      # a buffer registered for it: that call was refused
                    self.session.fenced(e, True)
                    raise
            if res is not None:
                return res
        res = self._call(self._append_attend, lambda m, o: pb.AppendAttendRequest(
            cache=cache, layer=layer, sequence_ids=seq_ids, k=m["k"], v=m["v"], q=m["q"], scale=scale, out=o[0],
            token_ids=token_ids or [], query_tokens=query_tokens),
            {"k": k, "v": v, "q": q}, [q.numel() * 2], lambda r, a: self._tensor(r.out, a), md=md)
        return res if out is None else out.copy_(res)

    def step_buffers(self, cache: str, batch: int, device: torch.device | str | None = None) -> StepBuffers:
        """k, v, q and out of a decode step of `batch` sequences as views of this
        client's registered buffer (plain tensors when it has none, e.g. a
        remote daemon): see StepBuffers. Views stay valid; a later arena (one
        grown for a larger call) only makes them cross by copy again. device:
        where the tensors live; None: the current CUDA device if this process
        has one, else the CPU."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        g = self.get_cache(cache).spec.geometry
        dtype = _dtype(g)
        shapes = ((batch, g.num_kv_heads, g.head_dim),) * 2 + ((batch, g.num_q_heads, g.head_dim),) * 2
        device = _normal(device)
        nbytes = [math.prod(s) * dtype.itemsize for s in shapes]
        with self._lock:
            need = sum(n + 64 for n in nbytes)
            arena = self._cuda_arena_for(need, device) if device.type == "cuda" else self._arena_for(need)
            if arena is None or arena.top - need < (arena.size >> 1):    # keep half the buffer for staging
                return StepBuffers(*(torch.empty(s, dtype=dtype, device=device) for s in shapes))
            return StepBuffers(*(arena.view[(off := arena.reserve(n)):off + n].view(dtype).view(s)
                                 for n, s in zip(nbytes, shapes)))

    def retrieve(self, cache: str, seq_id: str, start: int = 0, end: int = 0, layer_start: int = 0,
                 layer_end: int = 0, out_bytes: int = 0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [layers, end - start, Hkv, d] (sealed tokens dequantized) on `device`
        (default: host memory); end 0: to the sequence's end. For a CUDA device and a
        local daemon the daemon copies them into this client's CUDA buffer, and they
        never cross host memory. A range larger than RETRIEVE_CALL_BYTES comes in calls
        of whole layers, so the buffer it crosses stays that size."""
        for name, x in (("start", start), ("end", end), ("layer_start", layer_start), ("layer_end", layer_end),
                        ("out_bytes", out_bytes)):
            if x < 0:
                raise ValueError(f"{name}: must be >= 0, got {x}")
        device = _normal(device)
        if out_bytes and device is None:     # the caller sized the output range: one call, as it asked
            return self._retrieve(cache, seq_id, start, end, layer_start, layer_end, out_bytes, None, None)
        info = self.get_cache(cache).spec.geometry
        end = end or self.sequence_info(cache, seq_id).length     # sized here: the length, now
        layer_end = layer_end or info.num_layers
        dtype = _dtype(info)
        layer_bytes = max(0, end - start) * info.num_kv_heads * info.head_dim * dtype.itemsize
        step = max(1, RETRIEVE_CALL_BYTES // max(1, 2 * layer_bytes))
        if layer_end - layer_start <= step:       # one call (and the daemon's checks name a bad range)
            return self._retrieve(cache, seq_id, start, end, layer_start, layer_end,
                                  (layer_end - layer_start) * layer_bytes, device, None)
        shape = (layer_end - layer_start, end - start, info.num_kv_heads, info.head_dim)
        k = torch.empty(shape, dtype=dtype, device=device or "cpu")
        v = torch.empty_like(k)
        for a in range(layer_start, layer_end, step):
            b = min(a + step, layer_end)
            self._retrieve(cache, seq_id, start, end, a, b, (b - a) * layer_bytes, device,
                           (k[a - layer_start:b - layer_start], v[a - layer_start:b - layer_start]))
        return k, v

    def _retrieve(self, cache, seq_id, start, end, layer_start, layer_end, out_bytes, device, into):
        """One Retrieve call -> (k, v) on device (None: where the reply lies), or copied into `into`."""
        def read(r, arena):
            return tuple(self._tensor(t, arena, device, dst) for t, dst in zip((r.k, r.v), into or (None, None)))
        return self._named(cache, (seq_id,), (), lambda md: self._call(
            self._raw.Retrieve, lambda m, o: pb.RetrieveRequest(
                cache=cache, sequence_id=seq_id, start=start, end=end, layer_start=layer_start,
                layer_end=layer_end, k_out=o[0], v_out=o[1]), {}, [out_bytes, out_bytes], read, device, md))

    def fork(self, cache: str, seq_id: str, new_seq_id: str) -> None:
        req = pb.ForkRequest(cache=cache, sequence_id=seq_id, new_sequence_id=new_seq_id)
        self._named(cache, (seq_id,), (new_seq_id,), lambda md: self.stub.Fork(req, timeout=self.timeout, metadata=md))

    def offload(self, cache: str, seq_ids: list[str]) -> None:
        """Move sequences to the daemon's disk tier; returns once durable."""
        req = pb.OffloadRequest(cache=cache, sequence_ids=list(seq_ids))
        self._named(cache, seq_ids, (), lambda md: self.stub.Offload(req, timeout=self.timeout, metadata=md))

    def prefetch(self, cache: str, seq_ids: list[str]) -> None:
        """Page sequences back into GPU memory ahead of use."""
        req = pb.PrefetchRequest(cache=cache, sequence_ids=list(seq_ids))
        self._named(cache, seq_ids, (), lambda md: self.stub.Prefetch(req, timeout=self.timeout, metadata=md))

    def free(self, cache: str, seq_ids: list[str]) -> None:
        req = pb.FreeRequest(cache=cache, sequence_ids=list(seq_ids))
        self._named(cache, seq_ids, (), lambda md: self.stub.Free(req, timeout=self.timeout, metadata=md))
        self.session.forget(cache, seq_ids)

    # ---------------------------------------------------------------- stats
    def stats(self, cache: str = "") -> pb.StatsReply:
        return self.stub.Stats(pb.StatsRequest(cache=cache), timeout=self.timeout)

    def sequence_info(self, cache: str, seq_id: str) -> pb.SequenceInfoReply:
        req = pb.SequenceInfoRequest(cache=cache, sequence_id=seq_id)
        return self._named(cache, (seq_id,), (),
                           lambda md: self.stub.SequenceInfo(req, timeout=self.timeout, metadata=md))

    def list_sequences(self, cache: str) -> list[pb.SequenceInfoReply]:
        return list(self.stub.ListSequences(pb.ListSequencesRequest(cache=cache), timeout=self.timeout).sequences)
