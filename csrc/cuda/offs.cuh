// Device-side handling of `offs`, shared by the setup kernels of every path.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "gemm_cuda.h"

namespace grouped_ep::cuda {

struct MaxOp {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

// Called by every thread of a kSetupThreads-thread block. Writes the clamped end offsets
// ends[g] = min(max(0, offs[0], ..., offs[g]), T): a non-decreasing sequence within [0, T], equal
// to offs wherever offs is valid. Bad offs (decreasing, negative, past T) thus give empty or
// truncated groups instead of out-of-bounds reads and writes. On return `ends` is visible to
// the whole block.
// When ends32 is not null it receives the same values as int32 (rows < 2^31 then).
template <typename OffT>
__device__ void block_clamp_offs(const OffT* offs, int64_t groups, int64_t rows, int64_t* ends,
                                 int32_t* ends32 = nullptr) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage temp;
  int64_t carry = 0;  // running max of the previous chunks; starting at 0 clamps negatives
  for (int64_t base = 0; base < groups; base += kSetupThreads) {
    const int64_t g = base + threadIdx.x;
    // 0 is neutral here: every value is max-ed with carry >= 0 anyway.
    int64_t v = g < groups ? static_cast<int64_t>(offs[g]) : 0;
    int64_t chunk_max;  // cub gives every thread the block-wide aggregate
    Scan(temp).InclusiveScan(v, v, MaxOp{}, chunk_max);
    v = v > carry ? v : carry;
    if (g < groups) {
      ends[g] = v < rows ? v : rows;
      if (ends32 != nullptr) ends32[g] = static_cast<int32_t>(ends[g]);
    }
    carry = chunk_max > carry ? chunk_max : carry;
    __syncthreads();  // `temp` is reused by the next chunk; also publishes `ends`
  }
}

// Rows [start, end) of group g, from the clamped ends.
__device__ __forceinline__ void group_rows(const int64_t* ends, int64_t g, int64_t& start,
                                           int64_t& end) {
  start = g == 0 ? 0 : ends[g - 1];
  end = ends[g];
}

}  // namespace grouped_ep::cuda
