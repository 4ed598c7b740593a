// Which backend runs torch.ops.grouped_ep.gemm / gemm_wgrad on CUDA, and why.
//
// The requested backend (GROUPED_EP_BACKEND, grouped_ep.set_backend) is process-wide state kept
// here; the choice per call is made in gemm_cuda.cpp from the request, the call's dtype and
// shapes and the device. This header has no CUDA dependency: backend.cpp, which answers
// grouped_ep.backend_info(), is compiled into every build, CPU-only ones included.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace grouped_ep::backend {

enum class Backend : int { kAuto = 0, kCutlass = 1, kTorch = 2, kFallback = 3 };

// The process-wide request; kAuto (the default) lets the per-call policy decide.
Backend requested();
void set_requested(Backend b);
const char* name(Backend b);

#ifdef GROUPED_EP_WITH_CUDA
// Implemented in cuda/gemm_cuda.cpp: "key=value" lines describing `device` (name, compute
// capability, which CUTLASS kernels its image has) and, when dtype is given, the backend a call
// with that dtype, K and N would use on it and why. Host-side queries only.
std::vector<std::string> cuda_device_report(int device, std::optional<at::ScalarType> dtype,
                                            int64_t k, int64_t n);
#endif

}  // namespace grouped_ep::backend
