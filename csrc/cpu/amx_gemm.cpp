// A bf16 GEMM on AMX tiles (TDPBF16PS) for the CPU grouped GEMM's tiles.
//
// Why: on a CPU with AMX, oneDNN's bf16 GEMM (what at::mm runs) reaches 1.5-1.7 TFLOP/s per core
// on one large product, but each call has a set-up cost of the order of 10 us. A grouped GEMM of
// many small groups (E=128 experts of 64 rows x 256 x 128: 4.2 MFLOP each) paid it per group and
// ran at 0.15x of one dense product's speed (Intel Xeon with AMX-BF16, 2 threads, 2026-11-25).
// This kernel has no set-up beyond packing the right operand.
//
// What it computes: C[M, N] = A[M, K] @ B[K, N], accumulated in fp32 inside the tiles over the
// whole K, rounded once to bf16 (round to nearest even), like oneDNN's bf16 path.
//
// How: B is packed one panel of 32 columns at a time into the pair layout of avx512_pack.h
// ([steps][32] lanes, a step a pair of K values), its steps zero-padded to a multiple of 16: 16
// steps of 16 columns are one AMX B tile (16 rows of 64 bytes, 128 bytes apart). A is loaded as
// tiles of 16 rows x 32 values straight from memory when its K is contiguous and a multiple of 32;
// else (odd K, the weight gradient's transposed A) it is packed into rows of zero-padded K. A
// 32 x 32 block of C lives in four tiles (2 x 2); each step of 32 K values loads two tiles of A
// and two of B and issues four TDPBF16PS (a block of at most 16 rows or columns: half of them).
// The block is stored to a 4 KB fp32 buffer and rounded to bf16 from there.
//
// A group of few rows times an [E, N, K] weight (B K-contiguous, K a multiple of 32) is computed transposed,
// C^T = B^T A^T (`amx_swapped`): the weight's rows are then tiles as they lie in memory, and the
// group's few rows are packed instead of the whole weight. That cut the time of groups of 8
// rows (E=128 experts of 256 x 128) from 5.6 to 3.7 us, and made the bench's bf16 Zipf forward
// rows 1.06x to 1.30x faster (2 threads, two A/B rounds).
#include "amx_gemm.h"
#include "aligned_buffer.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GE_AMX_BUILD 1
#else
#define GE_AMX_BUILD 0
#endif

#if GE_AMX_BUILD
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_pack.h"
#endif

namespace grouped_ep {
namespace {

#if GE_AMX_BUILD
using avx512_pack::kNR;
using avx512_pack::pack_b;
using avx512_pack::transpose16;

#define GE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prfchw,amx-tile,amx-bf16")))

constexpr int64_t kTileSteps = 16;  // K pairs per tile: 32 bf16 values, one 64-byte tile row
constexpr int64_t kBlockRows = 32;  // rows of C per block (two tiles of 16)
constexpr int64_t kPackCap = 8 << 20;     // bytes of packed A a thread keeps at most (see run_amx)
constexpr int64_t kGroupBytes = 512 << 10;  // packed B per group of panels
constexpr int64_t kChunkRows = 256;         // rows of A run over one group's panels in turn

// GCC's AMX intrinsics are asm statements that do not tell the compiler they read or write
// memory: a fence before tiles load what C++ code just wrote (the tile configuration, packed
// operands) and after they store what C++ code then reads.
inline void memory_fence() { asm volatile("" ::: "memory"); }

// Palette 1, all eight tiles 16 rows x 64 bytes: 0-3 the 2 x 2 tiles of a C block (16 x 16 fp32),
// 4-5 A's two 16-row halves (16 x 32 bf16), 6-7 B's two 16-column halves (16 steps x 16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

GE_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  memory_fence();
  _tile_loadconfig(&cfg);
}

GE_AMX void release_tiles() { _tile_release(); }

// Zeroes the steps [steps, steps_pad) of a packed panel (pad to whole tiles of K).
inline void zero_pad_steps(uint16_t* panel, int64_t steps, int64_t steps_pad) {
  std::memset(panel + steps * kNR * 2, 0, (steps_pad - steps) * kNR * 4);
}

// The packing of one panel of a K-contiguous B (sbk == 1: the [E, N, K] weight) as a list of
// 16 x 16 lane transposes, done a few at a time between the tile products of the panel before
// it: the transposes run on the vector units while the AMX unit multiplies. (The same layout as
// avx512_pack.h's pack_panel.)
struct PanelPack {
  const uint16_t* src = nullptr;
  uint16_t* dst = nullptr;
  int64_t sn = 0, K = 0, n0 = 0, cols = 0, full = 0, per_col = 0, count = 0, done = 0;
};

// Zeroes what the transposes will not write (a partial panel's missing columns, bf16's odd-K
// last step, the pad steps up to `steps_pad`) and lists the transposes of panel p.
GE_AMX PanelPack start_panel(const uint16_t* b, int64_t sbn, int64_t K, int64_t N, int64_t p, uint16_t* out,
                             int64_t steps_pad) {
  PanelPack pk;
  const int64_t steps = (K + 1) / 2;
  pk.src = b, pk.dst = out, pk.sn = sbn, pk.K = K, pk.n0 = p * kNR;
  pk.cols = std::min(kNR, N - pk.n0), pk.full = K / 2;
  if (pk.cols < kNR) {
    std::memset(out, 0, steps_pad * kNR * 4);
  } else {
    if (K % 2) std::memset(out + (steps - 1) * kNR * 2, 0, kNR * 4);
    zero_pad_steps(out, steps, steps_pad);
  }
  pk.per_col = (pk.full + 15) / 16;
  pk.count = (pk.cols + 15) / 16 * pk.per_col;
  return pk;
}

// Runs the panel's transposes up to number `upto`.
GE_AMX void run_panel(PanelPack& pk, int64_t upto) {
  for (upto = std::min(upto, pk.count); pk.done < upto; ++pk.done) {
    const int64_t j0 = pk.done / pk.per_col * 16, s0 = pk.done % pk.per_col * 16;
    transpose16(pk.src + (pk.n0 + j0) * pk.sn + 2 * s0, pk.sn, std::min<int64_t>(16, pk.cols - j0),
                std::min<int64_t>(16, pk.full - s0), pk.dst + (s0 * kNR + j0) * 2);
  }
}

// The rest of the panel's transposes, and bf16's odd-K last step (one value, its partner zero).
GE_AMX void finish_panel(PanelPack& pk) {
  run_panel(pk, pk.count);
  if (pk.K % 2)
    for (int64_t j = 0; j < pk.cols; ++j) pk.dst[(pk.full * kNR + j) * 2] = pk.src[(pk.n0 + j) * pk.sn + pk.K - 1];
}

// One block of C from AR x BC tiles of 16 x 16 (AR, BC: 1 or 2): rows [0, rows) and columns
// [0, cols) (at most 16 * AR and 16 * BC) from 16 * AR rows of A (`a`, rows `lda` bytes apart,
// `tiles` * 32 values each, zero past K) and a packed panel of B. A block of 16 rows or 16
// columns issues half the tile products of a full one. With kTrans the block is C's transpose:
// its rows are C's columns, so C(j, i) = block(i, j) is written (through 16 x 16 transposes of
// the fp32 sums). `job` (optional): a panel to pack meanwhile, `quota` of its transposes spread
// over the steps.
template <int AR, int BC, bool kTrans>
GE_AMX void block(int64_t tiles, const char* a, int64_t lda, const char* bp, uint16_t* c, int64_t ldc,
                  int64_t rows, int64_t cols, PanelPack* job, int64_t quota) {
  const int64_t base = job ? job->done : 0;
  alignas(64) float acc[kBlockRows * kNR];
  _tile_zero(0);
  if constexpr (BC == 2) _tile_zero(1);
  if constexpr (AR == 2) _tile_zero(2);
  if constexpr (AR == 2 && BC == 2) _tile_zero(3);
  const char* a1 = a + 16 * lda;
  for (int64_t t = 0; t < tiles; ++t) {
    const char* bt = bp + t * kTileSteps * kNR * 4;
    _tile_loadd(4, a + t * 64, lda);
    _tile_loadd(6, bt, kNR * 4);
    if constexpr (BC == 2) _tile_loadd(7, bt + 64, kNR * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (BC == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (AR == 2) {
      _tile_loadd(5, a1 + t * 64, lda);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (BC == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if (job) run_panel(*job, base + (t + 1) * quota / tiles);
  }
  _tile_stored(0, acc, kNR * 4);
  if constexpr (BC == 2) _tile_stored(1, acc + 16, kNR * 4);
  if constexpr (AR == 2) _tile_stored(2, acc + 16 * kNR, kNR * 4);
  if constexpr (AR == 2 && BC == 2) _tile_stored(3, acc + 16 * kNR + 16, kNR * 4);
  memory_fence();
  const float* out = acc;
  alignas(64) float acc_t[kBlockRows * kNR];
  if constexpr (kTrans) {
    // acc_t(j, i) = acc(i, j), quadrant by quadrant (32-bit lanes: fp32 transposes as bf16 pairs do).
    for (int r = 0; r < AR; ++r)
      for (int q = 0; q < BC; ++q)
        transpose16(reinterpret_cast<const uint16_t*>(acc + r * 16 * kNR + q * 16), kNR * 2, 16, 16,
                    reinterpret_cast<uint16_t*>(acc_t + q * 16 * kNR + r * 16), kNR);
    out = acc_t;
    const int64_t block_rows = rows;
    rows = cols, cols = block_rows;
  }
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    _mm256_mask_storeu_epi16(c + i * ldc, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out + i * kNR)));
    if (m1) _mm256_mask_storeu_epi16(c + i * ldc + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out + i * kNR + 16)));
  }
}

// `block` with as many tiles as the block's rows and columns need.
template <bool kTrans>
GE_AMX void run_block(int64_t tiles, const char* a, int64_t lda, const char* bp, uint16_t* c, int64_t ldc,
                      int64_t rows, int64_t cols, PanelPack* job = nullptr, int64_t quota = 0) {
  if (rows > 16) {
    if (cols > 16) block<2, 2, kTrans>(tiles, a, lda, bp, c, ldc, rows, cols, job, quota);
    else block<2, 1, kTrans>(tiles, a, lda, bp, c, ldc, rows, cols, job, quota);
  } else {
    if (cols > 16) block<1, 2, kTrans>(tiles, a, lda, bp, c, ldc, rows, cols, job, quota);
    else block<1, 1, kTrans>(tiles, a, lda, bp, c, ldc, rows, cols, job, quota);
  }
}

// A's rows [0, M) as rows of `kpad` values at out (zero past K; rows up to M rounded up to 32
// zero too). A(m, k) = a[m * sam + k * sak]. With K contiguous (sak == 1) a row copy; else each
// 32-row panel is packed in the pair layout (steps x rows) into `tmp`, then transposed 16 x 16
// lanes at a time into rows.
GE_AMX void pack_a(const uint16_t* a, int64_t sam, int64_t sak, int64_t M, int64_t K, int64_t kpad,
                   uint16_t* out, uint16_t* tmp) {
  const int64_t mpad = (M + kBlockRows - 1) / kBlockRows * kBlockRows;
  if (sak == 1) {
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(out + m * kpad, a + m * sam, K * 2);
      std::memset(out + m * kpad + K, 0, (kpad - K) * 2);
    }
    std::memset(out + M * kpad, 0, (mpad - M) * kpad * 2);
    return;
  }
  const int64_t steps = (K + 1) / 2, steps_pad = kpad / 2;
  for (int64_t q = 0; q < mpad / kNR; ++q) {
    pack_b(a, sak, sam, K, M, tmp, q, q + 1);  // zero past K and past M
    zero_pad_steps(tmp, steps, steps_pad);
    for (int64_t j0 = 0; j0 < kNR; j0 += 16)
      for (int64_t s0 = 0; s0 < steps_pad; s0 += 16)
        transpose16(tmp + (s0 * kNR + j0) * 2, kNR * 2, 16, 16, out + (q * kNR + j0) * kpad + s0 * 2, steps_pad);
  }
}

struct Buffers {
  ScratchBuf<uint16_t> bpanel, apack, tmp;
  std::size_t release() { return bpanel.release() + apack.release() + tmp.release(); }
};
using Scratch = Listed<Buffers>;

// C = A @ B for rows [0, M) of A and C; see the top of the file.
GE_AMX void amx_impl(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t sam, int64_t sak, const uint16_t* b,
                     int64_t sbk, int64_t sbn, uint16_t* c, int64_t ldc, Scratch& s) {
  const int64_t steps = (K + 1) / 2, tiles = (steps + kTileSteps - 1) / kTileSteps;
  const int64_t kpad = tiles * kTileSteps * 2;  // K rounded up to 32
  // A in place: K contiguous and a multiple of 32 (tile rows never read past a row's end); its
  // last partial block of rows is copied, zero-padded, so no tile reads past A.
  const bool in_place = sak == 1 && kpad == K;
  const int64_t full = in_place ? M / kBlockRows * kBlockRows : 0;
  if (in_place) {
    if (full < M) pack_a(a + full * sam, sam, 1, M - full, K, kpad, s.apack.data(), nullptr);
  } else {
    pack_a(a, sam, sak, M, K, kpad, s.apack.data(), s.tmp.data());
  }
  const int64_t panels = (N + kNR - 1) / kNR, pstride = tiles * kTileSteps * kNR * 2;
  if (sbk == 1 && sbn != 1) {
    // A K-contiguous B: panel p + 1 is packed while panel p multiplies (two buffers).
    uint16_t* buf[2] = {s.bpanel.data(), s.bpanel.data() + pstride};
    const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
    PanelPack pk = start_panel(b, sbn, K, N, 0, buf[0], tiles * kTileSteps);
    finish_panel(pk);
    for (int64_t p = 0; p < panels; ++p) {
      memory_fence();
      const bool more = p + 1 < panels;
      if (more) pk = start_panel(b, sbn, K, N, p + 1, buf[(p + 1) % 2], tiles * kTileSteps);
      const int64_t n0 = p * kNR, cols = std::min(kNR, N - n0), quota = more ? (pk.count + blocks - 1) / blocks : 0;
      const char* bp = reinterpret_cast<const char*>(buf[p % 2]);
      for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
        const bool here = m0 < full;
        const uint16_t* a0 = here ? a + m0 * sam : s.apack.data() + (m0 - full) * kpad;
        run_block<false>(tiles, reinterpret_cast<const char*>(a0), (here ? sam : kpad) * 2, bp, c + m0 * ldc + n0,
                         ldc, std::min(kBlockRows, M - m0), cols, more ? &pk : nullptr, quota);
      }
      if (more) finish_panel(pk);
    }
    return;
  }
  // Else B is packed a group of panels at a time (up to kGroupBytes; a row-major B is then read row by
  // row, each row once per group), and the group's panels are run over A in chunks of
  // kChunkRows rows, so that A's chunk and B's group stay in L2 while they are reused.
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(panels, kGroupBytes / (pstride * 2)));
  for (int64_t p0 = 0; p0 < panels; p0 += group) {
    const int64_t pe = std::min(panels, p0 + group);
    pack_b(b, sbk, sbn, K, N, s.bpanel.data(), p0, pe, pstride);
    for (int64_t p = p0; p < pe; ++p) zero_pad_steps(s.bpanel.data() + (p - p0) * pstride, steps, tiles * kTileSteps);
    memory_fence();
    for (int64_t mc = 0; mc < M; mc += kChunkRows) {
      const int64_t mend = std::min(M, mc + kChunkRows);
      for (int64_t p = p0; p < pe; ++p) {
        const int64_t n0 = p * kNR, cols = std::min(kNR, N - n0);
        const char* bp = reinterpret_cast<const char*>(s.bpanel.data() + (p - p0) * pstride);
        for (int64_t m0 = mc; m0 < mend; m0 += kBlockRows) {
          const bool here = m0 < full;
          const uint16_t* a0 = here ? a + m0 * sam : s.apack.data() + (m0 - full) * kpad;
          run_block<false>(tiles, reinterpret_cast<const char*>(a0), (here ? sam : kpad) * 2, bp, c + m0 * ldc + n0,
                           ldc, std::min(kBlockRows, M - m0), cols);
        }
      }
    }
  }
}

// C = A @ B for a K-contiguous B (sbk == 1: the [E, N, K] weight) and a K-contiguous A with few
// rows, as C^T = B^T @ A^T: the weight's rows are tile rows as they are in memory, and what is
// packed into the pair layout is A^T (M x K values) and the sums transposed back (M x N), instead
// of the whole weight (N x K). `run_amx` picks it when that moves fewer values.
GE_AMX void amx_swapped(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t sam, const uint16_t* b,
                        int64_t sbn, uint16_t* c, int64_t ldc, Scratch& s) {
  // K is a multiple of 32 (`swapped_pays`): whole tiles of K, no padding steps.
  const int64_t tiles = K / (2 * kTileSteps), pstride = K * kNR;
  const int64_t panels = (M + kNR - 1) / kNR;
  pack_b(a, 1, sam, K, M, s.bpanel.data(), 0, panels, pstride);  // A^T, zero past M
  // The weight's rows in place, but a last block of fewer than 32 rows, copied zero-padded (no
  // tile reads past the weight).
  const int64_t full = N / kBlockRows * kBlockRows;
  if (full < N) pack_a(b + full * sbn, sbn, 1, N - full, K, K, s.apack.data(), nullptr);
  memory_fence();
  for (int64_t n0 = 0; n0 < N; n0 += kBlockRows) {
    const bool here = n0 < full;
    const uint16_t* w0 = here ? b + n0 * sbn : s.apack.data();
    const int64_t nrows = N - n0 < kBlockRows ? N - n0 : kBlockRows;
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t m0 = p * kNR, mcols = M - m0 < kNR ? M - m0 : kNR;
      run_block<true>(tiles, reinterpret_cast<const char*>(w0), (here ? sbn : K) * 2,
                      reinterpret_cast<const char*>(s.bpanel.data() + p * pstride), c + m0 * ldc + n0, ldc, nrows,
                      mcols);
    }
  }
}

// Whether C = A @ B takes `amx_swapped`: B and A K-contiguous, K a multiple of 32 (the weight's
// rows are then read in place; else every row would be copied), fewer than 128 rows, and packing
// A^T and transposing C moves at most twice the 32-bit lanes that packing B does
// (M (K / 2 + N) < 2 N K / 2). Measured on one thread against the plain path, E groups of M rows
// of the bench's [E, N, K] weights (Intel Xeon with AMX, 2026-11-25; single runs vary by about
// 7%): K x N = 256 x 128, 3.7 against 5.6 us per group at M = 8, 7.2 against 8.5 at 64, and
// about even at 128; 512 x 256, 1.1x to 1.6x faster from M = 16 to 384; 768 x 512, 1.1x to 1.3x
// up to M = 96, 0.9x at 128 and 0.77x at 256; 1024 x 1024, 1.2x to 1.6x up to 128, 0.95x at 256.
bool swapped_pays(int64_t M, int64_t N, int64_t K, int64_t sak, int64_t sbk, int64_t sbn) {
  const int64_t steps = K / 2;  // K is even here
  return sak == 1 && sbk == 1 && sbn != 1 && K % 32 == 0 && M < 128 && M * (steps + N) < 2 * N * steps;
}

// A thread's scratch, listed for cpu_pool_release.
thread_local Scratch amx_scratch;

// Sizes the scratch and cuts a packed A into blocks of rows whose packed copy stays under
// kPackCap (the weight gradient's K is a group's row count: any size).
void run_amx(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t sam, int64_t sak, const uint16_t* b,
             int64_t sbk, int64_t sbn, uint16_t* c, int64_t ldc) {
  Scratch& s = amx_scratch;
  std::lock_guard<std::mutex> in_use(s.in_use);
  const int64_t steps_pad = ((K + 1) / 2 + kTileSteps - 1) / kTileSteps * kTileSteps, kpad = steps_pad * 2;
  const int64_t pstride = steps_pad * kNR * 2, panels = (N + kNR - 1) / kNR;
  if (swapped_pays(M, N, K, sak, sbk, sbn)) {
    s.bpanel.resize(static_cast<size_t>((M + kNR - 1) / kNR * pstride));
    s.apack.resize(static_cast<size_t>(kBlockRows * kpad));  // the weight's last partial block
    configure_tiles();
    amx_swapped(M, N, K, a, sam, b, sbn, c, ldc, s);
    release_tiles();
    return;
  }
  s.bpanel.resize(static_cast<size_t>(std::max<int64_t>(2, std::min<int64_t>(panels, kGroupBytes / (pstride * 2))) * pstride));
  const bool in_place = sak == 1 && kpad == K;
  int64_t rows = kBlockRows;
  if (!in_place) {
    rows = kPackCap / (kpad * 2) / kBlockRows * kBlockRows;
    rows = rows < kBlockRows ? kBlockRows : rows;
    s.tmp.resize(static_cast<size_t>(steps_pad * kNR * 2));
  }
  s.apack.resize(static_cast<size_t>((M < rows ? (M + kBlockRows - 1) / kBlockRows * kBlockRows : rows) * kpad));
  configure_tiles();
  if (in_place) {
    amx_impl(M, N, K, a, sam, sak, b, sbk, sbn, c, ldc, s);
  } else {
    for (int64_t m0 = 0; m0 < M; m0 += rows)
      amx_impl(M - m0 < rows ? M - m0 : rows, N, K, a + m0 * sam, sam, sak, b, sbk, sbn, c + m0 * ldc, ldc, s);
  }
  release_tiles();
}
#undef GE_AMX
#endif

}  // namespace

bool amx_bf16_ready() {
#if GE_AMX_BUILD
  // Linux hands a process the AMX tile state (8 KB per thread) only on request
  // (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN asks the same way.
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

void bf16_amx_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam, int64_t sak,
                   const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(static_cast<void*>(c + m * ldc), 0, N * sizeof(*c));
    return;
  }
#if GE_AMX_BUILD
  run_amx(M, N, K, reinterpret_cast<const uint16_t*>(a), sam, sak, reinterpret_cast<const uint16_t*>(b), sbk, sbn,
          reinterpret_cast<uint16_t*>(c), ldc);
#else
  (void)a, (void)sam, (void)sak, (void)b, (void)sbk, (void)sbn;
#endif
}

}  // namespace grouped_ep
