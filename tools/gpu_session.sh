#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one call that fits a short lease: build the
# extension for the GPU, run every GPU test (compute-sanitizer included), the self-check and
# the CUDA benchmarks. Steps run in priority order under one time budget; a step that would
# pass the budget is cut short (benches with SIGINT, so they write the rows they finished).
#
#   bash tools/gpu_session.sh [budget_seconds]     # default 560
#   STEPS="tests bench_gemm_auto" bash tools/gpu_session.sh 300   # only these steps
#   (steps: build info check tests bench_gemm_cutlass bench_gemm_auto bench_gemm_torch bench_moe)
#
# (Keep gpu_prebuilt/ out of git: echo /gpu_prebuilt/ >> .git/info/exclude.)
# A gzipped extension from an earlier call's $OUT, carried as gpu_prebuilt/ (the _C*.so.gz and
# its prebuilt.txt), is used instead of building again when prebuilt.txt names the same csrc/ and
# setup.py contents (a hash) as this tree. The exit status is the worst step's (a bench cut
# short by the budget counts as done: it writes the rows it finished).
#
# Logs and bench results go to $OUT (default /tmp/gpu_session): results.tgz (every log, the
# junit XML, bench/results files) and summary.txt. Needs the CUTLASS headers in
# third_party/cutlass (make cutlass), python3 with torch (CUDA build), pytest, transformers.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
BUDGET=${1:-560}
WORK=/tmp/gpu_session_work
rm -rf "$WORK" && mkdir -p "$WORK/bench" "$OUT"
PY=${PYTHON:-python3}
T0=$SECONDS
SUMMARY=$WORK/summary.txt
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$SUMMARY"; }
WORST=0
BUILT=0
src_hash() { find csrc setup.py -type f | sort | xargs sha256sum | sha256sum | cut -c1-16; }

# step NAME MAX_SECONDS SIGNAL CMD...: runs CMD with its output in $WORK/NAME.log.
step() {
  local name=$1 max=$2 sig=$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0) - 20))
  if ((left < 20)); then
    say "== $name: skipped, budget spent"
    return 99
  fi
  ((max > left)) && max=$left
  say "== $name (at most ${max}s, started at +$((SECONDS - T0))s)"
  local s=$SECONDS rc
  timeout -s "$sig" -k 20 "$max" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  say "== $name: exit $rc after $((SECONDS - s))s"
  if ((rc == 124)) && [ "$sig" = INT ]; then rc=0; fi # cut by the budget, rows written
  ((rc > WORST)) && WORST=$rc
  tail -n "${TAIL_LINES:-15}" "$WORK/$name.log"
  return $rc
}

pack() {
  cp "$SUMMARY" "$OUT/summary.txt"
  tar czf "$OUT/results.tgz" -C "$WORK" .
  # The extension built in this call, for a later call that carries it instead of building.
  if ((BUILT)); then
    for so in grouped_ep/_C*.so; do gzip -1 -c "$so" >"$OUT/$(basename "$so").gz"; done
    echo "$(src_hash) $TORCH_CUDA_ARCH_LIST" >"$OUT/prebuilt.txt"
  fi
}
trap 'pack; exit $WORST' EXIT

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -2
  command -v compute-sanitizer
  nproc
} 2>&1 | tee -a "$SUMMARY"

STEPS=${STEPS:-build info check tests bench_gemm_cutlass bench_moe}
want() { [[ " $STEPS " == *" $1 "* ]]; }

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
if compgen -G "gpu_prebuilt/_C*.so.gz" >/dev/null &&
  [ "$(cut -d' ' -f1 gpu_prebuilt/prebuilt.txt 2>/dev/null)" = "$(src_hash)" ]; then
  for gz in gpu_prebuilt/_C*.so.gz; do gunzip -c "$gz" >"grouped_ep/$(basename "$gz" .gz)"; done
  say "== build: using the carried $(ls gpu_prebuilt | tr '\n' ' ')"
elif want build; then
  compgen -G "gpu_prebuilt/*" >/dev/null && say "== gpu_prebuilt/ is from other sources: building"
  TAIL_LINES=30 step build 300 TERM $PY setup.py build_ext --inplace || {
    say "build failed: nothing else can run"
    exit 1
  }
  BUILT=1
fi

want info && step info 60 TERM $PY -c "import grouped_ep; print(grouped_ep.backend_info())"
want check && TAIL_LINES=40 step check 90 TERM $PY -m grouped_ep check

TESTS=(
  tests/test_gemm_cuda.py tests/test_gemm_cuda_sanitizer.py tests/test_backend.py
  tests/test_loader.py::test_meta_model_onto_cuda
  tests/test_loader_quant.py::test_cuda_destination_equals_cpu_destination
  tests/test_nn.py::test_moe_without_ep_never_syncs_the_host_on_cuda
  tests/test_checkpoint.py::test_extra_saved_from_a_gpu_loads_without_it
)
want tests && TAIL_LINES=40 step tests 280 TERM $PY -m pytest -v -n 8 --dist loadgroup -p no:cacheprovider --timeout 150 \
  --junitxml="$WORK/gpu-tests.xml" "${TESTS[@]}"

# CUTLASS for every grouped_ep row (bf16 and fp16); torch._grouped_mm is a column of each row.
want bench_gemm_cutlass && GROUPED_EP_BACKEND=cutlass TAIL_LINES=60 step bench_gemm_cutlass \
  170 INT $PY bench/run.py --suite gemm --quick --out "$WORK/bench"
# What users get by default (auto: on Hopper, torch for bf16 and CUTLASS for fp16).
want bench_gemm_auto && GROUPED_EP_BACKEND=auto TAIL_LINES=30 step bench_gemm_auto \
  170 INT $PY bench/run.py --suite gemm --quick --out "$WORK/bench"
# torch._grouped_mm inside grouped_ep's guarantees, every dtype (fp16 then takes the fallback).
want bench_gemm_torch && GROUPED_EP_BACKEND=torch TAIL_LINES=30 step bench_gemm_torch \
  170 INT $PY bench/run.py --suite gemm --quick --out "$WORK/bench"
want bench_moe && TAIL_LINES=20 step bench_moe 90 INT $PY bench/run.py --suite moe --quick --out "$WORK/bench"
say "== done at +$((SECONDS - T0))s"
