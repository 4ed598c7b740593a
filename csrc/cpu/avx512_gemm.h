// Small-tile GEMMs on AVX-512 for the CPU grouped GEMM: bf16 (AVX512-BF16) and fp32
// (see avx512_gemm.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "prefetch_lines.h"

namespace grouped_ep {

// Whether this build has the kernels (x86-64 with GCC or Clang). The CPU must also have the
// instructions (avx512_bf16, or avx512f for fp32), which the caller checks.
bool avx512_gemm_compiled();

// C[M, N] = A[M, K] @ B[K, N], accumulated in fp32 over the whole K (bf16: rounded once, to
// nearest even). A(m, k) = a[m * sam + k * sak], B(k, n) = b[k * sbk + n * sbn],
// C(m, n) = c[m * ldc + n]. Any strides; fastest with sak == 1. `next` (optional): memory to
// prefetch meanwhile.
void bf16_avx512_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam,
                      int64_t sak, const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c,
                      int64_t ldc, const Prefetch* next = nullptr);
void f32_avx512_gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                     const float* b, int64_t sbk, int64_t sbn, float* c, int64_t ldc,
                     const Prefetch* next = nullptr);

}  // namespace grouped_ep
