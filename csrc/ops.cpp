// Every grouped_ep schema, defined once. Backend files (cpu/, cuda/, io/) register
// implementations only, with TORCH_LIBRARY_IMPL.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import grouped_ep._C` loads this library, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(grouped_ep, m) {
  // ---- grouped GEMM -------------------------------------------------------------------------
  // x: [T, K] rows grouped by expert; w: [E, K, N] (or [E, N, K] with trans_w); offs: [E] int32
  // or int64 cumulative end offsets. Returns [T, N]; rows past offs[-1] are zero.
  m.def("gemm(Tensor x, Tensor w, Tensor offs, bool trans_w=False) -> Tensor");
  // Weight gradient, the "ragged K" product: out[g] = x_g^T @ dy_g ([E, K, N]), or
  // dy_g^T @ x_g ([E, N, K]) with trans_w. Groups with no rows give exact zeros.
  m.def("gemm_wgrad(Tensor x, Tensor dy, Tensor offs, bool trans_w=False) -> Tensor");
  // Backend of the CUDA ops (csrc/cuda/backend.cpp): sets the requested backend when
  // set_backend is given, then returns "key=value" lines: the request, the build, and for
  // device >= 0 the device and (with dtype, k, n) the backend such a call uses and why.
  m.def("backend_info(str? set_backend=None, int device=-1, ScalarType? dtype=None, int k=0, "
        "int n=0) -> str[]");
  // What the CPU gemm does for `dtype` on this CPU: "avx512: ...", "blas: ...", "native:
  // avx512_bf16", "widen to fp32: ...", chosen at run time from the CPU (csrc/cpu/gemm_plan.h;
  // GROUPED_EP_CPU_F32_GEMM and GROUPED_EP_CPU_HALF_GEMM override).
  m.def("cpu_gemm_path(ScalarType dtype) -> str");
  // Unmaps the blocks the CPU output pool holds (csrc/cpu/out_pool.cpp); returns their bytes.
  m.def("cpu_pool_release() -> int");

  // ---- native reader (csrc/io) --------------------------------------------------------------
  // Copies byte ranges of the files `paths` into the storage of `outs` (contiguous CPU tensors)
  // with `threads` parallel preads. plan: int64 [N, 5]; row i = (file index, out index,
  // src_offset, dst_offset, length): file bytes [src_offset, src_offset + length) are written at
  // byte dst_offset of outs[out]. Returns the number of bytes read. expect: None, or 4 ints per
  // path, (st_dev, st_ino, st_size, st_mtime_ns) as the caller saw the file; a file that no
  // longer matches after open is an error before anything of it is read.
  m.def(
      "read_ranges(str[] paths, Tensor(a!)[] outs, Tensor plan, int threads=8, "
      "int[]? expect=None) -> int");
  // Dequantization (csrc/io/dequant.cpp): out[a, i, j] = value(q[a, i, j]) *
  // scale[a, row_block[i], col_block[j]] in fp32, rounded once to out's dtype. q: uint8
  // [A, R, C] float8_e4m3fn bytes (format "fp8") or [A, R, C/2] FP4 pairs ("mxfp4"); scale:
  // float32 [A, SR, SC]; row_block: int64 [R]; col_block: int64 [C]; out: [A, R, C], any strides;
  // rows spread over `threads` threads.
  m.def("dequantize(Tensor q, Tensor scale, Tensor row_block, Tensor col_block, Tensor(a!) out, str format, int threads=1) -> ()");
  // CRC32C (csrc/io/crc32c.cpp) of lengths[i] bytes at offsets[i] of file `path`, for each i:
  // int64 [N]. offsets, lengths: int64 [N] CPU. Ranges spread over `threads` threads.
  m.def("crc32c(str path, Tensor offsets, Tensor lengths, int threads=4) -> Tensor");
}
