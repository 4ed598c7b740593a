// Which GEMM the CPU grouped GEMM gives its tiles, per (dtype, CPU), chosen at run time:
// - fp32: at::mm (MKL / OpenBLAS), or on AMD CPUs with AVX512-BF16 this project's own AVX-512
//   kernel (avx512_gemm.cpp), which ran faster than MKL there, and on AMD CPUs without AVX-512
//   the own AVX2 kernel (avx2_gemm.cpp) (`f32_plan`);
// - bf16/fp16, by `half_plan`: native, the tiles go to at::mm as they are, so oneDNN runs its
//   AMX / AVX512-BF16 / AVX512-FP16 kernels (the ones torch.mm uses for that dtype on this CPU),
//   fp32 accumulation inside, one rounding at the end; or widen, on CPUs without native
//   low-precision GEMM, where torch's own bf16/fp16 matmul is slow: tiles are widened to fp32
//   for the product (on fp32's path) and narrowed once; where fp32 takes the AVX2 kernel, that
//   kernel widens as it reads, with no widened copy. On the native path, bf16 tiles too small
//   to pay oneDNN's per-call set-up (about 16 us on an AVX512-BF16 CPU) go to the own kernel.
// GROUPED_EP_CPU_F32_GEMM=blas|avx512|avx2 and GROUPED_EP_CPU_HALF_GEMM=native|widen|avx512|amx|avx2
// override the choice, read on every call (tests run each on any CPU that has it): native sends
// every tile to oneDNN, avx512 / amx / avx2 every tile of the dtype to that own kernel.
#pragma once

#include <ATen/ATen.h>

namespace grouped_ep {

enum class HalfPath { kNative, kWiden };

// How a call computes its tiles: the half path, and for bf16 (native path) and fp32 the FLOP
// count under which a tile goes to the own AVX-512 kernel (0: never; infinity: every tile), and
// whether the shape rules of `own_kernel` (measured for bf16 against oneDNN) apply on top.
struct Plan {
  HalfPath path = HalfPath::kNative;
  double own_below = 0;
  bool shape_rules = false;
  bool widen_own = false;  // widened tiles take the own fp32 kernel (fp32's plan says so)
  bool amx = false;        // the own bf16 kernel is the AMX one (amx_gemm.cpp), not AVX512-BF16
  bool avx2 = false;       // the own kernel is the AVX2 one (avx2_gemm.cpp), for fp32, bf16 and fp16
  bool gemv_mm = false;    // GEMV-like tiles go to at::mm (fp32 on the own AVX-512 kernel; fp16 widened)
};

// The plan for a product of `dt` tiles on this CPU now; raises on a bad override.
Plan plan_for(at::ScalarType dt);

// Whether some tiles of `dt` may take an own kernel under `plan` (fp16 only on the AVX2 one).
inline bool uses_own(const Plan& plan, at::ScalarType dt) {
  const bool typed = dt == at::kBFloat16 || dt == at::kFloat || (dt == at::kHalf && plan.avx2);
  return typed && plan.own_below > 0;
}

}  // namespace grouped_ep
