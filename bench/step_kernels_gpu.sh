#!/usr/bin/env bash
# Issue 29's per-step kernels on the lent GPU, one job (bench/RESULTS.md, "Speed, second round"): exactness against
# the MLX ops, each op's time, each transformer forward with the kernels and with their call sites through the MLX
# ops (--old), diffusers' forward in the same job, and each forward's matmuls and attentions alone (the floor).
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS. PARTS picks parts.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
run() { local name=$1; shift; echo "$(date +%T) start $name" >> "$L/steps.txt"
        timeout ${PART_TIMEOUT:-400} python3 bench/step_kernels_gpu.py "$@" > "$L/$name.txt" 2>&1
        echo "$(date +%T) rc=$? $name" >> "$L/steps.txt"; }
for part in ${PARTS:-exact ops klein sd3 dev floor}; do
  case $part in
    exact) run exact exact ;;
    ops) run ops ops ;;
    klein|sd3|dev)   # REPEAT rounds of (with the kernels, --old) alternating, then diffusers where it has the model
      model=$(case $part in klein) echo klein-4b;; sd3) echo sd3.5-medium;; dev) echo dev-q4;; esac)
      for r in $(seq 1 ${REPEAT:-1}); do
        run forward_${part}_$r forward $model; run forward_${part}_old_$r forward $model --old
      done
      [ $part = dev ] || run diffusers_$part diffusers $model ;;
    floor) for m in klein-4b sd3.5-medium dev-q4; do run floor_$m floor $m; done ;;
  esac
done
echo "$(date +%T) JOB-DONE" >> "$L/steps.txt"
