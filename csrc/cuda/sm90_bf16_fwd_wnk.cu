// CUTLASS instantiation: sm90 (Hopper, CUTLASS 3.x), bf16, forward with w [E, N, K] (trans_w=True).
// One instantiation per file, so the build compiles them in parallel.
#include <cutlass/numeric_types.h>

#include "sm90_grouped.cuh"

GROUPED_EP_SM90_INSTANCE(bf16, fwd_wnk, cutlass::bfloat16_t, GemmKind::kFwdWeightNK)
