// Hopper (sm_90a) grouped GEMM: CUTLASS 3.x pointer-array kernel with a device-side problem list.
//
// One single-block setup kernel reads `offs`, clamps it (offs.cuh) and writes, per group, the
// problem shape (M, N, K), the A/B/D pointers and strides into scratch memory. The CUTLASS kernel
// gets those arrays as device pointers and `nullptr` for host problem shapes, so its persistent
// grid is sized from the SM count and group sizes never reach the host.
//
// Included by exactly one .cu file per (dtype, GemmKind), which instantiates `run`.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cutlass/cutlass.h>
#include <cutlass/arch/config.h>

#include "gemm_cuda.h"
#include "offs.cuh"

// Needs CUDA >= 12.3 (device-side TMA descriptor updates). The guard is true in every compile
// pass (host and each -gencode), so all passes see the same kernels; CUTLASS itself compiles the
// kernel body only for sm_90a (elsewhere the body just reports an error, and
// the runtime dispatch never launches it there: see device_supports_sm90a in gemm_cuda.cu).
#if defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define GROUPED_EP_SM90_COMPILED 1

// Only the sm90 pieces of CUTLASS (the umbrella headers pull in every architecture, which costs
// compile time in each of the three nvcc passes).
#include <cute/tensor.hpp>
#include <cutlass/cluster_launch.hpp>
#include <cutlass/device_kernel.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder_decl.hpp>
#include <cutlass/gemm/collective/collective_mma_decl.hpp>
#include <cutlass/gemm/collective/sm90_mma_array_tma_gmma_ss_warpspecialized.hpp>
#include <cutlass/gemm/collective/builders/sm90_gmma_builder.inl>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal_decl.h>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/gemm/kernel/sm90_gemm_array_tma_warpspecialized_cooperative.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <map>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

namespace grouped_ep::cuda::sm90 {

using namespace cute;

// A is MxK, B is NxK (CUTLASS 3 convention), D is MxN row-major.
//   forward, w [E, K, N]: A = x_g (K-major), B = w_g read N-major       -> LayoutB RowMajor
//   forward, w [E, N, K]: A = x_g (K-major), B = w_g read K-major       -> LayoutB ColumnMajor
//   wgrad:  A = a_g^T (M-major, M = P), B = b_g (N-major, N = Q), K = group rows (ragged)
template <typename Element, GemmKind kKind>
struct Config {
  using LayoutA = std::conditional_t<kKind == GemmKind::kWgrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kKind == GemmKind::kFwdWeightNK, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 16 / sizeof(Element);  // TMA: 16-byte aligned rows

  // 128x256x64 cooperative tiles on 2x1 clusters (B multicast across the pair): the config
  // torch._grouped_mm uses for large bf16 problems on H100. Tuning is left to the benchmarks.
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

  // void C: the epilogue never reads a source matrix (D = 1 * acc).
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignment,
      Element, LayoutD*, kAlignment, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
      LayoutB*, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;

  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

template <typename Cfg, typename Element>
struct DeviceArrays {
  typename Cfg::Shape3* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  Element** ptr_d;
  typename Cfg::StrideA* stride_a;
  typename Cfg::StrideB* stride_b;
  typename Cfg::StrideD* stride_d;
};

struct SetupParams {
  const void* a;
  const void* b;
  void* d;
  int64_t* ends;
  int64_t groups, rows, k, n;
};

template <typename Cfg, typename Element, GemmKind kKind, typename OffT>
__global__ void __launch_bounds__(kSetupThreads)
    setup_kernel(const OffT* offs, SetupParams p, DeviceArrays<Cfg, Element> arr) {
  block_clamp_offs(offs, p.groups, p.rows, p.ends);
  const auto* a = static_cast<const Element*>(p.a);
  const auto* b = static_cast<const Element*>(p.b);
  auto* d = static_cast<Element*>(p.d);
  // Host checks guarantee rows, k, n < 2^31, so the int casts below are exact. Offsets are
  // 64-bit products.
  for (int64_t g = threadIdx.x; g < p.groups; g += kSetupThreads) {
    int64_t start, end;
    group_rows(p.ends, g, start, end);
    const int rows = static_cast<int>(end - start);
    const int k = static_cast<int>(p.k), n = static_cast<int>(p.n);
    if constexpr (kKind == GemmKind::kWgrad) {
      // out[g] (P x Q) = a_g^T b_g: M = P, N = Q, K = rows. A group without rows gets M = 0,
      // i.e. no tiles at all; its output block is zeroed by launch_zero_unwritten.
      arr.shapes[g] = make_shape(rows > 0 ? k : 0, n, rows);
      arr.ptr_a[g] = a + start * p.k;
      arr.ptr_b[g] = b + start * p.n;
      arr.ptr_d[g] = d + g * p.k * p.n;
      arr.stride_a[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(k, rows, 1));
      arr.stride_b[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(n, rows, 1));
      arr.stride_d[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(k, n, 1));
    } else {
      // out rows [start, end) = x rows [start, end) @ w_g: M = rows (0 for an empty group).
      arr.shapes[g] = make_shape(rows, n, k);
      arr.ptr_a[g] = a + start * p.k;
      arr.ptr_b[g] = b + g * p.k * p.n;
      arr.ptr_d[g] = d + start * p.n;
      arr.stride_a[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(rows, k, 1));
      arr.stride_b[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(n, k, 1));
      arr.stride_d[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(rows, n, 1));
    }
  }
}

// Lets `kernel` use `bytes` of dynamic shared memory on `device`: once per device, so that a
// CUDA-graph capture never has to call into the driver for it.
inline void allow_dynamic_smem(const void* kernel, int bytes, int device) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.insert({kernel, device});
}

// The SM count and the number of clusters that fit on the device at once, for
// KernelHardwareInfo (example 57 fills it with make_kernel_hardware_info): with a cluster count
// the persistent grid is a whole number of clusters that can all be resident. CUTLASS's own
// query leaves out the dynamic shared memory (then it overestimates, and the scheduler ignores
// it); this one passes the kernel's. Once per (kernel, device), after allow_dynamic_smem.
template <typename Kernel, typename ClusterShape>
cutlass::KernelHardwareInfo hardware_info(const void* kernel, int smem, int device,
                                          int sm_count) {
  static std::mutex mutex;
  static std::map<int, cutlass::KernelHardwareInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int clusters = 0;  // unknown: 0 makes CUTLASS size the grid from the SM count
#if defined(CUTLASS_SM90_CLUSTER_LAUNCH_ENABLED)
  const dim3 cluster(size<0>(ClusterShape{}), size<1>(ClusterShape{}), size<2>(ClusterShape{}));
  auto config = cutlass::ClusterLauncher::make_cluster_launch_config(
      cluster, cluster, dim3(Kernel::MaxThreadsPerBlock, 1, 1), smem);
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config.launch_config) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
#endif
  const cutlass::KernelHardwareInfo info{device, sm_count, clusters};
  return cache.emplace(device, info).first->second;
}

inline void check_cutlass(cutlass::Status status, const char* what) {
  TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_ep: CUTLASS sm90 grouped GEMM ", what,
              " failed: ", cutlass::cutlassGetStatusString(status));
}

template <typename Element, GemmKind kKind>
void run(const GroupedGemmArgs& args) {
  using Cfg = Config<Element, kKind>;
  using Kernel = typename Cfg::Kernel;
  const int64_t E = args.groups;

  ScratchLayout layout;
  const size_t o_shapes = layout.add<typename Cfg::Shape3>(E);
  const size_t o_pa = layout.add<const Element*>(E);
  const size_t o_pb = layout.add<const Element*>(E);
  const size_t o_pd = layout.add<Element*>(E);
  const size_t o_sa = layout.add<typename Cfg::StrideA>(E);
  const size_t o_sb = layout.add<typename Cfg::StrideB>(E);
  const size_t o_sd = layout.add<typename Cfg::StrideD>(E);
  void* base = args.alloc(layout.bytes());
  DeviceArrays<Cfg, Element> arr{
      at_offset<typename Cfg::Shape3>(base, o_shapes), at_offset<const Element*>(base, o_pa),
      at_offset<const Element*>(base, o_pb),           at_offset<Element*>(base, o_pd),
      at_offset<typename Cfg::StrideA>(base, o_sa),    at_offset<typename Cfg::StrideB>(base, o_sb),
      at_offset<typename Cfg::StrideD>(base, o_sd)};

  const SetupParams sp{args.a, args.b, args.d, args.ends, E, args.rows, args.k, args.n};
  if (args.offs_int64) {
    setup_kernel<Cfg, Element, kKind><<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int64_t*>(args.offs), sp, arr);
  } else {
    setup_kernel<Cfg, Element, kKind><<<1, kSetupThreads, 0, args.stream>>>(
        static_cast<const int32_t*>(args.offs), sp, arr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
  constexpr int kSmem = Kernel::SharedStorageSize;
  allow_dynamic_smem(kernel, kSmem, args.device);
  const cutlass::KernelHardwareInfo hw_info =
      hardware_info<Kernel, typename Cfg::ClusterShape>(kernel, kSmem, args.device, args.sm_count);

  typename Kernel::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(E), arr.shapes, /*host_problem_shapes=*/nullptr},
      {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b},
      {{}, /*ptr_C=*/nullptr, /*dC=*/nullptr, arr.ptr_d, arr.stride_d},
      hw_info};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  arguments.epilogue.thread.dAlpha = {_0{}, _0{}, 0};
  arguments.epilogue.thread.dBeta = {_0{}, _0{}, 0};

  // What cutlass::gemm::device::GemmUniversalAdapter does, without its headers.
  TORCH_CHECK(Kernel::can_implement(arguments),
              "grouped_ep: CUTLASS sm90 grouped GEMM cannot implement these arguments");
  void* workspace = args.alloc(Kernel::get_workspace_size(arguments));
  check_cutlass(Kernel::initialize_workspace(arguments, workspace, args.stream),
                "workspace initialization");
  typename Kernel::Params params = Kernel::to_underlying_arguments(arguments, workspace);

  const dim3 grid = Kernel::get_grid_shape(params);
  const dim3 block = Kernel::get_block_shape();
  const dim3 cluster(size<0>(typename Cfg::ClusterShape{}), size<1>(typename Cfg::ClusterShape{}),
                     size<2>(typename Cfg::ClusterShape{}));
  void* kernel_params[] = {&params};
  const cutlass::Status status = cutlass::ClusterLauncher::launch(grid, cluster, block, kSmem,
                                                                  args.stream, kernel,
                                                                  kernel_params);
  // Read the CUDA error first: it says why a launch failed, and must not be left pending.
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(status == cutlass::Status::kSuccess && err == cudaSuccess,
              "grouped_ep: CUTLASS sm90 grouped GEMM launch failed: ",
              cutlass::cutlassGetStatusString(status), "; CUDA: ", cudaGetErrorString(err),
              " (grid ", grid.x, "x", grid.y, ", cluster ", cluster.x, "x", cluster.y, ")");
}

}  // namespace grouped_ep::cuda::sm90

#define GROUPED_EP_SM90_INSTANCE(type, kind, Element, Kind)              \
  namespace grouped_ep::cuda {                                           \
  void sm90_##type##_##kind(const GroupedGemmArgs& args) {               \
    sm90::run<Element, Kind>(args);                                      \
  }                                                                      \
  }

#else  // no CUTLASS sm90 support in this toolkit

#define GROUPED_EP_SM90_INSTANCE(type, kind, Element, Kind)                                  \
  namespace grouped_ep::cuda {                                                               \
  void sm90_##type##_##kind(const GroupedGemmArgs&) {                                        \
    TORCH_CHECK(false, "grouped_ep: built without the sm90 grouped GEMM (needs CUDA >= 12.3)"); \
  }                                                                                          \
  }

#endif
