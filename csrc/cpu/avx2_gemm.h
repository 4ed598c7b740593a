// GEMMs on AVX2 + FMA for the CPU grouped GEMM's tiles, on CPUs without AVX-512 (see
// avx2_gemm.cpp): fp32, and bf16 / fp16 widened to fp32 inside the kernel.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "prefetch_lines.h"

namespace grouped_ep {

// Whether this build has the kernels (x86-64 with GCC or Clang). The CPU must also have AVX2, FMA
// and F16C, which the caller checks.
bool avx2_gemm_compiled();

// C[M, N] = A[M, K] @ B[K, N], accumulated in fp32 over the whole K; bf16 and fp16 operands are
// widened exactly as they are read and the sum is rounded once, to nearest even.
// A(m, k) = a[m * sam + k * sak], B(k, n) = b[k * sbk + n * sbn], C(m, n) = c[m * ldc + n]. Any
// strides; fastest with sbk == 1 or sbn == 1.
void f32_avx2_gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak, const float* b,
                   int64_t sbk, int64_t sbn, float* c, int64_t ldc, const Prefetch* next = nullptr);
void bf16_avx2_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam, int64_t sak,
                    const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c, int64_t ldc,
                    const Prefetch* next = nullptr);
void f16_avx2_gemm(int64_t M, int64_t N, int64_t K, const c10::Half* a, int64_t sam, int64_t sak,
                   const c10::Half* b, int64_t sbk, int64_t sbn, c10::Half* c, int64_t ldc,
                   const Prefetch* next = nullptr);

}  // namespace grouped_ep
