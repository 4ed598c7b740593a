// The CPU grouped GEMM's choice of GEMM per (dtype, CPU): see gemm_plan.h.
#include "gemm_plan.h"

#include <ATen/Context.h>
#include <ATen/cpu/Utils.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "amx_gemm.h"
#include "avx2_gemm.h"
#include "avx512_gemm.h"
#include "checks.h"

namespace grouped_ep {
namespace {

constexpr double kEvery = std::numeric_limits<double>::infinity();

// The CPU features (cpuinfo names, as at::cpu::get_cpu_capabilities() spells them) that give
// oneDNN a native GEMM for `dt`; the same conditions under which torch.mm itself takes oneDNN's
// low-precision kernels for that dtype.
const char* const* native_features(at::ScalarType dt) {
  static const char* const bf16[] = {"amx_bf16", "avx512_bf16", nullptr};
  static const char* const fp16[] = {"amx_fp16", "avx512_fp16", nullptr};
  return dt == at::kBFloat16 ? bf16 : fp16;
}

// Whether this CPU has `feature` (a cpuinfo name, as at::cpu::get_cpu_capabilities() spells it).
bool cpu_has(const char* feature) {
  const auto caps = at::cpu::get_cpu_capabilities();
  const auto it = caps.find(feature);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

// The first native feature this CPU has for `dt`, or "" (computed once per dtype).
std::string native_feature(at::ScalarType dt) {
  auto detect = [](at::ScalarType d) -> std::string {
    if (!at::hasMKLDNN()) return "";
    for (const char* const* f = native_features(d); *f; ++f)
      if (cpu_has(*f)) return *f;
    return "";
  };
  static const std::string bf16 = detect(at::kBFloat16), fp16 = detect(at::kHalf);
  return dt == at::kBFloat16 ? bf16 : fp16;
}

// Whether the own AVX2 kernel can run: built, and the CPU has its instructions.
bool has_avx2_gemm() {
  static const bool has = avx2_gemm_compiled() && cpu_has("avx2") && cpu_has("fma3") && cpu_has("f16c");
  return has;
}

bool has_avx512_bf16() {
  static const bool has = avx512_gemm_compiled() && cpu_has("avx512_bf16");
  return has;
}

// bf16 tiles below this many FLOPs take the own kernel on the native path (with the shape rules
// of gemm_cpu.cpp's `own_kernel`). Measured on an AVX512-BF16 CPU without AMX (AMD EPYC,
// 2026-11-23), each time against oneDNN's `at::mm` per tile in the same run: one thread, the own
// kernel ran at 0.98x to 1.65x for tiles of 8 to 64 rows; in the grouped GEMM, where it also
// prefetches the next tile, 1.01x to 1.08x for forward tiles of 1 to 8.6 GFLOP (512 to 2048 rows,
// K and N 1024 or 2048; 1.02x to 1.06x with 2 threads), and 1.02x to 1.13x for weight gradients
// of 0.6 to 4.3 GFLOP per group (but 0.93x for 4 groups of 512 rows at K = N = 1024, tiles that
// took the own kernel before too). So every tile the shape rules allow takes it, up to 10 GFLOP.
// On a CPU with AMX this applies only where the AMX kernel cannot run (Linux refused the tile
// state): oneDNN's AMX peak is several times this kernel's, so only tiles of about the size of
// oneDNN's set-up cost (1 MFLOP) take it. (Intel Xeon with AMX, 2 threads, 2026-11-25: this
// kernel ran at 189 to 224 GFLOP/s on every bench row, oneDNN at 153 to 319 on 2 to 4 MFLOP tiles.)
double own_kernel_below() {
  static const double below = cpu_has("amx_bf16") ? 1.0e6 : 1.0e10;
  return below;
}

// Whether bf16 tiles can take the own AMX kernel: the CPU has AMX-BF16 (and AVX512-BF16, for the
// rounding to bf16) and Linux granted this process the tile state.
bool has_amx_bf16() {
  static const bool has = cpu_has("amx_bf16") && has_avx512_bf16() && amx_bf16_ready();
  return has;
}

// bf16 tiles below this many FLOPs take the own AMX kernel where the CPU has AMX (with the shape
// rules of gemm_cpu.cpp's `own_kernel`, which cut it to 64 MFLOP for most shapes; the largest
// tile measured there was 1.07 GFLOP).
constexpr double kAmxBelow = 1.2e9;

// Whether fp32 tiles take an own kernel by default: on AMD CPUs, the AVX-512 one where the CPU
// has its instruction set, else the AVX2 one. There MKL's fp32 GEMM is slower than on Intel: one
// thread, AMD EPYC with AVX512-BF16, 2026-11-23, the own AVX-512 kernel ran 1.03x to 1.26x MKL's
// `at::mm` on every tile shape tried (8 to 4096 rows, K and N 256 to 4096, up to a 64 MB weight),
// and 1.12x to 1.30x on the geomeans of the grouped GEMM bench. On Intel CPUs MKL is the
// reference implementation, faster than the own kernel on every bench row but those of the
// smallest tiles (`kF32OwnBelowIntel`).
bool is_amd() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}
bool f32_own_default() { return is_amd() && has_avx512_bf16(); }
// On AMD CPUs without AVX-512 (AMD EPYC with AVX2 only, 2026-11-25) the own AVX2 kernel ran 1.03x
// to 1.17x MKL per tile on one thread, and 1.06x MKL per tile on the geomean of the grouped GEMM
// bench's fp32 rows (2 threads). Not measured on Intel CPUs without AVX-512: MKL stays there.
bool f32_avx2_default() { return is_amd() && !has_avx512_bf16() && has_avx2_gemm(); }

// fp32 tiles under this many FLOPs take the own kernel on other CPUs with its instruction set
// (Intel). Intel Xeon with AMX, 2 threads, 2026-11-25, every tile on the own kernel against every
// tile on MKL, same process: E=128 groups of 64 x 256 x 128 (4.2 MFLOP) 1.11x forward, 1.11x
// and 0.99x forward+backward; every other bench row (16.8 MFLOP tiles and up) 0.74x to 1.01x.
constexpr double kF32OwnBelowIntel = 8.0e6;

// What `gemv_like` (gemm_cpu.cpp) sends to at::mm, for cpu_gemm_path.
constexpr const char* kGemvWhy =
    "; GEMV-like tiles (1-2 rows and K x N over 260K, 1 column, or 2-4 columns of a K-contiguous B) on at::mm";

// The plan for an fp32 product on this CPU, honouring GROUPED_EP_CPU_F32_GEMM=auto|blas|avx512|avx2.
Plan f32_plan(std::string* why = nullptr) {
  const char* env = std::getenv("GROUPED_EP_CPU_F32_GEMM");
  const bool forced = env && *env && std::strcmp(env, "auto") != 0;
  bool own = f32_own_default(), avx2 = f32_avx2_default();
  if (forced) {
    own = std::strcmp(env, "avx512") == 0;
    avx2 = std::strcmp(env, "avx2") == 0;
    GE_CHECK(own || avx2 || std::strcmp(env, "blas") == 0, "gemm: environment variable GROUPED_EP_CPU_F32_GEMM=",
             env, " must be 'auto', 'blas', 'avx512' or 'avx2'");
    GE_CHECK(!own || has_avx512_bf16(), "gemm: GROUPED_EP_CPU_F32_GEMM=avx512 needs a CPU with ",
             "avx512_bf16 (the kernels' instruction set; and an x86-64 GCC/Clang build); this one has none");
    GE_CHECK(!avx2 || has_avx2_gemm(), "gemm: GROUPED_EP_CPU_F32_GEMM=avx2 needs a CPU with avx2, fma and ",
             "f16c (and an x86-64 GCC/Clang build); this one lacks them");
  }
  const bool small_own = !forced && !own && !avx2 && has_avx512_bf16();  // MKL, the own kernel for small tiles
  if (why) {
    const char* reason = forced             ? "forced by GROUPED_EP_CPU_F32_GEMM"
                         : own              ? "AMD CPU with avx512_bf16"
                         : avx2             ? "AMD CPU without avx512_bf16"
                         : has_avx512_bf16() ? "not an AMD CPU"
                                             : "no avx512_bf16, not an AMD CPU";
    *why = std::string(own    ? forced ? "avx512: own avx512 kernel for every tile ("
                                       : "avx512: own avx512 kernel for every tile but GEMV-like ones ("
                       : avx2 ? "avx2: own avx2 kernel for every tile ("
                              : "blas: at::mm per tile (") +
           reason + ")";
    if (small_own) *why += "; tiles under 8 MFLOP on the own avx512 kernel";
    if (!forced && (own || small_own)) *why += kGemvWhy;
  }
  Plan plan{HalfPath::kNative, own || avx2 ? kEvery : small_own ? kF32OwnBelowIntel : 0, false};
  plan.avx2 = avx2;
  plan.gemv_mm = !forced && (own || small_own);  // gemm_cpu.cpp's `gemv_like`
  return plan;
}

// The plan for a bf16/fp16 product on this CPU, honouring GROUPED_EP_CPU_HALF_GEMM. `why`, when
// given, gets a short reason for the bench output.
Plan half_plan(at::ScalarType dt, std::string* why = nullptr) {
  const bool bf16 = dt == at::kBFloat16;
  const char* env = std::getenv("GROUPED_EP_CPU_HALF_GEMM");
  const bool forced = env && *env && std::strcmp(env, "auto") != 0;
  if (forced) {
    const bool native = std::strcmp(env, "native") == 0, own = std::strcmp(env, "avx512") == 0;
    const bool amx = std::strcmp(env, "amx") == 0, avx2 = std::strcmp(env, "avx2") == 0;
    GE_CHECK(native || own || amx || avx2 || std::strcmp(env, "widen") == 0,
             "gemm: environment variable GROUPED_EP_CPU_HALF_GEMM=", env,
             " must be 'auto', 'native', 'widen', 'avx512', 'amx' or 'avx2'");
    GE_CHECK(!avx2 || has_avx2_gemm(), "gemm: GROUPED_EP_CPU_HALF_GEMM=avx2 needs a CPU with avx2, fma and ",
             "f16c (and an x86-64 GCC/Clang build); this one lacks them");
    if (avx2) {  // bf16 and fp16 alike
      if (why) *why = "own avx2 kernel for every tile (widening as it reads), forced by GROUPED_EP_CPU_HALF_GEMM";
      Plan plan{HalfPath::kWiden, kEvery, false};
      plan.avx2 = true;
      return plan;
    }
    GE_CHECK(!own || has_avx512_bf16(), "gemm: GROUPED_EP_CPU_HALF_GEMM=avx512 needs a CPU with ",
             "avx512_bf16 (and an x86-64 GCC/Clang build); this one has none");
    GE_CHECK(!amx || has_amx_bf16(), "gemm: GROUPED_EP_CPU_HALF_GEMM=amx needs a CPU with amx_bf16 and ",
             "avx512_bf16 (and an x86-64 GCC/Clang build, and Linux granting the AMX state); this one has ",
             cpu_has("amx_bf16") ? "amx_bf16 but not the rest" : "no amx_bf16");
    if ((!own && !amx) || bf16) {
      if (why) *why = own   ? "own avx512-bf16 kernel for every tile, forced by GROUPED_EP_CPU_HALF_GEMM"
                      : amx ? "own amx-bf16 kernel for every tile, forced by GROUPED_EP_CPU_HALF_GEMM"
                            : "forced by GROUPED_EP_CPU_HALF_GEMM";
      if (own || amx) return {HalfPath::kNative, kEvery, false, false, amx};
      return {native ? HalfPath::kNative : HalfPath::kWiden, 0, false};
    }
    // avx512 and amx name bf16 kernels: fp16 keeps its automatic choice.
  }
  const auto feature = native_feature(dt);
  if (feature.empty()) {
    // Widened tiles take fp32's path; where that is the AVX2 kernel, it widens as it reads.
    const bool avx2 = f32_plan().avx2;
    if (why) *why = std::string("no amx/avx512 ") + (bf16 ? "bf16" : "fp16") +
                    (at::hasMKLDNN() ? "" : " (torch without oneDNN)") +
                    (avx2 ? "; every tile on the own avx2 kernel, widening as it reads" : "");
    Plan plan{HalfPath::kWiden, avx2 ? kEvery : 0, false};
    plan.avx2 = avx2;
    // Forced values that reach here name bf16 kernels (avx512, amx): fp16 keeps its automatic plan.
    plan.gemv_mm = !bf16;  // where plan_for finds the tiles on the own fp32 kernel
    return plan;
  }
  if (bf16 && has_amx_bf16()) {
    if (why) *why = feature + "; tiles under 64 MFLOP (1200 with a K-contiguous B and up to 128 rows) on the own amx-bf16 kernel";
    return {HalfPath::kNative, kAmxBelow, true, false, true};
  }
  const double below = bf16 && has_avx512_bf16() ? own_kernel_below() : 0;
  if (why) {
    *why = feature;
    if (below > 0) *why += "; tiles under " + std::to_string(static_cast<int64_t>(below / 1e6)) +
                           " MFLOP on the own avx512-bf16 kernel";
  }
  return {HalfPath::kNative, below, true};
}

}  // namespace

Plan plan_for(at::ScalarType dt) {
  if (dt == at::kFloat) return f32_plan();
  if (dt != at::kBFloat16 && dt != at::kHalf) return Plan{};
  auto plan = half_plan(dt);
  // Tiles widened to fp32 tensors (GROUPED_EP_CPU_HALF_GEMM=widen, or no AVX2 kernel) take the
  // own AVX-512 kernel where fp32 does; where fp32 takes the AVX2 kernel, forced widening means
  // at::mm on the widened copies (the AVX2 kernel widens by itself).
  if (plan.path == HalfPath::kWiden && !plan.avx2) {
    const auto f32 = f32_plan();
    plan.widen_own = f32.own_below > 0 && !f32.avx2;
  }
  plan.gemv_mm = plan.gemv_mm && plan.widen_own;  // GEMV-like fp16 tiles stay fp16 for at::mm
  return plan;
}

// What gemm does for `dtype` on this CPU now ("avx512: own ...", "blas: ...", "native:
// avx512_bf16", "widen to fp32: no amx/avx512 fp16", ...; the bench prints it).
std::string cpu_gemm_path(at::ScalarType dtype) {
  std::string why;
  if (dtype == at::kFloat) {
    f32_plan(&why);
    return why;
  }
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::string("as is: ") + c10::toString(dtype);
  const auto plan = plan_for(dtype);
  half_plan(dtype, &why);
  if (plan.gemv_mm) why += "; tiles of 1-2 rows or 1-4 columns of a K-contiguous B on at::mm in fp16";
  return (plan.path == HalfPath::kNative ? "native: " : "widen to fp32: ") + why;
}

// No tensor argument to dispatch on: one kernel for every backend.
TORCH_LIBRARY_IMPL(grouped_ep, CompositeExplicitAutograd, m) {
  m.impl("cpu_gemm_path", &cpu_gemm_path);
}

}  // namespace grouped_ep
