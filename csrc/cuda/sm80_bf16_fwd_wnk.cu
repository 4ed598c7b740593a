// CUTLASS instantiation: sm80 (Ampere, CUTLASS 2.x), bf16, forward with w [E, N, K] (trans_w=True).
// One instantiation per file, so the build compiles them in parallel.
#include <cutlass/numeric_types.h>

#include "sm80_grouped.cuh"

GROUPED_EP_SM80_INSTANCE(bf16, fwd_wnk, cutlass::bfloat16_t, GemmKind::kFwdWeightNK)
