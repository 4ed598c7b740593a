// Ampere (sm_80+) grouped GEMM: CUTLASS 2.x GemmGrouped with device-only scheduling.
//
// As on sm90, one single-block setup kernel clamps `offs` and writes per-group problem sizes,
// pointers and leading dimensions; the grouped kernel runs on a fixed persistent grid
// (SM count x occupancy) and walks the problem list on the device (GroupScheduleMode::kDeviceOnly),
// so no problem size is needed on the host.
//
// Included by exactly one .cu file per (dtype, GemmKind), which instantiates `run`.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/gemm.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>
#include <cutlass/gemm/kernel/gemm_grouped.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>
#include <cutlass/layout/matrix.h>
#include <cutlass/numeric_types.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "gemm_cuda.h"
#include "offs.cuh"

namespace grouped_ep::cuda::sm80 {

// A is MxK, B is KxN, C/D MxN row-major (CUTLASS 2 convention).
//   forward, w [E, K, N]: A = x_g row-major (lda = K), B = w_g row-major (ldb = N)
//   forward, w [E, N, K]: A = x_g row-major, B = w_g column-major (ldb = K)
//   wgrad: A = a_g^T column-major (M = P, lda = P), B = b_g row-major (ldb = Q), K = group rows
template <typename Element, GemmKind kKind>
struct Config {
  using LayoutA = std::conditional_t<kKind == GemmKind::kWgrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kKind == GemmKind::kFwdWeightNK, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 16 / sizeof(Element);  // 128-bit cp.async

  // The configuration of CUTLASS's grouped GEMM example for 16-bit inputs on A100.
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlignment,  //
      Element, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,  //
      Element, LayoutC, float,                                         //
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,             //
      cutlass::gemm::GemmShape<128, 128, 32>, cutlass::gemm::GemmShape<64, 64, 32>,
      cutlass::gemm::GemmShape<16, 8, 16>,
      cutlass::epilogue::thread::LinearCombination<Element, kAlignment, float, float>,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, /*Stages=*/4,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  static_assert(!Kernel::kTransposed, "row-major C must not need the transposed kernel");
};

// cutlass::Kernel<GemmKernel>, except that the body is left out of the sm_90a image: Hopper runs
// the sm90 kernels (sm90_grouped.cuh), and this saves compiling the 2.x mainloop twice. The
// runtime dispatch never launches it where the body is missing; if it ever did, it traps.
template <typename GemmKernel>
__global__ void __launch_bounds__(GemmKernel::kThreadCount)
    grouped_kernel(typename GemmKernel::Params params) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ int smem[];
  GemmKernel op;
  op(params, *reinterpret_cast<typename GemmKernel::SharedStorage*>(smem));
#else
  __trap();
#endif
#endif
}

struct SetupParams {
  const void* a;
  const void* b;
  void* d;
  int64_t* ends;
  int64_t groups, rows, k, n;
};

template <typename Element>
struct DeviceArrays {
  cutlass::gemm::GemmCoord* sizes;
  Element** ptr_a;
  Element** ptr_b;
  Element** ptr_d;
  int64_t* lda;
  int64_t* ldb;
  int64_t* ldd;
};

template <typename Element, GemmKind kKind, typename OffT>
__global__ void __launch_bounds__(kSetupThreads)
    setup_kernel(const OffT* offs, SetupParams p, DeviceArrays<Element> arr) {
  block_clamp_offs(offs, p.groups, p.rows, p.ends);
  // The kernel only reads A and B; CUTLASS 2 takes non-const pointer arrays.
  auto* a = const_cast<Element*>(static_cast<const Element*>(p.a));
  auto* b = const_cast<Element*>(static_cast<const Element*>(p.b));
  auto* d = static_cast<Element*>(p.d);
  // Host checks guarantee rows, k, n < 2^31; pointer offsets are 64-bit products.
  for (int64_t g = threadIdx.x; g < p.groups; g += kSetupThreads) {
    int64_t start, end;
    group_rows(p.ends, g, start, end);
    const int rows = static_cast<int>(end - start);
    const int k = static_cast<int>(p.k), n = static_cast<int>(p.n);
    if constexpr (kKind == GemmKind::kWgrad) {
      // out[g] (P x Q) = a_g^T b_g; a group without rows gets M = 0 (no tiles), its output
      // block is zeroed by launch_zero_unwritten.
      arr.sizes[g] = cutlass::gemm::GemmCoord(rows > 0 ? k : 0, n, rows);
      arr.ptr_a[g] = a + start * p.k;
      arr.ptr_b[g] = b + start * p.n;
      arr.ptr_d[g] = d + g * p.k * p.n;
      arr.lda[g] = p.k;
      arr.ldb[g] = p.n;
      arr.ldd[g] = p.n;
    } else {
      arr.sizes[g] = cutlass::gemm::GemmCoord(rows, n, k);
      arr.ptr_a[g] = a + start * p.k;
      arr.ptr_b[g] = b + g * p.k * p.n;
      arr.ptr_d[g] = d + start * p.n;
      arr.lda[g] = p.k;
      arr.ldb[g] = kKind == GemmKind::kFwdWeightNK ? p.k : p.n;
      arr.ldd[g] = p.n;
    }
  }
}

// Resident blocks per SM for this kernel, computed once per device (host-side query, no sync).
template <typename Kernel>
int blocks_per_sm(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  const void* fn = reinterpret_cast<const void*>(&grouped_kernel<Kernel>);
  constexpr int kSmem = sizeof(typename Kernel::SharedStorage);
  C10_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int blocks = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, Kernel::kThreadCount, kSmem));
  TORCH_CHECK(blocks > 0, "grouped_ep: the sm80 grouped GEMM kernel cannot run on device ", device,
              " (", kSmem, " bytes of shared memory per block)");
  cache.emplace(device, blocks);
  return blocks;
}

template <typename Element, GemmKind kKind>
void run(const GroupedGemmArgs& args) {
  using Kernel = typename Config<Element, kKind>::Kernel;
  const int64_t E = args.groups;

  ScratchLayout layout;
  const size_t o_sizes = layout.add<cutlass::gemm::GemmCoord>(E);
  const size_t o_pa = layout.add<Element*>(E);
  const size_t o_pb = layout.add<Element*>(E);
  const size_t o_pd = layout.add<Element*>(E);
  const size_t o_lda = layout.add<int64_t>(E);
  const size_t o_ldb = layout.add<int64_t>(E);
  const size_t o_ldd = layout.add<int64_t>(E);
  void* base = args.alloc(layout.bytes());
  DeviceArrays<Element> arr{at_offset<cutlass::gemm::GemmCoord>(base, o_sizes),
                            at_offset<Element*>(base, o_pa),
                            at_offset<Element*>(base, o_pb),
                            at_offset<Element*>(base, o_pd),
                            at_offset<int64_t>(base, o_lda),
                            at_offset<int64_t>(base, o_ldb),
                            at_offset<int64_t>(base, o_ldd)};

  const SetupParams sp{args.a, args.b, args.d, args.ends, E, args.rows, args.k, args.n};
  if (args.offs_int64) {
    setup_kernel<Element, kKind><<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int64_t*>(args.offs), sp, arr);
  } else {
    setup_kernel<Element, kKind><<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int32_t*>(args.offs), sp, arr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int threadblocks = args.sm_count * blocks_per_sm<Kernel>(args.device);
  // beta = 0: the epilogue never reads C (ptr_C may alias D).
  typename Kernel::EpilogueOutputOp::Params epilogue(1.0f, 0.0f);
  typename Kernel::Arguments arguments(arr.sizes, static_cast<int>(E), threadblocks, epilogue,
                                       arr.ptr_a, arr.ptr_b, arr.ptr_d, arr.ptr_d, arr.lda,
                                       arr.ldb, arr.ldd, arr.ldd);
  TORCH_CHECK(Kernel::can_implement(arguments) == cutlass::Status::kSuccess,
              "grouped_ep: CUTLASS sm80 grouped GEMM cannot implement these arguments");
  // kDeviceOnly scheduling needs no workspace and no host problem sizes.
  typename Kernel::Params params(arguments, /*workspace=*/nullptr, /*tile_count=*/0);
  grouped_kernel<Kernel>
      <<<threadblocks, Kernel::kThreadCount, sizeof(typename Kernel::SharedStorage), args.stream>>>(
          params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace grouped_ep::cuda::sm80

#define GROUPED_EP_SM80_INSTANCE(type, kind, Element, Kind) \
  namespace grouped_ep::cuda {                              \
  void sm80_##type##_##kind(const GroupedGemmArgs& args) {  \
    sm80::run<Element, Kind>(args);                         \
  }                                                         \
  }
