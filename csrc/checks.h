// Input checks shared by every backend of the grouped GEMM ops. One function per entry point;
// every message names the argument and what was expected.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace grouped_ep {

#define GE_CHECK(cond, ...) TORCH_CHECK((cond), "grouped_ep.", __VA_ARGS__)

inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  const bool half = dt == at::kBFloat16 || dt == at::kHalf;
  const bool ok = half || dt == at::kFloat || (dt == at::kDouble && t.device().is_cpu());
  GE_CHECK(ok, op, ": ", name, " must be bfloat16, float16 or float32 (float64 on CPU), got ",
           dt, " on ", t.device());
}

// `groups`: the group count offs must match (w's E), or -1 where offs itself defines it.
inline void check_offs(const char* op, const at::Tensor& offs, const at::Tensor& x,
                       int64_t groups) {
  GE_CHECK(offs.dim() == 1, op, ": offs must be 1-D [E], got ", offs.dim(), "-D shape ",
           offs.sizes());
  GE_CHECK(offs.scalar_type() == at::kInt || offs.scalar_type() == at::kLong, op,
           ": offs must be int32 or int64, got ", offs.scalar_type());
  GE_CHECK(groups < 0 || offs.size(0) == groups, op, ": offs has length ", offs.size(0),
           " but w has ", groups, " groups (experts); offs must hold one cumulative end offset per group");
  GE_CHECK(offs.device() == x.device(), op, ": offs is on ", offs.device(), " but x is on ",
           x.device(), "; keep offs on x's device (no host sync)");
}

// gemm(x [T, K], w [E, K, N] or [E, N, K] when trans_w, offs [E]).
inline void check_gemm_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                              bool trans_w) {
  constexpr const char* op = "gemm";
  GE_CHECK(x.dim() == 2, op, ": x must be 2-D [T, K], got shape ", x.sizes());
  GE_CHECK(w.dim() == 3, op, ": w must be 3-D [E, K, N] (or [E, N, K] with trans_w=True), got shape ",
           w.sizes());
  check_float_dtype(op, "x", x);
  GE_CHECK(w.scalar_type() == x.scalar_type(), op, ": w has dtype ", w.scalar_type(),
           " but x has ", x.scalar_type(), "; they must match");
  GE_CHECK(w.device() == x.device(), op, ": w is on ", w.device(), " but x is on ", x.device());
  const int64_t k_w = trans_w ? w.size(2) : w.size(1);
  GE_CHECK(k_w == x.size(1), op, ": x has K=", x.size(1), " but w", trans_w ? "[E, N, K]" : "[E, K, N]",
           " with shape ", w.sizes(), " has K=", k_w, " (trans_w=", trans_w ? "True" : "False", ")");
  check_offs(op, offs, x, w.size(0));
}

// gemm_wgrad(x [T, K], dy [T, N], offs [E]).
inline void check_wgrad_inputs(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offs) {
  constexpr const char* op = "gemm_wgrad";
  GE_CHECK(x.dim() == 2, op, ": x must be 2-D [T, K], got shape ", x.sizes());
  GE_CHECK(dy.dim() == 2, op, ": dy must be 2-D [T, N], got shape ", dy.sizes());
  check_float_dtype(op, "x", x);
  GE_CHECK(dy.scalar_type() == x.scalar_type(), op, ": dy has dtype ", dy.scalar_type(),
           " but x has ", x.scalar_type(), "; they must match");
  GE_CHECK(dy.device() == x.device(), op, ": dy is on ", dy.device(), " but x is on ", x.device());
  GE_CHECK(dy.size(0) == x.size(0), op, ": dy has ", dy.size(0), " rows but x has ", x.size(0));
  check_offs(op, offs, x, /*groups=*/-1);
}

// Host-side validation of offs values (CPU tensors only: reading device offs would sync).
// Returns the end offsets as int64.
inline std::vector<int64_t> read_offs_cpu(const char* op, const at::Tensor& offs, int64_t T) {
  const auto o = offs.to(at::kLong).contiguous();
  const int64_t* p = o.data_ptr<int64_t>();
  std::vector<int64_t> ends(p, p + o.numel());
  int64_t prev = 0;
  for (size_t g = 0; g < ends.size(); ++g) {
    GE_CHECK(ends[g] >= prev, op, ": offs must be non-decreasing and non-negative, but offs[", g,
             "]=", ends[g], (g == 0 ? std::string(" < 0") : " < offs[" + std::to_string(g - 1) + "]=" + std::to_string(prev)));
    prev = ends[g];
  }
  GE_CHECK(prev <= T, op, ": offs[-1]=", prev, " is past the ", T, " rows of x");
  return ends;
}

}  // namespace grouped_ep
