// The native half of grouped_ep.load_sharded: copies planned byte ranges of checkpoint files
// into the memory of CPU tensors, with a pool of threads issuing large preadv() calls.
//
// Python decides which bytes go where (grouped_ep/loading/); this file only moves them:
//   1. Every plan row is validated before any byte is read.
//   2. Rows are sorted by (file, offset) and cut into chunks of up to kChunkBytes of *contiguous
//      file bytes*: ranges that touch in the file are read by one preadv() into their scattered
//      destinations (an expert's gate, up and down weights are adjacent in a safetensors file
//      but land in three tensors). Chunks are taken in file order from a shared counter, so the
//      disk sees one sequential stream per file however many threads read it.
//   3. Read-ahead: POSIX_FADV_SEQUENTIAL on every file (a larger kernel read-ahead window); each
//      16 MiB preadv() is itself one large request to the disk. Explicit POSIX_FADV_WILLNEED on
//      chunks ahead is off by default (GROUPED_EP_READER_LOOKAHEAD=n asks for the chunk
//      n * threads ahead): measured on the CI-class VM's disk, it made cold loads slower.
//   4. No page fault hides inside the reads: before reading a chunk, its worker populates the
//      destination pages itself (MADV_POPULATE_WRITE), so the copy out of the page cache runs
//      into resident memory.
// The first error stops the other threads and is reported with the file, the offset and the
// reason. Every thread is joined on every path (errors and failed thread creation included):
// no std::thread outlives the call, none is left joinable.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "checks.h"
#include "io/join_all.h"
#include "pages.h"

namespace grouped_ep {
namespace {

constexpr int64_t kChunkBytes = 16 << 20;  // a few read-ahead windows; still spreads one large
                                           // tensor over every thread
constexpr int64_t kPlanCols = 5;           // file, out, src_offset, dst_offset, length
constexpr uintptr_t kHugePage = 2 << 20;
constexpr size_t kMaxSegments = 512;  // iovecs per preadv (IOV_MAX is 1024 on Linux)
// With GROUPED_EP_READER_LOOKAHEAD=n, a worker that takes chunk i asks the kernel to start reading
// chunk i + n * workers (POSIX_FADV_WILLNEED). Default 0: in interleaved cold loads of a 0.8 GB
// checkpoint (6 rounds, 2026-11-23), the median went from 1.19 to 1.46 GB/s on 1 rank and from
// 1.01 to 1.30 GB/s on 2 ranks without it (likely because WILLNEED submits its I/O from the
// worker, which then waits on a full disk queue instead of copying).
constexpr size_t kLookahead = 0;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we fall back
#endif

// GROUPED_EP_READER_HUGEPAGES=1 turns transparent huge pages on for the destinations (off by
// default: on the shared 2-core bench machine, short of memory, huge-page allocation stalled in
// compaction and loads ran at 0.76x get_slice against 1.65x without it, geomean of two quick
// bench runs minutes apart, bench/results/*-20261122-1959-quick and -2003-quick).
// GROUPED_EP_READER_POPULATE=0 turns the populate-before-read step off (to measure it).
// Each is 0 or 1 (unset or empty: the default); anything else is an error naming the variable
// ("false" had turned huge pages on). Read on the calling thread, before any worker starts.
// `v` in quotes, with control characters, quotes, backslashes and non-ASCII bytes as \xNN: an
// error must show "1\n" as such (its first line, all a LoadError keeps, ended after the "1").
std::string quoted(const char* v) {
  std::string out = "'";
  for (const char* p = v; *p; ++p) {
    const auto c = static_cast<unsigned char>(*p);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out + "'";
}

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  GE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0, "read_ranges: environment variable ", name,
           "=", quoted(v), " must be 0 (off) or 1 (on); the default is ", fallback ? "1" : "0");
  return std::strcmp(v, "1") == 0;
}

// GROUPED_EP_READER_LOOKAHEAD: a whole number of chunks, 0 to 1024, in decimal digits only
// (unset or empty: kLookahead).
size_t env_lookahead() {
  const char* v = std::getenv("GROUPED_EP_READER_LOOKAHEAD");
  if (v == nullptr || *v == '\0') return kLookahead;
  const size_t len = std::strlen(v);
  const bool digits = len <= 4 && std::all_of(v, v + len, [](char c) { return c >= '0' && c <= '9'; });
  const long n = digits ? std::strtol(v, nullptr, 10) : -1;
  GE_CHECK(n >= 0 && n <= 1024, "read_ranges: environment variable GROUPED_EP_READER_LOOKAHEAD=", quoted(v),
           " must be a whole number of chunks from 0 to 1024");
  return static_cast<size_t>(n);
}

// Fresh destination memory would otherwise be faulted in by the kernel during the copy, one
// 4 KiB page at a time. Asking for transparent huge pages on the 2 MiB-aligned interior of
// large outputs cuts the faults 512x (a hint: ignored where THP is off).
void advise_huge_pages(const at::Tensor& out, bool enabled) {
  if (!enabled || out.nbytes() < 2 * kHugePage) return;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) / kHugePage * kHugePage;
  const uintptr_t last = (begin + out.nbytes()) / kHugePage * kHugePage;
#ifdef MADV_HUGEPAGE
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

// Makes [dst, dst + len) resident and writable before the read. MADV_POPULATE_WRITE faults the
// whole range in one call; where the kernel lacks it (or the mapping refuses it), one write per
// page does the same. Writing a byte the read then overwrites is harmless.
void populate(uint8_t* dst, int64_t len, bool& madvise_works) {
  const uintptr_t page = pages::page_size();
  if (len <= 0) return;
  if (madvise_works && pages::populate_write(dst, len)) return;
  madvise_works = false;
  volatile uint8_t* p = dst;
  for (int64_t off = 0; off < len;) {
    p[off] = 0;
    off += static_cast<int64_t>(page - (reinterpret_cast<uintptr_t>(dst + off) % page));
  }
}

struct Row {
  int64_t file;
  int64_t src;
  uint8_t* dst;
  int64_t len;
};

// `len` contiguous bytes of one file at `src`, read into segments [first, last) of `segments`.
struct Chunk {
  int64_t file;
  int64_t src;
  int64_t len;
  size_t first;
  size_t last;
};

// Owns the open descriptors of one call; closes them however the call ends. `expect`, when not
// empty, holds 4 values per path, (st_dev, st_ino, st_size, st_mtime in ns) as they were when
// the caller read the file's header: a file replaced or rewritten since (a writer's
// save-then-rename) is refused rather than read at the offsets of the old header.
class Files {
 public:
  Files(const std::vector<std::string>& paths, const std::vector<int64_t>& expect)
      : paths_(paths) {
    fds_.reserve(paths.size());
    try {
      for (size_t i = 0; i < paths.size(); ++i) {
        const std::string& path = paths[i];
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        const int err = errno;
        GE_CHECK(fd >= 0, "read_ranges: cannot open ", path, ": ", std::strerror(err),
                 err == EMFILE ? " (the process's open-file limit, `ulimit -n`)" : "");
        fds_.push_back(fd);
        if (!expect.empty()) check_unchanged(fd, path, &expect[4 * i]);
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a larger read-ahead window
      }
    } catch (...) {
      // A constructor that throws runs no destructor: every file opened so far stayed open
      // (a review: 124 descriptors per failed load, until the process could open nothing).
      close_all();
      throw;
    }
  }
  ~Files() { close_all(); }
  Files(const Files&) = delete;
  Files& operator=(const Files&) = delete;
  int fd(int64_t i) const { return fds_[i]; }
  static void check_unchanged(int fd, const std::string& path, const int64_t* want) {
    struct stat st {};
    GE_CHECK(::fstat(fd, &st) == 0, "read_ranges: cannot stat ", path, ": ",
             std::strerror(errno));
    // Wraps modulo 2^64 (unsigned arithmetic: no overflow), as the caller's value does.
    const auto mtime_ns = static_cast<int64_t>(
        static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ULL +
        static_cast<uint64_t>(st.st_mtim.tv_nsec));
    const bool same = static_cast<int64_t>(st.st_dev) == want[0] &&
                      static_cast<int64_t>(st.st_ino) == want[1] &&
                      static_cast<int64_t>(st.st_size) == want[2] && mtime_ns == want[3];
    GE_CHECK(same, "read_ranges: ", path,
             ": the file changed since its header was read (now ", st.st_size,
             " bytes, inode ", st.st_ino, "; then ", want[2], " bytes, inode ", want[1],
             "; or a new modification time): it was replaced or rewritten during the load, "
             "load again once it is complete");
  }
  void check_all_unchanged(const std::vector<int64_t>& expect) const {
    for (size_t i = 0; !expect.empty() && i < fds_.size(); ++i) {
      check_unchanged(fds_[i], paths_[i], &expect[4 * i]);
    }
  }
  const std::string& path(int64_t i) const { return paths_[i]; }

 private:
  void close_all() {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
  }

  const std::vector<std::string>& paths_;
  std::vector<int> fds_;
};

// Reads exactly the chunk's bytes into its segments; returns an empty string, or what went wrong.
std::string preadv_full(int fd, const Chunk& c, const std::vector<Row>& segments) {
  std::vector<iovec> iov;
  iov.reserve(c.last - c.first);
  for (size_t s = c.first; s < c.last; ++s) {
    iov.push_back({segments[s].dst, static_cast<size_t>(segments[s].len)});
  }
  size_t next = 0;  // first iovec not yet complete
  int64_t done = 0;
  while (done < c.len) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - next, IOV_MAX));
    const ssize_t n = ::preadv(fd, iov.data() + next, count, c.src + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::string("pread failed at offset ") + std::to_string(c.src + done) + ": " +
             std::strerror(errno);
    }
    if (n == 0) {
      return "unexpected end of file at offset " + std::to_string(c.src + done) + " (wanted " +
             std::to_string(c.len - done) + " more bytes; is the file truncated?)";
    }
    done += n;
    for (size_t left = static_cast<size_t>(n); left > 0;) {  // skip what was filled
      const size_t take = std::min(left, iov[next].iov_len);
      iov[next].iov_base = static_cast<uint8_t*>(iov[next].iov_base) + take;
      iov[next].iov_len -= take;
      left -= take;
      if (iov[next].iov_len == 0) ++next;
    }
  }
  return {};
}

// Sorted rows -> chunks of contiguous file bytes (segments are rows cut at chunk boundaries).
void make_chunks(std::vector<Row>& rows, std::vector<Row>& segments, std::vector<Chunk>& chunks) {
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.file != b.file ? a.file < b.file : a.src < b.src;
  });
  for (const Row& r : rows) {
    for (int64_t b = 0; b < r.len;) {
      const bool extend = !chunks.empty() && chunks.back().file == r.file &&
                          chunks.back().src + chunks.back().len == r.src + b &&
                          chunks.back().len < kChunkBytes &&
                          chunks.back().last - chunks.back().first < kMaxSegments;
      if (!extend) chunks.push_back({r.file, r.src + b, 0, segments.size(), segments.size()});
      Chunk& c = chunks.back();
      const int64_t take = std::min(r.len - b, kChunkBytes - c.len);
      segments.push_back({r.file, r.src + b, r.dst + b, take});
      c.len += take;
      c.last = segments.size();
      b += take;
    }
  }
}

// paths: files the plan refers to by index. outs: contiguous CPU tensors written in place.
// plan: int64 [N, 5], row i = (file, out, src_offset, dst_offset, length) in bytes.
// expect: none, or (st_dev, st_ino, st_size, st_mtime_ns) per path, checked after each open.
int64_t read_ranges_cpu(const std::vector<std::string>& paths, at::TensorList outs,
                        const at::Tensor& plan, int64_t threads,
                        at::OptionalIntArrayRef expect) {
  constexpr const char* op = "read_ranges";
  GE_CHECK(plan.dim() == 2 && plan.size(1) == kPlanCols, op,
           ": plan must be int64 [N, 5] (file, out, src_offset, dst_offset, length), got shape ",
           plan.sizes());
  GE_CHECK(plan.scalar_type() == at::kLong && plan.device().is_cpu(), op,
           ": plan must be an int64 CPU tensor, got ", plan.scalar_type(), " on ", plan.device());
  GE_CHECK(threads >= 1, op, ": threads must be >= 1, got ", threads);
  std::vector<int64_t> identity;
  if (expect.has_value()) {
    GE_CHECK(expect->size() == 4 * paths.size(), op, ": expect must hold 4 values per path (",
             4 * paths.size(), "), got ", expect->size());
    identity.assign(expect->begin(), expect->end());
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    GE_CHECK(outs[i].device().is_cpu() && outs[i].is_contiguous(), op, ": outs[", i,
             "] must be a contiguous CPU tensor, got ", outs[i].device(),
             outs[i].is_contiguous() ? "" : " (non-contiguous)");
  }
  const at::Tensor plan_rows = plan.contiguous();
  const int64_t n = plan_rows.size(0);
  const int64_t* p = plan_rows.data_ptr<int64_t>();

  // Validate every row before touching any byte.
  std::vector<Row> rows;
  rows.reserve(n);
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
    GE_CHECK(src <= INT64_MAX - len, op, ": plan row ", i, " ends past the largest file offset");
    if (len > 0) rows.push_back({file, src, static_cast<uint8_t*>(outs[out].data_ptr()) + dst, len});
    total += len;
  }
  // Read on every call (cheap), so that a bad value is an error every time, not only the first.
  const bool huge_pages = env_flag("GROUPED_EP_READER_HUGEPAGES", false);
  const bool populate_enabled = env_flag("GROUPED_EP_READER_POPULATE", true);
  const size_t lookahead = env_lookahead();
  if (rows.empty()) return 0;
  std::vector<Row> segments;
  std::vector<Chunk> chunks;
  make_chunks(rows, segments, chunks);

  for (const auto& out : outs) advise_huge_pages(out, huge_pages);
  const Files files(paths, identity);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
  auto fail = [&](std::string why) noexcept {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!failed.exchange(true)) {
      try {
        error = std::move(why);
      } catch (...) {  // no memory for the message: the flag alone still stops the call
      }
    }
  };
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(chunks.size()));
  auto prefetch = [&](size_t i) {
    if (i >= chunks.size()) return;
    const Chunk& c = chunks[i];
    ::posix_fadvise(files.fd(c.file), c.src, c.len, POSIX_FADV_WILLNEED);
  };
  const size_t ahead = lookahead * static_cast<size_t>(workers);
  for (size_t i = 0; i < std::min(ahead, chunks.size()); ++i) prefetch(i);
  // Runs on every worker thread and on the calling thread; nothing may escape it (an exception
  // leaving a thread's function is std::terminate).
  auto work = [&]() noexcept {
    try {
      bool madvise_works = true;
      while (!failed.load(std::memory_order_relaxed)) {
        const size_t i = next.fetch_add(1);
        if (i >= chunks.size()) return;
        if (ahead) prefetch(i + ahead);
        const Chunk& c = chunks[i];
        for (size_t s = c.first; populate_enabled && s < c.last; ++s) {
          populate(segments[s].dst, segments[s].len, madvise_works);
        }
        std::string why = preadv_full(files.fd(c.file), c, segments);
        if (!why.empty()) return fail(files.path(c.file) + ": " + why);
      }
    } catch (const std::exception& e) {
      fail(std::string("reader thread failed: ") + e.what());
    } catch (...) {
      fail("reader thread failed with an unknown error");
    }
  };
  {
    JoinAll pool(static_cast<size_t>(workers - 1));
    try {
      for (int64_t t = 1; t < workers; ++t) pool.start(work);
    } catch (const std::exception& e) {  // e.g. EAGAIN: read with the threads that did start
      TORCH_WARN_ONCE("grouped_ep.read_ranges: could not start all ", workers,
                      " reader threads (", e.what(), "); reading with fewer");
    }
    work();
  }  // every thread joined here
  GE_CHECK(!failed.load(), op, ": ", error);
  // Again after the reads: a file rewritten in place while they ran (`rsync --inplace`, a
  // writer opening it "r+b") kept its inode and size, and gave part-old, part-new bytes
  // silently (a review); its modification time moved.
  files.check_all_unchanged(identity);
  return total;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CPU, m) { m.impl("read_ranges", &read_ranges_cpu); }

}  // namespace grouped_ep
