#!/usr/bin/env bash
# Issue 25's GPU target on the lent H200, in one job (and SD 1.5 at 512x512 after it) (bench/RESULTS.md, "SDXL on the H200"): SDXL base at its real
# config with random bf16 weights (bench/make_random_models.py sdxl), 1024x1024, 30 steps, guidance 5: mlxdiff and
# diffusers side by side (bench/speed_gpu.py: first image, second image with the same / a new prompt, s/step), each
# process under the same outside sampler (python -m mlxdiff.footprint run: NVML's whole-process GPU memory).
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
fp() { local name=$1; shift; python3 -m mlxdiff.footprint run --interval 0.1 --json "$L/fp_$name.json" -- "$@" > "$L/$name.txt" 2>&1; tail -1 "$L/$name.txt" >> "$L/summary.txt"; }
stamp start
[ -f /tmp/sdxl/model_index.json ] || python3 bench/make_random_models.py sdxl --out /tmp/sdxl --device cuda > "$L/make_sdxl.txt" 2>&1
stamp made
fp sdxl_mlxdiff python3 bench/speed_gpu.py mlxdiff /tmp/sdxl --steps 30 --size 1024; stamp mlxdiff
fp sdxl_diffusers python3 bench/speed_gpu.py diffusers /tmp/sdxl --steps 30 --size 1024; stamp diffusers
/usr/bin/time -f "%e s wall" python3 -m mlxdiff.generate --model /tmp/sdxl --prompt fox --width 1024 --height 1024 \
  --steps 30 --no-progress --report-memory --output "$L/sdxl.png" > "$L/sdxl_cli.txt" 2>&1; stamp cli
python3 bench/speed_gpu.py table "$L/sdxl_mlxdiff.txt" "$L/sdxl_diffusers.txt" > "$L/table.md" 2>&1
# SD 1.5 at 512x512, 30 steps, the same way
[ -f /tmp/sd15/model_index.json ] || python3 bench/make_random_models.py sd1.5 --out /tmp/sd15 --device cuda > "$L/make_sd15.txt" 2>&1
fp sd15_mlxdiff python3 bench/speed_gpu.py mlxdiff /tmp/sd15 --steps 30 --size 512; stamp sd15_mlxdiff
fp sd15_diffusers python3 bench/speed_gpu.py diffusers /tmp/sd15 --steps 30 --size 512; stamp sd15_diffusers
python3 bench/speed_gpu.py table "$L"/sdxl_*.txt "$L"/sd15_*.txt > "$L/table.md" 2>&1
stamp done
