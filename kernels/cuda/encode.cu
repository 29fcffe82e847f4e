#include "common.cuh"

// ------------------------------------------------------------------ PQ encode
// grid (ceil(N / (32*T)), L * Hkv, M / MG), block MG warps: warp w <-> subspace
// m0 + w, lane <-> T tokens (lane, lane + 32, ...). Centroid data of the
// block's subspaces in shared memory as float4 (-2c0, -2c1, ||c||^2, 0) for
// dsub 2 or 2 x float4 (-2c0..-2c3), (||c||^2, 0, 0, 0) for dsub 4; every lane
// of a warp reads the same entry (broadcast). Distance ||x||^2 + ||c||^2 - 2x.c
// (>= 0) with the centroid index in its 8 low mantissa bits: one fminf per
// candidate is the argmin, ties -> lowest index (as the Triton kernel).
template <int DSUB, int T, int MG, bool XBF16, bool XF32, bool S64>
__global__ void __launch_bounds__(MG * 32) pq_encode(
    const void* __restrict__ xv, long long sx_n, long long sx_h, const float4* __restrict__ cpre,
    const void* __restrict__ slots, u8* codes, long long so_blk, long long so_h,
    long long so_off, long long so_m, int N, int M, int bs, int hkv, long long sx_l, long long so_l) {
  constexpr int F4 = DSUB == 2 ? 1 : 2;
  __shared__ float4 sc[MG * 256 * F4];
  // h: (layer, KV head) of a launch over every layer (cpre stacked [L * Hkv, M, ...])
  const int h = blockIdx.y, m0 = blockIdx.z * MG;
  const long long x_h = (long long)(h / hkv) * sx_l + (long long)(h % hkv) * sx_h;
  const long long o_h = (long long)(h / hkv) * so_l + (long long)(h % hkv) * so_h;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float4* src = cpre + ((long long)h * M + m0) * 256 * F4;
  for (int i = threadIdx.x; i < MG * 256 * F4; i += MG * 32) sc[i] = src[i];
  const int m = m0 + warp;
  const int n0 = blockIdx.x * 32 * T;
  float x[T][DSUB], xn[T];
  float best[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    int n = n0 + lane + 32 * t;
    xn[t] = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; ++j) {
      float v = 0.f;
      if (n < N) {
        long long o = (long long)n * sx_n + x_h + m * DSUB + j;
        if (XF32) v = reinterpret_cast<const float*>(xv)[o];
        else v = from16<XBF16>(reinterpret_cast<const u16*>(xv)[o]);
      }
      x[t][j] = v;
      xn[t] += v * v;
    }
    best[t] = __int_as_float(0x7f7fffff);
  }
  __syncthreads();
  const float4* cw = sc + warp * 256 * F4;
#pragma unroll 4
  for (int c = 0; c < 256; ++c) {
    float4 e = cw[c * F4];
    float cn;
    float4 e2;
    if (DSUB == 4) { e2 = cw[c * F4 + 1 % F4]; cn = e2.x; } else { cn = e.z; }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float d = cn + xn[t];
      d = fmaf(x[t][0], e.x, d);
      d = fmaf(x[t][1], e.y, d);
      if (DSUB == 4) {
        d = fmaf(x[t][2 % DSUB], e.z, d);
        d = fmaf(x[t][3 % DSUB], e.w, d);
      }
      d = fmaxf(d, 0.f);
      float key = __int_as_float((__float_as_int(d) & ~255) | c);
      best[t] = fminf(best[t], key);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    int n = n0 + lane + 32 * t;
    if (n < N) {
      long long slot = S64 ? reinterpret_cast<const long long*>(slots)[n]
                           : (long long)reinterpret_cast<const int*>(slots)[n];
      long long blk = slot / bs, off = slot % bs;
      codes[blk * so_blk + o_h + off * so_off + (long long)m * so_m] =
          (u8)(__float_as_int(best[t]) & 255);
    }
  }
}

// ------------------------------------------------- PQ encode through cell tables (dsub 2)
// Tables and why they are exact: kernels/pq_cells.py. grid (M / 16, token chunks, L * Hkv),
// 256 threads; thread -> token (tid / 4) of each 64-token step and subspaces
// m0 + 4 (tid % 4) + 0..3, i.e. one 16 B (fp16/bf16) or 32 B (fp32) load per thread,
// the four threads of a token reading 64 contiguous bytes. In shared memory: the
// block's 16 subspaces' centroids (fp32 pairs, ~2 KB each) and breakpoints; the cell
// records (count byte + CMAX ascending candidate bytes, padded by repeating the last)
// are read through L1 (8 KB per subspace at G = 32, CMAX = 7).
// Every float op that decides a code is inline PTX without .ftz: --use_fast_math must
// neither flush subnormals nor contract the distance, which is reference.pq_encode's
// fp32 arithmetic bit for bit, fl(||c||^2 - 2 fl(fl(x0 c0) + fl(x1 c1))). A strict < over
// ascending indices then gives its argmin, ties to the lowest index. A lane whose
// point is outside the grid, non-finite, or in a FULL cell joins a warp-wide scan of
// all 256 centroids (one such point at a time, 8 centroids per lane).

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r;
}
__device__ __forceinline__ bool lt_f32(float a, float b) {
  u32 r;
  asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ bool ge_f32(float a, float b) {
  u32 r;
  asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ bool eq_f32(float a, float b) {
  u32 r;
  asm("{ .reg .pred p; setp.eq.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float cell_dist(float x0, float x1, float2 c) {
  float cn = add_rn(mul_rn(c.x, c.x), mul_rn(c.y, c.y));
  float dot = add_rn(mul_rn(x0, c.x), mul_rn(x1, c.y));
  return fma_rn(-2.f, dot, cn);
}

// 8 consecutive x values of one (token, head) row as fp32
template <bool XBF16, bool XF32>
__device__ __forceinline__ void load_x8(float (&x)[8], const void* xv, long long o) {
  if (XF32) {
    const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(xv) + o);
    float4 a = __ldg(p), b = __ldg(p + 1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  } else {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(xv) + o));
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = from16<XBF16>((u16)(w[i] & 0xffffu));
      x[2 * i + 1] = from16<XBF16>((u16)(w[i] >> 16));
    }
  }
}

template <int CMAX>
struct CellRec { u32 w[(CMAX + 1) / 4]; };

template <int CMAX>
__device__ __forceinline__ CellRec<CMAX> load_rec(const u8* p) {
  constexpr int NW = (CMAX + 1) / 4;
  CellRec<CMAX> r;
  if (NW == 4) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    r.w[0] = v.x; r.w[1 % NW] = v.y; r.w[2 % NW] = v.z; r.w[3 % NW] = v.w;
  } else {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    r.w[0] = v.x; r.w[1 % NW] = v.y;
  }
  return r;
}

template <int G, int CMAX, bool XBF16, bool XF32, bool S64>
__global__ void __launch_bounds__(256) pq_encode_cells(
    const void* __restrict__ xv, long long sx_n, long long sx_h,
    const float2* __restrict__ cents,   // [L * Hkv, M, 256] (c0, c1) fp32
    const float* __restrict__ bps,      // [L * Hkv, M, 2, G + 1]
    const u8* __restrict__ recs,        // [L * Hkv, M, G * G, CMAX + 1]
    const void* __restrict__ slots, u8* codes, long long so_blk, long long so_h,
    long long so_off, long long so_m, int N, int M, int bs, int tok_per_block, int vec_store,
    int hkv, long long sx_l, long long so_l) {
  constexpr int MG = 16, NB = G + 1, NW = (CMAX + 1) / 4, REC = CMAX + 1;
  static_assert((G & (G - 1)) == 0 && (CMAX == 7 || CMAX == 15), "G power of 2, CMAX 7 or 15");
  __shared__ float2 sc[MG * 256];
  __shared__ float sb[MG * 2 * NB];
  const int h = blockIdx.z, m0 = blockIdx.x * MG;
  const int tid = threadIdx.x, lane = tid & 31, q = tid & 3;
  {
    const float2* src = cents + ((long long)h * M + m0) * 256;
    for (int i = tid; i < MG * 256; i += 256) sc[i] = src[i];
    const float* bsrc = bps + ((long long)h * M + m0) * 2 * NB;
    for (int i = tid; i < MG * 2 * NB; i += 256) sb[i] = bsrc[i];
  }
  __syncthreads();
  const int n_lo = blockIdx.y * tok_per_block;
  const int n_hi = min(N, n_lo + tok_per_block);
  // h: (layer, KV head) of a launch over every layer (tables stacked [L * Hkv, M, ...])
  const long long xoff = (long long)(h / hkv) * sx_l + (long long)(h % hkv) * sx_h + 2 * (m0 + 4 * q);
  const long long o_h = (long long)(h / hkv) * so_l + (long long)(h % hkv) * so_h + (long long)(m0 + 4 * q) * so_m;
  const u8* rec_q = recs + ((long long)h * M + m0 + 4 * q) * (G * G) * REC;

  float xn[8];
  load_x8<XBF16, XF32>(xn, xv, (long long)min(n_lo + (tid >> 2), n_hi - 1) * sx_n + xoff);
  for (int nb = n_lo; nb < n_hi; nb += 64) {        // block-uniform trip count
    const int n = nb + (tid >> 2);
    const bool ok = n < n_hi;
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = xn[i];
    if (nb + 64 < n_hi)                             // prefetch the next step's row
      load_x8<XBF16, XF32>(xn, xv, (long long)min(n + 64, n_hi - 1) * sx_n + xoff);

    // cells of the 4 subspaces first, so their record loads are in flight together
    CellRec<CMAX> rec[4];
    bool full[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float* bx = sb + (4 * q + s) * 2 * NB;
      const float* by = bx + NB;
      const float px = x[2 * s], py = x[2 * s + 1];
      const bool in = ge_f32(px, bx[0]) && lt_f32(px, bx[G]) && ge_f32(py, by[0]) && lt_f32(py, by[G]);
      int ix = 0, iy = 0;
#pragma unroll
      for (int st = G / 2; st >= 1; st >>= 1) {
        if (ge_f32(px, bx[ix + st])) ix += st;
        if (ge_f32(py, by[iy + st])) iy += st;
      }
      rec[s] = load_rec<CMAX>(rec_q + ((long long)s * G * G + ix * G + iy) * REC);
      full[s] = !in;
    }

    u32 code4 = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float px = x[2 * s], py = x[2 * s + 1];
      const float2* cs = sc + (4 * q + s) * 256;
      u32 w[NW];
#pragma unroll
      for (int i = 0; i < NW; ++i) w[i] = rec[s].w[i];
      const int cnt = w[0] & 255;
      full[s] = full[s] || cnt > CMAX;
      // drop the count byte: w now streams the candidate bytes
#pragma unroll
      for (int i = 0; i < NW; ++i) w[i] = i + 1 < NW ? __funnelshift_r(w[i], w[(i + 1) % NW], 8) : w[i] >> 8;
      // lanes past their count re-test their last candidate (padding): no divergence
      const int kw = __reduce_max_sync(FULL, full[s] ? 0 : cnt);
      float bd = __int_as_float(0x7f800000);
      int bi = 0;
      for (int k = 0; k < kw; ++k) {
        const int ci = w[0] & 255;
#pragma unroll
        for (int i = 0; i < NW; ++i) w[i] = i + 1 < NW ? __funnelshift_r(w[i], w[(i + 1) % NW], 8) : w[i] >> 8;
        const float d = cell_dist(px, py, cs[ci]);
        if (lt_f32(d, bd)) { bd = d; bi = ci; }
      }
      u32 need = __ballot_sync(FULL, full[s] && ok);
      while (need) {
        const int src = __ffs(need) - 1;
        need &= need - 1;
        const float qx = __shfl_sync(FULL, px, src), qy = __shfl_sync(FULL, py, src);
        const float2* cw = sc + (4 * (src & 3) + s) * 256;
        float d2 = __int_as_float(0x7f800000);
        int i2 = lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float d = cell_dist(qx, qy, cw[lane + 32 * j]);
          if (lt_f32(d, d2)) { d2 = d; i2 = lane + 32 * j; }
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) {
          const float od = __shfl_xor_sync(FULL, d2, o);
          const int oi = __shfl_xor_sync(FULL, i2, o);
          if (lt_f32(od, d2) || (eq_f32(od, d2) && oi < i2)) { d2 = od; i2 = oi; }
        }
        if (lane == src) bi = i2;
      }
      code4 |= (u32)bi << (8 * s);
    }

    if (ok) {
      const long long slot = S64 ? reinterpret_cast<const long long*>(slots)[n]
                                 : (long long)reinterpret_cast<const int*>(slots)[n];
      const long long blk = slot / bs, off = slot % bs;
      u8* dst = codes + blk * so_blk + o_h + off * so_off;
      if (vec_store) {
        *reinterpret_cast<u32*>(dst) = code4;
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) dst[s * so_m] = (u8)(code4 >> (8 * s));
      }
    }
  }
}

