// CUTLASS instantiation: sm80 (Ampere, CUTLASS 2.x), fp16, forward with w [E, K, N] (trans_w=False).
// One instantiation per file, so the build compiles them in parallel.
#include <cutlass/numeric_types.h>

#include "sm80_grouped.cuh"

GROUPED_EP_SM80_INSTANCE(fp16, fwd_wkn, cutlass::half_t, GemmKind::kFwdWeightKN)
