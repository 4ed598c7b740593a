// grouped_ep::backend_info: the requested backend (settable), what this build contains, and the
// per-device choice of backend. Compiled into every build (CPU-only too), so that
// grouped_ep.backend_info() and set_backend() work everywhere.
#include "backend.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

namespace grouped_ep::backend {
namespace {

std::atomic<int> g_requested{static_cast<int>(Backend::kAuto)};

Backend parse(const std::string& s) {
  if (s == "auto") return Backend::kAuto;
  if (s == "cutlass") return Backend::kCutlass;
  if (s == "torch") return Backend::kTorch;
  if (s == "fallback") return Backend::kFallback;
  TORCH_CHECK_VALUE(false, "grouped_ep.set_backend: backend must be one of 'auto', 'cutlass', ",
                    "'torch', 'fallback', got '", s, "'");
  return Backend::kAuto;  // not reached
}

#if defined(GROUPED_EP_WITH_CUDA) && __has_include("grouped_ep_build_config.h")
#include "grouped_ep_build_config.h"  // written by setup.py: GROUPED_EP_CUDA_ARCH_LIST
#endif
#ifndef GROUPED_EP_CUDA_ARCH_LIST
#define GROUPED_EP_CUDA_ARCH_LIST "unknown"
#endif

// backend_info(str? set_backend=None, int device=-1, ScalarType? dtype=None, int k=0, int n=0)
std::vector<std::string> backend_info(const std::optional<std::string>& set_backend,
                                      int64_t device, std::optional<at::ScalarType> dtype,
                                      int64_t k, int64_t n) {
  if (set_backend.has_value()) set_requested(parse(*set_backend));
  std::vector<std::string> out;
  out.push_back(std::string("requested=") + name(requested()));
#ifdef GROUPED_EP_WITH_CUDA
  out.push_back("built_cuda=1");
  out.push_back(std::string("cuda_arch_list=") + GROUPED_EP_CUDA_ARCH_LIST);
  if (device >= 0) {
    for (auto& line : cuda_device_report(static_cast<int>(device), dtype, k, n)) {
      out.push_back(std::move(line));
    }
  }
#else
  (void)device, (void)dtype, (void)k, (void)n;
  out.push_back("built_cuda=0");
#endif
  return out;
}

}  // namespace

Backend requested() { return static_cast<Backend>(g_requested.load()); }

void set_requested(Backend b) { g_requested.store(static_cast<int>(b)); }

const char* name(Backend b) {
  switch (b) {
    case Backend::kAuto:
      return "auto";
    case Backend::kCutlass:
      return "cutlass";
    case Backend::kTorch:
      return "torch";
    case Backend::kFallback:
      return "fallback";
  }
  return "?";
}

// No tensor argument: the composite kernel is the one the dispatcher finds on every build.
TORCH_LIBRARY_IMPL(grouped_ep, CompositeImplicitAutograd, m) {
  m.impl("backend_info", &backend_info);
}

}  // namespace grouped_ep::backend
