#!/usr/bin/env bash
# Everything that needs the GPU, in one call (device time is scarce). Writes JSON under $OUT.
#   bash bench/gpu_suite.sh [checks] [kernels] [logprob] [onpolicy] [engine] [trainer] [sync] [e2e] [grpo05]  (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
parts=${*:-checks kernels logprob onpolicy engine trainer sync e2e grpo05}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for p in $parts; do
  echo "=== $p"; t0=$(date +%s)
  case $p in
    checks)   timeout 200 python3 tests/triton_checks.py ${CHECKS:-} > "$OUT/triton_checks.jsonl"; rc=$?; cut -c1-300 "$OUT/triton_checks.jsonl" ;;
    kernels)  timeout 200 python3 bench/kernels_bench.py; rc=$? ;;
    logprob)  timeout 120 python3 bench/logprob_bench.py; rc=$? ;;
    onpolicy) timeout 200 python3 bench/gpu_true_on_policy.py; rc=$? ;;
    engine)   timeout 300 python3 bench/engine_bench.py 2>&1 | grep -v "Loading weights"; rc=${PIPESTATUS[0]} ;;
    trainer)  timeout 400 python3 bench/trainer_bench.py --compile; rc=$? ;;
    sync)     timeout 120 python3 bench/weight_sync_bench.py; rc=$? ;;
    e2e)      timeout 200 python3 -m pipeline.cli run configs/tiny.yaml run_dir=/tmp/gpu_e2e num_rollout=20 train.device=cuda \
                engine.device=cuda weights.backend=gloo model.dtype=bfloat16 determinism.true_on_policy=true \
                --no-progress 2>&1 | tail -12; rc=${PIPESTATUS[0]}
              cp /tmp/gpu_e2e/metrics.jsonl "$OUT/e2e_metrics.jsonl" 2>/dev/null
              [ $rc = 0 ] || for f in /tmp/gpu_e2e/logs/*.log; do echo "--- $f"; tail -n 25 "$f"; done ;;
    grpo05)   timeout 240 python3 bench/e2e_bench.py; rc=$? ;;
  esac
  echo "=== $p rc=$rc $(( $(date +%s) - t0 ))s"
done
