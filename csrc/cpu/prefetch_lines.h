// Which cache lines the CPU GEMM kernels (avx512_gemm.cpp, avx2_gemm.cpp) prefetch in each
// micro-kernel call: memory described as runs of bytes (a span, or the rows or columns of a
// strided B), cut into lines and handed out evenly over a range of calls. Plain C++, no
// intrinsics: the kernel issues the prefetches itself.
#pragma once

#include <cstdint>

namespace grouped_ep {

// The next tile's operands, which the kernel asks for (a few cache lines per step) while it
// computes, so the next tile's first pass does not wait on DRAM: A's rows (one contiguous span)
// and B as the next call reads it (its strides, as in the kernel's arguments). A kernel
// prefetches A (up to a cap) and B's first panel; each later panel of B is prefetched while the
// panel before it computes. Null pointers: nothing to prefetch.
struct Prefetch {
  const void* a = nullptr;
  int64_t a_bytes = 0;
  const void* b = nullptr;
  int64_t sbk = 0, sbn = 0, K = 0, N = 0;
};

namespace prefetch_lines {

// Memory as `count` runs of `len` bytes, `stride` bytes apart: a panel of B's source, or a span.
struct Runs {
  const char* p = nullptr;
  int64_t count = 0, stride = 0, len = 0;
};

// The memory columns [n0, n0 + cols) of B(k, n) = b[k * sbk + n * sbn] are packed from (nothing
// for no columns, or for strides other than sbk == 1 or sbn == 1).
template <typename T>
Runs b_source(const T* b, int64_t sbk, int64_t sbn, int64_t K, int64_t n0, int64_t cols) {
  if (b == nullptr || cols <= 0 || K <= 0) return {};
  const char* base = reinterpret_cast<const char*>(b + n0 * sbn);
  constexpr int64_t es = sizeof(T);
  if (sbk == 1) return {base, cols, sbn * es, K * es};
  if (sbn == 1) return {base, K, sbk * es, cols * es};
  return {};
}

// The cache lines of some runs, handed out evenly over a tile's micro-kernel calls [first, end).
class Feed {
 public:
  Feed() = default;
  Feed(Runs r, int64_t first, int64_t end) : r_(r), first_(first), end_(end) {
    if (r_.count <= 0 || r_.len <= 0) return;
    if (r_.stride == r_.len) r_.len *= r_.count, r_.count = 1;  // back to back: one run
    // Runs that all start at the same offset in a line: from that line, exactly their lines;
    // else one more line per run than a run from a line's start needs (the last byte's line).
    const int64_t off = static_cast<int64_t>(reinterpret_cast<uintptr_t>(r_.p) % 64);
    if (r_.count == 1 || r_.stride % 64 == 0) {
      r_.p -= off;
      r_.len += off;
      per_ = (r_.len + 63) / 64;
    } else {
      per_ = (r_.len + 63) / 64 + 1;
    }
    left_ = r_.count * per_;
    // The common cases, one run or one line per run: line i is at p + i * step.
    step_ = r_.count == 1 ? 64 : per_ == 1 ? r_.stride : 0;
    at_ = r_.p;
  }
  // Appends call `call`'s share to out[n ..] (up to cap); returns the new count.
  int64_t take(int64_t call, const char** out, int64_t n, int64_t cap) {
    if (call < first_ || call >= end_) return n;
    int64_t k = (left_ + (end_ - call) - 1) / (end_ - call);
    if (k > cap - n) k = cap - n;
    left_ -= k;
    if (step_ != 0) {
      for (; k > 0; --k, at_ += step_) out[n++] = at_;
      return n;
    }
    for (; k > 0; --k) {
      out[n++] = r_.p + run_ * r_.stride + (line_ * 64 < r_.len ? line_ * 64 : r_.len - 1);
      if (++line_ == per_) line_ = 0, ++run_;
    }
    return n;
  }

 private:
  Runs r_;
  const char* at_ = nullptr;
  int64_t first_ = 0, end_ = 0, per_ = 0, left_ = 0, step_ = 0, run_ = 0, line_ = 0;
};

}  // namespace prefetch_lines
}  // namespace grouped_ep
