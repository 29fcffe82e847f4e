// Device helpers shared by the kernels of kernels/cuda/: tensor-core MMA, fp16/bf16
// packing, byte permutes, cp.async, 32-bit shared loads, and the bulk copies (sm_90) that
// complete on an mbarrier. Each kernel source includes it (build.py source() inlines it).

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

// PRMT in its generic mode: a selector nibble with bit 3 set replicates the sign of the
// byte it names (0x00 for bytes < 0x80), which __byte_perm does not promise.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// cp.async (16 B, L2 only) to the shared-window address dst: the CF kernel streams each
// warp's code tiles into a shared-memory ring a few tiles ahead, so no register waits on HBM
__device__ __forceinline__ void cp_async16(u32 dst, const u8* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

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
