#!/usr/bin/env bash
# Issue 28: the distributed runs on two GPUs of one host (nvidia-h200-x2), NCCL through mx.distributed, launched
# with mlx.launch, random weights at the real configs, against one GPU in the same job (bench/distributed_gpu.py):
#   dev_1 / dev_tp2:    FLUX.2-dev, Q4_K_M GGUF transformer, 1024x1024, 4 steps: one GPU, then --split tensor on 2
#   sd_1 / sd_cfg2:     SD3.5 Medium, CFG 7, 1024x1024, 8 steps: one GPU, then --split guidance on 2
#   dp_1 / dp_2:        a data-parallel job of 8 SD3.5 Medium images (1024x1024, 28 steps, CFG 7): 1 GPU, then 2
# then the images compared (compare_*.txt: within 1 level expected) and the RESULT lines as one table (table.md).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). PARTS picks what runs ("make dev sd dp" by default; each part
# skips the models already written, so a job cut by the 10-minute call limit goes on where it stopped).
# Run on the GPU machine after the device recipe's activate step (../shared/device/README.md, its wheels prepared with
# `prepare-mlx-cuda.sh diffusers==0.42.1 gguf==0.19.0 mlx-lm==0.32.2`); logs in $LOGS. A dry run of the script's logic on a
# CPU with small models: BACKEND=ring PARTS="dev sd dp" DEV=folder GGUF= SD=folder SIZE=64 STEPS_DP=2 (GGUF empty:
# the folder's own transformer; bench/RESULTS.md, "Two GPUs", has the command that writes a tiny SD3 folder).
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs-distributed}
mkdir -p "$L"
export NCCL_NVLS_ENABLE=0
LAUNCH=$(command -v mlx.launch || echo "$(dirname "$(command -v python3)")/mlx.launch")
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
one() {   # one NAME ARGS...: a single process on GPU 0
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0 python3 bench/distributed_gpu.py "$@" > "$L/$name.txt" 2>&1
}
two() {   # two NAME ARGS...: two ranks, one per GPU (mlx.launch's nccl backend sets CUDA_VISIBLE_DEVICES per rank)
  local name=$1; shift
  "$LAUNCH" --backend "${BACKEND:-nccl}" -n 2 -- "$(command -v python3)" bench/distributed_gpu.py "$@" > "$L/$name.txt" 2>&1
}
DEV=${DEV:-/tmp/dev}; GGUF=${GGUF-/tmp/f2.gguf}; SD=${SD:-/tmp/sd35m}; SIZE=${SIZE:-1024}
T=(); [ -z "$GGUF" ] || T=(--transformer "$GGUF")
stamp start
nvidia-smi topo -m > "$L/topology.txt" 2>&1
for part in ${PARTS:-make dev sd dp}; do
  case $part in
    make)
      [ -f "$DEV/model_index.json" ] || python3 bench/make_random_models.py flux2-dev --out "$DEV" --device cuda \
        > "$L/make_flux2-dev.txt" 2>&1
      [ -z "$GGUF" ] || [ -f "$GGUF" ] || python3 bench/flux2_dev_gpu.py write-gguf "$GGUF" > "$L/make_gguf.txt" 2>&1
      [ -f "$SD/model_index.json" ] || python3 bench/make_random_models.py sd3.5-medium --out "$SD" --device cuda \
        > "$L/make_sd3.5-medium.txt" 2>&1 ;;
    dev)
      one dev_1 run "$DEV" "${T[@]}" --size "$SIZE" --out "$L/dev_1"
      two dev_tp2 run "$DEV" "${T[@]}" --size "$SIZE" --split tensor --out "$L/dev_tp2"
      python3 bench/streaming_gpu.py compare "$L/dev_1" "$L/dev_tp2" > "$L/compare_dev.txt" 2>&1 ;;
    sd)
      one sd_1 run "$SD" --guidance 7 --steps 8 --size "$SIZE" --out "$L/sd_1"
      two sd_cfg2 run "$SD" --guidance 7 --steps 8 --size "$SIZE" --split guidance --out "$L/sd_cfg2"
      python3 bench/streaming_gpu.py compare "$L/sd_1" "$L/sd_cfg2" > "$L/compare_sd.txt" 2>&1 ;;
    dp)
      one dp_1 images "$SD" --guidance 7 --count 8 --size "$SIZE" --steps "${STEPS_DP:-28}"
      two dp_2 images "$SD" --guidance 7 --count 8 --size "$SIZE" --steps "${STEPS_DP:-28}" ;;
  esac
  stamp "$part"
done
python3 bench/distributed_gpu.py table "$L" > "$L/table.md" 2>&1
cat "$L/table.md"
stamp JOB-DONE
