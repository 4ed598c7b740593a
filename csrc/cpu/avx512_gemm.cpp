// Small GEMMs on AVX-512 for the CPU grouped GEMM's tiles: bf16 (vdpbf16ps) and fp32 (vfmadd).
//
// Why: through at::mm a bf16 product costs oneDNN about 16 us of set-up per call on this
// project's bench CPU, before any FLOP. A grouped GEMM with many small groups (E=128 experts,
// 64 rows each) pays that per group and reaches a third of one dense GEMM's speed. And in a
// grouped GEMM every tile's operands come from memory (each group has its own weight), where a
// library call per tile cannot overlap one tile's loads with the previous tile's FLOPs. These
// kernels have no set-up beyond packing the right operand, and prefetch while they compute: the
// next tile's operands (which the caller names), B's next panel when B is large, and the output's
// next lines with write intent.
//
// What they compute: C[M, N] = A[M, K] @ B[K, N], accumulated in fp32: bf16 in registers over the
// whole K, rounded once at the end (round to nearest even), like oneDNN's bf16 path; fp32 in
// blocks of 256 K values, each block's sum added to C.
//
// How (in 32-bit lanes, so both types share the layout): B is packed one panel of 32 columns at a
// time, as [steps][32] lanes, a step being one K value (fp32) or a pair of K values side by side
// (bf16, vdpbf16ps's pair layout), zero-padded in K and N. A is read in place when its K dimension
// is contiguous (prefetched while B is packed), else packed the same way. The micro-kernel holds
// an 8 x 32 block of C in 16 registers; each step broadcasts one lane of A and multiplies two
// vectors of B.
//
// Only the functions under the target attribute use AVX-512, and they instantiate no library
// template (scratch is allocated outside them), so no inline function shared with other files is
// compiled with AVX-512 here. The caller checks that the CPU has the instructions first.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "aligned_buffer.h"
#include "avx512_gemm.h"
#include "prefetch_lines.h"

// The kernels are built for x86-64 with GCC or Clang (target attributes); elsewhere the entry
// points are empty and avx512_gemm_compiled() says so.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GE_AVX512_BUILD 1
#else
#define GE_AVX512_BUILD 0
#endif
#if GE_AVX512_BUILD
#include "avx512_pack.h"
#endif

namespace grouped_ep {
namespace {

using prefetch_lines::b_source;
using prefetch_lines::Feed;
using prefetch_lines::Runs;

#if GE_AVX512_BUILD
using avx512_pack::kNR;
using avx512_pack::kPer;
using avx512_pack::load_lane;
using avx512_pack::pack_b;
constexpr int64_t kMR = 8;  // rows per micro-kernel call
constexpr int64_t kKBlock = 256;  // fp32 steps summed from zero before they are added to C

// One instruction set for both types (fp32 included), so the caller requires avx512_bf16 for either.
#define GE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prfchw")))

// acc[i] += sum over steps [s0, s1) of A's lane (i, s) * B's lane s (fp32), prefetching pf[s].
template <int MR>
GE_AVX512 inline __attribute__((always_inline)) void f32_steps(__m512 (&acc)[MR][2], int64_t s0, int64_t s1,
                                                               const float* a, int64_t am, int64_t ak,
                                                               const float* bp, const char* const* pf,
                                                               int64_t lines) {
  for (int64_t s = s0; s < s1; ++s) {
    if (s < lines) _mm_prefetch(pf[s], _MM_HINT_T1);
    const __m512 b0 = _mm512_loadu_ps(bp + s * kNR), b1 = _mm512_loadu_ps(bp + s * kNR + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * am + s * ak]);
      acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
    }
  }
}

// C[i, 0:cols] = sum over steps of A's lane (i, s) . B's lane s, for i < MR. A's lane (i, s)
// starts at a + i * am + s * ak; `half_tail` (bf16): A has an odd K read in place, so the last
// step is A(i, K-1) alone (its neighbour in memory is not part of A). bp: the packed panel of B.
// pf, lines: cache lines to prefetch meanwhile, one per step (the rest after the loop). add_c
// (fp32 only): C holds the sums of earlier K blocks; these steps' sums are added to it.
template <typename T, int MR>
GE_AVX512 void micro(int64_t steps, bool half_tail, bool add_c, const T* a, int64_t am, int64_t ak, const T* bp,
                     T* c, int64_t ldc, int64_t cols, const char* const* pf, int64_t lines) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
  if constexpr (kPer<T> == 1) {
    if (steps <= kKBlock && !add_c) {
      f32_steps<MR>(acc, 0, steps, a, am, ak, bp, pf, lines);
    } else {
      // fp32 sums each block of kKBlock steps from zero and adds it to C: one running sum over
      // a large K (a weight gradient's K is a group's row count) was 4x-8x further from an
      // fp64 reference than at::mm at K = 4096 to 32768 (a review, 2026-11-26).
      for (int64_t s0 = 0; s0 < steps; s0 += kKBlock) {
        const int64_t s1 = steps - s0 < kKBlock ? steps : s0 + kKBlock;
        f32_steps<MR>(acc, s0, s1, a, am, ak, bp, pf, lines);
        for (int i = 0; i < MR; ++i) {
          float* row = reinterpret_cast<float*>(c + i * ldc);
          if (s0 > 0 || add_c) {
            acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_maskz_loadu_ps(m0, row));
            acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_maskz_loadu_ps(m1, row + 16));
          }
          if (s1 < steps) {  // the last block's sums are stored below
            _mm512_mask_storeu_ps(row, m0, acc[i][0]);
            _mm512_mask_storeu_ps(row + 16, m1, acc[i][1]);
            acc[i][0] = acc[i][1] = _mm512_setzero_ps();
          }
        }
      }
    }
  } else {
    for (int64_t s = 0; s < steps; ++s) {
      if (s < lines) _mm_prefetch(pf[s], _MM_HINT_T1);
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + s * 2 * kNR);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + s * 2 * kNR + kNR);
      for (int i = 0; i < MR; ++i) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_lane(a + i * am + s * ak)));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
      }
    }
    if (half_tail) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + steps * 2 * kNR);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + steps * 2 * kNR + kNR);
      for (int i = 0; i < MR; ++i) {
        const uint32_t v = a[i * am + steps * ak];  // the last value, its pair partner zero
        const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
      }
    }
  }
  for (int64_t l = steps; l < lines; ++l) _mm_prefetch(pf[l], _MM_HINT_T1);
  for (int i = 0; i < MR; ++i) {
    if constexpr (kPer<T> == 1) {
      _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
      _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
    } else {
      _mm256_mask_storeu_epi16(c + i * ldc, m0, (__m256i)_mm512_cvtneps_pbh(acc[i][0]));
      _mm256_mask_storeu_epi16(c + i * ldc + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[i][1]));
    }
  }
}

constexpr int64_t kMaxLines = 1024;     // prefetches handed to one micro-kernel call
constexpr int64_t kNextA = 256 << 10;   // bytes of the next tile's A prefetched ahead
constexpr int64_t kWholeB = 256 << 10;  // a B up to this size is prefetched whole, ahead

// Asks, with write intent, for the lines of C's rows [0, rows) and columns [0, cols) (from c):
// a line of C not in cache would be read from memory at its first store. Done one micro-kernel
// call ahead. (One thread, 128 experts' 64 x 128 x 256 bf16 tiles in turn: 1.2x faster with it.
// Over the bench's rows, fwd+bwd: 0.95x the time for bf16, 0.94x for fp32; fwd unchanged.)
template <typename T>
GE_AVX512 void prefetch_c(const T* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(c + i * ldc), end = begin + cols * sizeof(T);
    for (uintptr_t l = begin & ~uintptr_t(63); l < end; l += 64) __builtin_prefetch(reinterpret_cast<const void*>(l), 1, 3);
  }
}

template <typename T>
using Micro = void (*)(int64_t, bool, bool, const T*, int64_t, int64_t, const T*, T*, int64_t, int64_t,
                       const char* const*, int64_t);
template <typename T>
constexpr Micro<T> kMicro[kMR + 1] = {nullptr,     micro<T, 1>, micro<T, 2>, micro<T, 3>, micro<T, 4>,
                                      micro<T, 5>, micro<T, 6>, micro<T, 7>, micro<T, 8>};

// bpanel: one packed panel of B; apack: A packed (M rounded up to kNR rows), used only when A's K
// dimension is not contiguous (sak != 1). add_c (fp32): add the product to C (a later K block).
template <typename T>
GE_AVX512 void gemm_impl(int64_t M, int64_t N, int64_t K, const T* a, int64_t sam, int64_t sak, const T* b,
                         int64_t sbk, int64_t sbn, T* c, int64_t ldc, T* bpanel, T* apack, const Prefetch* next,
                         bool add_c) {
  constexpr int64_t per = kPer<T>;
  const int64_t steps = (K + per - 1) / per;
  // A in place when its steps are contiguous; else packed like B, its K dim as the step dim and
  // its rows as the columns: 32-row panels of [steps][32] lanes, 8-row blocks never straddle one.
  const bool packed = sak != 1;
  int64_t am = sam, ak = per, full_steps = K / per;
  bool half_tail = K % per != 0;
  if (packed) {
    pack_b(a, sak, sam, K, M, apack);
    am = per;
    ak = kNR * per;
    half_tail = false;
    full_steps = steps;
  }
  // A read in place comes from memory once, in the first panel's pass: ask for all of it now,
  // so it arrives while B is packed.
  if (!packed)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 64 / sizeof(T)) _mm_prefetch(reinterpret_cast<const char*>(a + m * sam + k), _MM_HINT_T1);
  // Prefetched meanwhile, spread over the micro-kernel calls: the next tile's A (up to kNextA
  // bytes) over the whole tile, and the next tile's B: whole over the whole tile when it is at
  // most kWholeB, else panel by panel: its first panel during this tile's last panel, and each
  // later one during the panel before it. A large B would not fit in L2 beside this tile's
  // operands; a small one is better asked for early (E=128 experts of 256 x 128 bf16, an A/B
  // in fixed order over the bench rows: panel by panel was 1.06x to 1.09x slower there).
  const int64_t panels = (N + kNR - 1) / kNR, blocks = (M + kMR - 1) / kMR, calls = panels * blocks;
  const auto small = [](int64_t k, int64_t n) { return k * n * static_cast<int64_t>(sizeof(T)) <= kWholeB; };
  const bool whole_b = small(K, N);  // then this B came whole, during the tile before
  Feed next_a, next_b;
  if (next) {
    const T* nb = static_cast<const T*>(next->b);
    const int64_t a_bytes = next->a ? (next->a_bytes < kNextA ? next->a_bytes : kNextA) : 0;
    next_a = {Runs{static_cast<const char*>(next->a), 1, 0, a_bytes}, 0, calls};
    if (small(next->K, next->N))
      next_b = {b_source(nb, next->sbk, next->sbn, next->K, 0, next->N), 0, calls};
    else
      next_b = {b_source(nb, next->sbk, next->sbn, next->K, 0, next->N < kNR ? next->N : kNR), calls - blocks, calls};
  }
  const char* lines[kMaxLines];
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kNR, cols = N - n0 < kNR ? N - n0 : kNR;
    const int64_t n1 = n0 + kNR, cols1 = whole_b ? 0 : N - n1 < kNR ? N - n1 : kNR;
    Feed this_b{b_source(b, sbk, sbn, K, n1, cols1), p * blocks, (p + 1) * blocks};
    if (p == 0) prefetch_c(c, ldc, M < kMR ? M : kMR, cols);
    pack_b(b, sbk, sbn, K, N, bpanel, p, p + 1);
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t mr = M - m0 < kMR ? M - m0 : kMR, call = p * blocks + m0 / kMR;
      if (m0 + kMR < M)  // the next call's rows of C: this panel's next rows, or the next panel's first
        prefetch_c(c + (m0 + kMR) * ldc + n0, ldc, M - m0 - kMR < kMR ? M - m0 - kMR : kMR, cols);
      else if (n1 < N)
        prefetch_c(c + n1, ldc, M < kMR ? M : kMR, N - n1 < kNR ? N - n1 : kNR);
      const T* a0 = packed ? apack + (m0 / kNR) * steps * kNR * per + (m0 % kNR) * per : a + m0 * sam;
      int64_t n = this_b.take(call, lines, 0, kMaxLines);
      n = next_a.take(call, lines, n, kMaxLines);
      n = next_b.take(call, lines, n, kMaxLines);
      kMicro<T>[mr](full_steps, half_tail, add_c, a0, am, ak, bpanel, c + m0 * ldc + n0, ldc, cols, lines, n);
    }
  }
}
#undef GE_AVX512

// Scratch per thread, grown as needed (outside the AVX-512 functions, see the top). fp32 runs a K
// over kKCache values in blocks of kKCache, each added to C, so a packed panel of B holds at most
// kKCache steps (256 KB); and a packed A is done in blocks
// of rows whose packed copy stays under kPackCap, each block packing B's panels again, a small
// cost next to its products (2 * rows FLOPs per packed value of B, rows >= 32). Why the K
// blocks: a weight gradient's K is a group's row count, and a whole-K panel (128 bytes per row:
// 8 MB at 65536 rows) came from memory again for every 8 rows of C: 2.4x to 3.8x at::mm's time
// for groups of 16K+ rows (a review, 2026-11-26). The blocks end on multiples of kKBlock, so the
// sums are the same, bit for bit, and fp32's scratch stays under 8.3 MB a thread. bf16 sums its
// whole K in registers (one rounding), so its panel still holds the whole K (64 bytes per K
// value; the shape rules of gemm_cpu.cpp keep K x N under 2M, so only a B of few columns and very
// many rows makes it large).
constexpr int64_t kPackCap = 8 << 20;  // bytes
// fp32 K values per block, a multiple of kKBlock. One thread, fp32 weight gradients with groups of
// 16K to 256K rows: blocks of 512, 1024 and 2048 within 3% of each other and of at::mm; 2048
// leaves every tile of up to 2048 rows (the bench's) as it was.
constexpr int64_t kKCache = 2048;

// A thread's scratch per type (at most about 8 MB for fp32; for bf16 it grows with K), listed
// for cpu_pool_release.
template <typename T>
struct Buffers {
  ScratchBuf<T> bpanel, apack;
  std::size_t release() { return bpanel.release() + apack.release(); }
};
template <typename T>
using Scratch = Listed<Buffers<T>>;
thread_local Scratch<uint16_t> scratch_bf16;
thread_local Scratch<float> scratch_f32;

template <typename T>
void run(int64_t M, int64_t N, int64_t K, const T* a, int64_t sam, int64_t sak, const T* b, int64_t sbk,
         int64_t sbn, T* c, int64_t ldc, const Prefetch* next) {
  if (M <= 0 || N <= 0) return;
  Scratch<T>& scratch = []() -> Scratch<T>& {
    if constexpr (std::is_same<T, float>::value) return scratch_f32;
    else return scratch_bf16;
  }();
  std::lock_guard<std::mutex> in_use(scratch.in_use);
  ScratchBuf<T>&bpanel = scratch.bpanel, &apack = scratch.apack;
  constexpr int64_t per = kPer<T>;
  const int64_t kc = per == 1 && K > kKCache ? kKCache : K;  // K values per block
  const int64_t lanes = (kc + per - 1) / per * kNR * per;  // one panel
  bpanel.resize(static_cast<size_t>(lanes));
  const int64_t panels = (M + kNR - 1) / kNR;
  const int64_t cap = kPackCap / static_cast<int64_t>(lanes * sizeof(T));  // panels per block
  const int64_t block = sak == 1 ? M : (cap < 1 ? 1 : cap < panels ? cap : panels) * kNR;
  if (sak != 1) apack.resize(static_cast<size_t>(lanes * (block / kNR)));
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t mb = M - m0 < block ? M - m0 : block;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kb = K - k0 < kc ? K - k0 : kc;
      gemm_impl(mb, N, kb, a + m0 * sam + k0 * sak, sam, sak, b + k0 * sbk, sbk, sbn, c + m0 * ldc, ldc,
                bpanel.data(), apack.data(), m0 + mb >= M && k0 + kb >= K ? next : nullptr, k0 > 0);
    }
  }
}
#endif

}  // namespace

bool avx512_gemm_compiled() { return GE_AVX512_BUILD; }


void bf16_avx512_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam,
                      int64_t sak, const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c,
                      int64_t ldc, const Prefetch* next) {
#if GE_AVX512_BUILD
  run(M, N, K, reinterpret_cast<const uint16_t*>(a), sam, sak, reinterpret_cast<const uint16_t*>(b), sbk, sbn,
      reinterpret_cast<uint16_t*>(c), ldc, next);
#else
  (void)M, (void)N, (void)K, (void)a, (void)sam, (void)sak, (void)b, (void)sbk, (void)sbn, (void)c, (void)ldc;
  (void)next;
#endif
}

void f32_avx512_gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                     const float* b, int64_t sbk, int64_t sbn, float* c, int64_t ldc, const Prefetch* next) {
#if GE_AVX512_BUILD
  run(M, N, K, a, sam, sak, b, sbk, sbn, c, ldc, next);
#else
  (void)M, (void)N, (void)K, (void)a, (void)sam, (void)sak, (void)b, (void)sbk, (void)sbn, (void)c, (void)ldc;
  (void)next;
#endif
}

}  // namespace grouped_ep
