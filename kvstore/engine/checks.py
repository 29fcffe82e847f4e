"""The engine's checks of a request, run before any state changes; errors
name the request field: the float tensors it brings (K, V, Q, codebook
samples: dtype, shape, values in the cache's dtype), the sequences and layer
it names, its scale, and the room a batch needs."""
from __future__ import annotations

import math

import torch

from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence
from kvstore.errors import FailedPrecondition, InvalidArgument, quote
from kvstore.kernels.plan import MAX_QUERY_TOKENS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_values(x: torch.Tensor, field: str, limit: float, converted: bool) -> None:
    """Refuse NaN, Inf and |element| > limit in x, a tensor in a cache's dtype
    (one min/max reduction). converted: x is the daemon's conversion of the
    request's tensor, where an Inf may be a finite value past the dtype's range."""
    if x.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    if -limit <= lo and hi <= limit:       # False for NaN too
        return
    if math.isnan(lo) or math.isnan(hi):
        raise InvalidArgument(field, "contains NaN")
    if math.isinf(lo) or math.isinf(hi):
        top = torch.finfo(x.dtype).max
        raise InvalidArgument(field, f"contains Inf, or values past {top:g} that overflow the cache's {x.dtype}"
                              if converted else "contains Inf")
    raise InvalidArgument(field, f"holds {max(-lo, hi):g}; a {x.dtype} cache takes |{field}| <= {limit:g} "
                          "(larger ones overflow the fp32 attention scores)")


def request_tensor(cfg: CacheConfig, t: torch.Tensor, field: str, shape: tuple,
                   limit: float | None = None) -> torch.Tensor:
    """Check a float tensor's shape (None = any size) and values, -> it on the
    cache's device in the cache dtype. limit: the largest |element| taken (q
    and k: ModelGeometry.qk_limit); None: any value finite in the cache dtype."""
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidArgument(field, f"dtype {dtype_name(t.dtype)} is not FLOAT16, BFLOAT16 or FLOAT32")
    if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidArgument(field, f"shape {list(t.shape)}, expected {want}")
    x = t.to(dtype=getattr(torch, cfg.geometry.dtype))
    # Values are checked in the cache dtype, after the conversion, which can
    # overflow (1e5 in fp32 is Inf in fp16). On CUDA the check synchronises
    # with the host: a tensor that arrives on the GPU in the cache dtype (the
    # decode path) is the client's responsibility, as a check would stall
    # every call; one the daemon converts costs a copy anyway and is checked.
    if not x.is_cuda or x is not t:
        check_values(x, field, limit if limit is not None else torch.finfo(x.dtype).max, x is not t)
    return x.to(device=cfg.device)


def sequences(cache, tenant: str, seq_ids: list[str], unique: bool, all_held: bool = False) -> list[Sequence]:
    """The sequences a request names, in its order (NotFound for one that is not there).
    all_held (Free, Offload): as many as the cache holds, which a restart into a cache of
    a smaller max_sequences makes more than that."""
    if not seq_ids:
        raise InvalidArgument("sequence_ids", "empty batch")
    # A call holds its cache's lock for the whole batch: rows past what the cache
    # holds at once (only an Attend's repeats get there) would stall every other
    # caller of the cache for as long as the caller likes.
    most = max(cache.cfg.max_sequences, len(cache.seqs) if all_held else 0)
    if len(seq_ids) > most:
        raise InvalidArgument("sequence_ids", f"{len(seq_ids)} rows, more than the cache's "
                                              f"max_sequences={cache.cfg.max_sequences}"
                              + (f" and the {len(cache.seqs)} sequences it holds" if all_held else ""))
    if unique and len(set(seq_ids)) != len(seq_ids):
        raise InvalidArgument("sequence_ids", "a sequence appears twice in one batch")
    return [cache.seq(tenant, i, "sequence_ids") for i in seq_ids]


def check_layer(cfg: CacheConfig, layer: int) -> None:
    if not 0 <= layer < cfg.geometry.num_layers:
        raise InvalidArgument("layer", f"{layer} outside [0, {cfg.geometry.num_layers})")


def layer_range(cfg: CacheConfig, layer_start: int, layer_end: int) -> int:
    """A Retrieve's layers [layer_start, layer_end) (0: to the last) -> layer_end."""
    nl = cfg.geometry.num_layers
    end = layer_end or nl
    if end > nl:
        raise InvalidArgument("layer_end", f"{end} is past the cache's {nl} layers")
    if not layer_start < end:
        raise InvalidArgument("layer_start", f"{layer_start} is not below layer_end {end}: no layer to read")
    return end


def token_range(seq_id: str, start: int, end: int, length: int) -> None:
    """A Retrieve's tokens [start, end) of a sequence of `length` committed tokens
    (end already resolved from 0): at least one token, all committed."""
    if length == 0:
        raise InvalidArgument("sequence_id", f"sequence {quote(seq_id)} has no committed tokens to retrieve")
    if end > length:
        raise InvalidArgument("end", f"{end} is past the {length} committed tokens")
    if not start < end:
        raise InvalidArgument("start", f"{start} is not below end {end}: an empty range (Retrieve reads "
                              "at least one token)")


def query(cfg: CacheConfig, n_seqs: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """Checks shared by the attend paths -> (q on the cache device, scale)."""
    g = cfg.geometry
    q = request_tensor(cfg, q, "q", (n_seqs, g.num_q_heads, g.head_dim), g.qk_limit)
    if not 0 <= scale <= g.max_scale():      # NaN fails too; Inf is past the bound
        raise InvalidArgument("scale", f"must be in [0, {g.max_scale():.3g}] (0: 1/sqrt(head_dim); past the "
                              f"bound, scores of {g.dtype} q and k overflow fp32), got {scale}")
    return q, scale or 1.0 / math.sqrt(g.head_dim)


def query_tokens(cfg: CacheConfig, layer: int, t: int) -> int:
    """An AppendAttend's tokens per sequence (0: one) -> T, checked: in [1, 128]
    (kernels/plan.py MAX_QUERY_TOKENS); with T > 1 the layer has no sliding window
    (each query would need its own), and a pq cache keeps all T new tokens in fp16
    until they are attended (T <= residual + 1: the tail keeps at least R + 1 tokens
    once its sealed blocks are taken)."""
    t = t or 1
    if not 1 <= t <= MAX_QUERY_TOKENS:
        raise InvalidArgument("query_tokens", f"must be in [1, {MAX_QUERY_TOKENS}], got {t}")
    if t > 1 and (cfg.window(layer) or cfg.chunk(layer)):
        raise InvalidArgument("query_tokens", f"layer {layer} has a sliding window or attention chunks: "
                              "multi-token attention does not take them (send one token per call)")
    if t > 1 and cfg.codec.kind == "pq" and t > cfg.residual + 1:
        raise InvalidArgument("query_tokens", f"{t} tokens per sequence: a pq cache with residual "
                              f"{cfg.residual} keeps only the newest {cfg.residual + 1} in fp16")
    return t


def step_ids(token_ids, n_seqs: int, t: int) -> list | None:
    """An AppendAttend's token_ids (empty, or one per new token: n_seqs x t, sequence
    by sequence) -> one list per sequence, or None."""
    if token_ids is None or not len(token_ids):
        return None
    if len(token_ids) != n_seqs * t:
        raise InvalidArgument("token_ids", f"{len(token_ids)} ids for {n_seqs} sequences x {t} tokens")
    return [list(token_ids[i * t:(i + 1) * t]) for i in range(n_seqs)]


def output_into(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """out if the kernels can write the result straight into it (q's shape,
    dtype and device, contiguous), else None: the result gets its own tensor."""
    if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
            or not out.is_contiguous():
        return None
    return out


def refusals(cache, seqs: list[Sequence], counts: list[int], layer: int | None,
             token_ids: list | None = None) -> None:
    """An append's refusals that read only the sequences' metadata: run before
    anything is paged in, so a refused append leaves every sequence in its tier."""
    for i, (s, c) in enumerate(zip(seqs, counts)):
        if (layer is None and any(s.pending)) or s.reserved:
            raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted tokens")
        if layer is None:
            cache.check_count(s, c)
        else:
            cache.check_step_continues(s, layer)
        if token_ids is not None and len(token_ids[i]):
            cache.check_token_ids(s, c, token_ids[i], layer)


def batch_room(cache, seqs: list[Sequence], counts: list[int], layer: int | None,
               token_ids: list | None = None) -> None:
    """Refuse a batch that will not fit, or that any of its sequences
    would refuse, before writing any of it."""
    refusals(cache, seqs, counts, layer, token_ids)
    cache.check_room(*write_room(cache, seqs, counts, layer))


def write_room(cache, seqs: list[Sequence], counts: list[int], layer: int | None) -> tuple[int, int, int]:
    """(main, tail, freed) blocks an append of counts[i] tokens to seqs[i] takes (Room.room_needed)."""
    room = [cache.room_needed(s, c, layer) for s, c in zip(seqs, counts)]
    return sum(r[0] for r in room), sum(r[1] for r in room), sum(r[2] for r in room)


def reserve_refusals(cache, seqs: list[Sequence]) -> None:
    """A batch's Reserve refusals that read only the sequences' metadata: uncommitted
    per-layer tokens, slots a lapse dropped (Cache.check_reservations_kept)."""
    for s in seqs:
        if any(s.pending):
            raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted per-layer tokens")
    cache.check_reservations_kept(seqs)


def reserve_room(cache, seqs: list[Sequence], n: int) -> None:
    """Refuse a batch's Reserve of n slots each that the pools cannot give whole,
    before any of its sequences commits."""
    cache.check_room(*reserve_need(cache, seqs, n), "num_tokens")


def reserve_need(cache, seqs: list[Sequence], n: int) -> tuple[int, int, int]:
    """(main, tail, 0) blocks a batch's Reserve of n slots each takes (Room.reserve_room)."""
    room = [cache.reserve_room(s, n) for s in seqs]
    return sum(m for m, _ in room), sum(t for _, t in room), 0


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the proto's DType names it (torch.float16 -> FLOAT16)."""
    return str(dtype).removeprefix("torch.").upper()
