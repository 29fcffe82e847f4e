#include "common.cuh"

// Log-sum-exp merge of the partials of one (sequence, query row); base-2 lse in.
// Rows as pq_attn numbers them: row bv = (b, query group j), head = (KV head, row hd of
// gv); row hd is query token j * (gv / cg) + hd / cg, query head KV head * cg + hd % cg
// (MTQ, multi-token queries; without it row bv is sequence bv and head its query head, and
// so_t, sl_t, ng, gv, cg and nt are not read). Padding rows (token >= nt) write nothing.
template <int D, bool BF16, bool MTQ = false>
__global__ void pq_merge(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                         const int* __restrict__ item_ptr, u16* out, long long so_b,
                         long long so_h, float* lse, long long sl_b, int hq, long long so_t,
                         long long sl_t, int ng, int gv, int cg, int nt) {
  const int bv = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  int b = bv, tok = 0, oh = head;
  if constexpr (MTQ) {
    const int kv = head / gv, hd = head - kv * gv, tl = hd / cg;
    b = bv / ng;
    tok = (bv - b * ng) * (gv / cg) + tl;
    oh = kv * cg + hd - tl * cg;
    if (tok >= nt) return;
  }
  const int lo = item_ptr[bv], hi = item_ptr[bv + 1];
  // One pass, NBT independent loads of lse and o per batch, rescaled online: a sequence's
  // items (split-K: 16 at B=1 32K on 132 SMs) are one memory round trip, where reading the
  // lse for the max first and then lse and o again took three or four (ncu, H100, B=1
  // 32K: 5.25 us of a 27.6 us step).
  constexpr int NBT = 16;
  float mm = NEG_INF, L = 0.f, O = 0.f;
  for (int i0 = lo; i0 < hi; i0 += NBT) {
    float x[NBT], o[NBT];
#pragma unroll
    for (int j = 0; j < NBT; ++j) {
      const long long row = (long long)(i0 + j) * hq + head;
      x[j] = i0 + j < hi ? lse_part[row] : NEG_INF;
      o[j] = i0 + j < hi ? o_part[row * D + d] : 0.f;
    }
    float mx = mm;
#pragma unroll
    for (int j = 0; j < NBT; ++j) mx = fmaxf(mx, x[j]);
    if (mx == NEG_INF) continue;                 // no tokens yet: nothing to weigh
    const float alpha = exp2f(mm - mx);          // mm = -inf: 0, L and O are 0 anyway
    L *= alpha;
    O *= alpha;
#pragma unroll
    for (int j = 0; j < NBT; ++j) {
      const float w = exp2f(x[j] - mx);
      L += w;
      O += w * o[j];
    }
    mm = mx;
  }
  if (L > 0.f) O /= L;
  out[(long long)b * so_b + (long long)tok * so_t + (long long)oh * so_h + d] = to16<BF16>(O);
  if (d == 0)
    lse[(long long)b * sl_b + (long long)tok * sl_t + oh] =
        L > 0.f ? (mm + log2f(L)) * 0.6931471805599453f : NEG_INF;
}
