// CUTLASS instantiation: sm90 (Hopper, CUTLASS 3.x), bf16, weight gradient (ragged K).
// One instantiation per file, so the build compiles them in parallel.
#include <cutlass/numeric_types.h>

#include "sm90_grouped.cuh"

GROUPED_EP_SM90_INSTANCE(bf16, wgrad, cutlass::bfloat16_t, GemmKind::kWgrad)
