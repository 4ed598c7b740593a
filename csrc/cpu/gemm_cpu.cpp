// CPU kernels for grouped_ep::gemm and grouped_ep::gemm_wgrad.
//
// The work is cut into tasks of about equal FLOPs: a task is a chunk of output rows of one
// group. Threads pull tasks from a shared counter (largest first), so many small groups and a
// few large ones both keep every core busy. Inside a task one BLAS call does the FLOPs; inside
// at::parallel_for BLAS and ATen run single-threaded, so there is no oversubscription.
// bf16/fp16 tiles are widened to fp32 for the product (fp32 accumulation) and narrowed once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "checks.h"

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
  // Several tasks per thread for balance, but not so small that call overhead dominates.
  const double target = std::max(total / (threads * 4.0), 4.0e6);
  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(rows.size()); ++g) {
    if (rows[g] == 0) continue;
    const double f = rows[g] * row_flops[g];
    int64_t chunks = std::min<int64_t>(rows[g], std::max<int64_t>(1, static_cast<int64_t>(f / target)));
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

// Runs fn(task) for every task, threads pulling the next task from a shared counter.
template <typename Fn>
void run_tasks(const std::vector<Task>& tasks, const Fn& fn) {
  if (tasks.empty()) return;
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (n == 1 || at::get_num_threads() == 1) {
    for (const auto& t : tasks) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(tasks[i]);
  });
}

// out = a @ b, with fp32 accumulation for half types. `out` may be a strided view.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  const auto dt = out.scalar_type();
  if (dt == at::kFloat || dt == at::kDouble) {
    at::mm_out(out, a, b);
  } else {
    out.copy_(at::mm(a.to(at::kFloat), b.to(at::kFloat)));
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

  auto out = at::empty({T, N}, x.options());
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
  run_tasks(tasks, [&](const Task& t) {
    const int64_t r0 = starts[t.group] + t.begin, n = t.end - t.begin;
    const auto w_g = trans_w ? w.select(0, t.group).t() : w.select(0, t.group);
    mm_into(out.narrow(0, r0, n), x.narrow(0, r0, n), w_g);
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
  auto out = at::empty({E, P, Q}, x.options());
  if (E == 0) return out;

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
  run_tasks(tasks, [&](const Task& t) {
    const int64_t g = t.group, n = t.end - t.begin;
    const auto a_g = a.narrow(0, starts[g], rows[g]).narrow(1, t.begin, n);
    const auto b_g = b.narrow(0, starts[g], rows[g]);
    mm_into(out.select(0, g).narrow(0, t.begin, n), a_g.t(), b_g);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CPU, m) {
  m.impl("gemm", &gemm_cpu);
  m.impl("gemm_wgrad", &gemm_wgrad_cpu);
}

}  // namespace grouped_ep
