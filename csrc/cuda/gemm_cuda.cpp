// CUDA implementations of grouped_ep::gemm and grouped_ep::gemm_wgrad.
//
// Three backends (decided on the host from the request, dtype, shapes and the device, never from
// offs; see choose_backend):
//   torch    torch._grouped_mm's grouped kernel: bf16 on compute capability 9.0 / 10.0 (elsewhere
//            torch loops over groups with a host sync, so this backend is not used there);
//   cutlass  this project's CUTLASS kernels: bf16 / fp16, sm90a image -> CUTLASS 3.x pointer-array
//            grouped GEMM (sm90_*.cu), other sm_80+ -> CUTLASS 2.x GemmGrouped (sm80_*.cu);
//   fallback tiled kernels (fallback.cu) for any dtype, shape and device (PTX embedded).
// torch and cutlass need K % 8 == 0 and N % 8 == 0 (P, Q for wgrad), 16-byte aligned base
// pointers and T, K, N < 2^31; a case a backend cannot run goes to the fallback.
// Default (request "auto"): torch where it runs the case (bf16 on sm 9.0 / 10.0), else CUTLASS
// on architectures listed in kCutlassVerified (the GPU tests passed there; on sm 9.0 that makes
// fp16 CUTLASS), else the fallback. bf16 stays on torch where both run: on an H200 the CUTLASS
// kernel measured 0.950x torch._grouped_mm on the geometric mean of the gemm bench
// (bench/results/nvidia-h200-20261126-0253-quick.md) and the torch backend 0.942x in another
// run: parity, so the kernel torch maintains stays. fp16 CUTLASS ran 1.6x torch's fp16 path
// (a per-group loop) and 19x to 51x the fallback.
//
// No path syncs with the host: `offs` stays on the device. A single-block kernel clamps it
// (ends[g] = min(max(offs[0..g], 0), T), see offs.cuh); rows and groups that no GEMM tile covers
// are zeroed by a kernel that reads the clamped ends. So on CUDA, bad offs (decreasing,
// negative, past T) give clamped groups, never out-of-bounds access; the CPU kernels raise an
// error for them instead. The torch backend gets the clamped ends as its int32 offsets. All
// work runs on the current stream with caching-allocator scratch (CUDA-graph capturable).
//
// This file is host code (compiled once, by the C++ compiler); kernels live in the .cu files.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/_grouped_mm.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend.h"
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

using backend::Backend;

// The (compute capability, CUTLASS kernels) pairs whose kernels passed tests/test_gemm_cuda.py;
// only there can `auto` pick them. A device of a listed capability that runs other kernels is
// not verified: an H100 with a build lacking the sm_90a image runs the sm80 kernels, which have
// not run on a GPU. 90 / sm90a: an H200, torch 2.11.0+cu130, 2026-11-26
// (bench/results/nvidia-h200-20261126-gpu-session.md).
struct Verified {
  int cc;  // major * 10 + minor
  const char* kernels;  // kernels_name(): "sm90a" or "sm80"
};
constexpr std::array<Verified, 1> kCutlassVerified{{{90, "sm90a"}}};

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  std::string name;
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
  info.minor = prop->minor;
  info.name = prop->name;
  info.sm_count = prop->multiProcessorCount;
  const bool image_90a = prop->major == 9 && device_runs_sm90a();
  info.sm90a = image_90a && sm90_compiled();
  info.sm80 = prop->major >= 8 && !image_90a;
  return cache.emplace(device, info).first->second;
}

// The facts about one call that decide its backend.
struct Case {
  at::ScalarType dtype;
  int64_t groups, rows, k, n;
  bool aligned;  // every base pointer 16-byte aligned
};

struct Choice {
  Backend backend;
  std::string reason;
};

// Why the CUTLASS or torch kernels cannot take `c` ("" when they can): the requirements both
// share (16-byte rows for TMA / cp.async, 32-bit problem sizes).
std::string shape_limits(const Case& c) {
  constexpr int64_t kIntMax = (int64_t{1} << 31) - 1;
  if (c.k % 8 != 0 || c.n % 8 != 0) return "K and N must be multiples of 8 (16-byte rows)";
  if (c.rows > kIntMax || c.k > kIntMax || c.n > kIntMax || c.groups > kIntMax) {
    return "T, K, N must be below 2^31";
  }
  if (!c.aligned) return "a base pointer is not 16-byte aligned";
  return "";
}

std::string torch_refusal(const Case& c, const DeviceInfo& info) {
  if (c.dtype != at::kBFloat16) {
    return "torch._grouped_mm has a grouped kernel for bf16 only (other dtypes loop with a host "
           "sync)";
  }
  const bool arch = (info.major == 9 || info.major == 10) && info.minor == 0;
  if (!arch) {
    return "torch._grouped_mm's grouped kernel needs compute capability 9.0 or 10.0 (elsewhere "
           "it loops with a host sync)";
  }
  return shape_limits(c);
}

std::string cutlass_refusal(const Case& c, const DeviceInfo& info) {
  if (c.dtype != at::kBFloat16 && c.dtype != at::kHalf) return "CUTLASS kernels are bf16/fp16";
  if (!info.sm90a && !info.sm80) {
    return "this build has no CUTLASS kernel for sm_" + std::to_string(info.major * 10 + info.minor);
  }
  return shape_limits(c);
}

// The CUTLASS kernels `info`'s device runs: "sm90a", "sm80" or "none".
const char* kernels_name(const DeviceInfo& info) {
  return info.sm90a ? "sm90a" : info.sm80 ? "sm80" : "none";
}

bool cutlass_verified(const DeviceInfo& info) {
  for (const Verified& v : kCutlassVerified) {
    if (v.cc == info.major * 10 + info.minor && std::string(v.kernels) == kernels_name(info)) {
      return true;
    }
  }
  return false;
}

Choice choose_backend(const Case& c, const DeviceInfo& info) {
  const Backend req = backend::requested();
  if (req == Backend::kFallback) return {Backend::kFallback, "requested"};
  if (req == Backend::kTorch || req == Backend::kCutlass) {
    const std::string why = req == Backend::kTorch ? torch_refusal(c, info)
                                                   : cutlass_refusal(c, info);
    if (why.empty()) return {req, "requested"};
    return {Backend::kFallback, std::string(backend::name(req)) + " requested, but " + why};
  }
  const std::string torch_why = torch_refusal(c, info);
  if (torch_why.empty()) return {Backend::kTorch, "default: torch._grouped_mm runs this case"};
  const std::string sm = "sm_" + std::to_string(info.major * 10 + info.minor);
  if (!cutlass_verified(info)) {
    return {Backend::kFallback, "default: " + torch_why + "; CUTLASS not yet verified on " + sm};
  }
  const std::string cutlass_why = cutlass_refusal(c, info);
  if (cutlass_why.empty()) {
    return {Backend::kCutlass, "default: " + torch_why + "; CUTLASS is verified on " + sm};
  }
  return {Backend::kFallback, "default: " + torch_why + "; CUTLASS: " + cutlass_why};
}

bool aligned16(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0) return false;
  }
  return true;
}

int dtype_code(at::ScalarType dt) {
  return dt == at::kFloat ? 0 : dt == at::kBFloat16 ? 1 : 2;
}

// Runs one grouped product: a, b contiguous; the result is [T, N] (forward) or [E, P, Q]
// (wgrad). The cutlass and fallback backends write into a fresh tensor allocated first (before
// any scratch); the torch backend's output comes from torch._grouped_mm.
at::Tensor run_grouped(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                       GemmKind kind, int64_t rows, int64_t k, int64_t n) {
  const int device = a.get_device();
  const DeviceInfo& info = device_info(device);
  const int64_t groups = offs.size(0);
  const Case c{a.scalar_type(), groups, rows, k, n, aligned16({&a, &b})};
  const Choice choice = choose_backend(c, info);

  std::vector<int64_t> out_shape = kind == GemmKind::kWgrad ? std::vector<int64_t>{groups, k, n}
                                                            : std::vector<int64_t>{rows, n};
  at::Tensor d;
  if (choice.backend != Backend::kTorch) d = at::empty(out_shape, a.options());

  std::vector<at::Tensor> scratch;  // freed on return: later work on this stream may reuse it
  const auto byte_opts = a.options().dtype(at::kByte);
  GroupedGemmArgs args;
  args.a = a.const_data_ptr();
  args.b = b.const_data_ptr();
  args.offs = offs.const_data_ptr();
  args.offs_int64 = offs.scalar_type() == at::kLong;
  args.groups = groups;
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
  args.ends = static_cast<int64_t*>(args.alloc(sizeof(int64_t) * groups));

  switch (choice.backend) {
    case Backend::kTorch: {
      // torch reads its offsets as int32 on the device: give it the clamped ends, so that bad
      // offs are clamped exactly as on the other backends. rows < 2^31 (torch_refusal).
      const at::Tensor ends32 = at::empty({groups}, offs.options().dtype(at::kInt));
      args.ends32 = ends32.data_ptr<int32_t>();
      launch_clamp_offs(args);
      if (kind == GemmKind::kWgrad) {
        d = at::_grouped_mm(a.t(), b, ends32);  // [P, T] column-major x [T, Q] -> [E, P, Q]
      } else {
        d = at::_grouped_mm(a, kind == GemmKind::kFwdWeightNK ? b.transpose(1, 2) : b, ends32);
      }
      // K, N multiples of 8 make torch's (16-byte padded) output contiguous.
      TORCH_INTERNAL_ASSERT(d.is_contiguous() && d.sizes() == at::IntArrayRef(out_shape),
                            "grouped_ep: torch._grouped_mm returned shape ", d.sizes(),
                            " strides ", d.strides());
      args.d = d.data_ptr();
      // torch leaves rows past the last offset, and empty groups' wgrad blocks, unwritten.
      launch_zero_unwritten(args, kind, d.element_size());
      return d;
    }
    case Backend::kFallback:
      args.d = d.data_ptr();
      launch_clamp_offs(args);
      fallback_gemm(args, kind, dtype_code(a.scalar_type()));
      // The wgrad fallback writes every block itself, empty groups included.
      if (kind != GemmKind::kWgrad) launch_zero_unwritten(args, kind, d.element_size());
      return d;
    case Backend::kCutlass:
    case Backend::kAuto: {
      args.d = d.data_ptr();
      const HalfType type = a.scalar_type() == at::kBFloat16 ? HalfType::kBF16 : HalfType::kFP16;
      if (info.sm90a) {
        sm90_grouped_gemm(type, kind, args);
      } else {
        sm80_grouped_gemm(type, kind, args);
      }
      launch_zero_unwritten(args, kind, d.element_size());
      return d;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "grouped_ep: unknown backend");
}

// gemm: x [T, K], w [E, K, N] (or [E, N, K] with trans_w), offs [E] -> [T, N].
at::Tensor gemm_cuda(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& offs_in,
                     bool trans_w) {
  check_gemm_inputs(x_in, w_in, offs_in, trans_w);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t T = x_in.size(0), K = x_in.size(1), E = w_in.size(0);
  const int64_t N = trans_w ? w_in.size(1) : w_in.size(2);
  if (T == 0 || N == 0) return at::empty({T, N}, x_in.options());
  // No group, or empty products: all rows are zero.
  if (E == 0 || K == 0) return at::zeros({T, N}, x_in.options());
  const auto x = x_in.contiguous(), w = w_in.contiguous(), offs = offs_in.contiguous();
  return run_grouped(x, w, offs, trans_w ? GemmKind::kFwdWeightNK : GemmKind::kFwdWeightKN, T, K,
                     N);
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
  if (E * P * Q == 0) return at::empty({E, P, Q}, x_in.options());
  if (T == 0) return at::zeros({E, P, Q}, x_in.options());  // every group is empty
  const auto a = a_in.contiguous(), b = b_in.contiguous(), offs = offs_in.contiguous();
  return run_grouped(a, b, offs, GemmKind::kWgrad, T, P, Q);
}

}  // namespace

}  // namespace grouped_ep::cuda

namespace grouped_ep::backend {

std::vector<std::string> cuda_device_report(int device, std::optional<at::ScalarType> dtype,
                                            int64_t k, int64_t n) {
  using namespace grouped_ep::cuda;
  TORCH_CHECK_VALUE(device >= 0 && device < at::cuda::device_count(), "grouped_ep.backend_info: device ", device,
                    " does not exist (", static_cast<int>(at::cuda::device_count()),
                    " CUDA devices)");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the sm90a probe
  const DeviceInfo& info = device_info(device);
  std::vector<std::string> out;
  out.push_back("device_name=" + info.name);
  out.push_back("compute_capability=" + std::to_string(info.major) + "." +
                std::to_string(info.minor));
  out.push_back(std::string("cutlass_kernels=") + kernels_name(info));
  out.push_back(std::string("cutlass_verified=") + (cutlass_verified(info) ? "1" : "0"));
  if (dtype.has_value()) {
    const Case c{*dtype, 1, 1, k, n, /*aligned=*/true};
    const Choice choice = choose_backend(c, info);
    out.push_back(std::string("backend=") + name(choice.backend));
    out.push_back("reason=" + choice.reason);
  }
  return out;
}

}  // namespace grouped_ep::backend

namespace grouped_ep::cuda {

TORCH_LIBRARY_IMPL(grouped_ep, CUDA, m) {
  m.impl("gemm", &gemm_cuda);
  m.impl("gemm_wgrad", &gemm_wgrad_cuda);
}

}  // namespace grouped_ep::cuda
