#!/usr/bin/env bash
# The memory-floor figures on the lent GPU (bench/RESULTS.md, "Memory floor"), in one job: FLUX.2-dev's random
# Q4_K_M GGUF transformer (mlxdiff, affine and raw layouts; diffusers' GGUF path), GGUF layouts per type at
# FLUX.2-dev's layer sizes, then both VAEs' decode at 1024x1024 in bf16 (mlxdiff beside diffusers).
# Run on the GPU machine after the device recipe's activate step. ONLY="mlxdiff-raw layouts vae" runs a subset.
set -u
cd "$(dirname "$0")/.."
f=/tmp/f2.gguf
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
if want mlxdiff || want mlxdiff-raw || want diffusers; then [ -f $f ] || python3 bench/flux2_dev_gpu.py write-gguf $f; fi
want mlxdiff && python3 bench/flux2_dev_gpu.py mlxdiff $f --strategy dequantize
want mlxdiff-raw && MLXDIFF_GGUF_LAYOUT=raw python3 bench/flux2_dev_gpu.py mlxdiff $f --strategy dequantize
want diffusers && python3 bench/flux2_dev_gpu.py diffusers $f
want layouts && python3 bench/gguf_layouts.py --out 18432 --in 6144 --tokens 4608 --dtype bfloat16
want vae && python3 bench/vae_decode.py --sizes 1024 --vaes sd3 flux2 --dtype bfloat16
echo JOB-DONE
