// Fallback grouped GEMM kernels: any dtype (fp32, bf16, fp16), any K and N (no alignment), any
// device. Classic shared-memory tiling: a 256-thread block computes a 64x64 output tile, each
// thread 4x4 outputs, in fp32, stepping through the reduction 16 at a time. All indexing is
// 64-bit. Group bounds come from the clamped `ends` (launch_clamp_offs) on the device.
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "gemm_cuda.h"
#include "offs.cuh"

namespace grouped_ep::cuda {
namespace {

constexpr int kTile = 64;      // output tile: kTile x kTile
constexpr int kStep = 16;      // reduction step
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPer = kTile / 16;

// Accumulates acc += As^T Bs for one kStep slice: As[kk][row], Bs[kk][col].
__device__ __forceinline__ void mma_step(const float (&As)[kStep][kTile],
                                         const float (&Bs)[kStep][kTile], float (&acc)[kPer][kPer],
                                         int tx, int ty) {
#pragma unroll
  for (int kk = 0; kk < kStep; ++kk) {
    float a[kPer], b[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
    for (int j = 0; j < kPer; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[i][j] += a[i] * b[j];
  }
}

// Forward: out rows [start, end) of group g = x rows [start, end) @ w_g. blockIdx.x enumerates
// the 64-row tiles of all groups in order (group-aligned, so a tile never spans two groups);
// gridDim.x is an upper bound (ceil(T/64) + E) and surplus blocks exit. Column tiles of 64 are
// walked with a grid-stride loop over blockIdx.y (gridDim.y <= 65535), so N has no limit.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
               const int64_t* __restrict__ ends, int64_t groups, int64_t K, int64_t N,
               bool trans_w) {
  int64_t tile = blockIdx.x, g = 0, start = 0, end = 0;
  for (; g < groups; ++g) {
    group_rows(ends, g, start, end);
    const int64_t tiles = (end - start + kTile - 1) / kTile;
    if (tile < tiles) break;
    tile -= tiles;
  }
  if (g == groups) return;
  const int64_t row0 = start + tile * kTile;
  const T* wg = w + g * K * N;
  const int64_t col_tiles = (N + kTile - 1) / kTile;

  __shared__ float As[kStep][kTile];
  __shared__ float Bs[kStep][kTile];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  for (int64_t col_tile = blockIdx.y; col_tile < col_tiles; col_tile += gridDim.y) {
  const int64_t col0 = col_tile * kTile;
  float acc[kPer][kPer] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kStep) {
    for (int idx = tid; idx < kStep * kTile; idx += kThreads) {
      // A: consecutive threads walk K (x is row-major [T, K]).
      const int kk = idx % kStep, r = idx / kStep;
      const int64_t row = row0 + r, k = k0 + kk;
      As[kk][r] = (row < end && k < K) ? static_cast<float>(x[row * K + k]) : 0.f;
      // B: consecutive threads walk w's contiguous dimension.
      int kb, c;
      if (trans_w) {
        kb = idx % kStep, c = idx / kStep;
      } else {
        kb = idx / kTile, c = idx % kTile;
      }
      const int64_t kg = k0 + kb, col = col0 + c;
      float v = 0.f;
      if (kg < K && col < N) v = static_cast<float>(trans_w ? wg[col * K + kg] : wg[kg * N + col]);
      Bs[kb][c] = v;
    }
    __syncthreads();
    mma_step(As, Bs, acc, tx, ty);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t row = row0 + ty + 16 * i;
    if (row >= end) continue;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t col = col0 + tx + 16 * j;
      if (col < N) out[row * N + col] = static_cast<T>(acc[i][j]);
    }
  }
  }  // col_tile
}

// Weight gradient: out[g] (P x Q) = a_g^T b_g over the rows of group g. blockIdx.x = group x
// 64-row tile of P; blockIdx.y strides over the 64-column tiles of Q. Every element of out is written here, groups
// without rows included (as zeros).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    wgrad_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                 const int64_t* __restrict__ ends, int64_t P, int64_t Q, int64_t p_tiles) {
  const int64_t g = blockIdx.x / p_tiles;
  const int64_t p0 = (blockIdx.x % p_tiles) * kTile;
  const int64_t q_tiles = (Q + kTile - 1) / kTile;
  int64_t start, end;
  group_rows(ends, g, start, end);

  __shared__ float As[kStep][kTile];
  __shared__ float Bs[kStep][kTile];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  for (int64_t q_tile = blockIdx.y; q_tile < q_tiles; q_tile += gridDim.y) {
  const int64_t q0 = q_tile * kTile;
  float acc[kPer][kPer] = {};
  for (int64_t t0 = start; t0 < end; t0 += kStep) {
    for (int idx = tid; idx < kStep * kTile; idx += kThreads) {
      const int kk = idx / kTile, c = idx % kTile;  // consecutive threads walk a row
      const int64_t t = t0 + kk;
      As[kk][c] = (t < end && p0 + c < P) ? static_cast<float>(a[t * P + p0 + c]) : 0.f;
      Bs[kk][c] = (t < end && q0 + c < Q) ? static_cast<float>(b[t * Q + q0 + c]) : 0.f;
    }
    __syncthreads();
    mma_step(As, Bs, acc, tx, ty);
    __syncthreads();
  }
  T* og = out + g * P * Q;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t p = p0 + ty + 16 * i;
    if (p >= P) continue;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t q = q0 + tx + 16 * j;
      if (q < Q) og[p * Q + q] = static_cast<T>(acc[i][j]);
    }
  }
  }  // q_tile
}

template <typename T>
void launch(const GroupedGemmArgs& args, GemmKind kind) {
  const auto* a = static_cast<const T*>(args.a);
  const auto* b = static_cast<const T*>(args.b);
  auto* d = static_cast<T*>(args.d);
  // The kernels stride over column tiles, so any N fits in gridDim.y's 65535.
  const int64_t col_tiles = std::min<int64_t>((args.n + kTile - 1) / kTile, 65535);
  if (kind == GemmKind::kWgrad) {
    const int64_t p_tiles = (args.k + kTile - 1) / kTile;
    const int64_t blocks = args.groups * p_tiles;
    TORCH_CHECK(blocks < (int64_t{1} << 31), "grouped_ep: gemm_wgrad fallback grid too large");
    wgrad_kernel<T><<<dim3(blocks, col_tiles), kThreads, 0, args.stream>>>(a, b, d, args.ends,
                                                                          args.k, args.n, p_tiles);
  } else {
    // Sum over groups of ceil(rows_g / 64) <= ceil(T / 64) + E.
    const int64_t blocks = (args.rows + kTile - 1) / kTile + args.groups;
    TORCH_CHECK(blocks < (int64_t{1} << 31), "grouped_ep: gemm fallback grid too large");
    fwd_kernel<T><<<dim3(blocks, col_tiles), kThreads, 0, args.stream>>>(
        a, b, d, args.ends, args.groups, args.k, args.n, kind == GemmKind::kFwdWeightNK);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void fallback_gemm(const GroupedGemmArgs& args, GemmKind kind, int dtype) {
  switch (dtype) {
    case 0:
      return launch<float>(args, kind);
    case 1:
      return launch<c10::BFloat16>(args, kind);
    case 2:
      return launch<c10::Half>(args, kind);
    default:
      TORCH_CHECK(false, "grouped_ep: fallback GEMM got an unknown dtype code ", dtype);
  }
}

}  // namespace grouped_ep::cuda
