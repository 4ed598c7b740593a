// A small bf16 GEMM for the CPU grouped GEMM's small tiles, on AVX512-BF16 (vdpbf16ps).
//
// Why: through at::mm a bf16 product costs oneDNN about 16 us of set-up per call on this
// project's bench CPU, before any FLOP. A grouped GEMM with many small groups (E=128 experts,
// 64 rows each) pays that per group and reaches a third of one dense GEMM's speed. This kernel
// has no set-up beyond packing the right operand, so small tiles run near the instruction's rate.
//
// What it computes: C[M, N] = A[M, K] @ B[K, N] for bf16 A, B, C, accumulated in fp32 in registers
// over the whole K and rounded once (round to nearest even), like oneDNN's bf16 path.
//
// How: B is packed whole, in panels of 32 columns, into vdpbf16ps's pair layout ([K/2][32][2]:
// the values of rows 2k and 2k+1 side by side), zero-padded in K and N. A is read in place when
// its K dimension is contiguous (prefetched while B is packed), else packed the same way. The
// micro-kernel holds an 8 x 32 block of C in 16 registers; each step broadcasts one pair of A
// and multiplies two vectors of B.
//
// Only the functions under the target attribute use AVX-512, and they instantiate no library
// template (scratch is allocated outside them), so no inline function shared with other files is
// compiled with AVX-512 here. The caller checks that the CPU has avx512_bf16 first.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_avx512.h"

namespace grouped_ep {
namespace {

constexpr int64_t kNR = 32;  // columns per panel (two vectors of 16 fp32)
constexpr int64_t kMR = 8;   // rows per micro-kernel call

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// dst[kk * 32 + j] = the 32-bit pair at src + j * sn + 2 * kk (16-bit units), for j < rows and
// kk < n (both at most 16); dst rows are kNR pairs apart. Rows past `rows` are left alone.
GE_AVX512_BF16 void transpose16(const uint16_t* src, int64_t sn, int64_t rows, int64_t n, uint16_t* dst) {
  const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = j < rows ? _mm512_maskz_loadu_epi32(m, src + j * sn) : _mm512_setzero_si512();
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  // u[4q + e]: per 128-bit lane L, element 4L + e of rows 4q .. 4q + 3.
  __m512i u[16];
  for (int q = 0; q < 4; ++q) {
    const __m512i* tq = t + 4 * q;
    u[4 * q + 0] = _mm512_unpacklo_epi64(tq[0], tq[2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(tq[0], tq[2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(tq[1], tq[3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(tq[1], tq[3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD), w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    const __m512i col[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v1, w1, 0x88),
                            _mm512_shuffle_i32x4(v0, w0, 0xDD), _mm512_shuffle_i32x4(v1, w1, 0xDD)};
    for (int h = 0; h < 4; ++h) {
      const int kk = 4 * h + e;  // column kk of the 16 x 16 block
      if (kk < n) _mm512_mask_storeu_epi32(dst + kk * 2 * kNR, rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1), col[h]);
    }
  }
}

// out[kk][j][2] = (src(2kk, n0 + j), src(2kk + 1, n0 + j)) for j < 32, zero outside K x N.
// src(k, n) = src[k * sk + n * sn], with sn != 1 (pack_b interleaves contiguous rows itself).
GE_AVX512_BF16 void pack_panel(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N,
                              int64_t n0, uint16_t* out) {
  const int64_t pairs = (K + 1) / 2, cols = N - n0 < kNR ? N - n0 : kNR;
  std::memset(out, 0, pairs * 2 * kNR * sizeof(uint16_t));
  if (sk == 1) {
    // Each pair is contiguous in the source: a transpose of 32-bit values, 16 x 16 at a time.
    const int64_t full = K / 2;
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      const int64_t rows = cols - j0 < 16 ? cols - j0 : 16;
      for (int64_t kk0 = 0; kk0 < full; kk0 += 16) {
        const int64_t n = full - kk0 < 16 ? full - kk0 : 16;
        transpose16(src + (n0 + j0) * sn + 2 * kk0, sn, rows, n, out + (kk0 * kNR + j0) * 2);
      }
      if (K % 2)
        for (int64_t j = j0; j < j0 + rows; ++j) out[(full * kNR + j) * 2] = src[(n0 + j) * sn + K - 1];
    }
    return;
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < cols; ++j) out[((k / 2) * kNR + j) * 2 + k % 2] = src[k * sk + (n0 + j) * sn];
}

// All of B, panel after panel: panel p ([pairs][32][2], columns 32p ..) at out + p * pairs * 64.
// A row-major B is read in row order (two rows at a time, every panel's part of them), so the
// reads stream through memory instead of striding down one 64-byte column strip per panel.
GE_AVX512_BF16 void pack_b(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N, uint16_t* out) {
  const int64_t pairs = (K + 1) / 2, stride = pairs * 2 * kNR;
  if (sn != 1) {
    for (int64_t n0 = 0, p = 0; n0 < N; n0 += kNR, ++p) pack_panel(src, sk, sn, K, N, n0, out + p * stride);
    return;
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* r0 = src + 2 * kk * sk;
    const bool second = 2 * kk + 1 < K;
    for (int64_t n0 = 0, p = 0; n0 < N; n0 += kNR, ++p) {
      const int64_t cols = N - n0 < kNR ? N - n0 : kNR;
      const __mmask32 m = cols == kNR ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + n0);
      const __m512i b = second ? _mm512_maskz_loadu_epi16(m, r0 + sk + n0) : _mm512_setzero_si512();
      uint16_t* o = out + p * stride + kk * 2 * kNR;
      _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + kNR, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// C[i, 0:cols] = sum over pairs of A's pair (i, kk) . B's pair kk, for i < MR. A's pair (i, kk)
// starts at a + i * am + kk * ak; `half_tail`: A has an odd K read in place, so the last pair is
// A(i, K-1) alone (its neighbour in memory is not part of A). bp: the packed panel of B.
template <int MR>
GE_AVX512_BF16 void micro(int64_t pairs, bool half_tail, const uint16_t* a, int64_t am, int64_t ak,
                          const uint16_t* bp, uint16_t* c, int64_t ldc, int64_t cols) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + kk * 2 * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + kk * 2 * kNR + kNR);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(a + i * am + kk * ak)));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
    }
  }
  if (half_tail) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + pairs * 2 * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + pairs * 2 * kNR + kNR);
    for (int i = 0; i < MR; ++i) {
      const uint32_t v = a[i * am + pairs * ak];  // the last value, its pair partner zero
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
  for (int i = 0; i < MR; ++i) {
    _mm256_mask_storeu_epi16(c + i * ldc, m0, (__m256i)_mm512_cvtneps_pbh(acc[i][0]));
    _mm256_mask_storeu_epi16(c + i * ldc + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[i][1]));
  }
}

using Micro = void (*)(int64_t, bool, const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*,
                       int64_t, int64_t);
constexpr Micro kMicro[kMR + 1] = {nullptr,  micro<1>, micro<2>, micro<3>, micro<4>,
                                   micro<5>, micro<6>, micro<7>, micro<8>};

// bpanel: pairs * 2 * kNR values per panel of B (N rounded up to kNR); apack: the same for A's
// rows (M rounded up to kNR), used only when A's K dimension is not contiguous (sak != 1).
GE_AVX512_BF16 void gemm_impl(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t sam,
                              int64_t sak, const uint16_t* b, int64_t sbk, int64_t sbn, uint16_t* c,
                              int64_t ldc, uint16_t* bpanel, uint16_t* apack) {
  const int64_t pairs = (K + 1) / 2;
  // A in place when its pairs are contiguous; else packed like B, its K dim as the pair dim and
  // its rows as the columns: 32-row panels of [pairs][32][2], 8-row blocks never straddle one.
  const bool packed = sak != 1;
  int64_t am = sam, ak = 2, full_pairs = K / 2;
  bool half_tail = K % 2 == 1;
  if (packed) {
    pack_b(a, sak, sam, K, M, apack);
    am = 2;
    ak = 2 * kNR;
    half_tail = false;
    full_pairs = pairs;
  }
  // A read in place comes from memory once, in the first panel's pass: ask for all of it now,
  // so it arrives while B is packed.
  if (!packed)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 32) _mm_prefetch(reinterpret_cast<const char*>(a + m * sam + k), _MM_HINT_T1);
  pack_b(b, sbk, sbn, K, N, bpanel);
  for (int64_t n0 = 0, p = 0; n0 < N; n0 += kNR, ++p) {
    const int64_t cols = N - n0 < kNR ? N - n0 : kNR;
    const uint16_t* panel = bpanel + p * pairs * 2 * kNR;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t mr = M - m0 < kMR ? M - m0 : kMR;
      const uint16_t* a0 = packed ? apack + (m0 / kNR) * pairs * 2 * kNR + (m0 % kNR) * 2 : a + m0 * sam;
      kMicro[mr](full_pairs, half_tail, a0, am, ak, panel, c + m0 * ldc + n0, ldc, cols);
    }
  }
}
#undef GE_AVX512_BF16
#endif

}  // namespace

bool bf16_avx512_compiled() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return true;
#else
  return false;
#endif
}

void bf16_avx512_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* a, int64_t sam,
                      int64_t sak, const c10::BFloat16* b, int64_t sbk, int64_t sbn, c10::BFloat16* c,
                      int64_t ldc) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (M <= 0 || N <= 0) return;
  // Scratch per thread, grown as needed (outside the AVX-512 functions, see the top).
  thread_local std::vector<uint16_t> bpanel, apack;
  const int64_t pairs = (K + 1) / 2, mp = (M + kNR - 1) / kNR * kNR;
  bpanel.resize(static_cast<size_t>(pairs * 2 * ((N + kNR - 1) / kNR * kNR)));
  if (sak != 1) apack.resize(static_cast<size_t>(pairs * 2 * mp));
  gemm_impl(M, N, K, reinterpret_cast<const uint16_t*>(a), sam, sak, reinterpret_cast<const uint16_t*>(b),
            sbk, sbn, reinterpret_cast<uint16_t*>(c), ldc, bpanel.data(), apack.data());
#else
  (void)M, (void)N, (void)K, (void)a, (void)sam, (void)sak, (void)b, (void)sbk, (void)sbn, (void)c, (void)ldc;
#endif
}

}  // namespace grouped_ep
