// A bf16 GEMM on AMX tiles for the CPU grouped GEMM's tiles (see amx_gemm.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace grouped_ep {

// Whether this process can run the AMX kernel: built for x86-64 with GCC or Clang, and the Linux
// kernel granted this process the AMX tile state (asked once, on the first call). The caller
// checks the CPU's flags (amx_bf16, avx512_bf16) first.
bool amx_bf16_ready();

// C[M, N] = A[M, K] @ B[K, N] on AMX-BF16, accumulated in fp32 over the whole K and rounded once
// to bf16 (to nearest even). A(m, k) = a[m * sam + k * sak], B(k, n) = b[k * sbk + n * sbn],
// C(m, n) = c[m * ldc + n]. Any strides; fastest with sak == 1 and K a multiple of 32. Unlike
// the AVX-512 kernels it prefetches nothing: asking for the next tile's operands made it slower
// (E=128 groups of 64 x 256 x 128, one thread: 595 GFLOP/s without, 448 to 553 with), and so did
// asking for a group's whole weight before its products on the transposed path (8-row groups of
// the same experts: 4.4 us per group with, 3.7 without).
void bf16_amx_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam, int64_t sak,
                   const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c, int64_t ldc);

}  // namespace grouped_ep
