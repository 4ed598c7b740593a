// CRC32C (Castagnoli) of byte ranges of a file, for the checkpoint checksums
// (grouped_ep/checkpoint/checksum.py: written at save, checked at load and by `inspect`).
//
// Why not zlib.crc32: it ran at 2.0 GB/s on one core (Intel Xeon, 2026-11-25), and a save reads
// back and a load reads once more every byte of the checkpoint. The SSE4.2 crc32 instruction
// (CRC32C's polynomial) takes 8 bytes per instruction; CPUs without it use a table. Ranges are
// spread over `threads` threads, each with its own buffer, reading with pread.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "checks.h"
#include "io/join_all.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define GE_CRC_HW 1
#else
#define GE_CRC_HW 0
#endif

namespace grouped_ep {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected
constexpr size_t kBuffer = size_t(8) << 20;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      t[i] = c;
    }
    return t;
  }();
  return table;
}

uint32_t crc_soft(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = crc_table();
  while (n--) crc = t[(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
  return crc;
}

#if GE_CRC_HW
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

// The running CRC (before the final inversion) of n more bytes.
uint32_t crc_update(uint32_t crc, const uint8_t* p, size_t n) {
#if GE_CRC_HW
  if (has_sse42()) return crc_hw(crc, p, n);
#endif
  return crc_soft(crc, p, n);
}

// CRC32C of `lengths[i]` bytes at `offsets[i]` of file `path`, each, as int64 [N].
at::Tensor crc32c_ranges(c10::string_view path_view, const at::Tensor& offsets, const at::Tensor& lengths,
                         int64_t threads) {
  const std::string path(path_view);
  constexpr const char* op = "crc32c";
  for (const auto* t : {&offsets, &lengths}) {
    GE_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->device().is_cpu(), op,
             ": offsets and lengths must be 1-D int64 CPU tensors");
  }
  GE_CHECK(offsets.numel() == lengths.numel(), op, ": ", offsets.numel(), " offsets but ", lengths.numel(),
           " lengths");
  GE_CHECK(threads >= 1, op, ": threads must be >= 1, got ", threads);
  const auto off = offsets.contiguous(), len = lengths.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* l = len.data_ptr<int64_t>();
  const int64_t n = off.numel();
  for (int64_t i = 0; i < n; ++i) {
    GE_CHECK(o[i] >= 0 && l[i] >= 0, op, ": range ", i, " has offset ", o[i], " and length ", l[i]);
  }
  auto out = at::empty({n}, at::kLong);
  int64_t* crc = out.data_ptr<int64_t>();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  GE_CHECK(fd >= 0, op, ": cannot open ", path, ": ", std::strerror(errno));
  std::mutex lock;
  std::string error;  // the first failure, under lock
  auto work = [&](int64_t first, int64_t step) {
    std::vector<uint8_t> buf(std::min<size_t>(kBuffer, 1 << 20));
    for (int64_t i = first; i < n; i += step) {
      uint32_t c = 0xFFFFFFFFu;
      int64_t done = 0;
      while (done < l[i]) {
        const size_t want = static_cast<size_t>(std::min<int64_t>(l[i] - done, kBuffer));
        if (buf.size() < want) buf.resize(want);
        const ssize_t got = ::pread(fd, buf.data(), want, o[i] + done);
        if (got <= 0) {
          if (got < 0 && errno == EINTR) continue;
          std::lock_guard<std::mutex> g(lock);
          if (error.empty()) {
            error = path + ": " + (got < 0 ? std::string("read failed at offset ") : std::string("file ends at offset ")) +
                    std::to_string(o[i] + done) + (got < 0 ? std::string(": ") + std::strerror(errno) : "") +
                    ", inside the range of " + std::to_string(l[i]) + " bytes at offset " + std::to_string(o[i]);
          }
          return;
        }
        c = crc_update(c, buf.data(), static_cast<size_t>(got));
        done += got;
      }
      crc[i] = static_cast<int64_t>(c ^ 0xFFFFFFFFu);
    }
  };
  {
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
    JoinAll pool(static_cast<size_t>(workers - 1));
    for (int64_t w = 1; w < workers; ++w) {
      try {
        pool.start(work, w, workers);
      } catch (const std::system_error&) {  // no thread to be had: this one does its share
        work(w, workers);
      }
    }
    work(0, workers);
  }
  ::close(fd);
  GE_CHECK(error.empty(), op, ": ", error);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CompositeExplicitAutograd, m) { m.impl("crc32c", &crc32c_ranges); }

}  // namespace grouped_ep
