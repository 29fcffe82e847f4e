// PQ decode attention + PQ encode, CUDA C++ for NVRTC (loaded by kernels/cuda_pq.py).
//
// Attention: one thread block per (work item, KV head). A work item is a range of
// PQ-coded sealed tokens of one sequence and/or a range of its fp16 tail. The
// block stages the K and V codebooks of its KV head in shared memory once, then
// each warp takes 16-token tiles (round robin) and runs them through mma.sync:
//   S  = Q K^T   A = q (rows = the G query heads, padded to 16), B = gathered K
//                centroid words (a dsub=2 centroid is one fp16 pair = one B reg)
//   O^T = V^T P^T A = gathered V words, re-paired across tokens with PRMT,
//                B = P (straight from S's accumulator layout, FA2 style).
// Head-dim coordinates are permuted (free for a dot product) so that lane
// (g, c) of a warp reads the K codes of one token as M/4 contiguous bytes and
// the V codes of one subspace as 4 contiguous bytes.
// Shared-memory layouts give each group of lanes that gather from the same
// subspace its own banks: K entry (m, code) at (m % MQ)*1024 + code*4 + m/MQ
// (lanes with c = m/MQ use banks = c mod 4 + 4*(code mod 8)); V entry at
// (m/8)*2048 + code*8 + m%8.
// Partials (o, base-2 lse) per item go to o_part / lse_part; pq_merge combines.
// On sm_90 the CF kernel (TMA) takes its codebooks as bulk copies of a per-head image of
// exactly those shared-memory bytes, built once per codebook (cuda_pq.codebook_image);
// elsewhere, or while no image is cached, it stages them through registers (RegStager).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define FULL 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// lo -> low 16 bits, hi -> high 16 bits
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <bool BF16>
__device__ __forceinline__ u16 to16(float x) {
  u16 r;
  if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

template <bool BF16>
__device__ __forceinline__ float from16(u16 x) {
  float r;
  if (BF16) r = __uint_as_float(((u32)x) << 16);
  else asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
}

// CF shared memory: K table (64 KiB: 256-byte code rows), V table (64 KiB region), then
// each warp's ring of code tiles (cf_stages x 32*M bytes: 4 deep up to 12 warps, else
// 3, to fit 227 KiB at d = 128); cuda_pq._attn_smem mirrors this
__host__ __device__ constexpr int cf_stages(int nw) { return nw <= 12 ? 4 : 3; }
template <int D>
__host__ __device__ constexpr int cf_ring_offset() { return 131072; }

// token of column n of S n-tile t (and of P^T k-row)
__device__ __forceinline__ int sigma(int t, int n) { return 4 * (n >> 1) + 2 * t + (n & 1); }

// PRMT in its generic mode: a selector nibble with bit 3 set replicates the sign of the
// byte it names (0x00 for bytes < 0x80), which __byte_perm does not promise.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// cp.async (16 B, L2 only): the CF kernel streams each warp's code tiles into a
// shared-memory ring a few tiles ahead, so no register waits on HBM
__device__ __forceinline__ void cp_async16(unsigned char* dst, const u8* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(unsigned char* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
               :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// a 32-bit shared-window load: with a generic pointer the compiler spends a second
// IMAD per V gather on the window base
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}

// Bulk copies (sm_90): global -> shared on the copy engine, completion counted in bytes on
// an mbarrier. Below sm_90 the kernels that use them (TMA) are never launched.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
#if __CUDA_ARCH__ >= 900
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(phase) : "memory");
  } while (!done);
#endif
}
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

// Debug stamps (compile with -DPQ_STAMPS; nothing of it exists otherwise): lane 0 of each
// warp writes clock64 at the stage boundaries of pq_attn, its SM id and %globaltimer at
// entry / exit into pq_stamps[((blockIdx.y * gridDim.x + blockIdx.x) * NW + warp) * 16 + k]
// (bench/attrib_cuda_pq.py reads them back).
#ifdef PQ_STAMPS
#define PQ_STAMP_CAP (1 << 21)
__device__ unsigned long long pq_stamps[PQ_STAMP_CAP];
__device__ __forceinline__ unsigned long long pq_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 pq_smid() {
  u32 r;
  asm volatile("mov.u32 %0, %smid;" : "=r"(r));
  return r;
}
#define PQ_STAMP(k)                                                                       \
  do {                                                                                     \
    if (lane == 0) {                                                                       \
      const long long ix_ = ((long long)(blockIdx.y * gridDim.x + blockIdx.x) * NW + warp) * 16; \
      if (ix_ + 16 <= PQ_STAMP_CAP) ((volatile unsigned long long*)pq_stamps)[ix_ + (k)] = clock64(); \
    }                                                                                      \
  } while (0)
#define PQ_STAMP_X(k, v)                                                                  \
  do {                                                                                     \
    if (lane == 0) {                                                                       \
      const long long ix_ = ((long long)(blockIdx.y * gridDim.x + blockIdx.x) * NW + warp) * 16; \
      if (ix_ + 16 <= PQ_STAMP_CAP) ((volatile unsigned long long*)pq_stamps)[ix_ + (k)] = (v); \
    }                                                                                      \
  } while (0)
#else
#define PQ_STAMP(k)
#define PQ_STAMP_X(k, v)
#endif

// r[i] <- r[(i - s) & 7] with s = gq minus its bits below NR: select stages, registers only
template <int NR>
__device__ __forceinline__ void rot_hi(u32 (&r)[8], int gq) {
#pragma unroll
  for (int v = NR; v < 8; v *= 2) {
    const bool on = gq & v;
    u32 t[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = on ? r[(i - v) & 7] : r[i];
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = t[i];
  }
}

// one codebook entry: DSUB fp16 = 1 (dsub 2) or 2 (dsub 4) 32-bit words
template <int DSUB> struct Ent;
template <> struct Ent<2> { typedef u32 T; };
template <> struct Ent<4> { typedef uint2 T; };

template <int DSUB>
__device__ __forceinline__ u32 ent_word(const typename Ent<DSUB>::T& e, int p);
template <> __device__ __forceinline__ u32 ent_word<2>(const u32& e, int p) { return e; }
template <> __device__ __forceinline__ u32 ent_word<4>(const uint2& e, int p) {
  return p ? e.y : e.x;
}

// code bytes of one lane: MQ bytes (4, 8 or 16)
template <int MQ> struct CodeVec;
template <> struct CodeVec<4> { u32 w[1]; };
template <> struct CodeVec<8> { u32 w[2]; };
template <> struct CodeVec<16> { u32 w[4]; };

template <int MQ>
__device__ __forceinline__ void load_codes(CodeVec<MQ>& v, const u8* p) {
  if (MQ == 16) {
    uint4 x = __ldg(reinterpret_cast<const uint4*>(p));
    v.w[0] = x.x; v.w[1] = x.y; v.w[2 % (MQ / 4)] = x.z; v.w[3 % (MQ / 4)] = x.w;
  } else if (MQ == 8) {
    uint2 x = __ldg(reinterpret_cast<const uint2*>(p));
    v.w[0] = x.x; v.w[1 % (MQ / 4)] = x.y;
  } else {
    v.w[0] = __ldg(reinterpret_cast<const u32*>(p));
  }
}

template <int MQ>
__device__ __forceinline__ u32 code_at(const CodeVec<MQ>& v, int i) {
  return (v.w[i >> 2] >> ((i & 3) * 8)) & 0xffu;
}

struct AttnArgs {
  const u16* q; long long sq_b, sq_h;
  const int* items; int n_items;           // [n, 5]: b, pq_lo, pq_hi, t_lo, t_hi
  float* o_part; float* lse_part;          // [n, Hq, D], [n, Hq]
  const u8* kc; const u8* vc; long long skc_blk, skc_h, svc_blk, svc_h;
  const u16* kcb; const u16* vcb;          // [Hkv, M, 256, DSUB]
  const int* st; long long st_stride;
  const u16* tk; const u16* tv; long long stk_blk, stk_h, stk_t, stv_blk, stv_h, stv_t;
  const int* tt; long long tt_stride;
  float qk_scale;                          // scale * log2(e)
  int hq, g, bs, tbs;
};

// Everything per warp for one 16-token tile once its K/V entries are known.
// VG > 0 (conflict-free V gathers, G <= VG in {2, 4}): the PQ tiles accumulate O^T in
// ov, whose 8 * NT columns are (m-tile c of a group of four, head h) = (n / VG, n % VG);
// o keeps the usual columns (= heads) for the fp16 tail tiles. Both share m_i, l_i.
template <int D, int DSUB, bool BF16, int VG = 0>
struct WarpState {
  static constexpr int M = D / DSUB;
  static constexpr int KS = D / 16;     // k-steps of S = Q K^T
  static constexpr int NMT = D / 16;    // m-tiles of O^T
  static constexpr int NT = VG ? VG / 2 : 1;
  static constexpr int NHX = VG ? D / 64 : 1;
  float o[NMT][4];
  float ov[NHX][NT][4];
  float m_i, l_i;
};

// RESCALE_O false: o is known to be zero (the PQ tiles of VG, before any tail tile), so
// it need not stay live in registers through the PQ loop
template <int D, int DSUB, bool BF16, int VG, bool RESCALE_O = true>
__device__ __forceinline__ void softmax_pv(WarpState<D, DSUB, BF16, VG>& ws, float (&s)[2][4],
                                           const bool (&valid)[2][2], float qk_scale, int lane,
                                           u32& pb0, u32& pb1) {
  float x00 = valid[0][0] ? s[0][0] * qk_scale : NEG_INF;
  float x01 = valid[0][1] ? s[0][1] * qk_scale : NEG_INF;
  float x10 = valid[1][0] ? s[1][0] * qk_scale : NEG_INF;
  float x11 = valid[1][1] ? s[1][1] * qk_scale : NEG_INF;
  float mx = fmaxf(fmaxf(x00, x01), fmaxf(x10, x11));
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
  float m_new = fmaxf(ws.m_i, mx);
  float alpha = exp2f(ws.m_i - m_new);
  float p00 = exp2f(x00 - m_new), p01 = exp2f(x01 - m_new);
  float p10 = exp2f(x10 - m_new), p11 = exp2f(x11 - m_new);
  ws.l_i = ws.l_i * alpha + ((p00 + p01) + (p10 + p11));
  if (__any_sync(FULL, m_new > ws.m_i)) {
    int c = lane & 3;
    float a0 = __shfl_sync(FULL, alpha, (2 * c) * 4);
    float a1 = __shfl_sync(FULL, alpha, (2 * c + 1) * 4);
    if constexpr (RESCALE_O) {
#pragma unroll
      for (int mt = 0; mt < WarpState<D, DSUB, BF16, VG>::NMT; ++mt) {
        ws.o[mt][0] *= a0; ws.o[mt][1] *= a1; ws.o[mt][2] *= a0; ws.o[mt][3] *= a1;
      }
    }
    if constexpr (VG > 0) {
      const float b0 = __shfl_sync(FULL, alpha, ((2 * c) % VG) * 4);
      const float b1 = __shfl_sync(FULL, alpha, ((2 * c + 1) % VG) * 4);
#pragma unroll
      for (int hx = 0; hx < WarpState<D, DSUB, BF16, VG>::NHX; ++hx)
#pragma unroll
        for (int nt = 0; nt < WarpState<D, DSUB, BF16, VG>::NT; ++nt) {
          float* v = ws.ov[hx][nt];
          v[0] *= b0; v[1] *= b1; v[2] *= b0; v[3] *= b1;
        }
    }
  }
  ws.m_i = m_new;
  pb0 = pack2<BF16>(p00, p01);
  pb1 = pack2<BF16>(p10, p11);
}

template <int D, int DSUB, bool BF16, int VG>
__device__ __forceinline__ void pv_mma(WarpState<D, DSUB, BF16, VG>& ws, int X, int p, u32 w0, u32 w1,
                                       u32 w2, u32 w3, u32 pb0, u32 pb1) {
  u32 a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
  u32 a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
  mma16816<BF16>(ws.o[X * (DSUB / 2) + p], a0, a1, a2, a3, pb0, pb1);
}

// CF tables staged through registers: global [M][256] words -> the CF layouts (K word
// (code, m = c*MQ + 8hh + i) at code*256 + 4*(32hh + 4i + c); VG: V word (code, m) at
// 65536 + code*256 + 4m). A unit is 16 B of global = 4 codes of one subspace; lanes (r, s)
// of a warp read 16 subspaces x 32 contiguous bytes (whole sectors) and store each word to
// a bank that depends on the subspace only (16 distinct: 2 wavefronts per store). The
// units go in NB batches; a batch's loads are all in flight before its stores, and the
// kernel issues batch 0 at entry, before anything that waits on memory.
// (The cp.async4 copy it replaces, PQ_STAGE_ASYNC, spent ~11 us issuing: each 4-byte copy
// instruction touched 8 half-used sectors.)
#ifndef PQ_STAGE_NB
#define PQ_STAGE_NB 2
#endif
template <int M, int NW, int VG>
struct RegStager {
  static constexpr int MQ = M / 4, NT = NW * 32, U = M * 64;   // units per table
  static constexpr int UT = VG > 0 ? 2 * U : U;
  static constexpr int IT = (UT + NT - 1) / NT;
  static constexpr int NB = IT < PQ_STAGE_NB ? IT : PQ_STAGE_NB;
  static constexpr int BATCH = (IT + NB - 1) / NB;
  uint4 v[BATCH];
  u32 dst[BATCH];
  // rot (a multiple of 32, < UT): where this block starts in the tables, so that the
  // blocks of one head do not all ask the same L2 lines at the same time
  __device__ __forceinline__ void load(const u32* gk, const u32* gv, int tid, int i0, int rot) {
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int u0 = tid + (i0 + j) * NT;
      if (i0 + j < IT && u0 < UT) {
        const int u = u0 + rot < UT ? u0 + rot : u0 + rot - UT;
        const int uu = u % U, s = uu & 1, r = (uu >> 1) & 15, cg = (uu >> 5) & 31, mb = uu >> 10;
        const int code0 = 8 * cg + 4 * s;
        if (u < U) {   // K
          const int hh = mb % (MQ / 8), cpair = mb / (MQ / 8), i = r & 7, c = 2 * cpair + (r >> 3);
          dst[j] = code0 * 256 + 4 * (32 * hh + 4 * i + c);
          v[j] = __ldg(reinterpret_cast<const uint4*>(gk + (c * MQ + 8 * hh + i) * 256 + code0));
        } else {       // V
          dst[j] = 65536 + code0 * 256 + 4 * (16 * mb + r);
          v[j] = __ldg(reinterpret_cast<const uint4*>(gv + (16 * mb + r) * 256 + code0));
        }
      }
    }
  }
  __device__ __forceinline__ void store(unsigned char* smem, int tid, int i0) {
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int u = tid + (i0 + j) * NT;
      if (i0 + j < IT && u < UT) {
        u32* d = reinterpret_cast<u32*>(smem + dst[j]);
        d[0] = v[j].x; d[64] = v[j].y; d[128] = v[j].z; d[192] = v[j].w;
      }
    }
  }
};

// CF codebook image: the first 128 KiB of the CF kernel's shared memory (K and V tables in
// the layouts above) for one KV head, built once per codebook in global memory
// (cuda_pq.codebook_image); TMA kernels copy it with IMG_CHUNKS bulk copies.
constexpr u32 IMG_BYTES = 131072;
constexpr int IMG_CHUNKS = 8;

// Block of a sealed token t >= 0 and its row in that block. BS_POW2 (the instantiation
// cuda_pq.py picks when the cache's block size is a power of two, as it is in practice):
// shift and mask by bs_shift = log2(bs). Else one unsigned division each. (Session 5: a
// runtime `bs_shift >= 0 ? shift : divide` had the compiler compute both signed divisions
// and select, ~30 of the tile loop's ~474 instructions.)
template <bool BS_POW2>
__device__ __forceinline__ int bs_block(int t, int bs, int bs_shift) {
  return BS_POW2 ? t >> bs_shift : (int)((u32)t / (u32)bs);
}
template <bool BS_POW2>
__device__ __forceinline__ int bs_row(int t, int bs) {
  return BS_POW2 ? t & (bs - 1) : (int)((u32)t % (u32)bs);
}

template <int D, int DSUB, bool BF16, int NW, int GP, bool TMA, bool BS_POW2>
__global__ void __launch_bounds__(NW * 32, 1) pq_attn(
    const u16* q, long long sq_b, long long sq_h, const int* items, float* o_part,
    float* lse_part, const u8* kc, const u8* vc, long long skc_blk, long long skc_h,
    long long svc_blk, long long svc_h, const u16* kcb, const u16* vcb, const int* st,
    long long st_stride, const u16* tk, const u16* tv, long long stk_blk, long long stk_h,
    long long stk_t, long long stv_blk, long long stv_h, long long stv_t, const int* tt,
    long long tt_stride, float qk_scale, int hq, int g, int bs, int tbs, int bs_shift,
    const u8* img) {
  static_assert(GP == 0 || (DSUB == 2 && (GP == 2 || GP == 4 || GP == 8)), "GP: 0 or 2/4/8, dsub 2");
  static_assert(!TMA || GP > 0, "TMA: the CF layouts only");
  constexpr bool CF = GP > 0;
  constexpr int VG = GP == 2 || GP == 4 ? GP : 0;     // conflict-free V gathers too
#ifdef PQ_STAGE_ASYNC
  constexpr bool STAGE_REG = false;
#else
  constexpr bool STAGE_REG = CF && !TMA;
#endif
  AttnArgs a;
  a.q = q; a.sq_b = sq_b; a.sq_h = sq_h; a.items = items; a.n_items = 0;
  a.o_part = o_part; a.lse_part = lse_part; a.kc = kc; a.vc = vc; a.skc_blk = skc_blk;
  a.skc_h = skc_h; a.svc_blk = svc_blk; a.svc_h = svc_h; a.kcb = kcb; a.vcb = vcb; a.st = st;
  a.st_stride = st_stride; a.tk = tk; a.tv = tv; a.stk_blk = stk_blk; a.stk_h = stk_h;
  a.stk_t = stk_t; a.stv_blk = stv_blk; a.stv_h = stv_h; a.stv_t = stv_t; a.tt = tt;
  a.tt_stride = tt_stride; a.qk_scale = qk_scale; a.hq = hq; a.g = g; a.bs = bs; a.tbs = tbs;
  constexpr int M = D / DSUB, MQ = M / 4, KS = D / 16, NX = M / 8;
  typedef typename Ent<DSUB>::T E;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sK = reinterpret_cast<E*>(smem);
  // CF: K rows of 256 B per code (64 KiB, see the staging below), V after them
  E* sV = CF ? reinterpret_cast<E*>(smem + 65536) : sK + M * 256;

  const int item = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, cq = lane & 3;
#ifdef PQ_STAMPS
  PQ_STAMP(0);
  PQ_STAMP_X(10, pq_gtime());
  PQ_STAMP_X(9, pq_smid());
#endif
  // the first batch of codebook loads goes out before the item is known (they depend on
  // the head only; a block with no PQ tiles never uses them): its latency overlaps the
  // item's and the block table's
  constexpr int M_ = D / DSUB;
  RegStager<M_, NW, VG> stg;
  const u32* stg_k = reinterpret_cast<const u32*>(a.kcb) + (long long)h * M_ * 256;
  const u32* stg_v = reinterpret_cast<const u32*>(a.vcb) + (long long)h * M_ * 256;
#ifndef PQ_NO_ROT
  const int stg_rot = (int)((blockIdx.x * 544u) % (u32)RegStager<M_, NW, VG>::UT) & ~31;
#else
  const int stg_rot = 0;
#endif
  if constexpr (STAGE_REG) stg.load(stg_k, stg_v, tid, 0, stg_rot);
  // TMA: the head's codebook image in IMG_CHUNKS bulk copies (lanes of warp 0, each block
  // starting at its own chunk), at entry, before the item is known; every path below waits
  // for them before it leaves or reuses the shared memory. Their mbarrier sits 8 bytes
  // after the ring (cuda_pq._attn_smem); as a static __shared__ variable it moved the
  // dynamic shared memory by 16 bytes and the tile loop ran ~6 % slower (session 5).
  const u32 bar = (u32)__cvta_generic_to_shared(smem) + cf_ring_offset<D>() + NW * cf_stages(NW) * 32 * M_;
  if constexpr (TMA) {
    if (warp == 0) {
      if (lane == 0) {
        mbar_init(bar, 1);
        mbar_expect_tx(bar, IMG_BYTES);
      }
      __syncwarp();
      if (lane < IMG_CHUNKS) {
        constexpr u32 CH = IMG_BYTES / IMG_CHUNKS;
        const u32 c = (lane + blockIdx.x) % IMG_CHUNKS;
        bulk_g2s((u32)__cvta_generic_to_shared(smem) + c * CH, img + (long long)h * IMG_BYTES + c * CH,
                 CH, bar);
      }
    }
  }
  const int* it = a.items + item * 5;
  const int b = it[0], pq_lo = it[1], pq_hi = it[2], t_lo = it[3], t_hi = it[4];
  const int n_pq = (pq_hi - pq_lo) >> 4;
  const int n_tl = (t_hi - t_lo + 15) >> 4;
  if (n_pq == 0 && n_tl == 0) {   // padding item of a plan kept for update()
    if constexpr (TMA) if (warp == 0) mbar_wait(bar, 0);
    return;
  }
  const int G = a.g;
  // CF: the block ids of the ring prologue's tiles, in flight together (one at a time,
  // each of its copies waited a memory round trip on its table load)
  int bpre[cf_stages(NW)];
  if constexpr (CF) {
    const int* st_b0 = a.st + (long long)b * a.st_stride;
#pragma unroll
    for (int k = 0; k < cf_stages(NW); ++k) {
      const int tile = warp + k * NW, t0 = pq_lo + 16 * tile;
      bpre[k] = tile < n_pq ? st_b0[bs_block<BS_POW2>(t0, a.bs, bs_shift)] : 0;
    }
  }
#ifndef PQ_STAGE_LATE
  // batch 0 to shared memory as soon as it lands and batch 1 out behind it, so that its
  // round trip overlaps the q / block-table loads and the ring prologue below
  if constexpr (STAGE_REG) {
    if (n_pq > 0) {
      stg.store(smem, tid, 0);
      if constexpr (RegStager<M_, NW, VG>::NB > 1) stg.load(stg_k, stg_v, tid, RegStager<M_, NW, VG>::BATCH, stg_rot);
    }
  }
#endif

  // ---- q fragments (permuted coordinates), rows >= G are zero. CF loads them only
  // for the tail tiles (after the PQ tiles, which use the rotated quads below).
  u32 qa0[KS], qa2[KS];
  auto load_q = [&]() {
    const bool row_ok = gq < G;
    const u16* qr = a.q + (long long)b * a.sq_b + (long long)(h * G + (row_ok ? gq : 0)) * a.sq_h;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      int e0, e2;
      if (DSUB == 2) { e0 = 2 * (cq * MQ + 2 * ks); e2 = 2 * (cq * MQ + 2 * ks + 1); }
      else { e0 = 4 * (cq * MQ + ks); e2 = e0 + 2; }
      qa0[ks] = row_ok ? *reinterpret_cast<const u32*>(qr + e0) : 0u;
      qa2[ks] = row_ok ? *reinterpret_cast<const u32*>(qr + e2) : 0u;
    }
  };
  if constexpr (!CF) load_q();

  // ---- stage the codebooks of head h (swizzled)
  if (!TMA && n_pq > 0) {
    const E* gk = reinterpret_cast<const E*>(a.kcb) + (long long)h * M * 256;
    const E* gv = reinterpret_cast<const E*>(a.vcb) + (long long)h * M * 256;
    if constexpr (CF && STAGE_REG) {
      // staged with the ring prologue below (stage_tables_reg)
    } else if constexpr (CF) {
      // K word (code, pos) at byte code*256 + 4*pos, pos = 32*hh + 4*i + c holding
      // subspace m = c*MQ + 8*hh + i: the bank (pos mod 32) does not depend on the
      // code, so 32 lanes that fetch 32 distinct (i, c) never collide whatever their
      // codes. Unit (i, code, hh) fills the 4 words c = 0..3 of one 16 B chunk; the 8
      // units of a quarter warp differ in i, so the chunks take distinct banks.
      // Asynchronous copies: a thread has all of its words in flight at once (a
      // load-then-store loop waited one L2 round trip per unit), and the first code
      // tiles stream in behind them (the ring prologue below); one barrier after both.
      for (int u = tid; u < (MQ / 8) * 2048; u += NW * 32) {
        const int i = u & 7, code = (u >> 3) & 255, hh = u >> 11;
        unsigned char* dst = smem + code * 256 + hh * 128 + i * 16;
#pragma unroll
        for (int c = 0; c < 4; ++c) cp_async4(dst + 4 * c, gk + (c * MQ + 8 * hh + i) * 256 + code);
      }
    } else {
      // K: thread unit (r, code) -> 4 entries m = r + j*MQ -> smem r*1024 + code*4 + j
      for (int u = tid; u < MQ * 256; u += NW * 32) {
        int r = u >> 8, code = u & 255;
        E e[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) e[j] = gk[(r + j * MQ) * 256 + code];
        E* dst = sK + r * 1024 + code * 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = e[j];
      }
    }
    if constexpr (VG > 0 && STAGE_REG) {
    } else if constexpr (VG > 0) {
      // V word (code, m) at byte 65536 + code*256 + 4*m: as for K, the bank (m mod 32)
      // does not depend on the code. Unit (i, code, hh): words m = 4*(8*hh + i) + 0..3.
      for (int u = tid; u < (M / 32) * 2048; u += NW * 32) {
        const int i = u & 7, code = (u >> 3) & 255, hh = u >> 11, m0 = 4 * (8 * hh + i);
        unsigned char* dst = smem + 65536 + code * 256 + (8 * hh + i) * 16;
#pragma unroll
        for (int c = 0; c < 4; ++c) cp_async4(dst + 4 * c, gv + (m0 + c) * 256 + code);
      }
    } else
    // V: unit (X, code) -> 8 entries m = 8X + j -> smem X*2048 + code*8 + j
    for (int u = tid; u < NX * 256; u += NW * 32) {
      int X = u >> 8, code = u & 255;
      E e[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = gv[(8 * X + j) * 256 + code];
      E* dst = sV + X * 2048 + code * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = e[j];
    }
    if constexpr (CF && !STAGE_REG) cp_async_commit();
  }
  PQ_STAMP(1);
  if constexpr (!CF) __syncthreads();   // CF: after the ring prologue (PQ tiles below)

  WarpState<D, DSUB, BF16, VG> ws;
  auto zero_o = [&]() {
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) ws.o[mt][0] = ws.o[mt][1] = ws.o[mt][2] = ws.o[mt][3] = 0.f;
  };
  if constexpr (VG == 0) zero_o();
#pragma unroll
  for (int hx = 0; hx < WarpState<D, DSUB, BF16, VG>::NHX; ++hx)
#pragma unroll
    for (int nt = 0; nt < WarpState<D, DSUB, BF16, VG>::NT; ++nt)
      ws.ov[hx][nt][0] = ws.ov[hx][nt][1] = ws.ov[hx][nt][2] = ws.ov[hx][nt][3] = 0.f;
  ws.m_i = NEG_INF;
  ws.l_i = 0.f;

  const E* sKl = sK + cq;     // lane's K bank offset (m / MQ == cq)
  const E* sVl = sV + gq;     // lane's V subspace within an octet
  const u8* kc_h = a.kc + (long long)h * a.skc_h;
  const u8* vc_h = a.vc + (long long)h * a.svc_h;
  const int* st_b = a.st + (long long)b * a.st_stride;
  const bool alltrue[2][2] = {{true, true}, {true, true}};

  // ---- PQ tiles, codes prefetched one tile ahead
  {
    CodeVec<MQ> kn[2];
    u32 vn[NX];
    int ti = warp;
    // The block id of a tile is read two tiles ahead of its codes: a code load that
    // waits on the table load in the same step stalls the warp for a memory latency.
    auto blk_of = [&](int tile) -> long long {
      const int t0 = pq_lo + 16 * tile;
      return tile < n_pq ? st_b[bs_block<BS_POW2>(t0, a.bs, bs_shift)] : 0;
    };
    auto fetch = [&](int tile, long long blk, CodeVec<MQ> (&kk)[2], u32 (&vv)[NX]) {
      int t0 = pq_lo + 16 * tile;
      int off = bs_row<BS_POW2>(t0, a.bs);
      const u8* kb = kc_h + blk * a.skc_blk + cq * MQ;
#pragma unroll
      for (int t = 0; t < 2; ++t) load_codes<MQ>(kk[t], kb + (off + sigma(t, gq)) * M);
      const u8* vb = vc_h + blk * a.svc_blk + off + 4 * cq + gq * a.bs;
#pragma unroll
      for (int X = 0; X < NX; ++X) vv[X] = __ldg(reinterpret_cast<const u32*>(vb + 8 * X * a.bs));
    };
    // CF (K side). Gather j of a half fetches, in lane (gq, cq), byte i = (gq + j) & 7
    // of the half (subspace cq*MQ + 8*hh + i): the 8 lanes of one cq fetch 8 distinct
    // i, so one shared-memory wavefront per gather whatever the codes. Column gq of B
    // then holds its subspaces rotated by gq. rot_hi undoes the rotation's high bits
    // (select stages); its low bits (gq mod NR) are matched by the rows of A instead:
    // the 16 rows are NR rotated copies of the GP query heads (row GP*rho + head), so
    // copy rho = gq mod NR meets column gq, and the wanted scores are picked out of the
    // accumulator afterwards (one select and shuffle per score).
    // ksel: PRMT selectors rotating a half's code bytes by gq; klo: the low byte
    // 16*i + 4*cq of gather j's address, four per register (< 0x80, so sign nibbles
    // in the address PRMT give zero bytes 2 and 3).
    constexpr int NR = CF ? 16 / GP : 1;
    u32 qk[KS][4];
    u32 ksel[2], klo[2];
    if constexpr (CF) {
      const int hd = gq % GP, r0 = gq / GP, r1 = (gq + 8) / GP;
      const bool ok = hd < G;
      const u16* qr = a.q + (long long)b * a.sq_b + (long long)(h * G + (ok ? hd : 0)) * a.sq_h;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int base = cq * MQ + 8 * (ks / 4), kq = ks % 4;
        const int sub[4] = {base + ((r0 + 2 * kq) & 7), base + ((r1 + 2 * kq) & 7),
                            base + ((r0 + 2 * kq + 1) & 7), base + ((r1 + 2 * kq + 1) & 7)};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          qk[ks][e] = ok ? *reinterpret_cast<const u32*>(qr + 2 * sub[e]) : 0u;
      }
      ksel[0] = ((gq + 0) & 7) | ((gq + 1) & 7) << 4 | ((gq + 2) & 7) << 8 | ((gq + 3) & 7) << 12;
      ksel[1] = ((gq + 4) & 7) | ((gq + 5) & 7) << 4 | ((gq + 6) & 7) << 8 | ((gq + 7) & 7) << 12;
      klo[0] = klo[1] = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) klo[j >> 2] |= (16u * ((gq + j) & 7) + 4u * cq) << (8 * (j & 3));
      // opaque: kept in registers, not recomputed from the thread index every tile
      asm volatile("" : "+r"(ksel[0]), "+r"(ksel[1]), "+r"(klo[0]), "+r"(klo[1]));
    }
    const u32 vlane = (u32)__cvta_generic_to_shared(smem) + 65536u + 4u * gq;
    // VG (V side). Slot j of a group hx of four m-tiles: lane (gq, cq) gathers m-tile
    // X = 4*hx + ((cq + j) & 3), so the 4 lanes of one gq hit 4 distinct banks; its
    // code word comes from the ring in that order (vr[j]). The rotation by cq is undone
    // by the MMA's columns: column n = (c, h) = (n / VG, n % VG) takes P of head h only
    // on k rows whose lane has (cq + j) & 3 == c, so it sums m-tile 4*hx + c.
    // vlo: address byte 32*((cq+j)&3) + 4*gq of slot j, four per register (< 0x80).
    u32 vlo = 0u;
    if constexpr (VG > 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) vlo |= (32u * ((cq + j) & 3) + 4u * gq) << (8 * j);
      asm volatile("" : "+r"(vlo));
    }
    // two code buffers in turn (no register copies): tile ti uses one while the
    // other fills with tile ti + NW
    CodeVec<MQ> kn2[2];
    u32 vn2[NX];
    auto tile = [&](CodeVec<MQ> (&kk)[2], u32 (&vv)[NX]) {
      float s[2][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
      if constexpr (CF) {
        float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int hh = 0; hh < MQ / 8; ++hh) {
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const u32 c0 = kk[t].w[2 * hh], c1 = kk[t].w[(2 * hh + 1) % (MQ / 4)];
            const u32 rc[2] = {__byte_perm(c0, c1, ksel[0]), __byte_perm(c0, c1, ksel[1])};
            u32 f[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const u32 sel = (j & 3) | (4 + (j & 3)) << 4 | (8 + (j & 3)) << 8 | (8 + (j & 3)) << 12;
              const u32 ad = prmt(klo[j >> 2], rc[j >> 2], sel);     // code*256 + 16i + 4cq
              f[j] = *reinterpret_cast<const u32*>(smem + ad + 128 * hh);
            }
            rot_hi<NR>(f, gq);
            // two accumulator chains per n-tile (even / odd kq), summed below
#pragma unroll
            for (int kq = 0; kq < 4; ++kq) {
              const u32* qq = qk[4 * hh + kq];
              mma16816<BF16>(kq & 1 ? s2[t] : s[t], qq[0], qq[1], qq[2], qq[3], f[2 * kq],
                             f[2 * kq + 1]);
            }
          }
        }
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int r = 0; r < 4; ++r) s[t][r] += s2[t][r];
        // score (head gq, column 2cq+e) sits at row GP*((2cq+e) mod NR) + head of the
        // lane with the same cq: register c_e or c_{2+e}, lane 4*(row mod 8) + cq
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int x = (2 * cq + e) % NR;
          const bool hi = GP * x >= 8;
          const int src = 4 * ((GP * x + gq % GP) & 7) + cq;
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const float v = hi ? s[t][2 + e] : s[t][e];
            s[t][e] = NR == 2 ? v : __shfl_sync(FULL, v, src);
          }
        }
      } else {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          u32 b0, b1;
          if (DSUB == 2) {
            b0 = ent_word<DSUB>(sKl[(2 * ks) * 1024 + code_at<MQ>(kk[t], 2 * ks) * 4], 0);
            b1 = ent_word<DSUB>(sKl[(2 * ks + 1) * 1024 + code_at<MQ>(kk[t], 2 * ks + 1) * 4], 0);
          } else {
            E e = sKl[ks * 1024 + code_at<MQ>(kk[t], ks) * 4];
            b0 = ent_word<DSUB>(e, 0);
            b1 = ent_word<DSUB>(e, 1);
          }
          mma16816<BF16>(s[t], qa0[ks], 0u, qa2[ks], 0u, b0, b1);
        }
      }
      }
      u32 pb0, pb1;
      softmax_pv<D, DSUB, BF16, VG, VG == 0>(ws, s, alltrue, a.qk_scale, lane, pb0, pb1);
#pragma unroll
      if constexpr (VG > 0) {
        constexpr int NT = VG / 2;
        // P of head gq % VG in every lane: the B columns n = gq are (c, head) pairs
        const int psrc = 4 * (gq % VG) + cq;
        const u32 px0 = __shfl_sync(FULL, pb0, psrc), px1 = __shfl_sync(FULL, pb1, psrc);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          u32 bm0[NT], bm1[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const bool on = ((cq + j) & 3) == (8 * nt + gq) / VG;
            bm0[nt] = on ? px0 : 0u;
            bm1[nt] = on ? px1 : 0u;
          }
#pragma unroll
          for (int hx = 0; hx < D / 64; ++hx) {
            const u32 cw = vv[4 * hx + j];
            u32 w[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const u32 sel = j | (4 + k) << 4 | (8 + j) << 8 | (8 + j) << 12;
              w[k] = *reinterpret_cast<const u32*>(smem + prmt(vlo, cw, sel) + 65536 + 128 * hx);
            }
            const u32 a0 = __byte_perm(w[0], w[1], 0x5410), a1 = __byte_perm(w[0], w[1], 0x7632);
            const u32 a2 = __byte_perm(w[2], w[3], 0x5410), a3 = __byte_perm(w[2], w[3], 0x7632);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              mma16816<BF16>(ws.ov[hx][nt], a0, a1, a2, a3, bm0[nt], bm1[nt]);
          }
        }
      } else {
#pragma unroll
      for (int X = 0; X < NX; ++X) {
        const u32 v4 = vv[X];
        if constexpr (CF) {   // GP = 8: swizzled V table; code byte by PRMT, address by IMAD
          u32 w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            w[k] = lds32(__byte_perm(v4, 0u, 0x4440 | k) * 32u + (vlane + X * 8192u));
          pv_mma<D, DSUB, BF16, VG>(ws, X, 0, w[0], w[1], w[2], w[3], pb0, pb1);
        } else {
          E e0 = sVl[X * 2048 + (v4 & 0xff) * 8];
          E e1 = sVl[X * 2048 + ((v4 >> 8) & 0xff) * 8];
          E e2 = sVl[X * 2048 + ((v4 >> 16) & 0xff) * 8];
          E e3 = sVl[X * 2048 + (v4 >> 24) * 8];
#pragma unroll
          for (int p = 0; p < DSUB / 2; ++p)
            pv_mma<D, DSUB, BF16, VG>(ws, X, p, ent_word<DSUB>(e0, p), ent_word<DSUB>(e1, p),
                                      ent_word<DSUB>(e2, p), ent_word<DSUB>(e3, p), pb0, pb1);
        }
      }
      }
    };
    if constexpr (CF) {
      // ring of STAGES tiles per warp after the codebooks: [K codes 16 x M][V codes M x 16]
      constexpr u32 TILE = 32 * M;
      constexpr int STAGES = cf_stages(NW);
      unsigned char* ring = smem + cf_ring_offset<D>() + warp * STAGES * TILE;
      // lane constants, kept in registers (opaque) rather than rebuilt every tile
      u32 kdst = 16 * lane, krd0 = sigma(0, gq) * M + cq * MQ, krd1 = sigma(1, gq) * M + cq * MQ;
      u32 vrd = 16 * M + gq * 16 + 4 * cq;
      long long vsrc = (long long)lane * a.bs;
      asm volatile("" : "+r"(kdst), "+r"(krd0), "+r"(krd1), "+r"(vrd), "+l"(vsrc));
      u32 vr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) vr[j] = vrd + 128 * ((cq + j) & 3);
      if constexpr (VG > 0) asm volatile("" : "+r"(vr[0]), "+r"(vr[1]), "+r"(vr[2]), "+r"(vr[3]));
      auto issue = [&](int tile, long long blk, u32 stage_off) {
        if (tile < n_pq) {
          const int t0 = pq_lo + 16 * tile;
          const int off = bs_row<BS_POW2>(t0, a.bs);
          unsigned char* dst = ring + stage_off + kdst;
          const u8* kb = kc_h + blk * a.skc_blk + off * M + kdst;   // 16 rows, contiguous
          const u8* vb = vc_h + blk * a.svc_blk + off + vsrc;       // M rows of 16 B, stride bs
#pragma unroll
          for (int c = 0; c < M / 32; ++c) {
            cp_async16(dst + 512 * c, kb + 512 * c);
            cp_async16(dst + 16 * M + 512 * c, vb + (long long)(32 * c) * a.bs);
          }
        }
        cp_async_commit();      // empty groups too: the wait count stays uniform
      };
      // bpre: the block ids of the prologue's tiles, loaded at entry
#pragma unroll
      for (int k = 0; k < STAGES - 1; ++k) issue(warp + k * NW, bpre[k], k * TILE);
      long long bn = bpre[STAGES - 1];
      PQ_STAMP(2);
      if constexpr (STAGE_REG) {
        if (n_pq > 0) {
#ifdef PQ_STAGE_LATE
          stg.store(smem, tid, 0);
#pragma unroll
          for (int nb = 1; nb < RegStager<M, NW, VG>::NB; ++nb) {
            stg.load(stg_k, stg_v, tid, nb * RegStager<M, NW, VG>::BATCH, stg_rot);
            stg.store(smem, tid, nb * RegStager<M, NW, VG>::BATCH);
          }
#else
#pragma unroll
          for (int nb = 1; nb < RegStager<M, NW, VG>::NB; ++nb) {
            if (nb > 1) stg.load(stg_k, stg_v, tid, nb * RegStager<M, NW, VG>::BATCH, stg_rot);
            stg.store(smem, tid, nb * RegStager<M, NW, VG>::BATCH);
          }
#endif
        }
      }
      // the codebook copies (the oldest group, when this item has PQ tiles) are done
      if constexpr (TMA) {
        __syncthreads();                        // the mbarrier's init is seen by every warp
        if (n_pq > 0) mbar_wait(bar, 0);
      } else {
        cp_async_wait<STAGES - 1>();
        __syncthreads();
      }
      PQ_STAMP(3);
      u32 rd = 0, wr = (STAGES - 1) * TILE;      // stage offsets, advanced with wrap
      for (int k = 0; warp + k * NW < n_pq; ++k) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();           // tile k landed for every lane; stage (k - 1) is free
        {
          const long long bc = bn;
          bn = blk_of(warp + (k + STAGES) * NW);
          issue(warp + (k + STAGES - 1) * NW, bc, wr);
          wr = wr == (STAGES - 1) * TILE ? 0 : wr + TILE;
        }
        const unsigned char* st = ring + rd;
        rd = rd == (STAGES - 1) * TILE ? 0 : rd + TILE;
        CodeVec<MQ> kk[2];
        u32 vv[NX];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const unsigned char* row = st + (t ? krd1 : krd0);
          if constexpr (MQ == 16) {
            const uint4 x = *reinterpret_cast<const uint4*>(row);
            kk[t].w[0] = x.x; kk[t].w[1] = x.y; kk[t].w[2 % (MQ / 4)] = x.z; kk[t].w[3 % (MQ / 4)] = x.w;
          } else {
            const uint2 x = *reinterpret_cast<const uint2*>(row);
            kk[t].w[0] = x.x; kk[t].w[1 % (MQ / 4)] = x.y;
          }
        }
        if constexpr (VG > 0) {     // slot order: vv[4*hx + j] is m-tile 4*hx + ((cq+j)&3)
#pragma unroll
          for (int hx = 0; hx < D / 64; ++hx)
#pragma unroll
            for (int j = 0; j < 4; ++j)
              vv[4 * hx + j] = *reinterpret_cast<const u32*>(st + vr[j] + 512 * hx);
        } else {
#pragma unroll
          for (int X = 0; X < NX; ++X)
            vv[X] = *reinterpret_cast<const u32*>(st + vrd + 128 * X);
        }
        tile(kk, vv);
#ifdef PQ_STAMPS
        if (k == 0) PQ_STAMP(4);
        PQ_STAMP_X(12, k + 1);
#endif
      }
      cp_async_wait<0>();
      PQ_STAMP(5);
    } else {
    long long bA = blk_of(ti), bB = blk_of(ti + NW);
    if (ti < n_pq) fetch(ti, bA, kn, vn);
    bA = blk_of(ti + 2 * NW);
    for (; ti < n_pq; ti += 2 * NW) {
      if (ti + NW < n_pq) fetch(ti + NW, bB, kn2, vn2);
      bB = blk_of(ti + 3 * NW);
      tile(kn, vn);
      if (ti + NW >= n_pq) break;
      if (ti + 2 * NW < n_pq) fetch(ti + 2 * NW, bA, kn, vn);
      bA = blk_of(ti + 4 * NW);
      tile(kn2, vn2);
    }
    }
  }

  if constexpr (VG > 0) zero_o();   // o starts here: the PQ tiles used ov
  // ---- fp16/bf16 tail tiles (dense), same warp state
  if (n_tl > 0) {
    if constexpr (CF) load_q();
    const int* tt_b = a.tt + (long long)b * a.tt_stride;
    // tiles continue the round robin after the PQ tiles
    int first = warp - (n_pq % NW);
    if (first < 0) first += NW;
    // tail blocks are powers of two in practice: shifts, not divisions (the tail tiles are
    // a single warp's serial chain at the end of the longest block: every instruction counts)
    const int tsh = (a.tbs & (a.tbs - 1)) == 0 ? __ffs(a.tbs) - 1 : -1;
    for (int ti = first; ti < n_tl; ti += NW) {
      const int t0 = t_lo + 16 * ti;
      float s[2][4];
      bool valid[2][2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
        valid[t][0] = t0 + sigma(t, 2 * cq) < t_hi;
        valid[t][1] = t0 + sigma(t, 2 * cq + 1) < t_hi;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        int tok = t0 + sigma(t, gq);
        bool ok = tok < t_hi;
        const u16* row = a.tk;
        if (ok) {
          long long blk = tt_b[tsh >= 0 ? tok >> tsh : tok / a.tbs];
          row = a.tk + blk * a.stk_blk + (long long)h * a.stk_h + (long long)(tsh >= 0 ? tok & (a.tbs - 1) : tok % a.tbs) * a.stk_t;
        }
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          u32 b0 = 0, b1 = 0;
          if (ok) {
            if (DSUB == 2) {
              b0 = *reinterpret_cast<const u32*>(row + 2 * (cq * MQ + 2 * ks));
              b1 = *reinterpret_cast<const u32*>(row + 2 * (cq * MQ + 2 * ks + 1));
            } else {
              uint2 e = *reinterpret_cast<const uint2*>(row + 4 * (cq * MQ + ks));
              b0 = e.x; b1 = e.y;
            }
          }
          mma16816<BF16>(s[t], qa0[ks], 0u, qa2[ks], 0u, b0, b1);
        }
      }
      u32 pb0, pb1;
      softmax_pv<D, DSUB, BF16, VG>(ws, s, valid, a.qk_scale, lane, pb0, pb1);
      const u16* vrow[4];
      bool vok[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int tok = t0 + 4 * cq + k;
        vok[k] = tok < t_hi;
        vrow[k] = a.tv;
        if (vok[k]) {
          long long blk = tt_b[tsh >= 0 ? tok >> tsh : tok / a.tbs];
          vrow[k] = a.tv + blk * a.stv_blk + (long long)h * a.stv_h + (long long)(tsh >= 0 ? tok & (a.tbs - 1) : tok % a.tbs) * a.stv_t;
        }
      }
#pragma unroll
      for (int X = 0; X < NX; ++X) {
        E e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (vok[k]) e[k] = *reinterpret_cast<const E*>(vrow[k] + DSUB * (8 * X + gq));
          else e[k] = E();
        }
#pragma unroll
        for (int p = 0; p < DSUB / 2; ++p)
          pv_mma<D, DSUB, BF16, VG>(ws, X, p, ent_word<DSUB>(e[0], p), ent_word<DSUB>(e[1], p),
                                ent_word<DSUB>(e[2], p), ent_word<DSUB>(e[3], p), pb0, pb1);
      }
    }
  }

  // ---- combine the warps of the block through shared memory
  PQ_STAMP(6);
  float l = ws.l_i;
  l += __shfl_xor_sync(FULL, l, 1);
  l += __shfl_xor_sync(FULL, l, 2);
  if constexpr (TMA) if (n_pq == 0) mbar_wait(bar, 0);   // a tail-only block's copies landed
  __syncthreads();                                     // codebooks no longer needed
  PQ_STAMP(7);
  // rows of SD = D + 4 floats, coordinate pairs as 8-byte stores: the 16 lanes of a phase
  // (gq < 4 or >= 4, any cq) take 32 distinct banks (2*cq*SD = 8*cq mod 32); with rows of D
  // the four cq of a gq hit one bank (4-way on every store)
  constexpr int SD = D + 4;
  float* so = reinterpret_cast<float*>(smem);          // [NW][8][SD]
  float* sm = so + NW * 8 * SD;                        // [NW][8]
  float* sl = sm + NW * 8;                             // [NW][8]
  if (cq == 0) { sm[warp * 8 + gq] = ws.m_i; sl[warp * 8 + gq] = l; }
  float* base = so + warp * 8 * SD;
#pragma unroll
  for (int X = 0; X < NX; ++X) {
#pragma unroll
    for (int p = 0; p < DSUB / 2; ++p) {
      const float* c = ws.o[X * (DSUB / 2) + p];
      const int coord = (8 * X + gq) * DSUB + 2 * p;
      *reinterpret_cast<float2*>(base + (2 * cq) * SD + coord) = make_float2(c[0], c[2]);
      *reinterpret_cast<float2*>(base + (2 * cq + 1) * SD + coord) = make_float2(c[1], c[3]);
    }
  }
  if constexpr (VG > 0) {   // the PQ tiles' part: column n = 2cq + e of n-tile nt is (c, h)
    __syncwarp();
#pragma unroll
    for (int hx = 0; hx < D / 64; ++hx)
#pragma unroll
      for (int nt = 0; nt < VG / 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = 8 * nt + 2 * cq + e, c = n / VG, hd = n % VG;
          const int coord = 2 * (8 * (4 * hx + c) + gq);
          float2* pp = reinterpret_cast<float2*>(base + hd * SD + coord);
          float2 x = *pp;
          x.x += ws.ov[hx][nt][e];
          x.y += ws.ov[hx][nt][2 + e];
          *pp = x;
        }
  }
  __syncthreads();
  for (int e = tid; e < G * D; e += NW * 32) {
    int hd = e / D, coord = e % D;
    float mm = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) mm = fmaxf(mm, sm[w * 8 + hd]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      float wt = exp2f(sm[w * 8 + hd] - mm);        // empty warps: exp2(-inf) = 0
      L += sl[w * 8 + hd] * wt;
      O += so[(w * 8 + hd) * SD + coord] * wt;
    }
    long long row = (long long)item * a.hq + h * G + hd;
    a.o_part[row * D + coord] = O / L;
    if (coord == 0) a.lse_part[row] = mm + log2f(L);
  }
#ifdef PQ_STAMPS
  PQ_STAMP(8);
  PQ_STAMP_X(11, pq_gtime());
#endif
}

// Log-sum-exp merge of the partials of one (sequence, query head); base-2 lse in.
template <int D, bool BF16>
__global__ void pq_merge(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                         const int* __restrict__ item_ptr, u16* out, long long so_b,
                         long long so_h, float* lse, long long sl_b, int hq) {
  const int b = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int lo = item_ptr[b], hi = item_ptr[b + 1];
  // batches of 8 independent loads (a loop of one load per step waited an L2 round trip
  // per item: ~3.6 us at 16 items)
  constexpr int NBT = 8;
  float mm = NEG_INF;
  for (int i0 = lo; i0 < hi; i0 += NBT) {
    float x[NBT];
#pragma unroll
    for (int j = 0; j < NBT; ++j) x[j] = i0 + j < hi ? lse_part[(long long)(i0 + j) * hq + head] : NEG_INF;
#pragma unroll
    for (int j = 0; j < NBT; ++j) mm = fmaxf(mm, x[j]);
  }
  float L = 0.f, O = 0.f;
  if (hi > lo) {
    for (int i0 = lo; i0 < hi; i0 += NBT) {
      float x[NBT], o[NBT];
#pragma unroll
      for (int j = 0; j < NBT; ++j) {
        const long long row = (long long)(i0 + j) * hq + head;
        x[j] = i0 + j < hi ? lse_part[row] : NEG_INF;
        o[j] = i0 + j < hi ? o_part[row * D + d] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < NBT; ++j) {
        const float w = exp2f(x[j] - mm);
        L += w;
        O += w * o[j];
      }
    }
    O /= L;
  }
  out[(long long)b * so_b + (long long)head * so_h + d] = to16<BF16>(O);
  if (d == 0)
    lse[(long long)b * sl_b + head] = hi > lo ? (mm + log2f(L)) * 0.6931471805599453f : NEG_INF;
}

// ------------------------------------------------------------------ PQ encode
// grid (ceil(N / (32*T)), Hkv, M / MG), block MG warps: warp w <-> subspace
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
    long long so_off, long long so_m, int N, int M, int bs) {
  constexpr int F4 = DSUB == 2 ? 1 : 2;
  __shared__ float4 sc[MG * 256 * F4];
  const int h = blockIdx.y, m0 = blockIdx.z * MG;
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
        long long o = (long long)n * sx_n + (long long)h * sx_h + m * DSUB + j;
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
      codes[blk * so_blk + (long long)h * so_h + off * so_off + (long long)m * so_m] =
          (u8)(__float_as_int(best[t]) & 255);
    }
  }
}

// ------------------------------------------------- PQ encode through cell tables (dsub 2)
// Tables and why they are exact: kernels/pq_cells.py. grid (M / 16, token chunks, Hkv),
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
    const float2* __restrict__ cents,   // [Hkv, M, 256] (c0, c1) fp32
    const float* __restrict__ bps,      // [Hkv, M, 2, G + 1]
    const u8* __restrict__ recs,        // [Hkv, M, G * G, CMAX + 1]
    const void* __restrict__ slots, u8* codes, long long so_blk, long long so_h,
    long long so_off, long long so_m, int N, int M, int bs, int tok_per_block, int vec_store) {
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
  const long long xoff = (long long)h * sx_h + 2 * (m0 + 4 * q);
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
      u8* dst = codes + blk * so_blk + (long long)h * so_h + off * so_off + (long long)(m0 + 4 * q) * so_m;
      if (vec_store) {
        *reinterpret_cast<u32*>(dst) = code4;
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) dst[s * so_m] = (u8)(code4 >> (8 * s));
      }
    }
  }
}
