// Interface between the CUDA op entry points (gemm_cuda.cpp, host code) and the kernel files: the CUTLASS
// instantiations (sm90_*.cu, sm80_*.cu, one per file so the build runs in parallel) and the
// fallback kernels (fallback.cu). Kept free of ATen and CUTLASS headers so every file that
// includes it compiles fast.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace grouped_ep::cuda {

// What one grouped GEMM computes. Row-major everywhere; `a`, `b`, `d` are contiguous.
enum class GemmKind : int {
  // d[T, N] = a_g[rows, K] @ b[g] per group, b = w [E, K, N]   (gemm, trans_w=False)
  kFwdWeightKN = 0,
  // d[T, N] = a_g[rows, K] @ b[g]^T per group, b = w [E, N, K] (gemm, trans_w=True)
  kFwdWeightNK = 1,
  // d[g] = a_g^T @ b_g with a [T, P], b [T, Q], d [E, P, Q]: the ragged-K weight gradient
  kWgrad = 2,
};

enum class HalfType : int { kBF16 = 0, kFP16 = 1 };

// Stream-ordered device scratch that stays alive until the op returns (the caching allocator).
using ScratchAlloc = std::function<void*(size_t bytes)>;

// Places several device arrays in one scratch allocation, each 128-byte aligned (TMA descriptors
// are built from the pointer arrays' addresses and need 16-byte alignment at least).
class ScratchLayout {
 public:
  template <typename T>
  size_t add(int64_t count) {
    const size_t offset = bytes_;
    bytes_ = (bytes_ + sizeof(T) * static_cast<size_t>(count) + 127) / 128 * 128;
    return offset;
  }
  size_t bytes() const { return bytes_ > 0 ? bytes_ : 128; }

 private:
  size_t bytes_ = 0;
};

template <typename T>
T* at_offset(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

struct GroupedGemmArgs {
  const void* a = nullptr;  // forward: x [T, K];      wgrad: a [T, P]
  const void* b = nullptr;  // forward: w (see kind);  wgrad: b [T, Q]
  void* d = nullptr;        // forward: out [T, N];    wgrad: out [E, P, Q]
  const void* offs = nullptr;  // [E] cumulative end offsets on the device, int32 or int64
  bool offs_int64 = false;
  int64_t* ends = nullptr;  // [E] device scratch: receives the clamped end offsets
  int32_t* ends32 = nullptr;  // optional [E]: the same ends as int32 (torch's offsets), T < 2^31
  int64_t groups = 0;       // E
  int64_t rows = 0;         // T
  int64_t k = 0;            // forward: K; wgrad: P
  int64_t n = 0;            // forward: N; wgrad: Q
  int device = 0;    // CUDA device index (the op's device guard has made it current)
  int sm_count = 0;
  cudaStream_t stream = nullptr;
  ScratchAlloc alloc;
};

// Block size of the single-block kernels that clamp `offs` and write per-group arguments.
constexpr int kSetupThreads = 512;

// Clamps offs on the device: ends[g] = min(max(offs[0..g], 0), T), i.e. non-decreasing and
// within [0, T]. CUDA cannot validate offs without a host sync, so bad offs are clamped instead
// (the CPU kernels raise an error): no kernel can read or write out of bounds. Also writes
// args.ends32 when it is set.
void launch_clamp_offs(const GroupedGemmArgs& args);

// Zeroes what no GEMM tile writes, reading the clamped ends on the device. Forward: rows
// [ends[E-1], T) of d [T, N]. Wgrad: the [P, Q] blocks of groups without rows.
void launch_zero_unwritten(const GroupedGemmArgs& args, GemmKind kind, size_t elem_size);

// Simple tiled kernels (fp32 accumulation, 64-bit indexing) for any dtype and shape. They read
// args.ends (launch_clamp_offs first). dtype: 0 = fp32, 1 = bf16, 2 = fp16.
void fallback_gemm(const GroupedGemmArgs& args, GemmKind kind, int dtype);

// CUTLASS paths. Each writes args.ends and the per-group problem shapes, pointers and strides
// with one device kernel, then launches the grouped GEMM; nothing syncs with the host. They do
// not zero unwritten output (launch_zero_unwritten does).
// Requirements checked by the caller: K and N (P and Q) multiples of 8, 16-byte aligned base
// pointers, T, K, N < 2^31.
bool sm90_compiled();  // false when the toolkit is too old for the Hopper grouped kernels
// Whether the image the current device loads was built for sm_90a (where the CUTLASS sm90
// kernels have their bodies). Host-side query, no launch, no sync.
bool device_runs_sm90a();
void sm90_grouped_gemm(HalfType type, GemmKind kind, const GroupedGemmArgs& args);
void sm80_grouped_gemm(HalfType type, GemmKind kind, const GroupedGemmArgs& args);

// Per-instantiation entry points, one per .cu file.
#define GROUPED_EP_DECLARE_INSTANCE(arch, type, kind) \
  void arch##_##type##_##kind(const GroupedGemmArgs& args);
#define GROUPED_EP_FOR_EACH_INSTANCE(arch, X) \
  X(arch, bf16, fwd_wkn)                      \
  X(arch, bf16, fwd_wnk)                      \
  X(arch, bf16, wgrad)                        \
  X(arch, fp16, fwd_wkn)                      \
  X(arch, fp16, fwd_wnk)                      \
  X(arch, fp16, wgrad)
GROUPED_EP_FOR_EACH_INSTANCE(sm90, GROUPED_EP_DECLARE_INSTANCE)
GROUPED_EP_FOR_EACH_INSTANCE(sm80, GROUPED_EP_DECLARE_INSTANCE)

}  // namespace grouped_ep::cuda
