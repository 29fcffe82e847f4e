"""Validated configuration dataclasses: one per concept."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument, quote

from .names import check_label, check_name

DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
CODECS = ("fp16", "pq")
F32_MAX = 3.4028234663852886e38
# Largest |element| of q and k a cache takes. The kernels accumulate scores
# q.k * scale in fp32 (then scale them by log2(e) and subtract the row max),
# so |q.k| <= head_dim * QK_LIMIT^2 must leave room for a useful scale
# (ModelGeometry.max_scale). float16: its own max, every finite value.
# bfloat16 reaches fp32's range itself (a single q.k of two bf16 maxima is
# inf in fp32): its limit is 2^32, which still leaves scales up to ~9e15 at
# head_dim 512 and is far past what K and Q of a trained model hold.
QK_LIMITS = {"float16": 65504.0, "bfloat16": 2.0 ** 32}
MAX_COUNT = 1 << 16            # layers, query heads, KV heads
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?", re.ASCII)


def check_device(field: str, device: object) -> str:
    """device, if torch can name it as the daemon's: cpu, cuda or cuda:N."""
    if not isinstance(device, str) or _DEVICE.fullmatch(device) is None:
        raise InvalidArgument(field, f"must be cpu, cuda or cuda:N, got {quote(device)}")
    return device


@dataclass(slots=True, frozen=True)
class ModelGeometry:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"      # dtype of K/V/Q the client sends and receives

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"geometry.{name}", f"must be a positive integer, got {quote(v)}")
        # Per-layer and per-head state is built from these before any pool is sized: a bound far
        # past any model keeps one request from spending minutes on a count it cannot hold.
        for name in ("num_layers", "num_q_heads", "num_kv_heads"):
            if getattr(self, name) > MAX_COUNT:
                raise InvalidArgument(f"geometry.{name}", f"must be at most {MAX_COUNT}, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgument("geometry.num_q_heads",
                                  f"{self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 4 or self.head_dim > 512:
            raise InvalidArgument("geometry.head_dim", f"must be a multiple of 4 and <= 512, got {self.head_dim}")
        if self.dtype not in DTYPES or self.dtype == "float32":
            raise InvalidArgument("geometry.dtype", f"must be float16 or bfloat16, got {quote(self.dtype)}")

    @property
    def qk_limit(self) -> float:
        return QK_LIMITS[self.dtype]

    def max_scale(self) -> float:
        """The largest attention scale whose fp32 scores can never overflow:
        |scale * q.k| <= F32_MAX / 4 for q, k within qk_limit (the factor 4
        covers the log2(e) the kernels fold in and the subtraction of the row
        max). ~1.2e27 at head_dim 16 in fp16, ~3.6e16 at 128 in bf16."""
        return F32_MAX / (4 * self.head_dim * self.qk_limit ** 2)


@dataclass(slots=True, frozen=True)
class CodecConfig:
    kind: str = "pq"            # "pq" or "fp16"
    num_subvectors: int = 0     # M; 0 means head_dim // 2 (4 bits per element)
    num_centroids: int = 256

    def __post_init__(self) -> None:
        if self.kind not in CODECS:
            raise InvalidArgument("codec.kind", f"must be one of {CODECS}, got {quote(self.kind)}")
        if self.kind == "pq" and self.num_centroids != 256:
            raise InvalidArgument("codec.num_centroids", "only 256 centroids (8-bit codes) are supported")
        if self.num_subvectors < 0:
            raise InvalidArgument("codec.num_subvectors", "must be >= 0")

    def subvectors(self, head_dim: int) -> int:
        m = self.num_subvectors or head_dim // 2
        if self.kind == "pq" and m not in (head_dim // 2, head_dim // 4):
            raise InvalidArgument("codec.num_subvectors",
                                  f"must be head_dim/2={head_dim // 2} or head_dim/4={head_dim // 4}, got {m}")
        return m


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """A cache namespace. The pool is sized from `num_blocks`, or from
    `pool_bytes` divided by the bytes one block takes across all layers."""
    name: str
    model_id: str
    geometry: ModelGeometry
    codec: CodecConfig = field(default_factory=CodecConfig)
    block_size: int = 16
    residual: int = 128          # R: newest tokens kept in fp16 per sequence
    sink_tokens: int = 0         # S: first tokens of every sequence kept in fp16, never sealed (codec pq)
    num_blocks: int = 0
    pool_bytes: int = 0
    max_sequences: int = 256     # sizes the fp16 tail pool
    device: str = "cpu"
    host_bytes: int = 0          # pinned host tier under the GPU pools (0: none)
    low_watermark: float = 0.0   # move LRU sequences down while fewer blocks are free
    share_prefixes_across_tenants: bool = False   # else the tenant seeds every hash chain
    # Sliding-window attention: () or one entry per layer; w > 0: a decode query at
    # position p reads positions (p - w, p] only (transformers' convention), 0: all.
    layer_windows: tuple[int, ...] = ()
    # Chunked attention (Llama 4): () or one entry per layer; c > 0: a decode query at
    # position p reads positions [p - p % c, p] only, 0: none. Not with a window.
    layer_chunks: tuple[int, ...] = ()
    logit_softcap: float = 0.0   # > 0: scores s become c * tanh(s / c) (Gemma-2); 0: none
    # Learned attention-sink logits (gpt-oss): () or num_layers * num_q_heads, layer-major;
    # each is one more score with a zero value in its head's softmax; -inf: none.
    sink_logits: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self._validate()
        if self.host_bytes < 0:
            raise InvalidArgument("host_bytes", "must be >= 0")
        if 0 < self.host_bytes < self.host_pair_bytes():
            raise InvalidArgument("host_bytes", f"{self.host_bytes} holds no host block: the host tier keeps "
                                  f"a main and a tail block together, {self.host_pair_bytes()} bytes")
        if not 0.0 <= self.low_watermark < 1.0:
            raise InvalidArgument("low_watermark", f"must be in [0, 1), got {self.low_watermark}")

    def _validate(self) -> None:
        check_name("name", self.name)
        check_label("model_id", self.model_id)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise InvalidArgument("block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.residual < 0 or self.residual > 65536:
            raise InvalidArgument("residual", f"must be in [0, 65536], got {self.residual}")
        if (not isinstance(self.sink_tokens, int) or not 0 <= self.sink_tokens <= 65536
                or self.sink_tokens % self.block_size):
            raise InvalidArgument("sink_tokens", f"must be a multiple of block_size={self.block_size} "
                                  f"in [0, 65536], got {quote(self.sink_tokens)}")
        if self.max_sequences <= 0 or self.max_sequences > 1 << 20:
            raise InvalidArgument("max_sequences", f"must be in [1, 2^20], got {self.max_sequences}")
        if self.num_blocks < 0 or self.pool_bytes < 0:
            raise InvalidArgument("num_blocks", "num_blocks and pool_bytes must be >= 0")
        if (self.num_blocks == 0) == (self.pool_bytes == 0):
            raise InvalidArgument("num_blocks", "give exactly one of num_blocks or pool_bytes")
        self.codec.subvectors(self.geometry.head_dim)   # validates M against head_dim
        if self.capacity_blocks() < 1:
            raise InvalidArgument("pool_bytes", f"{self.pool_bytes} bytes hold no block of {self.bytes_per_block()} bytes")
        if self.capacity_blocks() > 1 << 24:
            field = "pool_bytes" if self.pool_bytes else "num_blocks"
            raise InvalidArgument(field, f"{self.capacity_blocks()} blocks of {self.bytes_per_block()} bytes: "
                                  "a pool holds at most 2^24 blocks")
        check_device("device", self.device)
        for name, what in (("layer_windows", "window"), ("layer_chunks", "chunk")):
            w = getattr(self, name)
            if not isinstance(w, tuple) or (w and len(w) != self.geometry.num_layers):
                raise InvalidArgument(name, f"must be empty or hold one {what} per layer ({self.geometry.num_layers}), "
                                      f"got {len(w) if isinstance(w, tuple) else quote(w)}")
            for x in w:
                if not isinstance(x, int) or not 0 <= x < 1 << 31:
                    raise InvalidArgument(name, f"{what}s must be integers in [0, 2^31), got {quote(x)}")
        both = [i for i, (w, c) in enumerate(zip(self.layer_windows, self.layer_chunks)) if w and c]
        if both:
            raise InvalidArgument("layer_chunks", f"layer {both[0]} has both a window and a chunk: one or the other")
        c = self.logit_softcap
        if not isinstance(c, (int, float)) or not (0.0 <= c < math.inf):
            raise InvalidArgument("logit_softcap", f"must be a finite number >= 0, got {quote(c)}")
        z, want = self.sink_logits, self.geometry.num_layers * self.geometry.num_q_heads
        if not isinstance(z, tuple) or (z and len(z) != want):
            raise InvalidArgument("sink_logits", f"must be empty or hold num_layers * num_q_heads = {want} "
                                  f"values (layer-major), got {len(z) if isinstance(z, tuple) else quote(z)}")
        for i, x in enumerate(z):
            if not isinstance(x, (int, float)) or math.isnan(x) or x == math.inf:
                raise InvalidArgument("sink_logits", f"entry {i} must be a finite number or -inf (no sink), "
                                      f"got {quote(x)}")

    # --- attention
    def window(self, layer: int) -> int:
        """The layer's sliding window in tokens; 0: it reads every token."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def chunk(self, layer: int) -> int:
        """The layer's attention chunk in tokens; 0: none."""
        return self.layer_chunks[layer] if self.layer_chunks else 0

    # --- derived sizes
    @property
    def m(self) -> int:
        return self.codec.subvectors(self.geometry.head_dim)

    def fp16_bytes_per_token(self) -> int:
        g = self.geometry
        return 2 * g.num_layers * g.num_kv_heads * g.head_dim * DTYPES[g.dtype]

    def bytes_per_token(self) -> int:
        """Bytes one sealed token takes in the main pool, K and V, all layers."""
        if self.codec.kind == "fp16":
            return self.fp16_bytes_per_token()
        return 2 * self.geometry.num_layers * self.geometry.num_kv_heads * self.m

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def capacity_blocks(self) -> int:
        return self.num_blocks or self.pool_bytes // self.bytes_per_block()

    @property
    def sinks(self) -> int:
        """Sink tokens in effect: the fp16 codec keeps every token exact anyway."""
        return self.sink_tokens if self.codec.kind == "pq" else 0

    def tail_blocks_per_sequence(self) -> int:
        # The sinks, R + block_size tokens at rest, plus one block being
        # filled, plus one when the tail starts mid-block.
        return self.sinks // self.block_size + math.ceil((self.residual + self.block_size) / self.block_size) + 2

    def tail_capacity_blocks(self) -> int:
        return self.max_sequences * self.tail_blocks_per_sequence()

    def host_pair_bytes(self) -> int:
        """A main block's payload and an fp16 tail block's: the host tier's unit."""
        return self.bytes_per_block() + self.block_size * self.fp16_bytes_per_token()

    def host_blocks(self) -> int:
        """Blocks in each of the host tier's two pools: the whole (main, tail) pairs host_bytes holds."""
        return self.host_bytes // self.host_pair_bytes()

    def host_tier_bytes(self) -> int:
        """What the host tier takes of host_bytes."""
        return self.host_blocks() * self.host_pair_bytes()
