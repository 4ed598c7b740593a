// A pool for the CPU grouped GEMM's large outputs (pooled_empty, out_pool.h).
//
// Why: glibc maps every allocation of 32 MiB or more afresh and unmaps it when it is freed, so a
// weight gradient of E x K x N values is new memory on every backward pass, and every one of its
// 4 KiB pages is zeroed by the kernel at first touch. For E=32 experts of 768 x 512 in fp32
// (48 MiB) that cost halved the weight gradient's speed: 182 GFLOP/s against 358 with glibc told
// to keep its memory (Intel Xeon, 2 threads, 2026-11-25). PyTorch's CPU allocator keeps no cache;
// this pool keeps the blocks of dead outputs, up to GROUPED_EP_CPU_POOL_MB (default 1024; 0 turns
// the pool off), and hands one out again for an output of the same size or up to 1/8 smaller
// (the smallest such block, the last given back among equals).
// The oldest blocks are unmapped first when the cap is reached.
#include "out_pool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "aligned_buffer.h"

namespace grouped_ep {
namespace {

constexpr size_t kMinBytes = size_t(4) << 20;
constexpr size_t kRound = size_t(1) << 20;  // block sizes are rounded up to this

size_t cap_bytes() {
  static const size_t cap = [] {
    const char* v = std::getenv("GROUPED_EP_CPU_POOL_MB");
    if (v == nullptr || *v == '\0') return size_t(1024) << 20;
    char* end = nullptr;
    errno = 0;
    const long long mb = std::strtoll(v, &end, 10);
    constexpr long long kMaxMb = 1LL << 30;  // 1 PiB: past it, MiB << 20 could wrap
    TORCH_CHECK(end != v && *end == '\0' && errno == 0 && mb >= 0 && mb <= kMaxMb,
                "grouped_ep.gemm: environment variable GROUPED_EP_CPU_POOL_MB=", v, " must be a whole number of MiB from 0 to ",
                kMaxMb, " (0 turns the output pool off)");
    return static_cast<size_t>(mb) << 20;
  }();
  return cap;
}

struct Block {
  void* p;
  size_t bytes;
  uint64_t tick;  // when it was given back (older ones go first)
};

// Never destroyed: outputs may die after static destructors have run.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // A held block of `bytes` to `bytes` + 1/8, or null: the smallest, and of those the one given
  // back last (its memory the most likely still in cache).
  Block take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const Block& b = free_[i];
      if (b.bytes < bytes || b.bytes > bytes + bytes / 8) continue;
      if (best == free_.size() || b.bytes < free_[best].bytes ||
          (b.bytes == free_[best].bytes && b.tick > free_[best].tick))
        best = i;
    }
    if (best == free_.size()) return {nullptr, 0, 0};
    const Block b = free_[best];
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    held_ -= b.bytes;
    return b;
  }

  // Keeps a dead output's block, unmapping the oldest blocks past the cap.
  void give(void* p, size_t bytes) {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back({p, bytes, ++tick_});
      held_ += bytes;
      while (held_ > cap_bytes() && !free_.empty()) {
        size_t oldest = 0;
        for (size_t i = 1; i < free_.size(); ++i)
          if (free_[i].tick < free_[oldest].tick) oldest = i;
        drop.push_back(free_[oldest]);
        held_ -= free_[oldest].bytes;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(oldest));
      }
    }
    for (const Block& b : drop) unmap(b.p, b.bytes);
  }

  // Unmaps every held block (outputs alive keep theirs); the bytes given back.
  size_t release() {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      held_ = 0;
    }
    size_t bytes = 0;
    for (const Block& b : drop) {
      unmap(b.p, b.bytes);
      bytes += b.bytes;
    }
    return bytes;
  }

  static void* map(size_t bytes) {
#if defined(__linux__)
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
#else
    return std::malloc(bytes);
#endif
  }

  static void unmap(void* p, size_t bytes) {
#if defined(__linux__)
    ::munmap(p, bytes);
#else
    (void)bytes;
    std::free(p);
#endif
  }

 private:
  std::mutex mu_;
  std::vector<Block> free_;
  size_t held_ = 0;
  uint64_t tick_ = 0;
};

void give_back(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  Pool::get().give(b->p, b->bytes);
  delete b;
}

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  size_t numel = 1;
  for (const auto s : sizes) numel *= static_cast<size_t>(s);
  const size_t want = numel * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (want < kMinBytes || cap_bytes() == 0) return at::empty(sizes, options);
  Block b = Pool::get().take(want);
  if (b.p == nullptr) {
    b.bytes = (want + kRound - 1) / kRound * kRound;
    b.p = Pool::map(b.bytes);
    TORCH_CHECK(b.p != nullptr, "grouped_ep.gemm: could not allocate ", b.bytes, " bytes for the output");
  }
  // A resizable storage like at::empty's (a resize goes to the CPU allocator), of the bytes
  // asked for: a block may be larger (rounded up, or reused), and what lies past the output
  // (an earlier output's values) is not part of it, e.g. for torch.save. The whole block returns
  // to the pool when the storage lets go of it.
  auto* held = new Block(b);
  c10::DataPtr data(b.p, held, &give_back, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), want, std::move(data), c10::GetCPUAllocator(), true);
  return at::empty({0}, options).set_(storage, 0, sizes);
}

namespace {
// torch.ops.grouped_ep.cpu_pool_release(): the held blocks unmapped now, their bytes returned
// (evaluation or export after CPU training need not keep up to the cap resident). The own AVX-512,
// AVX2 and AMX kernels' scratch of every thread is freed too, but for a call in progress (not
// counted in the bytes returned).
int64_t cpu_pool_release() {
  release_every_scratch();
  return static_cast<int64_t>(Pool::get().release());
}
}  // namespace

// No tensor argument to dispatch on: one kernel for every backend.
TORCH_LIBRARY_IMPL(grouped_ep, CompositeExplicitAutograd, m) { m.impl("cpu_pool_release", &cpu_pool_release); }

}  // namespace grouped_ep
