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
  // What the CPU gemm does for `dtype` on this CPU: "native: avx512_bf16", "widen to fp32: ...",
  // chosen at run time from CPU capability (GROUPED_EP_CPU_HALF_GEMM=native|widen overrides).
  m.def("cpu_gemm_path(ScalarType dtype) -> str");

  // ---- native reader (csrc/io) --------------------------------------------------------------
  // Copies byte ranges of the files `paths` into the storage of `outs` (contiguous CPU tensors)
  // with `threads` parallel preads. plan: int64 [N, 5]; row i = (file index, out index,
  // src_offset, dst_offset, length): file bytes [src_offset, src_offset + length) are written at
  // byte dst_offset of outs[out]. Returns the number of bytes read.
  m.def("read_ranges(str[] paths, Tensor(a!)[] outs, Tensor plan, int threads=8) -> int");
}
