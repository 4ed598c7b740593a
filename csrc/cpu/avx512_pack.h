// Packing of GEMM operands into 32-bit lanes for the CPU kernels (avx512_gemm.cpp, amx_gemm.cpp):
// a panel of 32 columns of B as [steps][32] lanes, a step being one K value (fp32) or a pair of
// K values side by side (bf16), zero-padded in K and N. That is the pair layout of AVX512-BF16's
// vdpbf16ps and, 16 columns at a time, of an AMX bf16 B tile (16 steps of 64 bytes per tile).
//
// Included only by files built for x86-64 with GCC or Clang; every function carries its target
// attribute, so the including file needs no AVX-512 flags, and its callers check the CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#define GE_PACK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prfchw")))

namespace grouped_ep {
namespace avx512_pack {

constexpr int64_t kNR = 32;  // columns per panel (two vectors of 16 fp32)

// Values of T per 32-bit lane: a bf16 step is a pair of K values, an fp32 step one.
template <typename T>
constexpr int64_t kPer = std::is_same<T, float>::value ? 1 : 2;

inline uint32_t load_lane(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A whole 16 x 16 block of `transpose16`. The two cross-lane steps are done by the loads: vector
// 4c + i gets, in its 128-bit lane L, the lanes 4c .. 4c + 3 of row 4L + i (one load and three
// masked broadcasts from memory), so only the in-lane 4 x 4 transposes are shuffles, 32 of them
// instead of 64 (port 5 runs every 512-bit shuffle; the broadcasts' merges can also run on port
// 0). One thread, Intel Xeon with AMX, 2026-11-25: packing a 256 x 512 bf16 weight took 42-45 ns
// per block against 60-62 ns with the four shuffle steps.
GE_PACK_TARGET inline void transpose16_full(const uint16_t* src, int64_t sn, uint16_t* dst, int64_t dst_lanes) {
  for (int c = 0; c < 4; ++c) {
    __m512i v[4];
    for (int i = 0; i < 4; ++i) {
      const uint16_t* p = src + i * sn + 8 * c;  // row i, lane 4c
      __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      x = _mm512_mask_broadcast_i32x4(x, 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * sn)));
      x = _mm512_mask_broadcast_i32x4(x, 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * sn)));
      v[i] = _mm512_mask_broadcast_i32x4(x, 0xF000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12 * sn)));
    }
    const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    uint16_t* d = dst + 4 * c * 2 * dst_lanes;
    _mm512_storeu_si512(d, _mm512_unpacklo_epi64(t0, t2));
    _mm512_storeu_si512(d + 2 * dst_lanes, _mm512_unpackhi_epi64(t0, t2));
    _mm512_storeu_si512(d + 4 * dst_lanes, _mm512_unpacklo_epi64(t1, t3));
    _mm512_storeu_si512(d + 6 * dst_lanes, _mm512_unpackhi_epi64(t1, t3));
  }
}

// dst[kk * 32 + j] = the 32-bit lane at src + j * sn + 2 * kk (16-bit units), for j < rows and
// kk < n (both at most 16); dst rows are `dst_lanes` lanes apart. Rows past `rows` are left alone.
GE_PACK_TARGET inline void transpose16(const uint16_t* src, int64_t sn, int64_t rows, int64_t n, uint16_t* dst,
                                       int64_t dst_lanes = kNR) {
  if (rows == 16 && n == 16) {
    transpose16_full(src, sn, dst, dst_lanes);
    return;
  }
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
      if (kk < n) _mm512_mask_storeu_epi32(dst + kk * 2 * dst_lanes, rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1), col[h]);
    }
  }
}

// Panel p of B (columns 32p ..) as [steps][32] lanes at out, zero outside K x N, for B(k, n) =
// src[k * sk + n * sn] with sn != 1.
template <typename T>
GE_PACK_TARGET inline void pack_panel(const T* src, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t n0, T* out) {
  constexpr int64_t per = kPer<T>;
  const int64_t steps = (K + per - 1) / per, cols = N - n0 < kNR ? N - n0 : kNR;
  // The transposes below fill every lane of a full panel but bf16's odd-K last step.
  if (sk != 1 || cols < kNR) std::memset(out, 0, steps * kNR * 4);
  else if (K % per) std::memset(out + (steps - 1) * kNR * per, 0, kNR * 4);
  if (sk != 1) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < cols; ++j) out[((k / per) * kNR + j) * per + k % per] = src[k * sk + (n0 + j) * sn];
    return;
  }
  // Each step's values are contiguous in the source: a transpose of 32-bit lanes, 16 x 16 at a
  // time (in 16-bit units, an fp32 source's column stride doubles).
  const int64_t full = K / per, sn16 = sn * (sizeof(T) / 2);
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const int64_t rows = cols - j0 < 16 ? cols - j0 : 16;
    for (int64_t s0 = 0; s0 < full; s0 += 16) {
      const int64_t n = full - s0 < 16 ? full - s0 : 16;
      transpose16(reinterpret_cast<const uint16_t*>(src + (n0 + j0) * sn + per * s0), sn16, rows, n,
                  reinterpret_cast<uint16_t*>(out) + (s0 * kNR + j0) * 2);
    }
    if (K % per)  // bf16's odd K: the last step holds one value
      for (int64_t j = j0; j < j0 + rows; ++j) out[(full * kNR + j) * per] = src[(n0 + j) * sn + K - 1];
  }
}

// Panels [p_first, p_end) of B, one after another from out (p_end < 0: to the last),
// `panel_stride` values apart (< 0: packed back to back). A row-major
// B (sn == 1) is read in row order (every panel's part of a row, then the next row).
template <typename T>
GE_PACK_TARGET inline void pack_b(const T* src, int64_t sk, int64_t sn, int64_t K, int64_t N, T* out,
                      int64_t p_first = 0, int64_t p_end = -1, int64_t panel_stride = -1) {
  constexpr int64_t per = kPer<T>;
  const int64_t steps = (K + per - 1) / per, stride = panel_stride < 0 ? steps * kNR * per : panel_stride;
  const int64_t pe = p_end < 0 ? (N + kNR - 1) / kNR : p_end;
  if (sn != 1) {
    for (int64_t p = p_first; p < pe; ++p) pack_panel(src, sk, sn, K, N, p * kNR, out + (p - p_first) * stride);
    return;
  }
  if constexpr (per == 1) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = p_first; p < pe; ++p) {
        const int64_t n0 = p * kNR, cols = N - n0 < kNR ? N - n0 : kNR;
        const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
        const __mmask16 m1 = cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
        T* o = out + (p - p_first) * stride + k * kNR;
        _mm512_storeu_ps(o, _mm512_maskz_loadu_ps(m0, src + k * sk + n0));
        _mm512_storeu_ps(o + 16, _mm512_maskz_loadu_ps(m1, src + k * sk + n0 + 16));
      }
  } else {
    // Rows 2s and 2s + 1 interleaved value by value.
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                        55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t s = 0; s < steps; ++s) {
      const T* r0 = src + 2 * s * sk;
      const bool second = 2 * s + 1 < K;
      for (int64_t p = p_first; p < pe; ++p) {
        const int64_t n0 = p * kNR, cols = N - n0 < kNR ? N - n0 : kNR;
        const __mmask32 m = cols == kNR ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
        const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + n0);
        const __m512i b = second ? _mm512_maskz_loadu_epi16(m, r0 + sk + n0) : _mm512_setzero_si512();
        T* o = out + (p - p_first) * stride + s * 2 * kNR;
        _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(o + kNR, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}

}  // namespace avx512_pack
}  // namespace grouped_ep
