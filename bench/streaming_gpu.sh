#!/usr/bin/env bash
# Streaming below the weights on the lent GPU, in one job (bench/RESULTS.md, "Streaming below the weights"): FLUX.2-dev
# end to end at 1024x1024, 4 steps, random weights at the real configs: the Q4_K_M GGUF transformer, the Mistral
# encoder as the folder's bf16 (18.5 B parameters; no disk here for a 4-bit copy beside both), the VAE. One process
# per run (bench/streaming_gpu.py run), each under `python -m mlxdiff.footprint run` (NVML, the whole process):
# resident (no limit), --memory-limit 8 and 4 (LIMITS; LIMITS= skips FLUX.2); then the latents and images compared,
# and the GGUF's read rate. SD_LIMITS="none 6": SD3.5 Large in bf16 the same way.
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
run() {   # run NAME FOLDER [args...]: one process under the outside sampler
  local name=$1; shift
  python3 -m mlxdiff.footprint run --interval 0.1 --json "$L/fp_$name.json" -- \
    python3 bench/streaming_gpu.py run "$@" --out "$L/run_$name" > "$L/run_$name.txt" 2>&1
  tail -1 "$L/run_$name.txt" >> "$L/summary.txt"
  stamp "run_$name"
}
stamp start
if [ -n "${SD_LIMITS:-}" ]; then   # SD3.5 Large in bf16 (8.1 B MMDiT, T5-XXL): SD_LIMITS="none 6"
  [ -f /tmp/sdl/model_index.json ] || python3 bench/make_random_models.py sd3.5-large --out /tmp/sdl --device cuda \
    > "$L/make_sd3.5-large.txt" 2>&1
  stamp make_sdl
  for limit in $SD_LIMITS; do
    extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
    run "sdl_$limit" /tmp/sdl "${extra[@]}"
  done
  for limit in $SD_LIMITS; do
    [ "$limit" = none ] || python3 bench/streaming_gpu.py compare "$L/run_sdl_none" "$L/run_sdl_$limit" \
      > "$L/compare_sdl_$limit.txt" 2>&1
  done
fi
[ -n "${LIMITS-x}" ] || { stamp JOB-DONE; exit 0; }
[ -f /tmp/dev/model_index.json ] || python3 bench/make_random_models.py flux2-dev --out /tmp/dev --device cuda \
  > "$L/make_flux2-dev.txt" 2>&1
stamp make_dev
[ -f /tmp/f2.gguf ] || python3 bench/flux2_dev_gpu.py write-gguf /tmp/f2.gguf > "$L/make_gguf.txt" 2>&1
stamp gguf
python3 bench/streaming_gpu.py rate /tmp/f2.gguf > "$L/rate_gguf.txt" 2>&1
for limit in ${LIMITS:-none 8 4}; do
  extra=(); [ "$limit" = none ] || extra=(--memory-limit "$limit")
  run "$limit" /tmp/dev --transformer /tmp/f2.gguf "${extra[@]}"
done
for limit in ${LIMITS:-none 8 4}; do
  [ "$limit" = none ] || python3 bench/streaming_gpu.py compare "$L/run_none" "$L/run_$limit" > "$L/compare_$limit.txt" 2>&1
done
stamp JOB-DONE
