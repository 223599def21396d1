#!/usr/bin/env bash
# Transformer steps beside diffusers at 1024x1024, bf16, random weights at the real configs (bench/forward_gpu.py),
# for each --model in MODELS (default "zimage-turbo qwen-image"; bench/flux1_dev_gpu.sh runs flux1-dev through it):
# Z-Image-Turbo (one forward a step, guidance 0, 128 caption tokens), Qwen-Image (true CFG: the prompt's forward at
# 128 tokens + the negative's at 8, one timed call = one step), FLUX.1-dev (4096 image + 512 text tokens). mlxdiff
# beside diffusers in one job, the sides alternating (A B A B; REPEAT pairs, default 2) per model. One ruler for
# both: nvidia-smi's memory.used every 0.1 s from outside, less the idle reading before each process, its peak while
# that side's timed forwards run (forward_gpu.py --phase-file). Nothing is written to disk (weights built in memory).
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS:
#     LOGS=$OUT/fwd bash bench/qwen_zimage_gpu.sh                    # both models, ~6 min on one H100 (estimate)
#     MODELS=qwen-image REPEAT=1 LOGS=$OUT/fwd bash bench/qwen_zimage_gpu.sh
# CPU chain check (no GPU; tiny configs): MODELS="zimage-tiny qwen-image-tiny" SIZE=64 DEVICE=cpu NO_SMI=1 bash ...
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
. bench/smi_ruler.sh
for model in ${MODELS:-zimage-turbo qwen-image}; do
  for rep in $(seq 1 "${REPEAT:-2}"); do
    for side in mlxdiff diffusers; do
      tag="${model}_${side}_$rep"
      idle=$(smi_used)
      phases="$L/phases_$tag.txt"; rm -f "$phases"
      smi_start "$L/smi_$tag.csv"
      python3 bench/forward_gpu.py "$side" --model "$model" --size "${SIZE:-1024}" --device "${DEVICE:-cuda}" \
        --phase-file "$phases" > "$L/forward_$tag.txt" 2>&1 || echo "FAILED $tag (see $L/forward_$tag.txt)" >> "$L/ruler.txt"
      smi_stop
      [ ! -f "$phases" ] || smi_peak "$L/smi_$tag.csv" "$idle" "$phases" \
        "{\"model\": \"$model\", \"side\": \"$side\", \"rep\": \"$rep\"}" >> "$L/ruler.txt"
    done
  done
done
[ ! -f "$L/ruler.txt" ] || cat "$L/ruler.txt"
grep -h RESULT "$L"/forward_*.txt
