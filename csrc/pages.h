// Making fresh memory resident before a kernel writes it (Linux; elsewhere these do nothing).
//
// Memory the C library has just mapped (glibc maps every allocation of 32 MiB or more afresh,
// and frees it back to the kernel) is faulted in one 4 KiB page at a time at its first write,
// each fault a trap into the kernel that zeroes the page. MADV_POPULATE_WRITE does the same
// work for a whole range in one call, without the traps.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace grouped_ep {
namespace pages {

inline uintptr_t page_size() {
#if defined(__linux__)
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
#else
  return 4096;
#endif
}

// MADV_POPULATE_WRITE on the pages that hold [p, p + len), whole pages only (it changes no
// byte, so pages shared with other data are fine). False where the kernel refuses (before
// Linux 5.14, or a mapping that does not allow it): the pages then fault in at first write.
inline bool populate_write(const void* p, int64_t len) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  if (len <= 0) return true;
  const uintptr_t page = page_size(), begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(len);
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
#else
  (void)p, (void)len;
  return false;
#endif
}

// Whether [p, p + len) looks freshly mapped: its first, middle or last page not yet resident
// (mincore). Memory the allocator hands out again is resident, and populating it once more
// would cost a page-table walk for nothing.
inline bool looks_fresh(const void* p, int64_t len) {
#if defined(__linux__)
  if (len <= 0) return false;
  const uintptr_t page = page_size(), first = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(len) - 1) / page * page;
  for (const uintptr_t at : {first, first + (last - first) / 2 / page * page, last}) {
    unsigned char resident = 0;
    if (::mincore(reinterpret_cast<void*>(at), page, &resident) == 0 && !(resident & 1)) return true;
  }
  return false;
#else
  (void)p, (void)len;
  return false;
#endif
}

}  // namespace pages
}  // namespace grouped_ep
