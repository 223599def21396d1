#!/usr/bin/env bash
# Step caching on the lent GPU (bench/RESULTS.md, "Step caching"), one job: klein-4B and SD3.5 Medium at 1024x1024,
# 28 steps, random weights at the real configs (bench/make_random_models.py): mlxdiff uncached and with
# --cache first-block at 0.05, at T_mid (the median of the first block's changes) and at 1e9 (every forward after
# the first skipped), then diffusers' hook (tail mended) at the same T_mid on the same noise, and which forwards each
# skipped (bench/step_cache_gpu.py). Run on the GPU machine after the device recipe's activate step; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
for kind in ${KINDS:-klein-4b sd3.5-medium}; do
  dir=/tmp/sc-$kind
  [ -f "$dir/model_index.json" ] || python3 bench/make_random_models.py "$kind" --out "$dir" --device cuda \
    > "$L/make_$kind.txt" 2>&1
  stamp "make_$kind"
  python3 bench/step_cache_gpu.py mlxdiff "$dir" --out "$L/mlxdiff_$kind.json" > "$L/mlxdiff_$kind.txt" 2>&1
  stamp "mlxdiff_$kind"
  t=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['t_mid'])" "$L/mlxdiff_$kind.json")
  python3 bench/step_cache_gpu.py diffusers "$dir" --threshold "$t" --out "$L/diffusers_$kind.json" \
    > "$L/diffusers_$kind.txt" 2>&1
  python3 bench/step_cache_gpu.py compare "$L/mlxdiff_$kind.json" "$L/diffusers_$kind.json" > "$L/compare_$kind.txt" 2>&1
  stamp "diffusers_$kind"
  rm -rf "$dir"
done
stamp JOB-DONE
