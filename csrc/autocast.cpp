// Autocast for grouped_ep::gemm and gemm_wgrad: inside torch.autocast, floating inputs (not
// fp64) are cast to the region's dtype, as torch.mm's are ("lower precision" ops), so the
// experts run in bf16 / fp16 with everything else; fp32 master weights are cast per region
// (autocast's cache), and the casts are recorded by autograd, so gradients reach them in fp32.
// The cast happens above autograd (Autocast keys dispatch first), then the op runs as usual.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace grouped_ep {
namespace {

using Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

template <c10::DeviceType D>
at::Tensor cast_and_call(const char* name, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                         bool trans_w) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(D));
  const auto dt = at::autocast::get_autocast_dtype(D);
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Op>();
  return op.call(at::autocast::cached_cast(dt, a, D), at::autocast::cached_cast(dt, b, D), offs, trans_w);
}

template <c10::DeviceType D>
at::Tensor gemm_autocast(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, bool trans_w) {
  return cast_and_call<D>("grouped_ep::gemm", x, w, offs, trans_w);
}

template <c10::DeviceType D>
at::Tensor gemm_wgrad_autocast(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offs, bool trans_w) {
  return cast_and_call<D>("grouped_ep::gemm_wgrad", x, dy, offs, trans_w);
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, AutocastCPU, m) {
  m.impl("gemm", &gemm_autocast<c10::DeviceType::CPU>);
  m.impl("gemm_wgrad", &gemm_wgrad_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(grouped_ep, AutocastCUDA, m) {
  m.impl("gemm", &gemm_autocast<c10::DeviceType::CUDA>);
  m.impl("gemm_wgrad", &gemm_wgrad_autocast<c10::DeviceType::CUDA>);
}

}  // namespace grouped_ep
