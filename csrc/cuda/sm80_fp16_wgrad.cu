// CUTLASS instantiation: sm80 (Ampere, CUTLASS 2.x), fp16, weight gradient (ragged K).
// One instantiation per file, so the build compiles them in parallel.
#include <cutlass/numeric_types.h>

#include "sm80_grouped.cuh"

GROUPED_EP_SM80_INSTANCE(fp16, wgrad, cutlass::half_t, GemmKind::kWgrad)
