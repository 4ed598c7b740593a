// The native half of grouped_ep.load_sharded: copies planned byte ranges of checkpoint files
// into the memory of CPU tensors, with a pool of threads issuing large pread() calls.
//
// Python decides which bytes go where (grouped_ep/loader.py); this file only moves them. Long
// ranges are cut into chunks so that every thread has work even when one tensor dominates, and
// threads pull chunks from a shared counter. Each file is opened once per call; pread() on a
// shared descriptor is thread-safe. The first error stops the other threads and is reported
// with the file, the offset and the reason.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checks.h"

namespace grouped_ep {
namespace {

constexpr int64_t kChunkBytes = 8 << 20;  // large enough for the kernel's read-ahead, small
                                          // enough to spread one big tensor over all threads
constexpr int64_t kPlanCols = 5;          // file, out, src_offset, dst_offset, length
constexpr uintptr_t kHugePage = 2 << 20;
// Chunks are taken in order; a worker that takes chunk i asks the kernel to start reading
// chunk i + kLookahead * workers. Cold files then see many reads in flight instead of one
// synchronous read-ahead window per thread (threads sharing a descriptor also share, and
// confuse, its read-ahead state).
constexpr size_t kLookahead = 4;

// Fresh destination memory is faulted in by the kernel during pread, one 4 KiB page at a time;
// on many machines that costs more than the copy. Asking for transparent huge pages on the
// 2 MiB-aligned interior of large outputs cuts the faults 512x (a hint: ignored where THP is
// off, and harmless on memory that is already resident).
void advise_huge_pages(const at::Tensor& out) {
  if (out.nbytes() < 2 * kHugePage) return;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t last = (begin + out.nbytes()) / kHugePage * kHugePage;
#ifdef MADV_HUGEPAGE
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

struct Chunk {
  int64_t file;
  uint8_t* dst;
  int64_t src;
  int64_t len;
};

// Owns the open descriptors of one call; closes them however the call ends.
class Files {
 public:
  explicit Files(const std::vector<std::string>& paths) : paths_(paths) {
    fds_.reserve(paths.size());
    for (const auto& path : paths) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      GE_CHECK(fd >= 0, "read_ranges: cannot open ", path, ": ", std::strerror(errno));
      fds_.push_back(fd);
    }
  }
  ~Files() {
    for (int fd : fds_) ::close(fd);
  }
  Files(const Files&) = delete;
  Files& operator=(const Files&) = delete;
  int fd(int64_t i) const { return fds_[i]; }
  const std::string& path(int64_t i) const { return paths_[i]; }

 private:
  const std::vector<std::string>& paths_;
  std::vector<int> fds_;
};

// Reads exactly `len` bytes at `offset`; returns an empty string, or what went wrong.
std::string pread_full(int fd, uint8_t* dst, int64_t offset, int64_t len) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, dst + done, static_cast<size_t>(len - done), offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::string("pread failed at offset ") + std::to_string(offset + done) + ": " +
             std::strerror(errno);
    }
    if (n == 0) {
      return "unexpected end of file at offset " + std::to_string(offset + done) + " (wanted " +
             std::to_string(len - done) + " more bytes; is the file truncated?)";
    }
    done += n;
  }
  return {};
}

// paths: files the plan refers to by index. outs: contiguous CPU tensors written in place.
// plan: int64 [N, 5], row i = (file, out, src_offset, dst_offset, length) in bytes.
int64_t read_ranges_cpu(const std::vector<std::string>& paths, at::TensorList outs,
                        const at::Tensor& plan, int64_t threads) {
  constexpr const char* op = "read_ranges";
  GE_CHECK(plan.dim() == 2 && plan.size(1) == kPlanCols, op,
           ": plan must be int64 [N, 5] (file, out, src_offset, dst_offset, length), got shape ",
           plan.sizes());
  GE_CHECK(plan.scalar_type() == at::kLong && plan.device().is_cpu(), op,
           ": plan must be an int64 CPU tensor, got ", plan.scalar_type(), " on ", plan.device());
  GE_CHECK(threads >= 1, op, ": threads must be >= 1, got ", threads);
  for (size_t i = 0; i < outs.size(); ++i) {
    GE_CHECK(outs[i].device().is_cpu() && outs[i].is_contiguous(), op, ": outs[", i,
             "] must be a contiguous CPU tensor, got ", outs[i].device(),
             outs[i].is_contiguous() ? "" : " (non-contiguous)");
  }
  const at::Tensor rows = plan.contiguous();
  const int64_t n = rows.size(0);
  const int64_t* p = rows.data_ptr<int64_t>();

  // Validate every row before touching any byte, and cut long ranges into chunks.
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t file = p[i * kPlanCols], out = p[i * kPlanCols + 1];
    const int64_t src = p[i * kPlanCols + 2], dst = p[i * kPlanCols + 3];
    const int64_t len = p[i * kPlanCols + 4];
    GE_CHECK(file >= 0 && file < static_cast<int64_t>(paths.size()), op, ": plan row ", i,
             " names file ", file, " but only ", paths.size(), " paths were given");
    GE_CHECK(out >= 0 && out < static_cast<int64_t>(outs.size()), op, ": plan row ", i,
             " names out ", out, " but only ", outs.size(), " tensors were given");
    GE_CHECK(src >= 0 && dst >= 0 && len >= 0, op, ": plan row ", i,
             " has a negative offset or length (src ", src, ", dst ", dst, ", length ", len, ")");
    const int64_t cap = static_cast<int64_t>(outs[out].nbytes());
    GE_CHECK(dst <= cap && len <= cap - dst, op, ": plan row ", i, " writes bytes [", dst, ", ",
             dst + len, ") of outs[", out, "], which has ", cap, " bytes");
    uint8_t* base = static_cast<uint8_t*>(outs[out].data_ptr());
    for (int64_t b = 0; b < len; b += kChunkBytes) {
      chunks.push_back({file, base + dst + b, src + b, std::min(kChunkBytes, len - b)});
    }
    total += len;
  }
  if (chunks.empty()) return 0;

  for (const auto& out : outs) advise_huge_pages(out);
  const Files files(paths);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(chunks.size()));
  auto prefetch = [&](size_t i) {
    if (i >= chunks.size()) return;
    const Chunk& c = chunks[i];
    ::posix_fadvise(files.fd(c.file), c.src, c.len, POSIX_FADV_WILLNEED);
  };
  const size_t ahead = kLookahead * static_cast<size_t>(workers);
  for (size_t i = 0; i < std::min(ahead, chunks.size()); ++i) prefetch(i);
  auto work = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t i = next.fetch_add(1);
      if (i >= chunks.size()) return;
      prefetch(i + ahead);
      const Chunk& c = chunks[i];
      std::string why = pread_full(files.fd(c.file), c.dst, c.src, c.len);
      if (!why.empty()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.exchange(true)) error = files.path(c.file) + ": " + why;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  GE_CHECK(!failed.load(), op, ": ", error);
  return total;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CPU, m) { m.impl("read_ranges", &read_ranges_cpu); }

}  // namespace grouped_ep
