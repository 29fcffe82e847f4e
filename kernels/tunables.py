"""Every knob of the kernels, in one place: its environment variable, its default, what it
trades, and the measurement behind the default. Read once at import; the benches set the
module attributes directly (the plans read them at plan time).

Times are H100 SXM, Hq 32, Hkv 8, d 128, M 64, bs 16, fp16 tail of 128 tokens
(bench/bench_cuda_pq.py, median over CUDA-graph replays with L2 flushed).
"""
from __future__ import annotations

import os

# KVSTORE_CUDA_PQ=0: the Triton kernels everywhere, never the CUDA C++ ones (which run,
# where cupy imports and the shape fits, because they are faster: kernels/router.py).
CUDA = os.environ.get("KVSTORE_CUDA_PQ", "1") != "0"

# KVSTORE_CUDA_PQ_WARPS: warps per attention thread block. More warps keep more gathers in
# flight but shrink each warp's share of shared memory (the code-tile ring is 4 deep up to
# 12 warps, 3 past): 12 was the fastest of 8 / 12 / 16 at B=1 and B=8 x 32K tokens. On the
# loop of fixed table addresses the 16-warp bulk-copy builds fit 128 registers (4-bit: no
# spill) and still gain nothing (H200, B=8 32K 4-bit 104.4 -> 104.2 us, 2-bit 85.1 -> 86.0;
# B=1 25.4 -> 26.3 and 23.6 -> 24.5): the loop is bound by its pipes, not by latency alone.
NUM_WARPS = int(os.environ.get("KVSTORE_CUDA_PQ_WARPS", "12"))

# KVSTORE_CUDA_PQ_2BIT_TILES_PER_STEP: 16-token tiles a warp takes per step of the 2-bit
# (dsub 4) tile loop, 1 or 2. Two give the scheduler two independent gather / MMA chains
# and share one softmax rescale; 12 warps, L2 flushed: B=8 32K 96.6 -> 90.8 us, B=8 128K
# 341.2 -> 313.9, B=32 32K 362.7 -> 334.2, B=32 128K 1340.9 -> 1243.3, B=1 32K 24.4 -> 25.1
# (d 256, Hq 4 / Hkv 1: B=8 42.2 -> 41.2, B=1 25.3 -> 26.4). 4-bit runs one tile a step:
# two measured slower there (B=8 32K 115.2 -> 118.4 us, B=1 27.2 -> 30.0); on the leaner
# loop of fixed table addresses (H200) two gain B=8 0.8 % (105.9 -> 105.1) and lose B=1
# 4 % (24.9 -> 26.0).
TILES_PER_STEP_2BIT = int(os.environ.get("KVSTORE_CUDA_PQ_2BIT_TILES_PER_STEP", "2"))
if TILES_PER_STEP_2BIT not in (1, 2):
    raise ValueError(f"KVSTORE_CUDA_PQ_2BIT_TILES_PER_STEP must be 1 or 2, got {TILES_PER_STEP_2BIT}")

# KVSTORE_CUDA_PQ_TAIL_TILES: what a sequence's fp16 tail costs the block that runs it, in
# PQ tiles per tail tile. The tail runs at the end of one block as one warp's serial chain
# of loads and arithmetic, ~5 us against ~1.15 us a PQ tile of that warp; the partition
# (cuda/attention.py _items) takes that many PQ tokens off the block with the tail.
# 0: the tail counts as free. H200, one run each of 0 / 2 / 4 / 8
# (KVSTORE_CUDA_PQ_TAIL_TILES=N python bench/bench_cuda_pq.py --no-encode --warps 12
# --bits 4 --shape 1 32768, and --bits 2, B=8): 4-bit B=1 28.0 / 26.8 / 25.1 / 25.4 us,
# B=8 106.4 / 105.4 / 104.8 / 106.6; 2-bit B=1 24.3 / 24.2 / 22.6 / 22.2, B=8 81.8 / 80.4 /
# 80.5 / 81.4.
TAIL_TILES = float(os.environ.get("KVSTORE_CUDA_PQ_TAIL_TILES", "4"))

# KVSTORE_CUDA_PQ_TMA_MAX_ITEM: on sm_90, plans whose work items average at most this many
# PQ tokens stage the codebooks by bulk (TMA) copies of the codebook image; longer ones
# through registers. The bulk copy starts a block ~4 us sooner, which is what short items
# are made of; past ~16K tokens an item's tile loop dominates and the register-staging
# build's loop runs 2-5 % faster (B=8 128K 403 vs 417 us, B=32 32K 420 vs 431, B=32 128K
# 1698 vs 1760; a tie at 16K). 0: registers always, and no codebook image is built.
TMA_MAX_ITEM_TOKENS = int(os.environ.get("KVSTORE_CUDA_PQ_TMA_MAX_ITEM", "16384"))

# KVSTORE_TRITON_MTQ_2BIT_TILE: PQ tokens per tile of the Triton multi-token kernel (T > 1
# query tokens) on 2-bit codes (dsub 4), which also runs without the one-token plans'
# 128-register cap: under it ptxas spills the 2-bit multi-token tile. H100, B=8 L=32K T=8,
# Hq 32 Hkv 8 d 128, one sweep (tile / warps / stages / cap / programs): 2-bit tile 64
# uncapped 770.9 us, tile 128 uncapped 861.7, tile 128 capped (the one-token default)
# 1984.2, SDPA flash 1596.4; 4-bit's fastest stays the one-token default (574.9 us).
# One of 16, 32, 64, 128 (it must divide the plans' 128-token chunks).
MTQ_2BIT_TILE = int(os.environ.get("KVSTORE_TRITON_MTQ_2BIT_TILE", "64"))
if MTQ_2BIT_TILE not in (16, 32, 64, 128):
    raise ValueError(f"KVSTORE_TRITON_MTQ_2BIT_TILE must be 16, 32, 64 or 128, got {MTQ_2BIT_TILE}")

# KVSTORE_MTQ_TRITON_ROWS: multi-token PQ plans with at least this many query rows per KV
# head (T query tokens x G query heads) run on Triton's wide tiles (MTQ_WIDE below) even
# where the CUDA C++ kernel takes the geometry (kernels/router.py); 0: never. Only plans
# of wide blocks go (more than plan.MULTI_ROWS = 64 rows, head_dim <= 128: plan.wide_rows),
# so a value below 65 acts as 65. The CUDA kernel decodes every tile of codes once per
# group of at most 8 rows, so its time grows with T x G; a wide Triton program decodes
# each tile for 128 rows. H200, L=32K, Hq 32
# Hkv 8 d 128, one sweep (CUDA / Triton wide, us): B=1 T=32 (128 rows) 4-bit 215 / 237,
# 2-bit 198 / 201; T=64 (256) 420 / 358, 388 / 291; T=128 (512) 822 / 639, 763 / 508;
# B=8 T=32 4-bit 1649 / 1454, 2-bit 1521 / 1108; B=8 T=128 6472 / 4046, 6023 / 3079.
MTQ_TRITON_ROWS = int(os.environ.get("KVSTORE_MTQ_TRITON_ROWS", "256"))
if MTQ_TRITON_ROWS < 0:
    raise ValueError(f"KVSTORE_MTQ_TRITON_ROWS must be >= 0 (0: never), got {MTQ_TRITON_ROWS}")

# Triton multi-token PQ programs with more than 64 query rows (head_dim <= 128): blocks
# of MTQ_WIDE_ROWS rows, (tile, warps) by bits per element, and a partition that aims at
# MTQ_WIDE_PROGRAMS programs per SM. Fastest of rows 64 / 128, (tile, warps) (32, 8) /
# (64, 4) / (64, 8) and 1 / 2 / 4 programs per SM in the sweep above at B=1 T=64 and 128;
# at B=1 T=128, rows 64 with the one-token partition (8 programs per SM) took 1841 us
# (4-bit) against 639 us.
MTQ_WIDE_ROWS = 128
MTQ_WIDE = {4: (32, 8), 2: (64, 4)}     # bits -> (PQ tokens a tile, warps)
MTQ_WIDE_PROGRAMS = 2
