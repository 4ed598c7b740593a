// Per-thread scratch for the CPU kernels' packed operands, on 64-byte boundaries.
//
// Why: a std::vector's storage is only 16-byte aligned (glibc's malloc; a large block comes from
// mmap 16 bytes past a page). Packed panels are read 64 bytes at a time (AMX tile rows, AVX-512
// vectors), and from such storage every read spans two cache lines. Intel Xeon with AMX,
// 2026-11-25, the grouped GEMM's forward on the bench's shapes (2 threads, 3 alternating rounds,
// scratch 16 bytes off a line against on one): bf16 rows on the own AMX kernel 1.06x to 1.33x
// faster (geomean of all ten rows 1.10x; the E=8 rows run on oneDNN), fp32 rows on the own
// AVX-512 kernel (E=128) 1.06x to 1.08x.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <vector>

namespace grouped_ep {

template <typename T>
struct Align64 {
  using value_type = T;
  Align64() = default;
  template <typename U>
  Align64(const Align64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Align64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Align64<U>&) const { return false; }
};

// A growable buffer whose data() is 64-byte aligned.
template <typename T>
struct ScratchBuf {
  std::vector<T, Align64<T>> v;
  void resize(std::size_t n) { v.resize(n); }
  T* data() { return v.data(); }
  // Frees the storage; returns its bytes.
  std::size_t release() {
    const std::size_t bytes = v.capacity() * sizeof(T);
    std::vector<T, Align64<T>>().swap(v);
    return bytes;
  }
};

// A thread's scratch of one kernel (each kernel keeps one per thread, thread_local). Every live
// one is listed, so that cpu_pool_release frees the scratch of every thread that grew one: a
// Python thread pool's, and OpenMP threads beyond the current count, not only the calling
// thread's team (a review: 82 MiB kept after cpu_pool_release, the op run on 4 executor
// threads). A kernel holds `in_use` while it computes; release_every_scratch skips a scratch in
// use (try_lock: a mutex that a thread the child of a fork does not have held stays held there).
// Each kernel's scratch is a `Listed<Buffers>`, listed once it is whole and off the list before
// its buffers are freed: a release running while a thread exited called a half-destroyed scratch
// ("pure virtual method called", a review).
class ScratchSlot {
 public:
  ScratchSlot() = default;
  virtual ~ScratchSlot() = default;
  ScratchSlot(const ScratchSlot&) = delete;
  ScratchSlot& operator=(const ScratchSlot&) = delete;
  // Frees the storage; returns its bytes.
  virtual std::size_t release() = 0;
  std::mutex in_use;

 protected:
  void list();
  void unlist();
};

// `Buffers` (ScratchBufs and a release() freeing them) as a listed scratch.
template <typename Buffers>
struct Listed final : ScratchSlot, Buffers {
  Listed() { list(); }
  ~Listed() override { unlist(); }
  std::size_t release() override { return Buffers::release(); }
};

// Frees every thread's scratch not in use; returns the bytes freed. For cpu_pool_release.
int64_t release_every_scratch();

}  // namespace grouped_ep
