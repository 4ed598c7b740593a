// CPU kernels for grouped_ep::gemm and grouped_ep::gemm_wgrad.
//
// The work is cut into tasks of about equal FLOPs: a task is a chunk of output rows of one
// group. Threads pull tasks from a shared counter (largest first), so many small groups and a
// few large ones both keep every core busy. Inside a task one GEMM call does the FLOPs; inside
// at::parallel_for BLAS and ATen run single-threaded, so there is no oversubscription. Which GEMM
// (at::mm, or this project's own AVX-512, AMX or AVX2 kernel) is chosen per (dtype, CPU) by
// gemm_plan.h. The own AVX-512 and AVX2 kernels prefetch the next task's operands while they
// compute (`run_tasks` tells each task which one its thread runs next).
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_gemm.h"
#include "avx2_gemm.h"
#include "avx512_gemm.h"
#include "checks.h"
#include "gemm_plan.h"
#include "out_pool.h"
#include "pages.h"

namespace grouped_ep {
namespace {

struct Task {
  int64_t group;
  int64_t begin;  // first output row of this chunk, relative to the group's output block
  int64_t end;
  double flops;
};

// Split each group's `rows[g]` output rows (costing `row_flops[g]` each) into chunks of about
// equal FLOPs, largest first.
std::vector<Task> plan_tasks(const std::vector<int64_t>& rows, const std::vector<double>& row_flops) {
  double total = 0;
  for (size_t g = 0; g < rows.size(); ++g) total += rows[g] * row_flops[g];
  const int threads = std::max(1, at::get_num_threads());
  // Several tasks per thread for balance, but not so small that call overhead dominates; one
  // thread gains nothing from splitting. A chunk keeps at least kMinRows rows: every chunk of a
  // group reads (and the own bf16 kernel packs) the group's whole weight.
  constexpr int64_t kMinRows = 64;
  const double target = threads == 1 ? total + 1 : std::max(total / (threads * 4.0), 4.0e6);
  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(rows.size()); ++g) {
    if (rows[g] == 0) continue;
    const double f = rows[g] * row_flops[g];
    int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, rows[g] / kMinRows),
                                       std::max<int64_t>(1, static_cast<int64_t>(f / target)));
    // Keep chunk boundaries on multiples of 8 rows where possible (vector-friendly for BLAS).
    int64_t step = (rows[g] + chunks - 1) / chunks;
    if (step > 8) step = (step + 7) / 8 * 8;
    for (int64_t b = 0; b < rows[g]; b += step) {
      const int64_t e = std::min(rows[g], b + step);
      tasks.push_back({g, b, e, (e - b) * row_flops[g]});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.flops > b.flops; });
  return tasks;
}

// Runs fn(task, next) for every task, threads pulling tasks from a shared counter. Each thread
// claims its next task before running the current one, so `next` (null for a thread's last) is
// the task it runs after this one: the own kernel prefetches its operands meanwhile.
template <typename Fn>
void run_tasks(const std::vector<Task>& tasks, const Fn& fn) {
  if (tasks.empty()) return;
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (n == 1 || at::get_num_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) fn(tasks[i], i + 1 < n ? &tasks[i + 1] : nullptr);
    return;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  // The caller's thread-local state (inference mode, the below-autograd dispatch guard) goes
  // with the tasks: ATen ops on other threads without it refused to write an inference
  // tensor ("Inplace update to inference tensor outside InferenceMode").
  const at::ThreadLocalState state;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t j = next.fetch_add(1);
      fn(tasks[i], j < n ? &tasks[j] : nullptr);
      i = j;
    }
  });
}

// A tile as raw operands for the own kernels: C[M, N] = A[M, K] @ B[K, N], any strides (no
// tensor views are made per tile: at these sizes their cost shows).
template <typename T>
struct Tile {
  int64_t M, N, K;
  const T* a;
  int64_t sam, sak;
  const T* b;
  int64_t sbk, sbn;
  T* c;
  int64_t ldc;
};

// Runs `tile` on the own kernel when the plan sends a tile of its size there, with the shape
// rules (`plan.shape_rules`) measured for each own bf16 kernel against oneDNN:
// - AVX512-BF16 (one thread, AMD EPYC, 2026-11-23): packing B does not pay for fewer than
//   32 rows of A when B is too large to stay in L2 (measured when the kernel still packed all of
//   B before its first product: 1 to 16 rows of a 2048 x 768 weight at 0.67x to 0.91x oneDNN, 32
//   rows at 1.05x), over 4 MB of B it never did (4096 x 4096: 0.67x to 0.81x), and an A read in
//   place over 4 MB, which the kernel reads again for every 32 columns of B, lost to oneDNN's
//   blocking (4096 x 1024 x 1024: 0.90x; 4096 x 2048 x 768: 0.92x; 2048 x 1024 x 1024: 1.04x).
// - AMX (Intel Xeon with AMX-BF16, 2 threads, 2026-11-25; 8 groups per call, M 32 to 2048, K x N
//   from 256 x 128 to 2048 x 2048, both weight layouts): the own kernel ran 1.06x to 4.1x oneDNN
//   on every tile under 64 MFLOP; above that oneDNN's blocking wins (0.59x to 0.92x for 256 rows
//   or more), except where B is K-contiguous (the [E, N, K] weight, which oneDNN must transpose
//   too) with up to 128 rows: there, with the next panel packed during the current one's
//   products, 1.11x to 1.56x on every such tile over 64 MFLOP in the sweep, up to 1.07 GFLOP;
//   at 256 rows 0.94x to 1.07x, left to oneDNN. 16 experts of qwen3-30b-a3b's size
//   (2048 x 1536, 0.4-0.8 GFLOP tiles at 64-128 rows): 1.25x to 2.0x oneDNN.
// - AVX2 (AMD EPYC without AVX-512, 2026-11-25), no rules: where the plan names it, it takes every
//   tile. One thread, E groups of the bench's tiles ([E, N, K] weights, 64 to 2048 rows, K x N
//   256 x 128 to 2048 x 1536): 1.03x to 1.17x MKL per tile for fp32; for bf16 1.08x to 1.14x
//   the widened copies through MKL. Two threads, the grouped GEMM bench's fp32 rows: geomean
//   1.06x the MKL path (every row but one at 1.00x or more; E8 balanced fwd+bwd 0.90x).
// Whether a tile is GEMV-like, where at::mm beats the own AVX-512 fp32 kernel: that kernel packs
// all of B to use each value once for 1-2 rows, and computes 32 columns per panel, 1 of them
// useful for N = 1. Measured on an AMD EPYC with AVX512-BF16 (one thread, 2026-11-26; 8 experts,
// every tile on the own kernel against every tile on MKL's at::mm): 1 row of 1024 x 1024 0.39x
// to 0.61x the time ([E, K, N] / [E, N, K] weights), 2 rows 0.60x to 0.79x, 3 rows 0.84x / 1.06x,
// 4 rows and up 1.07x to 1.19x; 1 row of 256 x 256 0.92x, of 64 x 64 1.12x; N = 1 (4096 rows,
// K 64 and 1024) 0.27x to 0.44x; N = 2 to 4: 0.34x to 0.80x where B is K-contiguous (the
// [E, N, K] weight), 1.70x to 1.72x where not; N = 5 to 8 1.10x to 1.31x. fp16 widened for the
// own kernel (no AVX512-FP16) widens all of B per tile first, which torch's fp16 at::mm (fp32
// sums, one rounding) does not, but that is fast only with a K-contiguous B: 1 row 0.35x, 2 rows
// 0.61x, 4 rows 1.00x, 8 rows 1.66x; N = 1 0.15x, N = 4 0.53x, N = 8 1.95x; B not K-contiguous:
// 5.4x to 11x.
bool gemv_like(int64_t M, int64_t N, int64_t K, int64_t sbk, bool half) {
  if (half) return sbk == 1 && (M <= 2 || N <= 4);
  return (M <= 2 && static_cast<double>(K) * N > 2.6e5) || N == 1 || (N <= 4 && sbk == 1);
}

template <typename T>
bool own_kernel(const Plan& plan, const Tile<T>& t, const Prefetch* next) {
  const double flops = 2.0 * t.M * t.N * t.K;
  if (flops >= plan.own_below) return false;
  if (plan.avx2) {  // no shape rules: it takes every tile where the plan names it
    if constexpr (std::is_same<T, float>::value)
      f32_avx2_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc, next);
    else if constexpr (std::is_same<T, c10::BFloat16>::value)
      bf16_avx2_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc, next);
    else
      f16_avx2_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc, next);
    return true;
  }
  if constexpr (std::is_same<T, c10::Half>::value) {
    return false;  // only the AVX2 kernel takes fp16
  } else {
    const double kn = static_cast<double>(t.K) * t.N, mk = static_cast<double>(t.M) * t.K;
    if (plan.shape_rules && plan.amx && !(flops < 6.4e7 || (t.sbk == 1 && t.M <= 128))) return false;
    if (plan.shape_rules && !plan.amx && (kn > 2.0e6 || (t.M < 32 && kn > 2.6e5) || (t.sak == 1 && mk > 2.1e6)))
      return false;
    if constexpr (std::is_same<T, float>::value) {
      if (plan.gemv_mm && gemv_like(t.M, t.N, t.K, t.sbk, false)) return false;
      f32_avx512_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc, next);
    } else if (plan.amx) {
      bf16_amx_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc);
    } else {
      bf16_avx512_gemm(t.M, t.N, t.K, t.a, t.sam, t.sak, t.b, t.sbk, t.sbn, t.c, t.ldc, next);
    }
    return true;
  }
}

// Makes a large output resident with every thread at once, where it is freshly mapped, before
// the kernels write it (pages.h). A weight gradient of 32 MiB or more is such an output on every
// call; before this, its page faults took a quarter of the fp32 backward of E=32 experts of
// 768 x 512 (12,289 faults, 49 ms; 2 threads, AMD EPYC, 2026-11-24). Populating 48 MiB took
// 8.1-8.5 ms there against 12.4-13.5 ms for the faults of one write per page, both on 2 threads;
// populating memory already resident costs 1 ms for 48 MiB, hence the residency check first.
// GROUPED_EP_CPU_POPULATE=0 turns it off (to measure it); a value other than 0 or 1 is an error.
void make_resident(const at::Tensor& out) {
  static const bool enabled = [] {
    const char* v = std::getenv("GROUPED_EP_CPU_POPULATE");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0) return true;
    TORCH_CHECK(std::strcmp(v, "0") == 0, "grouped_ep.gemm: environment variable GROUPED_EP_CPU_POPULATE=", v,
                " must be 0 (off) or 1 (on, the default)");
    return false;
  }();
  constexpr int64_t kMinBytes = 4 << 20, kChunk = 1 << 20;
  const int64_t bytes = static_cast<int64_t>(out.nbytes());
  const auto* base = static_cast<const char*>(out.const_data_ptr());
  if (!enabled || bytes < kMinBytes || !pages::looks_fresh(base, bytes)) return;
  at::parallel_for(0, (bytes + kChunk - 1) / kChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t b = c0 * kChunk, e = std::min(bytes, c1 * kChunk);
    pages::populate_write(base + b, e - b);  // refused: the pages fault in at first write, as before
  });
}

// Rows [row0, row0 + rows) of a contiguous tensor (else nothing) as the next tile's A.
void next_rows(Prefetch& pf, const at::Tensor& t, int64_t row0, int64_t rows) {
  if (rows <= 0 || !t.is_contiguous()) return;
  const auto row = t.numel() / t.size(0);
  pf.a = static_cast<const char*>(t.const_data_ptr()) + row0 * row * t.element_size();
  pf.a_bytes = rows * row * t.element_size();
}

// out = a @ b, with fp32 accumulation for half types. `out` may be a strided view; `plan` is
// looked up once per call of the op, not per tile.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, const Plan& plan) {
  const auto dt = out.scalar_type();
  if (dt == at::kFloat || dt == at::kDouble || plan.path == HalfPath::kNative) {
    at::mm_out(out, a, b);
  } else {
    // Widened, the product takes fp32's path on this CPU; GEMV-like fp16 tiles stay fp16.
    if (plan.gemv_mm && gemv_like(a.size(0), b.size(1), a.size(1), b.stride(0), true)) {
      at::mm_out(out, a, b);
      return;
    }
    const auto a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
    if (!plan.widen_own) {
      out.copy_(at::mm(a32, b32));
      return;
    }
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    auto c32 = at::empty({M, N}, a32.options());
    f32_avx512_gemm(M, N, K, a32.const_data_ptr<float>(), a32.stride(0), a32.stride(1), b32.const_data_ptr<float>(),
                    b32.stride(0), b32.stride(1), c32.data_ptr<float>(), N);
    out.copy_(c32);
  }
}

at::Tensor gemm_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& offs,
                    bool trans_w) {
  check_gemm_inputs(x_in, w_in, offs, trans_w);
  // The products below are plain ATen calls; autograd is handled one level up (ops.py), and
  // worker threads must not see tensors that require grad.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto x = x_in.detach(), w = w_in.detach();
  const int64_t T = x.size(0), K = x.size(1);
  const int64_t N = trans_w ? w.size(1) : w.size(2);
  const auto ends = read_offs_cpu("gemm", offs, T);
  const int64_t used = ends.empty() ? 0 : ends.back();

  auto out = pooled_empty({T, N}, x.options());
  make_resident(out);
  // Rows that belong to no group are zero, by contract.
  if (used < T) out.narrow(0, used, T - used).zero_();
  if (used == 0 || N == 0) return out;
  if (K == 0) {
    out.narrow(0, 0, used).zero_();
    return out;
  }

  std::vector<int64_t> starts(ends.size()), rows(ends.size());
  for (size_t g = 0; g < ends.size(); ++g) {
    starts[g] = g == 0 ? 0 : ends[g - 1];
    rows[g] = ends[g] - starts[g];
  }
  const auto tasks = plan_tasks(rows, std::vector<double>(rows.size(), 2.0 * K * N));
  const auto plan = plan_for(x.scalar_type());
  const auto dt = x.scalar_type();
  const bool own = uses_own(plan, dt);
  const int64_t sbk = w.stride(trans_w ? 2 : 1), sbn = w.stride(trans_w ? 1 : 2);  // B = w[g] (^T)
  run_tasks(tasks, [&](const Task& t, const Task* after) {
    const int64_t r0 = starts[t.group] + t.begin, n = t.end - t.begin;
    if (own) {
      Prefetch next;  // the next task's rows of x and its group's weight
      if (after) {
        next_rows(next, x, starts[after->group] + after->begin, after->end - after->begin);
        next.b = static_cast<const char*>(w.const_data_ptr()) + after->group * w.stride(0) * w.element_size();
        next.sbk = sbk, next.sbn = sbn, next.K = K, next.N = N;
      }
      const bool done = AT_DISPATCH_V2(dt, "gemm", AT_WRAP([&] {
        const Tile<scalar_t> tile{n, N, K, x.const_data_ptr<scalar_t>() + r0 * x.stride(0), x.stride(0), x.stride(1),
                                  w.const_data_ptr<scalar_t>() + t.group * w.stride(0), sbk, sbn,
                                  out.data_ptr<scalar_t>() + r0 * N, N};
        return own_kernel(plan, tile, &next);
      }), at::kFloat, at::kBFloat16, at::kHalf);
      if (done) return;
    }
    const auto w_g = trans_w ? w.select(0, t.group).t() : w.select(0, t.group);
    mm_into(out.narrow(0, r0, n), x.narrow(0, r0, n), w_g, plan);
  });
  return out;
}

at::Tensor gemm_wgrad_cpu(const at::Tensor& x_in, const at::Tensor& dy_in, const at::Tensor& offs,
                          bool trans_w) {
  check_wgrad_inputs(x_in, dy_in, offs);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto x = x_in.detach(), dy = dy_in.detach();
  const int64_t E = offs.size(0);
  const auto ends = read_offs_cpu("gemm_wgrad", offs, x.size(0));

  // out[g] = a_g^T @ b_g, with (a, b) = (x, dy) -> [E, K, N], or (dy, x) -> [E, N, K].
  const at::Tensor& a = trans_w ? dy : x;
  const at::Tensor& b = trans_w ? x : dy;
  const int64_t P = a.size(1), Q = b.size(1);
  auto out = pooled_empty({E, P, Q}, x.options());
  if (E == 0) return out;
  make_resident(out);

  // A task owns a block of rows of one group's [P, Q] output (a block of a's columns), so
  // tasks never write the same memory. Zero rows of a group means an exact-zero gradient.
  // An output row of group g costs 2 * rows[g] * Q FLOPs.
  std::vector<int64_t> starts(E), rows(E), out_rows(E);
  std::vector<double> row_flops(E);
  for (int64_t g = 0; g < E; ++g) {
    starts[g] = g == 0 ? 0 : ends[g - 1];
    rows[g] = ends[g] - starts[g];
    if (rows[g] == 0 || Q == 0) out.select(0, g).zero_();
    out_rows[g] = (rows[g] == 0 || Q == 0) ? 0 : P;
    row_flops[g] = 2.0 * rows[g] * Q;
  }
  const auto tasks = plan_tasks(out_rows, row_flops);
  const auto plan = plan_for(x.scalar_type());
  const auto dt = x.scalar_type();
  const bool own = uses_own(plan, dt);
  run_tasks(tasks, [&](const Task& t, const Task* after) {
    const int64_t g = t.group, n = t.end - t.begin;
    if (own) {
      Prefetch next;  // the next task's rows of a (its group's) and its B (b's rows of that group)
      if (after) {
        const int64_t h = after->group;
        next_rows(next, a, starts[h], rows[h]);
        next.b = static_cast<const char*>(b.const_data_ptr()) + starts[h] * b.stride(0) * b.element_size();
        next.sbk = b.stride(0), next.sbn = b.stride(1), next.K = rows[h], next.N = Q;
      }
      // A = a_g^T (columns t.begin .. of a's rows of group g), B = b's rows of group g.
      const bool done = AT_DISPATCH_V2(dt, "gemm_wgrad", AT_WRAP([&] {
        const Tile<scalar_t> tile{n, Q, rows[g], a.const_data_ptr<scalar_t>() + starts[g] * a.stride(0) + t.begin * a.stride(1),
                                  a.stride(1), a.stride(0), b.const_data_ptr<scalar_t>() + starts[g] * b.stride(0),
                                  b.stride(0), b.stride(1), out.data_ptr<scalar_t>() + (g * P + t.begin) * Q, Q};
        return own_kernel(plan, tile, &next);
      }), at::kFloat, at::kBFloat16, at::kHalf);
      if (done) return;
    }
    const auto a_g = a.narrow(0, starts[g], rows[g]).narrow(1, t.begin, n);
    const auto b_g = b.narrow(0, starts[g], rows[g]);
    mm_into(out.select(0, g).narrow(0, t.begin, n), a_g.t(), b_g, plan);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CPU, m) {
  m.impl("gemm", &gemm_cpu);
  m.impl("gemm_wgrad", &gemm_wgrad_cpu);
}

}  // namespace grouped_ep
