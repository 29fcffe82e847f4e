#include "common.cuh"

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
