// Small device kernels shared by every path: clamping offs, zeroing what no GEMM tile writes,
// and the sm_90a probe. No ATen here, so this file compiles fast for every architecture.
#include <c10/cuda/CUDAException.h>

#include <cutlass/arch/config.h>

#include <cstdint>

#include "gemm_cuda.h"
#include "offs.cuh"

namespace grouped_ep::cuda {

// ---- small device kernels ------------------------------------------------------------------

template <typename OffT>
__global__ void __launch_bounds__(kSetupThreads)
    clamp_offs_kernel(const OffT* offs, int64_t groups, int64_t rows, int64_t* ends,
                      int32_t* ends32) {
  block_clamp_offs(offs, groups, rows, ends, ends32);
}

void launch_clamp_offs(const GroupedGemmArgs& args) {
  if (args.offs_int64) {
    clamp_offs_kernel<<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int64_t*>(args.offs), args.groups, args.rows, args.ends, args.ends32);
  } else {
    clamp_offs_kernel<<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int32_t*>(args.offs), args.groups, args.rows, args.ends, args.ends32);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Zeroes bytes [0, n) of p with the whole grid: 16-byte stores in the aligned middle.
__device__ void grid_zero_bytes(char* p, int64_t n) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
  const int64_t head = min(n, misalign == 0 ? int64_t{0} : 16 - misalign);
  const int64_t vectors = (n - head) / 16;
  for (int64_t i = tid; i < head; i += stride) p[i] = 0;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  for (int64_t i = tid; i < vectors; i += stride) v[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + vectors * 16 + tid; i < n; i += stride) p[i] = 0;
}

// Forward: rows [ends[E-1], T) belong to no group.
__global__ void zero_tail_rows_kernel(char* out, const int64_t* ends, int64_t groups, int64_t rows,
                                      int64_t row_bytes) {
  const int64_t used = groups > 0 ? ends[groups - 1] : 0;
  grid_zero_bytes(out + used * row_bytes, (rows - used) * row_bytes);
}

// Wgrad: groups without rows get an exact-zero gradient block.
__global__ void zero_empty_groups_kernel(char* out, const int64_t* ends, int64_t groups,
                                         int64_t group_bytes) {
  for (int64_t g = 0; g < groups; ++g) {
    int64_t start, end;
    group_rows(ends, g, start, end);
    if (end == start) grid_zero_bytes(out + g * group_bytes, group_bytes);
  }
}

void launch_zero_unwritten(const GroupedGemmArgs& args, GemmKind kind, size_t elem_size) {
  const int blocks = 4 * args.sm_count, threads = 256;
  char* out = static_cast<char*>(args.d);
  const int64_t es = static_cast<int64_t>(elem_size);
  if (kind == GemmKind::kWgrad) {
    zero_empty_groups_kernel<<<blocks, threads, 0, args.stream>>>(out, args.ends, args.groups,
                                                                   args.k * args.n * es);
  } else {
    zero_tail_rows_kernel<<<blocks, threads, 0, args.stream>>>(out, args.ends, args.groups,
                                                               args.rows, args.n * es);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Holds its static shared memory only in the sm_90a image: cudaFuncGetAttributes on it tells,
// without launching anything, whether the image this device loads was built for sm_90a (where
// the CUTLASS sm90 kernels have their bodies; in a plain sm_90 image they only print an error).
__global__ void sm90a_probe_kernel(int* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ volatile int marker[32];
  marker[threadIdx.x % 32] = static_cast<int>(threadIdx.x);
  if (sink != nullptr) *sink = marker[(threadIdx.x + 1) % 32];
#endif
}

// The sm90_*.cu files compile their kernels under this same toolkit-version condition.
bool sm90_compiled() {
#if defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
  return true;
#else
  return false;
#endif
}

bool device_runs_sm90a() {
  cudaFuncAttributes attr{};
  const cudaError_t err =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&sm90a_probe_kernel));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no image for this device: leave the error to the launches
    return false;
  }
  return attr.sharedSizeBytes > 0;
}

}  // namespace grouped_ep::cuda
