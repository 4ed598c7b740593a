// GEMMs on AVX2 + FMA for the CPU grouped GEMM's tiles, on CPUs without AVX-512.
//
// Why: on such a CPU (AMD EPYC without AVX-512, 2026-11-25) torch has no fast bf16 or fp16 GEMM
// (oneDNN's low-precision kernels need AVX-512 or AMX), so those tiles were widened to fp32
// tensors, multiplied by MKL and narrowed back: three passes over memory and a fresh copy of the
// expert's weight for every tile. And MKL's per-call cost shows on a grouped GEMM's small tiles.
// These kernels widen bf16 / fp16 as they pack (B) or read (A) the operands, so every dtype runs
// the same fp32 micro-kernel with no copy of a whole operand, and round once at the end.
//
// What they compute: C[M, N] = A[M, K] @ B[K, N], fp32 sums in registers over the whole K;
// bf16 and fp16 outputs rounded once to nearest even (as c10's conversions do).
//
// How: B is packed one panel of 16 columns at a time as [K][16] fp32, zero-padded in N (all
// panels at once when A comes in several chunks, so each is packed once). A is read in place
// when it is fp32 with a contiguous K, else packed in blocks of 6 rows as [K][6] fp32. The
// micro-kernel holds a 6 x 16 block of C in 12 registers; each K step loads two vectors of B,
// broadcasts 6 values of A and issues 12 FMAs. A is taken in chunks of rows small enough to stay
// in L2 while every panel of B passes over it. While it computes, the kernel asks for what comes
// next, as the AVX-512 one does (see gemm_impl): B's next panel, the next tile's operands, C's
// next rows. One thread, 128 experts' 64 x 256 x 128 fp32 tiles (AMD EPYC, 2026-11-25, three
// rounds in turn), GFLOP/s forward / input gradient / weight gradient: 32.0-32.9 / 32.0-32.5 /
// 30.7-31.0 with it, 28.4-29.7 / 27.7-28.5 / 27.8-28.4 without, 31.8-32.8 / 30.9-31.9 /
// 29.5-30.4 with the next tile's operands alone; dense fp32 `torch.mm` 31.2-33.2 meanwhile.
//
// Only the functions under the target attribute use AVX2; they instantiate no library template
// (scratch is allocated outside them). The caller checks the CPU first (gemm_plan.cpp).
#include "avx2_gemm.h"
#include "aligned_buffer.h"

#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GE_AVX2_BUILD 1
#include <immintrin.h>
#else
#define GE_AVX2_BUILD 0
#endif

namespace grouped_ep {
namespace {

// How the operands are stored: fp32, or 16-bit values (bf16 or fp16) widened on reading.
enum class Kind { kF32, kBf16, kF16 };
template <Kind k>
using Elem = std::conditional_t<k == Kind::kF32, float, uint16_t>;

#if GE_AVX2_BUILD
#define GE_AVX2 __attribute__((target("avx2,fma,f16c")))

constexpr int64_t kNR = 16;              // columns per panel: two vectors of 8 fp32
constexpr int64_t kMR = 6;               // rows per micro-kernel call: 12 accumulators
constexpr int64_t kAChunk = 192 << 10;   // bytes of A (fp32) per chunk of rows, kept in L2
constexpr int64_t kMaxLines = 1024;      // prefetches handed to one micro-kernel call
constexpr int64_t kNextA = 256 << 10;    // bytes of the next tile's A prefetched ahead
constexpr int64_t kWholeB = 256 << 10;   // a B (as stored) up to this size is prefetched whole, ahead

using prefetch_lines::b_source;
using prefetch_lines::Feed;
using prefetch_lines::Runs;

template <Kind k>
GE_AVX2 inline float widen1(Elem<k> v) {
  if constexpr (k == Kind::kF32) {
    return v;
  } else if constexpr (k == Kind::kBf16) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return _cvtsh_ss(v);
  }
}

// 8 values from p, widened.
template <Kind k>
GE_AVX2 inline __m256 widen8(const Elem<k>* p) {
  if constexpr (k == Kind::kF32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (k == Kind::kBf16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);
  }
}

// 8 fp32 rounded to nearest even as 16-bit values; NaN becomes bf16's quiet NaN, as in c10.
template <Kind k>
GE_AVX2 inline __m128i narrow8(__m256 x) {
  if constexpr (k == Kind::kF16) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
}

// Stores one row of a micro-kernel's output: 16 columns in two vectors, the first `cols` kept;
// with kAdd (fp32 only) added to what c holds.
template <Kind o, bool kAdd>
GE_AVX2 inline void store_row(Elem<o>* c, __m256 v0, __m256 v1, int64_t cols) {
  if constexpr (o == Kind::kF32) {
    if (cols == kNR) {
      if constexpr (kAdd) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(c));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(c + 8));
      }
      _mm256_storeu_ps(c, v0);
      _mm256_storeu_ps(c + 8, v1);
      return;
    }
    alignas(32) float tmp[kNR];
    _mm256_store_ps(tmp, v0);
    _mm256_store_ps(tmp + 8, v1);
    for (int64_t j = 0; j < cols; ++j) c[j] = kAdd ? c[j] + tmp[j] : tmp[j];
  } else {
    static_assert(!kAdd, "sums over K blocks are kept in fp32");
    const __m128i h0 = narrow8<o>(v0), h1 = narrow8<o>(v1);
    if (cols == kNR) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c), h0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 8), h1);
      return;
    }
    alignas(16) uint16_t tmp[kNR];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h0);
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp + 8), h1);
    std::memcpy(c, tmp, cols * sizeof(uint16_t));
  }
}

// c[0:n] = v[0:n] rounded to the output type (the last step of a K-blocked product).
template <Kind o>
GE_AVX2 void narrow_row(const float* v, int64_t n, Elem<o>* c) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(c + j), narrow8<o>(_mm256_loadu_ps(v + j)));
  if (j < n) {
    alignas(32) float tmp[8] = {};
    alignas(16) uint16_t out[8];
    std::memcpy(tmp, v + j, (n - j) * sizeof(float));
    _mm_store_si128(reinterpret_cast<__m128i*>(out), narrow8<o>(_mm256_load_ps(tmp)));
    std::memcpy(c + j, out, (n - j) * sizeof(uint16_t));
  }
}

// In place: r[j][i] becomes the old r[i][j] (an 8 x 8 block of fp32).
GE_AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// dst[s * 16 + j] = B(s, n0 + j) widened, for s < K and j < cols, zero for cols <= j < 16.
template <Kind k>
GE_AVX2 void pack_panel(const Elem<k>* b, int64_t sbk, int64_t sbn, int64_t K, int64_t n0, int64_t cols,
                        float* dst) {
  const Elem<k>* b0 = b + n0 * sbn;
  if (sbn == 1 && cols == kNR) {  // rows of B contiguous: two loads per K step
    for (int64_t s = 0; s < K; ++s) {
      _mm256_storeu_ps(dst + s * kNR, widen8<k>(b0 + s * sbk));
      _mm256_storeu_ps(dst + s * kNR + 8, widen8<k>(b0 + s * sbk + 8));
    }
    return;
  }
  int64_t s0 = 0;
  if (sbk == 1) {  // columns of B contiguous (the [E, N, K] weight): 8 x 8 transposes
    for (; s0 + 8 <= K; s0 += 8) {
      for (int64_t h = 0; h < kNR; h += 8) {
        __m256 r[8];
        for (int64_t j = 0; j < 8; ++j)
          r[j] = h + j < cols ? widen8<k>(b0 + (h + j) * sbn + s0) : _mm256_setzero_ps();
        transpose8(r);
        for (int64_t kk = 0; kk < 8; ++kk) _mm256_storeu_ps(dst + (s0 + kk) * kNR + h, r[kk]);
      }
    }
  }
  for (int64_t s = s0; s < K; ++s)
    for (int64_t j = 0; j < kNR; ++j) dst[s * kNR + j] = j < cols ? widen1<k>(b0[s * sbk + j * sbn]) : 0.0f;
}

// dst[s * 6 + i] = A(i, s) widened, for s < K and i < rows (<= 6), zero for rows <= i < 6.
// Writes up to 2 floats past dst[6 * K] (the caller leaves room).
template <Kind k>
GE_AVX2 void pack_a(const Elem<k>* a, int64_t sam, int64_t sak, int64_t rows, int64_t K, float* dst) {
  int64_t s0 = 0;
  if (sam == 1 && sak >= 8) {  // a step's rows contiguous (the weight gradient's A): 8 values per
    // step, those past `rows` zeroed. They lie before the next step's first value, so every step
    // but the last (done below) reads inside A.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rows)), lane));
    for (; s0 + 1 < K; ++s0) _mm256_storeu_ps(dst + s0 * kMR, _mm256_and_ps(widen8<k>(a + s0 * sak), keep));
  }
  else if (sak == 1) {  // rows of A contiguous: 8 x 8 transposes of 6 rows and 2 of zeros
    for (; s0 + 8 <= K; s0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) r[i] = i < rows ? widen8<k>(a + i * sam + s0) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t kk = 0; kk < 8; ++kk) _mm256_storeu_ps(dst + (s0 + kk) * kMR, r[kk]);  // lanes 6, 7 overwritten next
    }
  }
  for (int64_t s = s0; s < K; ++s)
    for (int64_t i = 0; i < kMR; ++i) dst[s * kMR + i] = i < rows ? widen1<k>(a[i * sam + s * sak]) : 0.0f;
}

// C[i, 0:cols] (+)= sum over s < K of A(i, s) * bp[s * 16 : s * 16 + 16], for i < MR: A packed
// (A(i, s) = a[s * 6 + i]) or fp32 in place (A(i, s) = a[i * am + s]). pf, lines: cache lines to
// prefetch meanwhile, one per step (the rest after the loop).
template <Kind o, bool kPacked, bool kAdd, int MR>
GE_AVX2 void micro(int64_t K, const float* a, int64_t am, const float* bp, Elem<o>* c, int64_t ldc, int64_t cols,
                   const char* const* pf, int64_t lines) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K; ++s) {
    if (s < lines) _mm_prefetch(pf[s], _MM_HINT_T1);
    const __m256 b0 = _mm256_loadu_ps(bp + s * kNR), b1 = _mm256_loadu_ps(bp + s * kNR + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(kPacked ? a + s * kMR + i : a + i * am + s);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  for (int64_t l = K; l < lines; ++l) _mm_prefetch(pf[l], _MM_HINT_T1);
  // Out of registers through a local copy: indexing acc by a loop variable the compiler does not
  // unroll would keep it in memory, stored on every K step (half the speed, seen with GCC 12).
  alignas(32) float out[MR][kNR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(out[i], acc[i][0]);
    _mm256_store_ps(out[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < MR; ++i) store_row<o, kAdd>(c + i * ldc, _mm256_load_ps(out[i]), _mm256_load_ps(out[i] + 8), cols);
}

template <Kind o>
using Micro = void (*)(int64_t, const float*, int64_t, const float*, Elem<o>*, int64_t, int64_t, const char* const*,
                       int64_t);
template <Kind o, bool p, bool add>
constexpr Micro<o> kMicro[kMR + 1] = {nullptr,               micro<o, p, add, 1>, micro<o, p, add, 2>,
                                      micro<o, p, add, 3>,   micro<o, p, add, 4>, micro<o, p, add, 5>,
                                      micro<o, p, add, 6>};

// Asks for the lines of C's rows [0, rows) and columns [0, cols) (from c) one micro-kernel call
// before it stores them: a line of C not in cache would be read from memory at the store.
template <Kind o>
GE_AVX2 void prefetch_c(const Elem<o>* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(c + i * ldc), end = begin + cols * sizeof(Elem<o>);
    for (uintptr_t l = begin & ~uintptr_t(63); l < end; l += 64) _mm_prefetch(reinterpret_cast<const char*>(l), _MM_HINT_T0);
  }
}

// C = A @ B (o: C's type) or, with `add` (fp32 C), C += A @ B. bpack: one panel, or every panel
// when `keep_b` (then packed during the first chunk of rows); apack: a chunk of `mc` rows of A
// packed in 6-row blocks (unused when A is fp32 with a contiguous K, read in place).
// Prefetched meanwhile, spread over the micro-kernel calls (as in avx512_gemm.cpp): the next
// panel of B while the one before it computes, when it is to be packed; the next tile's A (up
// to kNextA bytes) over the whole tile; the next tile's B whole over the whole tile when it is
// at most kWholeB as stored, else its first panel during this tile's last panel.
template <Kind k, Kind o>
GE_AVX2 void gemm_impl(int64_t M, int64_t N, int64_t K, const Elem<k>* a, int64_t sam, int64_t sak,
                       const Elem<k>* b, int64_t sbk, int64_t sbn, Elem<o>* c, int64_t ldc, bool add, int64_t mc,
                       bool keep_b, float* bpack, float* apack, const Prefetch* next) {
  const bool in_place = k == Kind::kF32 && sak == 1;
  const int64_t panels = (N + kNR - 1) / kNR;
  const Micro<o>* micro_for = in_place ? kMicro<o, false, false> : kMicro<o, true, false>;  // by row count
  if constexpr (o == Kind::kF32)
    if (add) micro_for = in_place ? kMicro<o, false, true> : kMicro<o, true, true>;
  // Chunks hold whole 6-row blocks but the last: calls = panels x blocks of all of M.
  const int64_t calls = panels * ((M + kMR - 1) / kMR);
  const int64_t last_chunk = M - (M - 1) / mc * mc, last_calls = (last_chunk + kMR - 1) / kMR;
  const auto small = [](int64_t kk, int64_t n) { return kk * n * static_cast<int64_t>(sizeof(Elem<k>)) <= kWholeB; };
  const bool whole_b = small(K, N);  // then this B came whole, during the tile before
  Feed next_a, next_b;
  if (next) {
    const auto* nb = static_cast<const Elem<k>*>(next->b);
    const int64_t a_bytes = next->a ? (next->a_bytes < kNextA ? next->a_bytes : kNextA) : 0;
    next_a = {Runs{static_cast<const char*>(next->a), 1, 0, a_bytes}, 0, calls};
    if (small(next->K, next->N))
      next_b = {b_source(nb, next->sbk, next->sbn, next->K, 0, next->N), 0, calls};
    else
      next_b = {b_source(nb, next->sbk, next->sbn, next->K, 0, next->N < kNR ? next->N : kNR), calls - last_calls,
                calls};
  }
  const char* lines[kMaxLines];
  int64_t call = 0;
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t rows = M - m0 < mc ? M - m0 : mc, blocks = (rows + kMR - 1) / kMR;
    if (!in_place)
      for (int64_t i = 0; i < rows; i += kMR)
        pack_a<k>(a + (m0 + i) * sam, sam, sak, rows - i < kMR ? rows - i : kMR, K, apack + i * K);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kNR, cols = N - n0 < kNR ? N - n0 : kNR;
      const bool packs = !keep_b || m0 == 0;  // this chunk packs the panels
      const int64_t n1 = n0 + kNR, cols1 = whole_b || !packs ? 0 : N - n1 < kNR ? N - n1 : kNR;
      Feed this_b{b_source(b, sbk, sbn, K, n1, cols1), call, call + blocks};
      float* bp = keep_b ? bpack + p * K * kNR : bpack;
      if (packs) pack_panel<k>(b, sbk, sbn, K, n0, cols, bp);
      for (int64_t i = 0; i < rows; i += kMR, ++call) {
        const int64_t mr = rows - i < kMR ? rows - i : kMR;
        Elem<o>* ci = c + (m0 + i) * ldc + n0;
        if (i + kMR < rows)  // the next call's rows of C: this panel's next rows, or the next panel's first
          prefetch_c<o>(ci + kMR * ldc, ldc, rows - i - kMR < kMR ? rows - i - kMR : kMR, cols);
        else if (n1 < N)
          prefetch_c<o>(c + m0 * ldc + n1, ldc, rows < kMR ? rows : kMR, N - n1 < kNR ? N - n1 : kNR);
        int64_t n = this_b.take(call, lines, 0, kMaxLines);
        n = next_a.take(call, lines, n, kMaxLines);
        n = next_b.take(call, lines, n, kMaxLines);
        const float* ai = in_place ? reinterpret_cast<const float*>(a) + (m0 + i) * sam : apack + i * K;
        micro_for[mr](K, ai, sam, bp, ci, ldc, cols, lines, n);
      }
    }
  }
}

template <Kind o>
GE_AVX2 void narrow_rows(const float* v, int64_t M, int64_t N, Elem<o>* c, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m) narrow_row<o>(v + m * N, N, c + m * ldc);
}
#undef GE_AVX2

// K is cut into blocks of at most kKBlock values (about equal) when it is larger than
// kKSplit: a weight gradient's K is a group's row count, which has no bound. Sums over the
// blocks are kept in fp32 (C itself for fp32, else a scratch copy rounded once at the end).
constexpr int64_t kKSplit = 1536, kKBlock = 1024;
// All of B is packed once (rather than per chunk of A's rows) when its packed copy is at most
// this size.
constexpr int64_t kKeepB = 16 << 20;  // bytes

// Scratch per thread, grown as needed (outside the AVX2 functions, see the top), listed for
// cpu_pool_release: a bf16 weight gradient of K 8192 and N 4096 kept 50 MiB here after
// cpu_pool_release (a review, 2026-11-26).
struct Avx2Buffers {
  ScratchBuf<float> bpack, apack, csum;
  std::size_t release() { return bpack.release() + apack.release() + csum.release(); }
};
thread_local Listed<Avx2Buffers> scratch;

template <Kind k>
void run(int64_t M, int64_t N, int64_t K, const Elem<k>* a, int64_t sam, int64_t sak, const Elem<k>* b,
         int64_t sbk, int64_t sbn, Elem<k>* c, int64_t ldc, const Prefetch* next) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  std::lock_guard<std::mutex> in_use(scratch.in_use);
  ScratchBuf<float>&bpack = scratch.bpack, &apack = scratch.apack, &csum = scratch.csum;
  const int64_t blocks = K > kKSplit ? (K + kKBlock - 1) / kKBlock : 1;
  const int64_t kc = (K + blocks - 1) / blocks;
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t fit = kAChunk / (kc * static_cast<int64_t>(sizeof(float))) / kMR * kMR;
  const int64_t mc = fit < kMR ? kMR : fit < M ? fit : M;
  const bool keep_b = mc < M && panels * kc * kNR * static_cast<int64_t>(sizeof(float)) <= kKeepB;
  bpack.resize(static_cast<size_t>((keep_b ? panels : 1) * kc * kNR));
  apack.resize(static_cast<size_t>((mc + kMR - 1) / kMR * kMR * kc + 8));
  if (blocks == 1) {
    gemm_impl<k, k>(M, N, K, a, sam, sak, b, sbk, sbn, c, ldc, false, mc, keep_b, bpack.data(), apack.data(), next);
    return;
  }
  float* sum;
  int64_t lds;
  if constexpr (k == Kind::kF32) {
    sum = c, lds = ldc;
  } else {
    csum.resize(static_cast<size_t>(M * N));
    sum = csum.data(), lds = N;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kb = K - k0 < kc ? K - k0 : kc;
    gemm_impl<k, Kind::kF32>(M, N, kb, a + k0 * sak, sam, sak, b + k0 * sbk, sbk, sbn, sum, lds, k0 > 0, mc, keep_b,
                             bpack.data(), apack.data(), k0 + kb >= K ? next : nullptr);
  }
  if constexpr (k != Kind::kF32) narrow_rows<k>(sum, M, N, c, ldc);
}
#else
template <Kind k>
void run(int64_t, int64_t, int64_t, const Elem<k>*, int64_t, int64_t, const Elem<k>*, int64_t, int64_t, Elem<k>*,
         int64_t, const Prefetch*) {}  // never called: avx2_gemm_compiled() is false
#endif

}  // namespace

bool avx2_gemm_compiled() { return GE_AVX2_BUILD; }

void f32_avx2_gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak, const float* b,
                   int64_t sbk, int64_t sbn, float* c, int64_t ldc, const Prefetch* next) {
  run<Kind::kF32>(M, N, K, a, sam, sak, b, sbk, sbn, c, ldc, next);
}

void bf16_avx2_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam, int64_t sak,
                    const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c, int64_t ldc,
                    const Prefetch* next) {
  run<Kind::kBf16>(M, N, K, reinterpret_cast<const uint16_t*>(a), sam, sak, reinterpret_cast<const uint16_t*>(b),
                   sbk, sbn, reinterpret_cast<uint16_t*>(c), ldc, next);
}

void f16_avx2_gemm(int64_t M, int64_t N, int64_t K, const c10::Half* a, int64_t sam, int64_t sak,
                   const c10::Half* b, int64_t sbk, int64_t sbn, c10::Half* c, int64_t ldc,
                   const Prefetch* next) {
  run<Kind::kF16>(M, N, K, reinterpret_cast<const uint16_t*>(a), sam, sak, reinterpret_cast<const uint16_t*>(b),
                  sbk, sbn, reinterpret_cast<uint16_t*>(c), ldc, next);
}

}  // namespace grouped_ep
