#!/usr/bin/env bash
# Issue "The footprint the user sees" on the lent GPU, in one job (bench/RESULTS.md, "The footprint the user sees"):
# whole-process GPU memory (NVML through `python -m mlxdiff.footprint`, the same ruler for mlxdiff and diffusers)
# beside MLX's own counters; random weights at the real configs, 1024x1024, 4 steps.
#   probe   where the 20 GiB went: a Q4_K_M GGUF FLUX.2-dev transformer loaded as before (MLX's own cache, not cleared)
#           and as now (bench/footprint_probe.py old | new)
#   pool    the CUDA memory pool after that load and a forward (bench/footprint_pool_probe.py: reserved vs used)
#   dev     FLUX.2-dev through the CLI: default, two images, --memory-limit 24 / 22; diffusers' GGUF path (compare)
#   klein   klein-4B: bench/speed_gpu.py mlxdiff (now, and MLXDIFF_CACHE_LIMIT=0: MLX's own cache) and diffusers, each
#           under the outside sampler; two CLI calls in a row (the first image per process; the PTX cache)
#   first   the first image per process: klein-4B CLI calls under cProfile, import times, the CUDA driver's JIT cache
#   sd3     SD3.5 Medium: bench/speed_gpu.py mlxdiff and diffusers under the outside sampler
# Run on the GPU machine after the device recipe's activate step; ONLY="dev klein" runs a subset; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
make() { [ -f "$2/model_index.json" ] || python3 bench/make_random_models.py "$1" --out "$2" --device cuda > "$L/make_$1.txt" 2>&1; }
fp() { local name=$1; shift; python3 -m mlxdiff.footprint run --interval 0.1 --json "$L/fp_$name.json" -- "$@" > "$L/$name.txt" 2>&1; tail -1 "$L/$name.txt" >> "$L/summary.txt"; }
GEN="python3 -m mlxdiff.generate --model /tmp/dev --transformer /tmp/f2.gguf --quantize text_encoder=4 --width 1024 --height 1024 --steps 4 --prompt fox --no-progress --report-memory"
stamp start
if want probe || want pool || want dev; then
  [ -f /tmp/f2.gguf ] || python3 bench/flux2_dev_gpu.py write-gguf /tmp/f2.gguf > "$L/make_gguf.txt" 2>&1
  stamp gguf
fi
if want probe; then
  for mode in old new; do python3 bench/footprint_probe.py /tmp/f2.gguf $mode > "$L/probe_$mode.txt" 2>&1; done
  stamp probe
fi
if want pool; then
  python3 bench/footprint_pool_probe.py /tmp/f2.gguf > "$L/pool_probe.txt" 2>&1; stamp pool
fi
if want dev; then
  make flux2-dev /tmp/dev; stamp make_dev
  fp dev_default $GEN --output "$L/dev.png"; stamp dev_default
  python3 -m mlxdiff.footprint compare --model /tmp/dev --transformer /tmp/f2.gguf --quantize text_encoder=4 \
    --width 1024 --height 1024 --steps 4 --no-sequential --interval 0.1 --out "$L/compare-dev" > "$L/compare_dev.txt" 2>&1
  stamp compare_dev
  fp dev_two $GEN --seed 1 2 --output "$L/dev2.png"; stamp dev_two
  fp dev_limit24 $GEN --memory-limit 24 --output "$L/dev24.png"; stamp dev_limit24
  fp dev_limit22 $GEN --memory-limit 22 --output "$L/dev22.png"; stamp dev_limit22
  rm -rf /tmp/dev /tmp/f2.gguf
fi
if want klein; then
  make klein-4b /tmp/k4; stamp make_klein
  fp klein_mlxdiff python3 bench/speed_gpu.py mlxdiff /tmp/k4
  MLXDIFF_CACHE_LIMIT=0 fp klein_mlxdiff_mlxcache python3 bench/speed_gpu.py mlxdiff /tmp/k4
  fp klein_diffusers python3 bench/speed_gpu.py diffusers /tmp/k4; stamp klein_speed
  ls /tmp/mlx/*/ptx 2>/dev/null | wc -l > "$L/ptx_files_before_cli.txt"
  for i in 1 2; do /usr/bin/time -f "%e s wall" python3 -m mlxdiff.generate --model /tmp/k4 --prompt fox --width 1024 \
    --height 1024 --steps 4 --no-progress --output "$L/k$i.png" > "$L/klein_cli_$i.txt" 2>&1; done
  ls /tmp/mlx/*/ptx 2>/dev/null | wc -l > "$L/ptx_files_after_cli.txt"; du -sh /tmp/mlx >> "$L/ptx_files_after_cli.txt" 2>&1
  stamp klein_cli
  rm -rf /tmp/k4
fi
if want first; then
  make klein-4b /tmp/k4; stamp make_klein
  K="-m mlxdiff.generate --model /tmp/k4 --prompt fox --width 1024 --height 1024 --steps 4 --no-progress"
  { du -sh ~/.nv/ComputeCache; ls /tmp/mlx/*/ptx | wc -l; } > "$L/jit_caches_before.txt" 2>&1
  python3 -X importtime -c "import mlxdiff.generate" 2> "$L/importtime.txt"
  for i in 1 2; do
    /usr/bin/time -f "%e s wall" python3 -m cProfile -o "$L/first_$i.prof" $K --output "$L/f$i.png" > "$L/first_$i.txt" 2>&1
  done
  { du -sh ~/.nv/ComputeCache; ls /tmp/mlx/*/ptx | wc -l; } > "$L/jit_caches_after.txt" 2>&1
  stamp first
  rm -rf /tmp/k4
fi
if want sd3; then
  make sd3.5-medium /tmp/sd; stamp make_sd3
  fp sd3_mlxdiff python3 bench/speed_gpu.py mlxdiff /tmp/sd
  fp sd3_diffusers python3 bench/speed_gpu.py diffusers /tmp/sd; stamp sd3_speed
  rm -rf /tmp/sd
fi
stamp JOB-DONE
