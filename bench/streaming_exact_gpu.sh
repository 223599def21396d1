#!/usr/bin/env bash
# Is a streamed run the resident one, bit for bit? Three runs of one folder (bench/streaming_gpu.py run, same seed and
# noise): resident as the run policy chooses (on a GPU with room: whole blocks compiled, models/fused.compiled_block),
# resident with MLXDIFF_COMPILE_BLOCKS=0 (eager blocks, as a streamed model always runs: memory.compile_blocks_for),
# and under --memory-limit $LIMIT (streamed); then each pair's latents compared. Written for Krea 2's streamed row,
# whose latents differed from the resident run's (bench/RESULTS.md, "Krea 2 on one H200"): does the difference come
# from streaming or from compiled against eager blocks?
#   MODEL=krea2 DIR=/tmp/k2 SIZE=512 STEPS=2 LIMIT=6 LOGS=/tmp/sx bash bench/streaming_exact_gpu.sh
# (the folder is written by bench/make_random_models.py MODEL when DIR has none). CPU chain check (tiny, RSS):
#   MODEL=krea2-tiny DIR=/tmp/k2t SIZE=64 STEPS=2 LIMIT=0.006 MAKE_DEVICE=cpu LOGS=/tmp/sx bash bench/streaming_exact_gpu.sh
# Run on the GPU machine after the device recipe's activate step. Random weights: only the comparison means anything.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/sx} dir=${DIR:-/tmp/k2}
mkdir -p "$L"
[ -f "$dir/model_index.json" ] || python3 bench/make_random_models.py "${MODEL:-krea2}" --out "$dir" \
  --device "${MAKE_DEVICE:-cuda}" > "$L/make.txt" 2>&1
args=(run "$dir" --size "${SIZE:-512}" --steps "${STEPS:-2}")
python3 bench/streaming_gpu.py "${args[@]}" --out "$L/resident" > "$L/resident.txt" 2>&1
MLXDIFF_COMPILE_BLOCKS=0 python3 bench/streaming_gpu.py "${args[@]}" --out "$L/eager" > "$L/eager.txt" 2>&1
python3 bench/streaming_gpu.py "${args[@]}" --memory-limit "${LIMIT:-6}" --out "$L/streamed" > "$L/streamed.txt" 2>&1
for pair in "eager streamed" "resident eager" "resident streamed"; do
  set -- $pair
  echo "RESULT $1 vs $2: $(python3 bench/streaming_gpu.py compare "$L/$1" "$L/$2" 2>&1 | grep RESULT)"
done | tee "$L/summary.txt"
grep -h "note: .*streamed\|pieces of work" "$L"/{resident,eager,streamed}.txt | sort | uniq -c >> "$L/summary.txt"
