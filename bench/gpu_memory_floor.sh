#!/usr/bin/env bash
# The memory-floor figures on the lent GPU (bench/RESULTS.md, "Memory floor"), in one job: FLUX.2-dev's random
# Q4_K_M GGUF transformer (mlxdiff dequantize strategy, diffusers' GGUF path), then both VAEs' decode at 1024x1024
# in bf16 (mlxdiff beside diffusers). Run on the GPU machine after the device recipe's activate step.
set -u
cd "$(dirname "$0")/.."
f=/tmp/f2.gguf
[ -f $f ] || python3 bench/flux2_dev_gpu.py write-gguf $f
python3 bench/flux2_dev_gpu.py mlxdiff $f --strategy dequantize
python3 bench/flux2_dev_gpu.py diffusers $f
python3 bench/vae_decode.py --sizes 1024 --vaes sd3 flux2 --dtype bfloat16
echo JOB-DONE
