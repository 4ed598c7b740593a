// A small-tile bf16 GEMM on AVX512-BF16, for the CPU grouped GEMM (see bf16_avx512.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace grouped_ep {

// Whether this build has the kernel (x86-64 with GCC or Clang). The CPU must also have
// avx512_bf16, which the caller checks.
bool bf16_avx512_compiled();

// C[M, N] = A[M, K] @ B[K, N], fp32 accumulation, one rounding. A(m, k) = a[m * sam + k * sak],
// B(k, n) = b[k * sbk + n * sbn], C(m, n) = c[m * ldc + n]. Any strides; fastest with sak == 1 and
// sbn == 1.
void bf16_avx512_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam,
                      int64_t sak, const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c,
                      int64_t ldc);

}  // namespace grouped_ep
