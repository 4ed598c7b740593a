// CUDA implementations of grouped_ep::gemm and grouped_ep::gemm_wgrad.
//
// Which kernel runs (decided on the host from shapes, dtype and the device, never from offs):
//   bf16 / fp16, K % 8 == 0 and N % 8 == 0 (P, Q for wgrad), 16-byte aligned base pointers,
//   T, K, N < 2^31:
//     - sm_90 device and an sm_90a image in this build -> CUTLASS 3.x pointer-array grouped GEMM
//       (sm90_*.cu: TMA + WGMMA, warp-specialized cooperative, problem list on the device);
//     - otherwise sm_80 or newer -> CUTLASS 2.x GemmGrouped, device-only scheduling (sm80_*.cu);
//   everything else -> the tiled fallback kernels (fallback.cu):
//     - fp32 (exact fp32 products; CUTLASS would round to tf32),
//     - K or N not a multiple of 8 (TMA and cp.async need 16-byte aligned rows),
//     - devices older than sm_80, and inputs with 2^31 rows or more.
//
// No path syncs with the host: `offs` stays on the device. A single-block kernel clamps it
// (ends[g] = min(max(offs[0..g], 0), T), see offs.cuh) and writes the per-group arguments; rows
// and groups that no GEMM tile covers are zeroed by a kernel that reads the clamped ends. So on
// CUDA, bad offs (decreasing, negative, past T) give clamped groups, never out-of-bounds access;
// the CPU kernels raise an error for them instead (they can read offs for free). Everything runs
// on the current stream with caching-allocator scratch, so the ops are CUDA-graph capturable.
//
// This file is host code (compiled once, by the C++ compiler); kernels live in the .cu files.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "checks.h"
#include "gemm_cuda.h"

namespace grouped_ep::cuda {

// ---- dispatch ------------------------------------------------------------------------------

void sm90_grouped_gemm(HalfType type, GemmKind kind, const GroupedGemmArgs& args) {
  using Fn = void (*)(const GroupedGemmArgs&);
  static constexpr Fn table[2][3] = {
      {sm90_bf16_fwd_wkn, sm90_bf16_fwd_wnk, sm90_bf16_wgrad},
      {sm90_fp16_fwd_wkn, sm90_fp16_fwd_wnk, sm90_fp16_wgrad}};
  table[static_cast<int>(type)][static_cast<int>(kind)](args);
}

void sm80_grouped_gemm(HalfType type, GemmKind kind, const GroupedGemmArgs& args) {
  using Fn = void (*)(const GroupedGemmArgs&);
  static constexpr Fn table[2][3] = {
      {sm80_bf16_fwd_wkn, sm80_bf16_fwd_wnk, sm80_bf16_wgrad},
      {sm80_fp16_fwd_wkn, sm80_fp16_fwd_wnk, sm80_fp16_wgrad}};
  table[static_cast<int>(type)][static_cast<int>(kind)](args);
}

namespace {

struct DeviceInfo {
  int major = 0;
  int sm_count = 0;
  bool sm90a = false;  // the sm90 CUTLASS kernels can run here
  // The sm80 CUTLASS kernels can run here: not where the device loads this build's sm_90a
  // image, in which their body is left out (a toolkit too old for the sm90 kernels would
  // otherwise send an H100 to a trap). Such a device takes the fallback instead.
  bool sm80 = false;
};

// Computed once per device: host-side queries only (no sync, fine during graph capture).
const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  DeviceInfo info;
  info.major = prop->major;
  info.sm_count = prop->multiProcessorCount;
  const bool image_90a = prop->major == 9 && device_runs_sm90a();
  info.sm90a = image_90a && sm90_compiled();
  info.sm80 = prop->major >= 8 && !image_90a;
  return cache.emplace(device, info).first->second;
}

enum class Path { kSm90, kSm80, kFallback };

Path choose_path(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d, int64_t groups,
                 int64_t rows, int64_t k, int64_t n, const DeviceInfo& info) {
  const auto dt = a.scalar_type();
  if (dt != at::kBFloat16 && dt != at::kHalf) return Path::kFallback;
  if (k % 8 != 0 || n % 8 != 0) return Path::kFallback;
  constexpr int64_t kIntMax = (int64_t{1} << 31) - 1;
  if (rows > kIntMax || k > kIntMax || n > kIntMax || groups > kIntMax) return Path::kFallback;
  for (const at::Tensor* t : {&a, &b, &d}) {
    if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0) return Path::kFallback;
  }
  if (info.sm90a) return Path::kSm90;
  if (info.sm80) return Path::kSm80;
  return Path::kFallback;
}

int dtype_code(at::ScalarType dt) {
  return dt == at::kFloat ? 0 : dt == at::kBFloat16 ? 1 : 2;
}

// Runs one grouped product. `d` is already allocated (first, before any scratch). a, b, d
// contiguous.
void run_grouped(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                 const at::Tensor& offs, GemmKind kind, int64_t rows, int64_t k, int64_t n) {
  const int device = a.get_device();
  const DeviceInfo& info = device_info(device);
  std::vector<at::Tensor> scratch;  // freed on return: later work on this stream may reuse it
  const auto byte_opts = a.options().dtype(at::kByte);
  GroupedGemmArgs args;
  args.a = a.const_data_ptr();
  args.b = b.const_data_ptr();
  args.d = d.data_ptr();
  args.offs = offs.const_data_ptr();
  args.offs_int64 = offs.scalar_type() == at::kLong;
  args.groups = offs.size(0);
  args.rows = rows;
  args.k = k;
  args.n = n;
  args.device = device;
  args.sm_count = info.sm_count;
  args.stream = at::cuda::getCurrentCUDAStream(device).stream();
  args.alloc = [&](size_t bytes) -> void* {
    scratch.push_back(at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 16))}, byte_opts));
    return scratch.back().data_ptr();
  };
  args.ends = static_cast<int64_t*>(args.alloc(sizeof(int64_t) * args.groups));

  const Path path = choose_path(a, b, d, args.groups, rows, k, n, info);
  if (path == Path::kFallback) {
    launch_clamp_offs(args);
    fallback_gemm(args, kind, dtype_code(a.scalar_type()));
    // The wgrad fallback writes every block itself, empty groups included.
    if (kind != GemmKind::kWgrad) launch_zero_unwritten(args, kind, d.element_size());
    return;
  }
  const HalfType type = a.scalar_type() == at::kBFloat16 ? HalfType::kBF16 : HalfType::kFP16;
  if (path == Path::kSm90) {
    sm90_grouped_gemm(type, kind, args);
  } else {
    sm80_grouped_gemm(type, kind, args);
  }
  launch_zero_unwritten(args, kind, d.element_size());
}

// gemm: x [T, K], w [E, K, N] (or [E, N, K] with trans_w), offs [E] -> [T, N].
at::Tensor gemm_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& offs_in,
                     bool trans_w) {
  check_gemm_inputs(x_in, w_in, offs_in, trans_w);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t T = x_in.size(0), K = x_in.size(1), E = w_in.size(0);
  const int64_t N = trans_w ? w_in.size(1) : w_in.size(2);
  auto out = at::empty({T, N}, x_in.options());
  if (T == 0 || N == 0) return out;
  if (E == 0 || K == 0) return out.zero_();  // no group, or empty products: all rows are zero
  const auto x = x_in.contiguous(), w = w_in.contiguous(), offs = offs_in.contiguous();
  run_grouped(x, w, out, offs, trans_w ? GemmKind::kFwdWeightNK : GemmKind::kFwdWeightKN, T, K,
              N);
  return out;
}

// gemm_wgrad: x [T, K], dy [T, N], offs [E] -> [E, K, N] (x_g^T dy_g), or [E, N, K] (dy_g^T x_g)
// with trans_w.
at::Tensor gemm_wgrad_cuda(const at::Tensor& x_in, const at::Tensor& dy_in,
                           const at::Tensor& offs_in, bool trans_w) {
  check_wgrad_inputs(x_in, dy_in, offs_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  // out[g] = a_g^T b_g with (a, b) = (x, dy), or (dy, x) for the transposed layout.
  const at::Tensor& a_in = trans_w ? dy_in : x_in;
  const at::Tensor& b_in = trans_w ? x_in : dy_in;
  const int64_t T = x_in.size(0), E = offs_in.size(0), P = a_in.size(1), Q = b_in.size(1);
  auto out = at::empty({E, P, Q}, x_in.options());
  if (out.numel() == 0) return out;
  if (T == 0) return out.zero_();  // every group is empty
  const auto a = a_in.contiguous(), b = b_in.contiguous(), offs = offs_in.contiguous();
  run_grouped(a, b, out, offs, GemmKind::kWgrad, T, P, Q);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CUDA, m) {
  m.impl("gemm", &gemm_cuda);
  m.impl("gemm_wgrad", &gemm_wgrad_cuda);
}

}  // namespace grouped_ep::cuda
