// What the PQ attention kernel (attention.cu) is built from: its shared-memory plan, the
// per-lane code and codebook-entry types, the per-warp online-softmax state and its P.V
// step, and the register staging of the codebooks. Layouts and why: attention.cu's top.
#include "common.cuh"

// CF shared memory: K table (64 KiB: 256-byte code rows), V table (64 KiB region), then
// each warp's ring of code tiles (cf_stages x 32*M bytes: 4 deep up to 12 warps, else
// 3, to fit 227 KiB at d = 128, dsub 2); attention.py _attn_smem mirrors this.
// dsub 4: the rings first (at most 48 KiB), then the two tables at the shared-window
// addresses T4_K and T4_V: a gather's address is then its PRMT result plus an immediate
// (from `smem + x` the compiler adds the window base of smem in one more instruction).
// That holds while the window base of smem (1 KiB: the system's reserved shared memory,
// sm_80 to sm_90) leaves the rings below T4_K; the kernel checks it at entry.
__host__ __device__ constexpr int cf_stages(int nw) { return nw <= 12 ? 4 : 3; }
// SPLIT builds (head_dim 256 as two CTAs of 128, below) also hold the score exchange
// (xchg_bytes): one ring stage fewer past 8 warps, two fewer past 12, to stay in 227 KiB.
__host__ __device__ constexpr int cf_stages(int nw, int split) {
  return split == 1 ? cf_stages(nw) : nw <= 8 ? 4 : nw <= 12 ? 3 : 2;
}
// per warp: two 512-byte slots (32 lanes x 4 partial scores) and their two mbarriers
__host__ __device__ constexpr int xchg_bytes(int nw) { return nw * (1024 + 16); }
template <int D, int DSUB = 2>
__host__ __device__ constexpr int cf_ring_offset() { return DSUB == 4 ? 0 : 131072; }
constexpr u32 T4_K = 65536, T4_V = 131072;
// dsub 2 (4-bit, one CTA): the tables sit at the start of dynamic shared memory, whose
// shared-window address is the 1 KiB reserved per block (sm_80 to sm_90; the router asks
// the device, build.reserved_smem, and the kernel checks at entry). A gather is then one
// PRMT and one `LDS [reg + imm]`: from `smem + x` the compiler added the window base in
// one more instruction a gather.
constexpr u32 T2_K = 1024, T2_V = T2_K + 65536;

// 8-byte load / store at a shared-window address plus an immediate
template <u32 OFF>
__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 r;
  asm("ld.shared.v2.b32 {%0, %1}, [%2+%3];" : "=r"(r.x), "=r"(r.y) : "r"(addr), "n"(OFF));
  return r;
}
template <u32 OFF>
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm("ld.shared.b32 %0, [%1+%2];" : "=r"(r) : "r"(addr), "n"(OFF));
  return r;
}
__device__ __forceinline__ void sts64(u32 addr, u32 x, u32 y) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(addr), "r"(x), "r"(y) : "memory");
}

// token of column n of S n-tile t (and of P^T k-row)
__device__ __forceinline__ int sigma(int t, int n) { return 4 * (n >> 1) + 2 * t + (n & 1); }
// Byte x of a code-ring stage (K rows of M bytes, then V rows of 16) sits at rsw<M>(x).
// Lane (gq, cq) reads K row sigma(t, gq) at byte cq * M / 4: at M = 32 rows 0 and 4 of a
// half-warp's 8-byte reads share banks, at M = 16 rows 0 and 8 of the warp's 4-byte
// reads, a two-way conflict on every read (ncu: 4 wavefronts for 2). Flipping bit 6
// (M = 32) or bit 5 (M = 16) by bit 7 separates them, moves whole 16-byte copies, and
// keeps the V reads (row gq + 8X, 4 bytes at 4cq) on 32 distinct banks.
template <int M>
__host__ __device__ constexpr u32 rsw(u32 x) {
  return M == 32 ? x ^ ((x >> 1) & 64u) : M == 16 ? x ^ ((x >> 2) & 32u) : x;
}

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

// dsub 4: r[i] <- r[4*(i/4) + (i - s) % 4] with s = gq mod 4 minus its bits below NR:
// the rotation of each quad of K gathers above what the A row copies undo (selects)
template <int NR, int N>
__device__ __forceinline__ void rot_quads(uint2 (&r)[N], int gq) {
#pragma unroll
  for (int v = NR; v < 4; v *= 2) {
    const bool on = gq & v;
    uint2 t[N];
#pragma unroll
    for (int i = 0; i < N; ++i) t[i] = on ? r[(i & ~3) | ((i - v) & 3)] : r[i];
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = t[i];
  }
}

// ---- head_dim 256 as a cluster of two CTAs (SPLIT = 2): CTA `half` of a (work item, KV
// head) holds the codebooks of coordinates [128*half, 128*half + 128) (its 64 KiB K and V
// tables, as a d = 128 head's) and computes each tile's scores over its half; a warp sends
// its 4 partial scores per lane to the same warp of the other CTA (st.async into that
// CTA's shared memory, completing on its mbarrier) and adds the ones it receives. Both
// CTAs then hold the same scores (a + b == b + a in IEEE), so the same softmax, and each
// accumulates its half of O. The whole d = 256 codebook pair (256 KiB) never has to fit
// one SM's shared memory, and the codes are still read once.
__device__ __forceinline__ u32 mapa(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// One warp's side of the exchange. Exchange k uses slot k % 2 (buffer and mbarrier) at
// parity (k / 2) % 2. A slot is written again (exchange k + 2) only after the other warp
// received exchange k + 1, which this warp sends after it read exchange k: two slots never
// race. The receiver's expect_tx may come before or after the sender's bytes (the
// mbarrier's tx-count goes negative in between); the phase completes with both.
struct Xchg {
  u32 lbuf, lbar, rbuf, rbar;   // this lane's 16 B in slot 0 (local, remote); the slot-0 mbarriers
  u32 k;
  __device__ __forceinline__ void init(u32 xbuf, u32 xbar, int warp, int lane, u32 peer) {
    lbuf = xbuf + warp * 1024 + lane * 16;
    lbar = xbar + warp * 16;
    rbuf = mapa(lbuf, peer);
    rbar = mapa(lbar, peer);
    k = 0;
#if __CUDA_ARCH__ >= 900
    if (lane == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(lbar) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(lbar + 8) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
  }
  // s[t][0..1]: this lane's two scores of n-tile t, partial in, whole out
  __device__ __forceinline__ void operator()(float (&s)[2][4], int lane) {
#if __CUDA_ARCH__ >= 900
    const u32 so = (k & 1) * 512, bo = (k & 1) * 8, par = (k >> 1) & 1;
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 512;" :: "r"(lbar + bo) : "memory");
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(rbuf + so), "f"(s[0][0]), "f"(s[0][1]), "f"(s[1][0]), "f"(s[1][1]), "r"(rbar + bo)
                 : "memory");
    mbar_wait(lbar + bo, par);
    float4 p;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(p.x), "=f"(p.y), "=f"(p.z), "=f"(p.w) : "r"(lbuf + so) : "memory");
    s[0][0] += p.x; s[0][1] += p.y; s[1][0] += p.z; s[1][1] += p.w;
    ++k;
#endif
  }
};

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

// Logit soft-capping in the kernel's base-2 units: a score x = s * scale * log2(e) becomes
// cap2 * tanh(x / cap2), cap2 = softcap * log2(e) (softcap * tanh(s * scale / softcap),
// scaled by log2(e) on both sides). tanh(t) = 1 - 2 / (e^2t + 1), e^2t = exp2(x * k2) with
// k2 = 2 log2(e) / cap2 = 2 / softcap: it saturates to +-1 without overflow (e^2t -> inf or
// 0; the fast division's 0 for a denominator past 2^126 is the limit too). tanh.approx
// (one MUFU op) was not taken: its 2^-11 relative error is ~0.035 of a base-2 score at
// Gemma-2's cap of 50, a 2.4 % error on a softmax weight.
struct SoftCap {
  float cap2, k2;
  __device__ __forceinline__ float operator()(float x) const {
    return cap2 - 2.f * cap2 / (exp2f(x * k2) + 1.f);
  }
};

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
  int hq, g, bs, tbs;                      // hq, g: query rows an item / a KV head (pq_attn_body)
  SoftCap cap;                             // read by the CAP builds only
};

// Everything per warp for one 16-token tile once its K/V entries are known.
// VG > 0 (conflict-free V gathers, G <= VG in {2, 4}; dsub 4 also 8): the PQ tiles
// accumulate O^T in ov, whose 8 * NT columns are (m-tile c of a group of four, head h) =
// (n / VG, n % VG); ov[hx] is a group of four m-tiles (dsub 2) or the coordinate pair hx
// of every subspace's four (dsub 4). o keeps the usual columns (= heads) for the fp16
// tail tiles. Both share m_i, l_i.
template <int D, int DSUB, bool BF16, int VG = 0>
struct WarpState {
  static constexpr int M = D / DSUB;
  static constexpr int KS = D / 16;     // k-steps of S = Q K^T
  static constexpr int NMT = D / 16;    // m-tiles of O^T
  static constexpr int NT = VG ? VG / 2 : 1;
  static constexpr int NHX = VG ? (DSUB == 2 ? D / 64 : 2) : 1;
  float o[NMT][4];
  float ov[NHX][NT][4];
  float m_i, l_i;
};

// RESCALE_O false: o is known to be zero (the PQ tiles of VG, before any tail tile), so
// it need not stay live in registers through the PQ loop. CAP: soft-cap the scores (cap).
// NN n-tiles of 8 tokens: 2 (one 16-token tile) or 4 (two tiles sharing one max and one
// rescale of O); pb[t]: P of n-tile t in the A layout of P.V.
template <int D, int DSUB, bool BF16, int VG, bool RESCALE_O, bool CAP, int NN, bool SAFE = false>
__device__ __forceinline__ void softmax_pvn(WarpState<D, DSUB, BF16, VG>& ws, float (&s)[NN][4],
                                            const bool (&valid)[NN][2], float qk_scale, int lane,
                                            u32 (&pb)[NN], const SoftCap& cap) {
  auto score = [&](float v) {
    const float x = v * qk_scale;
    if constexpr (CAP) return cap(x);
    else return x;
  };
  float x[NN][2], r[NN];
#pragma unroll
  for (int t = 0; t < NN; ++t) {
    x[t][0] = valid[t][0] ? score(s[t][0]) : NEG_INF;
    x[t][1] = valid[t][1] ? score(s[t][1]) : NEG_INF;
  }
#pragma unroll
  for (int t = 0; t < NN; ++t) r[t] = fmaxf(x[t][0], x[t][1]);
#pragma unroll
  for (int w = 1; w < NN; w *= 2)      // a tree: n-tile pairs first
#pragma unroll
    for (int t = 0; t < NN; t += 2 * w) r[t] = fmaxf(r[t], r[t + w]);
  float mx = r[0];
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
  float m_new = fmaxf(ws.m_i, mx);
  // SAFE: a row with no valid score yet (m_new -inf) gets alpha 0 and p 0, not NaN
  const float m_sub = SAFE && m_new == NEG_INF ? 0.f : m_new;
  float alpha = exp2f(ws.m_i - m_sub);
  float p[NN][2];
#pragma unroll
  for (int t = 0; t < NN; ++t) {
    p[t][0] = exp2f(x[t][0] - m_sub);
    p[t][1] = exp2f(x[t][1] - m_sub);
  }
#pragma unroll
  for (int t = 0; t < NN; ++t) r[t] = p[t][0] + p[t][1];
#pragma unroll
  for (int w = 1; w < NN; w *= 2)
#pragma unroll
    for (int t = 0; t < NN; t += 2 * w) r[t] = r[t] + r[t + w];
  ws.l_i = ws.l_i * alpha + r[0];
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
#pragma unroll
  for (int t = 0; t < NN; ++t) pb[t] = pack2<BF16>(p[t][0], p[t][1]);
}

// one 16-token tile
template <int D, int DSUB, bool BF16, int VG, bool RESCALE_O = true, bool CAP = false, bool SAFE = false>
__device__ __forceinline__ void softmax_pv(WarpState<D, DSUB, BF16, VG>& ws, float (&s)[2][4],
                                           const bool (&valid)[2][2], float qk_scale, int lane,
                                           u32& pb0, u32& pb1, const SoftCap& cap) {
  u32 pb[2];
  softmax_pvn<D, DSUB, BF16, VG, RESCALE_O, CAP, 2, SAFE>(ws, s, valid, qk_scale, lane, pb, cap);
  pb0 = pb[0];
  pb1 = pb[1];
}

template <int D, int DSUB, bool BF16, int VG>
__device__ __forceinline__ void pv_mma(WarpState<D, DSUB, BF16, VG>& ws, int X, int p, u32 w0, u32 w1,
                                       u32 w2, u32 w3, u32 pb0, u32 pb1) {
  u32 a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
  u32 a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
  mma16816<BF16>(ws.o[X * (DSUB / 2) + p], a0, a1, a2, a3, pb0, pb1);
}

// CF tables staged through registers: global [M][256] words -> the CF layouts. The
// batching both register stagers share: UT units of 16 B over NW warps, in NB = 2 batches
// whose loads are all in flight before their stores (the kernel issues batch 0 at entry,
// before anything that waits on memory). Map says where unit u comes from (global) and
// goes (shared memory) in its layout. (4-byte cp.async copies of the same words spent
// ~11 us issuing: each touched 8 half-used sectors.)
template <class Map, int NW>
struct RegBatches {
  static constexpr int NT = NW * 32, UT = Map::UT;
  static constexpr int IT = (UT + NT - 1) / NT;
  static constexpr int NB = IT < 2 ? IT : 2;
  static constexpr int BATCH = (IT + NB - 1) / NB;
  uint4 v[BATCH];
  u32 dst[BATCH];
  // rot (a multiple of 32, < UT): where this block starts in the tables, so that the
  // blocks of one head do not all ask the same L2 lines at the same time. wb: the shared
  // window's rank bits (attention.cu), added to fixed table addresses.
  __device__ __forceinline__ void load(const u32* gk, const u32* gv, int tid, int i0, int rot, u32 wb) {
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int u0 = tid + (i0 + j) * NT;
      if (i0 + j < IT && u0 < UT) {
        const int u = u0 + rot < UT ? u0 + rot : u0 + rot - UT;
        Map::unit(u, gk, gv, wb, dst[j], v[j]);
      }
    }
  }
  __device__ __forceinline__ void store(unsigned char* smem, int tid, int i0) {
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int u = tid + (i0 + j) * NT;
      if (i0 + j < IT && u < UT) Map::put(smem, dst[j], v[j]);
    }
  }
};

// dsub 2: K word (code, m = c*MQ + 8hh + i) at code*256 + 4*(32hh + 4i + c); VG: V word
// (code, m) at 65536 + code*256 + 4m. A unit is 16 B of global = 4 codes of one subspace; lanes (r, s) of a warp read
// 16 subspaces x 32 contiguous bytes (whole sectors) and store each word to a bank that
// depends on the subspace only (16 distinct: 2 wavefronts per store).
template <int M, int VG>
struct CfMap {
  static constexpr int MQ = M / 4, U = M * 64;   // units per table
  static constexpr int UT = VG > 0 ? 2 * U : U;
  static __device__ __forceinline__ void unit(int u, const u32* gk, const u32* gv, u32, u32& dst, uint4& v) {
    const int uu = u % U, s = uu & 1, r = (uu >> 1) & 15, cg = (uu >> 5) & 31, mb = uu >> 10;
    const int code0 = 8 * cg + 4 * s;
    if (u < U) {   // K
      const int hh = mb % (MQ / 8), cpair = mb / (MQ / 8), i = r & 7, c = 2 * cpair + (r >> 3);
      dst = code0 * 256 + 4 * (32 * hh + 4 * i + c);
      v = __ldg(reinterpret_cast<const uint4*>(gk + (c * MQ + 8 * hh + i) * 256 + code0));
    } else {       // V
      dst = 65536 + code0 * 256 + 4 * (16 * mb + r);
      v = __ldg(reinterpret_cast<const uint4*>(gv + (16 * mb + r) * 256 + code0));
    }
  }
  static __device__ __forceinline__ void put(unsigned char* smem, u32 dst, const uint4& v) {
    u32* d = reinterpret_cast<u32*>(smem + dst);
    d[0] = v.x; d[64] = v.y; d[128] = v.z; d[192] = v.w;
  }
};
template <int M, int NW, int VG> using RegStager = RegBatches<CfMap<M, VG>, NW>;

// dsub 4 (2-bit): two 64 KiB tables at T4_K and T4_V, 8-byte entries (one centroid, 4
// fp16). K entry (code, m = c*MQ + i) at T4_K + code*256 + 128*(i/4) + 8*(4c + i%4); V
// entry (code, m = 8X + r) at T4_V + code*256 + 128*(r/4) + 8*(4X + r%4), and at d = 64 (two
// m-tile groups X) twice, at slots 4*(2k + X) + r%4 for copies k = 0, 1 (a lane of cq
// reads copy cq/2: attention.cu's V gathers). Either way an entry's bank pair depends on
// its subspace (and copy) only. A unit is 16 B of global = 2 codes of one subspace; lane
// r of a half-warp takes slot r of a code row (16 distinct slots: every 8-byte store of a
// half-warp is one wavefront) and the two halves of a warp the 32 B of one sector.
template <int D>
struct Cf4Map {
  static constexpr int M = D / 4, MQ = M / 4, NX = M / 8;
  static constexpr int UK = M * 128, UV = 32 * 128;    // units of K, of V (its 32 slots a row)
  static constexpr int UT = UK + UV;
  static __device__ __forceinline__ void unit(int u, const u32* gk, const u32* gv, u32 wb, u32& dst, uint4& v) {
    const bool k = u < UK;
    const int uu = k ? u : u - UK;
    const int r = uu & 15, s = (uu >> 4) & 1, cg = (uu >> 5) & 63, mb = uu >> 11;
    const int code0 = 4 * cg + 2 * s;
    // slot r of half mb: K subspace (r/4)*MQ + 4mb + r%4, V 8*((r/4) mod NX) + 4mb + r%4
    const int m = k ? (r >> 2) * MQ + 4 * mb + (r & 3) : 8 * ((r >> 2) & (NX - 1)) + 4 * mb + (r & 3);
    dst = wb + (k ? T4_K : T4_V) + code0 * 256 + 128 * mb + 8 * r;
    v = __ldg(reinterpret_cast<const uint4*>((k ? gk : gv) + (m * 256 + code0) * 2));
  }
  static __device__ __forceinline__ void put(unsigned char*, u32 dst, const uint4& v) {
    sts64(dst, v.x, v.y);           // code0
    sts64(dst + 256, v.z, v.w);     // code0 + 1: the next row
  }
};
template <int D, int NW> using RegStager4 = RegBatches<Cf4Map<D>, NW>;

// the register stager of a build: RegStager (dsub 2) or RegStager4
template <int D, int DSUB, int NW, int VG> struct StagerOf { typedef RegStager<D / DSUB, NW, VG> T; };
template <int D, int NW, int VG> struct StagerOf<D, 4, NW, VG> { typedef RegStager4<D, NW> T; };

// CF codebook image: the first 128 KiB of the CF kernel's shared memory (K and V tables in
// the layouts above) for one KV head, built once per codebook in global memory
// (attention.py build_codebook_image); TMA kernels copy it with IMG_CHUNKS bulk copies.
constexpr u32 IMG_BYTES = 131072;
constexpr int IMG_CHUNKS = 8;
