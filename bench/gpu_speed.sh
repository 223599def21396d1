#!/usr/bin/env bash
# The speed and whole-pipeline figures on the lent GPU (bench/RESULTS.md, "Speed" and the FLUX.2-dev footprint
# table), in one job, on random real-config folders written here (deleted after use: the disk holds one at a time):
#   klein   klein-4B images: mlxdiff, diffusers, mflux (bench/speed_gpu.py)
#   forward klein-4B transformer forward with whole blocks compiled, 1 and 2 in flight (bench/forward_gpu.py)
#   dev     FLUX.2-dev, Q4_K_M GGUF transformer + 30-layer Mistral encoder: python -m mlxdiff.footprint compare
#           (mlxdiff with the encoder at 4 bits, diffusers as is, diffusers' sequential recipe), the same
#           image with --memory-limit 23, then mlxdiff images
#   sd3     SD3.5 Medium images: mlxdiff, diffusers
#   ops     each op of one klein-4B block, MLX beside torch (bench/block_ops_gpu.py)
#   t5cpu   SD3.5 Medium with T5-XXL at 8 / 4 bits on this host's CPU (MLXDIFF_DEVICE=cpu), beside diffusers as is
#           and sequential: issue 11's last row (11 minutes on the H200 host; the 2-core CI-like CPU cannot run diffusers' bf16)
# Run on the GPU machine after the device recipe's activate step; ONLY="klein dev" runs a subset; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
make() { [ -f "$2/model_index.json" ] || python3 bench/make_random_models.py "$1" --out "$2" --device cuda > "$L/make_$1.txt" 2>&1; }
if want klein; then
  make klein-4b /tmp/k4
  for side in mlxdiff diffusers mflux; do python3 bench/speed_gpu.py $side /tmp/k4 > "$L/speed_klein_$side.txt" 2>&1; done
  rm -rf /tmp/k4
fi
if want forward; then
  for n in 1 2; do MLXDIFF_COMPILE_BLOCKS=1 MLXDIFF_IN_FLIGHT=$n python3 bench/forward_gpu.py mlxdiff; done > "$L/forward_compiled.txt" 2>&1
fi
if want dev; then
  [ -f /tmp/f2.gguf ] || python3 bench/flux2_dev_gpu.py write-gguf /tmp/f2.gguf > "$L/make_gguf.txt" 2>&1
  make flux2-dev /tmp/dev
  python3 -m mlxdiff.footprint compare --model /tmp/dev --transformer /tmp/f2.gguf --quantize text_encoder=4 \
    --width 1024 --height 1024 --steps 4 --out "$L/footprint-dev" > "$L/footprint_dev.txt" 2>&1
  # the same image under a budget with no room for a second piece of work in flight: the floor
  python3 -m mlxdiff.generate --model /tmp/dev --transformer /tmp/f2.gguf --quantize text_encoder=4 --width 1024 \
    --height 1024 --steps 4 --prompt "a photo of a fox in the snow" --no-progress --report-memory --memory-limit 23 \
    --output "$L/limit23.png" > "$L/generate_limit23.txt" 2>&1
  python3 bench/speed_gpu.py mlxdiff /tmp/dev --transformer /tmp/f2.gguf --quantize text_encoder=4 > "$L/speed_dev_mlxdiff.txt" 2>&1
  rm -rf /tmp/dev /tmp/f2.gguf
fi
if want sd3; then
  make sd3.5-medium /tmp/sd
  for side in mlxdiff diffusers; do python3 bench/speed_gpu.py $side /tmp/sd > "$L/speed_sd3_$side.txt" 2>&1; done
  rm -rf /tmp/sd
fi
if want ops; then
  for n in 1 2; do MLXDIFF_IN_FLIGHT=$n python3 bench/block_ops_gpu.py mlx; done > "$L/ops_mlx.txt" 2>&1
  python3 bench/block_ops_gpu.py torch > "$L/ops_torch.txt" 2>&1
fi
if want t5cpu; then
  python3 bench/torch_cpu_bf16.py --size 2048 --mlx > "$L/machine.txt" 2>&1   # which BLAS each side has here
  make sd3.5-medium /tmp/sd
  MLXDIFF_DEVICE=cpu python3 -m mlxdiff.footprint compare --model /tmp/sd --quantize text_encoder_3=8 --width 512 \
    --height 512 --steps 2 --out "$L/footprint-t5-8" > "$L/footprint_t5_8.txt" 2>&1
  MLXDIFF_DEVICE=cpu python3 -m mlxdiff.footprint compare --mlxdiff-only --model /tmp/sd --quantize text_encoder_3=4 \
    --width 512 --height 512 --steps 2 --out "$L/footprint-t5-4" > "$L/footprint_t5_4.txt" 2>&1
  rm -rf /tmp/sd
fi
echo JOB-DONE
