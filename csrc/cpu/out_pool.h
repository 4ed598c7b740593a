// Large CPU outputs of the grouped GEMM from a pool of blocks that earlier outputs freed.
#pragma once

#include <ATen/ATen.h>

namespace grouped_ep {

// An uninitialized contiguous CPU tensor of `sizes`. Of 4 MiB or more, its memory comes from a
// pool of blocks that earlier such tensors gave back when they died, so their pages are already
// resident; else it is allocated as at::empty would. See out_pool.cpp.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace grouped_ep
