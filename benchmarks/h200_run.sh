#!/usr/bin/env bash
# One GPU session's work on a lent H200, in order: `tests` (GPU codegen tests), `kernels` (the
# kernel table, parameters tuned in the run), `norm` (the RMSNorm->Linear schedules side by side,
# benchmarks/norm_probe.py), `ceiling` (decode attention's streaming bound, benchmarks/attn_ceiling.py),
# `e2e` (end-to-end decode). Writes logs and results
# under $OUT. Carried FlashInfer wheels (.whl/) are installed and its kernels compiled first
# (benchmarks/flashinfer_warm.py, FI_TIMEOUT). Usage: bash benchmarks/h200_run.sh tests kernels [norm] [ceiling] [e2e] -- [extra kernels.py args]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  steps+=("$1"); shift
done
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then  # carried peer wheels (benchmarks/peer_wheels.sh): FlashInfer for the flashinfer_graph contender
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
  # compile FlashInfer's kernels before any step, under a limit; where that fails the steps leave it out
  timeout ${FI_TIMEOUT:-240} python3 benchmarks/flashinfer_warm.py 2>&1 | grep -v -i warning | tail -20 | tee "$OUT/flashinfer-warm.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export MIRAGE_BENCH_FLASHINFER=0
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.version.cuda)'; python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)'; nproc; } 2>&1 | tee "$OUT/env.txt"
for s in "${steps[@]}"; do
  echo "=== $s at +$(( $(date +%s) - start ))s"
  case $s in
    tests) timeout 150 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_codegen_gpu.py tests/test_tune_profile.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.log" ;;
    kernels) python3 benchmarks/kernels.py --out "$OUT" "${extra[@]}" 2>&1 | grep -v "^|\|^$\|^<\|^#\|^- " | tee "$OUT/kernels.log" | tail -40 ;;
    ceiling) timeout ${CEILING_TIMEOUT:-300} python3 benchmarks/attn_ceiling.py --out "$OUT" 2>&1 | grep -v -i warning > "$OUT/attn-ceiling.log"; tail -16 "$OUT/attn-ceiling.log" ;;
    norm) timeout ${NORM_TIMEOUT:-200} python3 benchmarks/norm_probe.py --out "$OUT" 2>&1 | grep -v -i warning > "$OUT/norm-probe.log"; tail -6 "$OUT/norm-probe.log" ;;
    e2e) tuned=${TUNED_FROM:-$(ls -t "$OUT"/kernels-*.json 2>/dev/null | head -1)}
         timeout ${E2E_TIMEOUT:-300} python3 benchmarks/e2e.py --out "$OUT" ${tuned:+--tuned-from "$tuned"} 2>&1 | grep -v Warning | tee "$OUT/e2e.log" | tail -30 ;;
  esac
done
echo "=== done at +$(( $(date +%s) - start ))s"
