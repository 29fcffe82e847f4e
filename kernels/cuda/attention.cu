// PQ decode attention (loaded by kernels/cuda/attention.py; partials merged by merge.cu).
//
// One thread block per (work item, KV head). A work item is a range of PQ-coded sealed
// tokens of one sequence and/or a range of its fp16 tail. The block stages the K and V
// codebooks of its KV head in shared memory once, then each warp takes 16-token tiles
// (round robin) and runs them through mma.sync:
//   S  = Q K^T   A = q (rows = the G query heads, padded to 16), B = gathered K
//                centroid words (a dsub=2 centroid is one fp16 pair = one B reg)
//   O^T = V^T P^T A = gathered V words, re-paired across tokens with PRMT,
//                B = P (straight from S's accumulator layout, FA2 style).
// Head-dim coordinates are permuted (free for a dot product) so that lane
// (g, c) of a warp reads the K codes of one token as M/4 contiguous bytes and
// the V codes of one subspace as 4 contiguous bytes.
// Shared-memory layouts by GP = 2, 4, 8 (images.group; "CF", dsub 2 and 4): gathers that
// never conflict, whatever the codes (the comments at the K and V gathers below); code
// tiles stream through a per-warp cp.async ring. On sm_90 (TMA) the codebooks arrive as
// bulk copies of a per-head image of exactly these shared-memory bytes (attention.py
// CodebookImage, built by the codebooks' owner); without an image they are staged through
// registers (RegStager, RegStager4).
// Block sizes are powers of two (bs_shift = log2(bs)): a token's block and row are a shift
// and a mask (a runtime division was ~30 of the tile loop's ~474 instructions).
// Partials (o, base-2 lse) per item go to o_part / lse_part; pq_merge combines them.
// Three template flags, each a build of its own so that the plain build's code is untouched:
// - WIN (sliding windows): an item's PQ range may start at any token (a window's first).
//   Its tiles start at the 16-token tile below (the code ring reads whole, 16-byte aligned
//   tiles) and the scores of the tokens before pq_lo are masked. The tail tiles address
//   each token through the table and start anywhere in every build.
// - CAP: logit soft-capping of every score (attention.cuh SoftCap), cap2 = softcap * log2(e).
// - MTQ (multi-token queries): an item row is a (sequence, query group) pair and the G
//   query rows of a block are QT tokens x q_cg heads (attention.py query_groups), causal
//   per row in the tail. Without it q_ng, q_cg, sq_t and q_tokens are not read.
#include "attention.cuh"

#define PQ_ATTN_PARAMS                                                                        \
    const u16 *q, long long sq_b, long long sq_h, const int *items, float *o_part,             \
    float *lse_part, const u8 *kc, const u8 *vc, long long skc_blk, long long skc_h,           \
    long long svc_blk, long long svc_h, const u16 *kcb, const u16 *vcb, const int *st,         \
    long long st_stride, const u16 *tk, const u16 *tv, long long stk_blk, long long stk_h,     \
    long long stk_t, long long stv_blk, long long stv_h, long long stv_t, const int *tt,       \
    long long tt_stride, float qk_scale, int hq, int g, int bs, int tbs, int bs_shift,         \
    const u8 *img, float cap2, long long sq_t, int q_ng, int q_cg, int q_tokens
#define PQ_ATTN_ARGS                                                                          \
    q, sq_b, sq_h, items, o_part, lse_part, kc, vc, skc_blk, skc_h, svc_blk, svc_h, kcb, vcb,  \
    st, st_stride, tk, tv, stk_blk, stk_h, stk_t, stv_blk, stv_h, stv_t, tt, tt_stride,       \
    qk_scale, hq, g, bs, tbs, bs_shift, img, cap2, sq_t, q_ng, q_cg, q_tokens

// DF: the head dim; SPLIT = 2: this CTA is half `half` of a cluster of two (attention.cuh),
// and D below is its share of the coordinates
template <int DF, int DSUB, bool BF16, int NW, int GP, bool TMA, bool WIN, bool CAP, int SPLIT, int PAIR,
          bool MTQ>
__device__ __forceinline__ void pq_attn_body(PQ_ATTN_PARAMS, int half) {
  constexpr int D = DF / SPLIT;
  static_assert(GP == 2 || GP == 4 || GP == 8, "GP: 2, 4 or 8");
  static_assert(PAIR == 1 || PAIR == 2, "PAIR: 16-token tiles a step of the tile loop");
  static_assert(SPLIT == 1 || (SPLIT == 2 && D == 128), "SPLIT: d 256 as two CTAs of 128");
  // conflict-free V gathers too (dsub 4: at every GP)
  constexpr int VG = GP == 2 || GP == 4 || (DSUB == 4 && GP == 8) ? GP : 0;
  constexpr bool STAGE_REG = !TMA;
  AttnArgs a;
  a.q = q; a.sq_b = sq_b; a.sq_h = sq_h; a.items = items; a.n_items = 0;
  a.o_part = o_part; a.lse_part = lse_part; a.kc = kc; a.vc = vc; a.skc_blk = skc_blk;
  a.skc_h = skc_h; a.svc_blk = svc_blk; a.svc_h = svc_h; a.kcb = kcb; a.vcb = vcb; a.st = st;
  a.st_stride = st_stride; a.tk = tk; a.tv = tv; a.stk_blk = stk_blk; a.stk_h = stk_h;
  a.stk_t = stk_t; a.stv_blk = stv_blk; a.stv_h = stv_h; a.stv_t = stv_t; a.tt = tt;
  a.tt_stride = tt_stride; a.qk_scale = qk_scale; a.hq = hq; a.g = g; a.bs = bs; a.tbs = tbs;
  if constexpr (CAP) a.cap = SoftCap{cap2, 2.8853900817779268f / cap2};   // k2 = 2 log2(e) / cap2
  if constexpr (SPLIT > 1) {   // this half's coordinates of q, the tail and o; its subspaces' codes
    a.q += half * D; a.tk += half * D; a.tv += half * D; a.o_part += half * D;
    a.kc += half * (D / DSUB);                     // K code rows keep their DF / DSUB bytes
    a.vc += (long long)half * (D / DSUB) * bs;     // V codes: one row of bs bytes a subspace
  }
  constexpr int M = D / DSUB, MQ = M / 4, KS = D / 16, NX = M / 8;
  typedef typename Ent<DSUB>::T E;
  extern __shared__ __align__(16) unsigned char smem[];
  // K rows of 256 B per code (64 KiB, see the staging below), V after them
  E* sV = reinterpret_cast<E*>(smem + 65536);

  const int item = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, cq = lane & 3;
  // the first batch of codebook loads goes out before the item is known (they depend on
  // the head only; a block with no PQ tiles never uses them): its latency overlaps the
  // item's and the block table's
  constexpr int M_ = D / DSUB;
  typedef typename StagerOf<D, DSUB, NW, VG>::T Stg;
  Stg stg;
  // SPLIT: [Hkv, 2 * M_, 256, DSUB] is [2 * Hkv, M_, 256, DSUB]: head h's half is head 2h + half
  const long long hv = SPLIT > 1 ? (long long)h * SPLIT + half : h;
  const u32* stg_k = reinterpret_cast<const u32*>(a.kcb) + hv * M_ * 256 * (DSUB / 2);
  const u32* stg_v = reinterpret_cast<const u32*>(a.vcb) + hv * M_ * 256 * (DSUB / 2);
  const int stg_rot = (int)((blockIdx.x * 544u) % (u32)Stg::UT) & ~31;
  // The dsub 4 tables sit at fixed shared-window addresses (T4_K, T4_V). In a cluster the
  // window of CTA rank r starts at r << 24 (0x1000400 for rank 1): SPLIT builds add those
  // bits (wb) to every such address, through the PRMTs that build them (no extra instruction).
  const u32 wb = SPLIT > 1 ? (u32)__cvta_generic_to_shared(smem) & 0xff000000u : 0u;
  if constexpr (STAGE_REG) stg.load(stg_k, stg_v, tid, 0, stg_rot, wb);
  // TMA: the head's codebook image in IMG_CHUNKS bulk copies (lanes of warp 0, each block
  // starting at its own chunk), at entry, before the item is known; every path below waits
  // for them before it leaves or reuses the shared memory. Their mbarrier sits 8 bytes
  // after the ring (attention.py _attn_smem); as a static __shared__ variable it moved the
  // dynamic shared memory by 16 bytes and the tile loop ran ~6 % slower.
  const u32 bar = (u32)__cvta_generic_to_shared(smem) + cf_ring_offset<D, DSUB>() + NW * cf_stages(NW, SPLIT) * 32 * M_;
  if constexpr (DSUB == 4) {   // the rings and the mbarrier below T4_K (attention.cuh)
    if (bar + 16 > T4_K + wb) __trap();
  } else if constexpr (SPLIT == 1) {   // the tables at T2_K (attention.cuh)
    if ((u32)__cvta_generic_to_shared(smem) != T2_K) __trap();
  }
  // SPLIT: the score exchange's buffers and mbarriers after the ring's mbarrier (dsub 2)
  // or after the V table (dsub 4: a cluster kernel's shared window starts higher, so
  // nothing more fits below T4_K); the other CTA writes them only after the cluster
  // barrier that follows their init
  Xchg xc;
  if constexpr (SPLIT > 1) {
    const u32 xb = DSUB == 4 ? wb + T4_V + 65536u : bar + 16;
    if constexpr (DSUB == 4) {     // attention.py _attn_smem asks for room past the V table
      u32 dyn;
      asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
      if ((u32)__cvta_generic_to_shared(smem) + dyn < xb + xchg_bytes(NW)) __trap();
    }
    xc.init(xb, xb + NW * 1024, warp, lane, (u32)half ^ 1u);
    cluster_arrive();
  }
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
        // SPLIT: this CTA's half of the head's image (as head hv of d 128), at its window.
        // (SPLIT 1 keeps its own expression: through hv, the plain builds' code changed)
        const u32 img_dst = DSUB == 4 ? T4_K + wb : (u32)__cvta_generic_to_shared(smem);
        const u8* src = SPLIT > 1 ? img + hv * IMG_BYTES : img + (long long)h * IMG_BYTES;
        bulk_g2s(img_dst + c * CH, src + c * CH, CH, bar);
      }
    }
  }
  const int* it = a.items + item * 5;
  // Multi-token queries: item row bv is query group qj of sequence b (q_ng groups a
  // sequence, one for decode); b picks the block tables, qj the group's query tokens.
  const int bv = it[0], pq_from = it[1], pq_hi = it[2], t_lo = it[3], t_hi = it[4];
  const int b = MTQ ? bv / q_ng : bv, qj = MTQ ? bv - b * q_ng : 0;
  // WIN: the item's first PQ token (pq_from) may sit inside a tile; its tiles start below it
  const int pq_lo = WIN ? pq_from & ~15 : pq_from;
  const int n_pq = (pq_hi - pq_lo) >> 4;
  const int n_tl = (t_hi - t_lo + 15) >> 4;
  if (n_pq == 0 && n_tl == 0) {   // padding item of a plan kept for update()
    if constexpr (TMA) if (warp == 0) mbar_wait(bar, 0);
    if constexpr (SPLIT > 1) cluster_wait();   // (both CTAs of the cluster take this item)
    return;
  }
  const int G = a.g;
  // Row hd < G of the block's query rows is query token qj * QT + hd / q_cg of the
  // sequence, head h * q_cg + hd % q_cg (without MTQ: QT 1, q_cg G). A padding row (a token past
  // the sequence's q_tokens) reads no q.
  const int QT = MTQ ? G / q_cg : 1;
  // (the plain builds keep their own expressions at the call sites: reading q through
  // these lambdas changed the d 256 builds' machine code, scripts/nvrtc_check.py --hashes)
  auto q_row = [&](int hd) -> const u16* {
    const int tl = hd / q_cg;
    return a.q + (long long)b * a.sq_b + (long long)(qj * QT + tl) * sq_t +
           (long long)(h * q_cg + hd - tl * q_cg) * a.sq_h;
  };
  auto q_real = [&](int hd) -> bool { return qj * QT + hd / q_cg < q_tokens; };
  // the block ids of the ring prologue's tiles, in flight together (one at a time, each of
  // its copies waited a memory round trip on its table load)
  int bpre[cf_stages(NW, SPLIT)];
  {
    const int* st_b0 = a.st + (long long)b * a.st_stride;
#pragma unroll
    for (int k = 0; k < cf_stages(NW, SPLIT); ++k) {
      const int tile = warp + k * NW, t0 = pq_lo + 16 * tile;
      bpre[k] = tile < n_pq ? st_b0[t0 >> bs_shift] : 0;
    }
  }
  // batch 0 to shared memory as soon as it lands and batch 1 out behind it, so that its
  // round trip overlaps the q / block-table loads and the ring prologue below
  if constexpr (STAGE_REG) {
    if (n_pq > 0) {
      stg.store(smem, tid, 0);
      if constexpr (Stg::NB > 1) stg.load(stg_k, stg_v, tid, Stg::BATCH, stg_rot, wb);
    }
  }

  // ---- q fragments (permuted coordinates), rows >= G are zero: for the tail tiles
  // (after the PQ tiles, which use the rotated quads below).
  u32 qa0[KS], qa2[KS];
  auto load_q = [&]() {
    const bool row_ok = MTQ ? gq < G && q_real(gq) : gq < G;
    const u16* qr = MTQ ? q_row(row_ok ? gq : 0)
                        : a.q + (long long)b * a.sq_b + (long long)(h * G + (row_ok ? gq : 0)) * a.sq_h;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      int e0, e2;
      if (DSUB == 2) { e0 = 2 * (cq * MQ + 2 * ks); e2 = 2 * (cq * MQ + 2 * ks + 1); }
      else { e0 = 4 * (cq * MQ + ks); e2 = e0 + 2; }
      qa0[ks] = row_ok ? *reinterpret_cast<const u32*>(qr + e0) : 0u;
      qa2[ks] = row_ok ? *reinterpret_cast<const u32*>(qr + e2) : 0u;
    }
  };

  // ---- stage the codebooks of head h. K word (code, pos) at byte code*256 + 4*pos,
  // pos = 32*hh + 4*i + c holding subspace m = c*MQ + 8*hh + i, so the bank (pos mod 32)
  // does not depend on the code: 32 lanes that fetch 32 distinct (i, c) never collide,
  // whatever their codes; VG: V word (code, m) at byte 65536 + code*256 + 4*m, likewise.
  // Those arrive by bulk copies (TMA) or from RegStager with the ring prologue below; here
  // only GP 8's V table for dsub 2 (X*2048 + code*8 + m%8 words).
  if (!TMA && n_pq > 0) {
    const long long hh = SPLIT > 1 ? hv : h;    // (SPLIT 1: the expression of the plain builds)
    const E* gv = reinterpret_cast<const E*>(a.vcb) + hh * M * 256;
    if constexpr (VG == 0) {
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
    }
  }

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

  const u8* kc_h = a.kc + (long long)h * a.skc_h;
  const u8* vc_h = a.vc + (long long)h * a.svc_h;
  const int* st_b = a.st + (long long)b * a.st_stride;
  const bool alltrue[2][2] = {{true, true}, {true, true}};

  // ---- PQ tiles, codes streamed through each warp's ring
  {
    // HOLD: this block's lane and warp indices come from a register the compiler cannot
    // see through, so it keeps the loop's lane constants in registers instead of rebuilding
    // them from an S2R of the thread index every step (12 instructions of a 2-bit step,
    // and the S2R's latency ahead of the score shuffles). Per build, whichever ran faster
    // (bench_cuda_pq.py --quick, H200, B=8 32K): held, 2-bit d 128 at G <= 4 ran 2-5 %
    // faster, 4-bit at G 2 and at d 64 3-5 %; 4-bit d 128 at G 4-8 and 2-bit d 64 ran
    // 0.7-2 % slower held, and the 2-bit G 8 builds reach the register cap.
    constexpr bool HOLD = DSUB == 4 ? D >= 128 && GP <= 4 : GP == 2 || D == 64;
    int lane_r = lane, warp_r = warp;
    if constexpr (HOLD) asm volatile("" : "+r"(lane_r), "+r"(warp_r));
    const int lane = lane_r, gq = lane_r >> 2, cq = lane_r & 3, warp = warp_r;
    // The block id of a tile is read two tiles ahead of its codes: a code load that
    // waits on the table load in the same step stalls the warp for a memory latency.
    // (st_b kept in registers: rebuilt from the arguments it cost ~15 instructions a tile.
    // A plain load: through the read-only path, ld.global.nc, the multi-token 4-bit kernel
    // ran 7 % slower, bench_mtq.py 420 -> 457 us on an H200, and decode no faster)
    const int* st_w = st_b;
    asm volatile("" : "+l"(st_w));
    auto blk_of = [&](int tile) -> long long {
      const int t0 = pq_lo + 16 * tile;
      return tile < n_pq ? st_w[t0 >> bs_shift] : 0;
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
    constexpr int NR = 16 / GP;
    u32 qk[KS][4];
    u32 ksel[2], klo[2];
    if constexpr (DSUB == 4) {
      // dsub 4: k-step j's B column gq holds subspace cq*MQ + (gq + j) % 4 + 4*(j/4), so
      // row copy rho of A holds cq*MQ + (rho + j) % 4 + 4*(j/4): coordinates 0-1 of it for
      // the k rows 2cq, 2cq+1 and 2-3 for 2cq+8, 2cq+9 (the entry's two words)
      const int hd = gq % GP, r0 = gq / GP, r1 = (gq + 8) / GP;
      const bool ok = MTQ ? hd < G && q_real(hd) : hd < G;
      const u16* qr = MTQ ? q_row(ok ? hd : 0)
                          : a.q + (long long)b * a.sq_b + (long long)(h * G + (ok ? hd : 0)) * a.sq_h;
#pragma unroll
      for (int j = 0; j < KS; ++j) {
        const int base = cq * MQ + 4 * (j / 4);
        const int s0 = base + ((r0 + j) & 3), s1 = base + ((r1 + j) & 3);
        const int e[4] = {4 * s0, 4 * s1, 4 * s0 + 2, 4 * s1 + 2};
#pragma unroll
        for (int x = 0; x < 4; ++x) qk[j][x] = ok ? *reinterpret_cast<const u32*>(qr + e[x]) : 0u;
      }
      // ksel: bytes (gq + jj) % 4 of a code word; klo byte jj: 8*(4cq + (gq + jj) % 4)
      ksel[0] = (gq & 3) | ((gq + 1) & 3) << 4 | ((gq + 2) & 3) << 8 | ((gq + 3) & 3) << 12;
      klo[0] = 0u;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) klo[0] |= (8u * (4 * cq + ((gq + jj) & 3))) << (8 * jj);
      ksel[1] = klo[1] = 0u;
      if constexpr (SPLIT > 1) {   // klo[p]: bytes 8*(4cq + (gq + jj)%4) for jj = 2p, 2p + 1, then wb's byte twice
        const u32 k0 = klo[0];
        klo[0] = (k0 & 0xffffu) | (wb >> 8) | wb;
        klo[1] = (k0 >> 16) | (wb >> 8) | wb;
        asm volatile("" : "+r"(klo[1]));
      }
      asm volatile("" : "+r"(ksel[0]), "+r"(klo[0]));
    } else {
      const int hd = gq % GP, r0 = gq / GP, r1 = (gq + 8) / GP;
      const bool ok = MTQ ? hd < G && q_real(hd) : hd < G;
      const u16* qr = MTQ ? q_row(ok ? hd : 0)
                          : a.q + (long long)b * a.sq_b + (long long)(h * G + (ok ? hd : 0)) * a.sq_h;
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
    if constexpr (VG > 0 && DSUB == 2) {
#pragma unroll
      for (int j = 0; j < 4; ++j) vlo |= (32u * ((cq + j) & 3) + 4u * gq) << (8 * j);
      asm volatile("" : "+r"(vlo));
    }
    // dsub 4 (V side). Slot j of the NJ m-tile groups X (8 subspaces of 4 coordinates):
    // lane (gq, cq) gathers subspace 8X + gq of X = (cq + j) % NJ for its 4 tokens, from
    // the entry's slot 4*sg + gq % 4 in half gq / 4 of the code row, sg = (cq + j) % 4 at
    // d = 128 and (cq & 2) + (cq + j) % 2 at d = 64 (copy cq / 2 of the table): 16
    // distinct slots in each half-warp. The MMA's columns undo the rotation by cq as for
    // dsub 2. vl[j]: address bytes 0, 2, 3 of slot j (T4_V + 128*(gq/4) + 8*slot).
    constexpr int NJ = NX < 4 ? NX : 4;
    u32 vl[NJ];
    if constexpr (VG > 0 && DSUB == 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int sg = (cq & (4 - NJ)) | ((cq + j) & (NJ - 1));
        vl[j] = wb + T4_V + 128u * (gq >> 2) + 8u * (4 * sg + (gq & 3));
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) asm volatile("" : "+r"(vl[j]));
    }
    // the scores of one 16-token tile (its K codes kk), whole in both CTAs of a SPLIT pair
    auto scores = [&](CodeVec<MQ> (&kk)[2], float (&s)[2][4]) {
#pragma unroll
      for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
      {
        float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        if constexpr (DSUB == 4) {
          // dsub 4: gather j of n-tile t fetches, in lane (gq, cq), the 8-byte entry of
          // subspace cq*MQ + i, i = (gq + j) % 4 + 4*(j/4), from bank pair 4cq + (gq + j) % 4
          // of half j/4 of the code row: 16 distinct pairs in each half-warp (gq/4 fixed),
          // so 2 wavefronts a gather (the least for 256 bytes) whatever the codes. B column
          // gq then holds each quad of subspaces rotated by gq mod 4; rot_quads undoes the
          // bits of it at or above NR and the A row copies the rest, as for dsub 2.
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            uint2 f[MQ];
#pragma unroll
            for (int qd = 0; qd < MQ / 4; ++qd) {
              const u32 rc = __byte_perm(kk[t].w[qd], 0u, ksel[0]);   // byte jj: subspace i
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) {
                // SPLIT: byte 3 from klo[jj/2]'s byte 2 (wb >> 24)
                const u32 sel = SPLIT > 1 ? (jj & 1) | (4 + jj) << 4 | (8 + (jj & 1)) << 8 | 2 << 12
                                          : jj | (4 + jj) << 4 | (8 + jj) << 8 | (8 + jj) << 12;
                const u32 ad = prmt(klo[SPLIT > 1 ? jj >> 1 : 0], rc, sel);     // code*256 + 8*(4cq + (gq+jj)%4)
                f[4 * qd + jj] = qd ? lds64<T4_K + 128>(ad) : lds64<T4_K>(ad);   // half qd
              }
            }
            rot_quads<NR, MQ>(f, gq);
#pragma unroll
            for (int j = 0; j < MQ; ++j) {
              const u32* qq = qk[j];
              mma16816<BF16>(j & 1 ? s2[t] : s[t], qq[0], qq[1], qq[2], qq[3], f[j].x, f[j].y);
            }
          }
        }
#pragma unroll
        for (int hh = 0; hh < (DSUB == 2 ? MQ / 8 : 0); ++hh) {
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const u32 c0 = kk[t].w[2 * hh], c1 = kk[t].w[(2 * hh + 1) % (MQ / 4)];
            const u32 rc[2] = {__byte_perm(c0, c1, ksel[0]), __byte_perm(c0, c1, ksel[1])};
            u32 f[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const u32 sel = (j & 3) | (4 + (j & 3)) << 4 | (8 + (j & 3)) << 8 | (8 + (j & 3)) << 12;
              const u32 ad = prmt(klo[j >> 2], rc[j >> 2], sel);     // code*256 + 16i + 4cq
              if constexpr (SPLIT == 1) f[j] = hh ? lds32<T2_K + 128>(ad) : lds32<T2_K>(ad);
              else f[j] = *reinterpret_cast<const u32*>(smem + ad + 128 * hh);
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
        if constexpr (SPLIT > 1) xc(s, lane);     // this half's partial scores -> whole
      }
    };
    // WIN: score (gq, column 2cq + e) of n-tile t is token sigma(t, 2cq + e) of the tile:
    // those before the window's first token (in the item's first tile only) are out
    auto in_window = [&](int tix, bool (&valid)[2][2]) {
      const int t0 = pq_lo + 16 * tix;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) valid[t][e] = t0 + sigma(t, 2 * cq + e) >= pq_from;
    };
    // O += P V of one tile (its V codes vv, P as the A-layout pairs pb0, pb1)
    auto pv = [&](u32 (&vv)[NX], u32 pb0, u32 pb1) {
      if constexpr (VG > 0 && DSUB == 4) {
        constexpr int NT = VG / 2;
        // P of head gq % VG in every lane: the B columns n = gq are (c, head) pairs
        const int psrc = 4 * (gq % VG) + cq;
        const u32 px0 = __shfl_sync(FULL, pb0, psrc), px1 = __shfl_sync(FULL, pb1, psrc);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          u32 bm0[NT], bm1[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const bool on = ((cq + j) & (NJ - 1)) == (8 * nt + gq) / VG;
            bm0[nt] = on ? px0 : 0u;
            bm1[nt] = on ? px1 : 0u;
          }
          const u32 cw = vv[j];     // tokens 4cq..4cq+3 of subspace 8*((cq + j) % NJ) + gq
          uint2 e[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)   // bytes: slot j's address byte 0, code k, 2, 0
            e[k] = lds64<0>(prmt(vl[j], cw, 0x3200 | (4 + k) << 4));
#pragma unroll
          for (int p = 0; p < 2; ++p) {   // coordinates 2p, 2p+1: rows gq, gq + 8
            const u32 w0 = p ? e[0].y : e[0].x, w1 = p ? e[1].y : e[1].x;
            const u32 w2 = p ? e[2].y : e[2].x, w3 = p ? e[3].y : e[3].x;
            const u32 a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
            const u32 a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              mma16816<BF16>(ws.ov[p][nt], a0, a1, a2, a3, bm0[nt], bm1[nt]);
          }
        }
      } else if constexpr (VG > 0) {
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
              const u32 ad = prmt(vlo, cw, sel);
              if constexpr (SPLIT == 1) w[k] = hx ? lds32<T2_V + 128>(ad) : lds32<T2_V>(ad);
              else w[k] = *reinterpret_cast<const u32*>(smem + ad + 65536 + 128 * hx);
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
        {   // GP = 8, dsub 2: swizzled V table; code byte by PRMT, address by IMAD
          u32 w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            w[k] = lds32<0>(__byte_perm(v4, 0u, 0x4440 | k) * 32u + (vlane + X * 8192u));
          pv_mma<D, DSUB, BF16, VG>(ws, X, 0, w[0], w[1], w[2], w[3], pb0, pb1);
        }
      }
      }
    };
    auto tile = [&](CodeVec<MQ> (&kk)[2], u32 (&vv)[NX], int tix) {
      float s[2][4];
      scores(kk, s);
      u32 pb0, pb1;
      if constexpr (WIN) {
        bool valid[2][2];
        in_window(tix, valid);
        softmax_pv<D, DSUB, BF16, VG, VG == 0, CAP>(ws, s, valid, a.qk_scale, lane, pb0, pb1, a.cap);
      } else {
        softmax_pv<D, DSUB, BF16, VG, VG == 0, CAP>(ws, s, alltrue, a.qk_scale, lane, pb0, pb1, a.cap);
      }
      pv(vv, pb0, pb1);
    };
    {
      // ring of STAGES tiles per warp after the codebooks: [K codes 16 x M][V codes M x 16]
      constexpr u32 TILE = 32 * M;
      constexpr int STAGES = cf_stages(NW, SPLIT);
      unsigned char* ring = smem + cf_ring_offset<D, DSUB>() + warp * STAGES * TILE;
      // lane constants, kept in registers (opaque) rather than rebuilt every tile
      // (stage bytes at rsw<M> positions: attention.cuh)
      u32 kdst = 16 * lane, krd0 = rsw<M>(sigma(0, gq) * M + cq * MQ), krd1 = rsw<M>(sigma(1, gq) * M + cq * MQ);
      // SPLIT: byte 16*lane of the tile's 16 x M K codes sits in row 16*lane / M of the
      // global rows of MF = DF / DSUB bytes
      constexpr int MF = DF / DSUB;
      u32 ksrc = (16 * lane / M) * MF + (16 * lane) % M;
      u32 vrd = 16 * M + gq * 16 + 4 * cq;
      long long vsrc = (long long)lane * a.bs;
      asm volatile("" : "+r"(kdst), "+r"(krd0), "+r"(krd1), "+r"(vrd), "+l"(vsrc));
      // A tile's copies are base + block * stride + its offset in the block, the bases
      // (lane and head included) and the ring's window address kept in registers (64-bit
      // products and rebuilt bases cost ~30 instructions a tile). Block strides are below
      // 2^32 bytes (attention.py misaligned() sends others to Triton). The d 256 builds of
      // 5-8 query heads a KV head leave the compiler free to rebuild them: held, they
      // spilled up to 56 bytes more at the 168-register cap.
      const u8* kb0 = kc_h + (SPLIT > 1 ? ksrc : kdst);
      const u8* vb0 = vc_h + vsrc;
      // this lane's copies of a stage: K bytes rsw<M>(kdst) + 512 c, V bytes 16 M after them
      // (16 M and 512 c do not touch bits 5-7, which rsw<M> reads and flips)
      u32 ring_w = (u32)__cvta_generic_to_shared(ring) + rsw<M>(kdst);
      const u32 kstr = (u32)a.skc_blk, vstr = (u32)a.svc_blk;
      if constexpr (!(SPLIT > 1 && GP == 8)) asm volatile("" : "+l"(kb0), "+l"(vb0), "+r"(ring_w));
      u32 vr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) vr[j] = rsw<M>(vrd + 128 * ((cq + j) & (DSUB == 2 ? 3 : NJ - 1)));
      if constexpr (VG > 0) asm volatile("" : "+r"(vr[0]), "+r"(vr[1]), "+r"(vr[2]), "+r"(vr[3]));
      const u32 vrd1 = rsw<M>(vrd + 128) - 128;    // VG 0: the rows gq + 8X of odd X
      auto issue = [&](int tile, long long blk, u32 stage_off) {
        if (tile < n_pq) {
          const int t0 = pq_lo + 16 * tile;
          const int off = t0 & (a.bs - 1);
          const u32 ub = (u32)blk, w = ring_w + stage_off;
          if constexpr (SPLIT > 1) {
            const u8* kb = (kb0 + off * MF) + (unsigned long long)ub * kstr;
            const u8* vb = (vb0 + off) + (unsigned long long)ub * vstr;
#pragma unroll
            for (int c = 0; c < M / 32; ++c) {
              cp_async16(w + 512 * c, kb + c * (512 / M) * MF);
              cp_async16(w + 16 * M + 512 * c, vb + (long long)(32 * c) * a.bs);
            }
          } else {
          const u8* kb = (kb0 + off * M) + (unsigned long long)ub * kstr;   // 16 rows, contiguous
          const u8* vb = (vb0 + off) + (unsigned long long)ub * vstr;       // M rows of 16 B, stride bs
#pragma unroll
          for (int c = 0; c < (M + 31) / 32; ++c) {
            if (M >= 32 || lane < M) {   // M = 16 (d 64, dsub 4): half the lanes
              cp_async16(w + 512 * c, kb + 512 * c);
              cp_async16(w + 16 * M + 512 * c, vb + (long long)(32 * c) * a.bs);
            }
          }
          }
        }
        cp_async_commit();      // empty groups too: the wait count stays uniform
      };
      // a tile's codes, from its ring stage st into registers
      auto codes = [&](const unsigned char* st, CodeVec<MQ> (&kk)[2], u32 (&vv)[NX]) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const unsigned char* row = st + (t ? krd1 : krd0);
          if constexpr (MQ == 16) {
            const uint4 x = *reinterpret_cast<const uint4*>(row);
            kk[t].w[0] = x.x; kk[t].w[1] = x.y; kk[t].w[2 % (MQ / 4)] = x.z; kk[t].w[3 % (MQ / 4)] = x.w;
          } else if constexpr (MQ == 4) {
            kk[t].w[0] = *reinterpret_cast<const u32*>(row);
          } else {
            const uint2 x = *reinterpret_cast<const uint2*>(row);
            kk[t].w[0] = x.x; kk[t].w[1 % (MQ / 4)] = x.y;
          }
        }
        if constexpr (VG > 0 && DSUB == 4) {    // vv[j]: group (cq + j) % NJ
#pragma unroll
          for (int j = 0; j < NJ; ++j) vv[j] = *reinterpret_cast<const u32*>(st + vr[j]);
        } else if constexpr (VG > 0) {     // slot order: vv[4*hx + j] is m-tile 4*hx + ((cq+j)&3)
#pragma unroll
          for (int hx = 0; hx < D / 64; ++hx)
#pragma unroll
            for (int j = 0; j < 4; ++j)
              vv[4 * hx + j] = *reinterpret_cast<const u32*>(st + vr[j] + 512 * hx);
        } else {
#pragma unroll
          for (int X = 0; X < NX; ++X)
            vv[X] = *reinterpret_cast<const u32*>(st + (X & 1 ? vrd1 : vrd) + 128 * X);
        }
      };
      // bpre: the block ids of the prologue's tiles, loaded at entry. PAIR: every stage
      // filled (a step frees two stages after it read them)
      constexpr int PRO = PAIR == 2 ? STAGES : STAGES - 1;
#pragma unroll
      for (int k = 0; k < PRO; ++k) issue(warp + k * NW, bpre[k], k * TILE);
      long long bn = bpre[STAGES - 1];
      long long bn2[2];
      if constexpr (PAIR == 2) {
        bn2[0] = blk_of(warp + STAGES * NW);
        bn2[1] = blk_of(warp + (STAGES + 1) * NW);
      }
      if constexpr (STAGE_REG) {
        if (n_pq > 0) {
#pragma unroll
          for (int nb = 1; nb < Stg::NB; ++nb) {
            if (nb > 1) stg.load(stg_k, stg_v, tid, nb * Stg::BATCH, stg_rot, wb);
            stg.store(smem, tid, nb * Stg::BATCH);
          }
        }
      }
      // the codebook copies (the oldest group, when this item has PQ tiles) are done
      if constexpr (TMA) {
        __syncthreads();                        // the mbarrier's init is seen by every warp
        if (n_pq > 0) mbar_wait(bar, 0);
      } else {
        cp_async_wait<PRO>();
        __syncthreads();
      }
      if constexpr (SPLIT > 1) cluster_wait();   // the other CTA's exchange mbarriers are set
      if constexpr (PAIR == 1) {
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
        codes(st, kk, vv);
        tile(kk, vv, warp + k * NW);
      }
      } else {
        // Two tiles a step: their gathers and MMAs are independent chains the scheduler
        // interleaves (one tile's chain leaves the warp waiting on each gather), and they
        // share one softmax max and one rescale of O. Tile k + 1 past the warp's last is
        // computed on whatever its stage holds (codes are always table indices) and
        // masked out. Stages: tile j in stage j % STAGES; a step reads two, then refills them.
        u32 rd = 0;
        for (int k = 0; warp + k * NW < n_pq; k += 2) {
          cp_async_wait<STAGES - 2>();
          __syncwarp();         // tiles k and k + 1 landed for every lane
          const u32 rd1 = rd == (STAGES - 1) * TILE ? 0 : rd + TILE;
          CodeVec<MQ> kk[2][2];
          u32 vv[2][NX];
          codes(ring + rd, kk[0], vv[0]);
          codes(ring + rd1, kk[1], vv[1]);
          __syncwarp();         // every lane read both stages: they take tiles k + STAGES, + 1
          issue(warp + (k + STAGES) * NW, bn2[0], rd);
          issue(warp + (k + STAGES + 1) * NW, bn2[1], rd1);
          rd = rd1 == (STAGES - 1) * TILE ? 0 : rd1 + TILE;
          bn2[0] = blk_of(warp + (k + STAGES + 2) * NW);
          bn2[1] = blk_of(warp + (k + STAGES + 3) * NW);
          const bool second = warp + (k + 1) * NW < n_pq;
          float sa[2][4], sb[2][4];
          scores(kk[0], sa);
          scores(kk[1], sb);
          float s[4][4];
          bool valid[4][2];
          bool va[2][2] = {{true, true}, {true, true}}, vb[2][2] = {{true, true}, {true, true}};
          if constexpr (WIN) {
            in_window(warp + k * NW, va);
            in_window(warp + (k + 1) * NW, vb);
          }
#pragma unroll
          for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              s[t][r] = sa[t][r];
              s[2 + t][r] = sb[t][r];
            }
#pragma unroll
          for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              valid[t][e] = va[t][e];
              valid[2 + t][e] = vb[t][e] && second;
            }
          u32 pb[4];
          softmax_pvn<D, DSUB, BF16, VG, VG == 0, CAP, 4>(ws, s, valid, a.qk_scale, lane, pb, a.cap);
          pv(vv[0], pb[0], pb[1]);
          pv(vv[1], pb[2], pb[3]);
        }
      }
      cp_async_wait<0>();
    }
  }

  if constexpr (VG > 0) zero_o();   // o starts here: the PQ tiles used ov
  // ---- fp16/bf16 tail tiles (dense), same warp state
  if (n_tl > 0) {
    load_q();
    const int* tt_b = a.tt + (long long)b * a.tt_stride;
    // tiles continue the round robin after the PQ tiles
    int first = warp - (n_pq % NW);
    if (first < 0) first += NW;
    // tail blocks are powers of two in practice: shifts, not divisions (the tail tiles are
    // a single warp's serial chain at the end of the longest block: every instruction counts)
    const int tsh = (a.tbs & (a.tbs - 1)) == 0 ? __ffs(a.tbs) - 1 : -1;
    // Multi-token queries are causal among themselves: the item holds its sequence's whole
    // tail, through the group's last query token (attention.py), and query token tl of
    // the group's nq sees nq - 1 - tl fewer of its newest tokens (row gq's scores; decode:
    // all of them; padding rows, tl >= nq: all of them too)
    const int row_hi = MTQ ? min(t_hi, t_hi - (min(QT, q_tokens - qj * QT) - 1 - gq / q_cg)) : t_hi;
    for (int ti = first; ti < n_tl; ti += NW) {
      const int t0 = t_lo + 16 * ti;
      float s[2][4];
      bool valid[2][2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
        valid[t][0] = t0 + sigma(t, 2 * cq) < row_hi;
        valid[t][1] = t0 + sigma(t, 2 * cq + 1) < row_hi;
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
      if constexpr (SPLIT > 1) xc(s, lane);
      u32 pb0, pb1;
      // SAFE (MTQ): a causal row may have no token in a warp's first tail tile
      softmax_pv<D, DSUB, BF16, VG, true, CAP, MTQ>(ws, s, valid, a.qk_scale, lane, pb0, pb1, a.cap);
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
  // SPLIT: every exchange is done; neither CTA leaves while the other may still address it
  if constexpr (SPLIT > 1) cluster_arrive();
  float l = ws.l_i;
  l += __shfl_xor_sync(FULL, l, 1);
  l += __shfl_xor_sync(FULL, l, 2);
  if constexpr (TMA) if (n_pq == 0) mbar_wait(bar, 0);   // a tail-only block's copies landed
  __syncthreads();                                     // codebooks no longer needed
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
  if constexpr (VG > 0 && DSUB == 4) {   // ov[p]: coordinates 2p, 2p+1 of subspace 8c + gq
    __syncwarp();
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int nt = 0; nt < VG / 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = 8 * nt + 2 * cq + e, c = n / VG, hd = n % VG;
          if (c < NX) {   // d 64, VG 2: columns of groups 2, 3 are empty
            float2* pp = reinterpret_cast<float2*>(base + hd * SD + 4 * (8 * c + gq) + 2 * p);
            float2 x = *pp;
            x.x += ws.ov[p][nt][e];
            x.y += ws.ov[p][nt][2 + e];
            *pp = x;
          }
        }
  } else if constexpr (VG > 0) {   // the PQ tiles' part: column n = 2cq + e of n-tile nt is (c, h)
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
    a.o_part[row * DF + coord] = O / L;
    if (coord == 0 && (SPLIT == 1 || half == 0)) a.lse_part[row] = mm + log2f(L);
  }
  if constexpr (SPLIT > 1) cluster_wait();
}

template <int D, int DSUB, bool BF16, int NW, int GP, bool TMA, bool WIN, bool CAP, int PAIR = 1, bool MTQ = false>
__global__ void __launch_bounds__(NW * 32, 1) pq_attn(PQ_ATTN_PARAMS) {
  pq_attn_body<D, DSUB, BF16, NW, GP, TMA, WIN, CAP, 1, PAIR, MTQ>(PQ_ATTN_ARGS, 0);
}

// head_dim 256 (sm_90): grid (items, Hkv, 2), each cluster the two halves of one block
template <int D, int DSUB, bool BF16, int NW, int GP, bool WIN, bool CAP, int PAIR = 1, bool MTQ = false,
          bool TMA = false>
__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(NW * 32, 1) pq_attn_split(PQ_ATTN_PARAMS) {
  pq_attn_body<D, DSUB, BF16, NW, GP, TMA, WIN, CAP, 2, PAIR, MTQ>(PQ_ATTN_ARGS, (int)cluster_rank());
}
