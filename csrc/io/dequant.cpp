// Dequantization of checkpoint tensors on CPU, for grouped_ep.load_sharded (planned in
// grouped_ep/loading/quant.py, called from dequant.py).
//
// out[a, i, j] = value(q, a, i, j) * scale[a, row_block[i], col_block[j]], computed in fp32 and
// rounded once to out's dtype (round to nearest even), as transformers does. value is a
// float8_e4m3fn byte ("fp8") or an FP4 E2M1 nibble ("mxfp4": two per byte, the low nibble first),
// both through tables of the rounded products (see run()). Rows are spread over `threads`
// std::threads (load_sharded's own count, not torch's intra-op setting, which launchers often
// set to 1 per rank); out may be any strided view (a box of the destination tensor).
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <type_traits>
#include <algorithm>
#include <string>
#include <system_error>
#include <vector>

#include "checks.h"
#include "io/join_all.h"

namespace grouped_ep {
namespace {

constexpr std::array<float, 16> kFp4 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table;
}

// One table entry: code * scale, rounded once to T. An mxfp4 scale given as its uint8 E8M0
// exponent e means 2^(e - 127), applied with ldexp as transformers does (torch.ldexp): exact for
// every e, 255 included (0 stays 0, 0.5 * 2^128 = 2^127), where a float scale cannot hold 2^128.
template <typename T, typename S>
T scaled(float code, S s) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    return static_cast<T>(std::ldexp(code, static_cast<int>(s) - 127));
  } else {
    return static_cast<T>(code * s);
  }
}

template <typename T, bool kFp4Packed, typename S>
void run(const at::Tensor& q, const at::Tensor& scale, const int64_t* rb, const int64_t* cb,
         at::Tensor& out, int64_t threads) {
  const int64_t A = out.size(0), R = out.size(1), C = out.size(2);
  const auto qs = q.strides();
  const auto os = out.strides();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const int64_t SR = scale.size(1), SC = scale.size(2);
  T* op = out.data_ptr<T>();
  const float* codes = kFp4Packed ? kFp4.data() : fp8_table().data();
  constexpr int64_t kCodes = kFp4Packed ? 16 : 256;
  // The output value of every code under every scale of one scale row, rounded once: the inner
  // loop is then a table lookup. Rows of one block share a scale row (DeepSeek-V3: 128 rows), so
  // a table is rebuilt once per block row (256 products per 128 x 128 values).
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<T> table(static_cast<size_t>(SC * kCodes));
    int64_t table_row = -1;
    for (int64_t ar = begin; ar < end; ++ar) {
      const int64_t a = ar / R, i = ar % R;
      const int64_t scale_row = a * SR + rb[i];
      if (scale_row != table_row) {
        const S* srow = sp + scale_row * SC;
        for (int64_t c = 0; c < SC; ++c) {
          for (int64_t k = 0; k < kCodes; ++k) {
            table[c * kCodes + k] = scaled<T>(codes[k], srow[c]);
          }
        }
        table_row = scale_row;
      }
      const T* t = table.data();
      const uint8_t* qrow = qp + a * qs[0] + i * qs[1];
      T* orow = op + a * os[0] + i * os[1];
      if constexpr (kFp4Packed) {
        for (int64_t j = 0; j < C; j += 2) {
          const uint8_t byte = qrow[(j >> 1) * qs[2]];
          orow[j * os[2]] = t[cb[j] * kCodes + (byte & 0xF)];
          orow[(j + 1) * os[2]] = t[cb[j + 1] * kCodes + (byte >> 4)];
        }
      } else {
        for (int64_t j = 0; j < C; ++j) orow[j * os[2]] = t[cb[j] * kCodes + qrow[j * qs[2]]];
      }
    }
  };
  // At least 64 Ki values per thread: below that, starting a thread costs more than it saves.
  const int64_t rows = A * R;
  const int64_t workers = std::max<int64_t>(
      1, std::min<int64_t>({threads, rows, (rows * C) / (64 << 10)}));
  const int64_t per = (rows + workers - 1) / workers;
  JoinAll pool(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t begin = w * per, end = std::min(rows, (w + 1) * per);
    try {
      pool.start(work, begin, end);
    } catch (const std::system_error&) {  // no thread to be had (a loaded machine): do it here
      work(begin, end);
    }
  }
  work(0, std::min(rows, per));
}

// q: uint8 [A, R, C] (fp8 bytes) or [A, R, C/2] (mxfp4); scale: float32 [A, SR, SC] contiguous
// (mxfp4 also uint8: the E8M0 exponents, see `scaled`);
// row_block: int64 [R] in [0, SR); col_block: int64 [C] in [0, SC); out: [A, R, C] bf16/fp16/fp32.
void dequantize_cpu(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& row_block,
                    const at::Tensor& col_block, at::Tensor out, c10::string_view format,
                    int64_t threads) {
  constexpr const char* op = "dequantize";
  const bool fp4 = format == "mxfp4";
  GE_CHECK(fp4 || format == "fp8", op, ": format must be 'fp8' or 'mxfp4', got '",
           std::string(format), "'");
  GE_CHECK(out.dim() == 3 && q.dim() == 3 && scale.dim() == 3, op,
           ": q, scale and out must be 3-D [A, R, C], got ", q.sizes(), ", ", scale.sizes(), ", ",
           out.sizes());
  const int64_t A = out.size(0), R = out.size(1), C = out.size(2);
  GE_CHECK(q.scalar_type() == at::kByte && q.device().is_cpu(), op,
           ": q must be a uint8 CPU tensor, got ", q.scalar_type(), " on ", q.device());
  GE_CHECK(q.size(0) == A && q.size(1) == R && q.size(2) == (fp4 ? (C + 1) / 2 : C), op,
           ": q has shape ", q.sizes(), " but out ", out.sizes(), " needs ",
           fp4 ? "[A, R, C/2] (two FP4 values per byte)" : "[A, R, C]");
  GE_CHECK(!fp4 || C % 2 == 0, op, ": mxfp4 out must have an even number of columns, got ", C);
  const bool e8m0 = scale.scalar_type() == at::kByte;
  GE_CHECK((scale.scalar_type() == at::kFloat || (fp4 && e8m0)) && scale.is_contiguous() &&
               scale.device().is_cpu(),
           op, ": scale must be a contiguous float32 CPU tensor (or, for mxfp4, uint8 E8M0 exponents), got ",
           scale.scalar_type(), scale.is_contiguous() ? "" : " (not contiguous)", " on ", scale.device());
  GE_CHECK(scale.size(0) == A, op, ": scale has ", scale.size(0), " leading entries, out ", A);
  for (const auto* m : {&row_block, &col_block}) {
    GE_CHECK(m->scalar_type() == at::kLong && m->dim() == 1 && m->is_contiguous() && m->device().is_cpu(), op,
             ": row_block and col_block must be contiguous 1-D int64 CPU tensors");
  }
  GE_CHECK(row_block.size(0) == R && col_block.size(0) == C, op, ": row_block has ",
           row_block.size(0), " entries and col_block ", col_block.size(0), "; out has ", R,
           " rows and ", C, " columns");
  GE_CHECK(out.device().is_cpu(), op, ": out must be a CPU tensor, got ", out.device());
  GE_CHECK(threads >= 1, op, ": threads must be >= 1, got ", threads);
  const int64_t* rb = row_block.data_ptr<int64_t>();
  const int64_t* cb = col_block.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    GE_CHECK(rb[i] >= 0 && rb[i] < scale.size(1), op, ": row_block[", i, "]=", rb[i],
             " is outside the ", scale.size(1), " scale rows");
  }
  for (int64_t j = 0; j < C; ++j) {
    GE_CHECK(cb[j] >= 0 && cb[j] < scale.size(2), op, ": col_block[", j, "]=", cb[j],
             " is outside the ", scale.size(2), " scale columns");
  }
  if (out.numel() == 0) return;
  switch (out.scalar_type()) {
#define GE_DEQUANT_CASE(ST, T)                                          \
  case at::ST:                                                          \
    if (e8m0) run<T, true, uint8_t>(q, scale, rb, cb, out, threads);  \
    else if (fp4) run<T, true, float>(q, scale, rb, cb, out, threads); \
    else run<T, false, float>(q, scale, rb, cb, out, threads);         \
    break;
    GE_DEQUANT_CASE(kFloat, float)
    GE_DEQUANT_CASE(kBFloat16, at::BFloat16)
    GE_DEQUANT_CASE(kHalf, at::Half)
#undef GE_DEQUANT_CASE
    default:
      GE_CHECK(false, op, ": out must be bfloat16, float16 or float32, got ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(grouped_ep, CPU, m) { m.impl("dequantize", &dequantize_cpu); }

}  // namespace grouped_ep
