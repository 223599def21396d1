#!/usr/bin/env bash
# Issue 44's speed rows and issue 42's SDXL ControlNet row in one job, mlxdiff beside diffusers, the sides alternating
# (mlxdiff, diffusers, mlxdiff, diffusers: REPEAT pairs, default 2) on random bf16 folders at the real configs
# (bench/make_random_models.py), whole images by bench/speed_gpu.py. Parts, in priority order (ONLY= picks them):
#   sdxlcn  SDXL base + one ControlNet (controlnet-canny-sdxl-1.0's config), 1024x1024, 30 steps, guidance 5, scale 1
#   sdxl    plain SDXL, the same
#   klein   FLUX.2 klein-4B, speed_gpu.py's defaults (1024x1024, 4 steps, guidance 1)
#   sd3     SD3.5 Medium, 1024x1024, 4 steps, CFG 7
# Two rulers on every process: `python3 -m mlxdiff.footprint run --interval 0.1` (on CUDA: what the device holds for
# the process, fp_TAG.json, summary.txt) and nvidia-smi's memory.used every 0.1 s from outside less the idle reading
# before it (bench/smi_ruler.sh, ruler.txt: process_peak_gib). Stamps in steps.txt; a failed side is a FAILED line
# there and the job goes on. A part's folders (under $WEIGHTS, default /tmp/r3w) are deleted once no later part of
# this job needs them (KEEP_FOLDERS=1 keeps them): klein-4B ~16 GB, SD3.5 Medium ~16 GB, SDXL ~7 GB, ControlNet ~5 GB.
# At the end: table.md (bench/speed_gpu.py table, the ControlNet rows apart) and ruler.md (both rulers per process).
# GPU time, estimated from bench/RESULTS.md's rows (one H200; mlxdiff's process = kernel warm-up image ~70 s for SDXL
# + 4 images + keep="none" re-read; diffusers' = load + 3 images): sdxlcn ~7 min (make ~1.5 min, then ~2.7 min a
# pair), sdxl ~5 min (~2.2 min a pair, folder reused), klein ~4.5 min (make ~1 min, ~1.7 min a pair), sd3 ~4.5 min:
# ~21 min for all four at REPEAT=2. It outlives one device call (10 min): start it in the background,
#     ONLY="sdxlcn sdxl klein sd3" LOGS=/tmp/r3 setsid nohup bash bench/speed_round3_gpu.sh > /tmp/r3.out 2>&1 &
# and poll steps.txt until JOB-DONE (copy $LOGS to $OUT each call).
# CPU chain check (no GPU; tiny folders; klein/sd3 have no tiny maker, so flux1-tiny stands in for both):
#     SDXL_MODEL=sdxl-tiny CN_MODEL=sdxl-controlnet-tiny KLEIN_MODEL=flux1-tiny SD3_MODEL=flux1-tiny SIZE=64 STEPS=2 \
#       REPEAT=1 DEVICE=cpu NO_SMI=1 WEIGHTS=/tmp/r3w-cpu LOGS=/tmp/r3-cpu bash bench/speed_round3_gpu.sh
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
W=${WEIGHTS:-/tmp/r3w}
PARTS=${ONLY:-sdxlcn sdxl klein sd3}
mkdir -p "$L" "$W"
. bench/smi_ruler.sh
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
make() {   # make MODEL DIR: written once (config.json / model_index.json present = done)
  [ -f "$2/model_index.json" ] || [ -f "$2/config.json" ] || python3 bench/make_random_models.py "$1" --out "$2" \
    --device "${DEVICE:-cuda}" > "$L/make_$(basename "$2").txt" 2>&1 || stamp "FAILED make $1 (see make_$(basename "$2").txt)"
}
drop() { [ -n "${KEEP_FOLDERS:-}" ] || rm -rf "$@"; }
# sides PART FOLDER ARGS...: mlxdiff and diffusers in turn, REPEAT pairs, each under both rulers
sides() {
  local part=$1 folder=$2; shift 2
  for rep in $(seq 1 "${REPEAT:-2}"); do
    for side in mlxdiff diffusers; do
      local tag="${part}_${side}_$rep" idle
      idle=$(smi_used)
      smi_start "$L/smi_$tag.csv"
      python3 -m mlxdiff.footprint run --interval 0.1 --json "$L/fp_$tag.json" -- \
        python3 bench/speed_gpu.py "$side" "$folder" "$@" > "$L/$tag.txt" 2>&1 || stamp "FAILED $tag (see $tag.txt)"
      smi_stop
      echo "$tag $(tail -1 "$L/$tag.txt")" >> "$L/summary.txt"
      smi_peak "$L/smi_$tag.csv" "$idle" - "{\"tag\": \"$tag\"}" >> "$L/ruler.txt"
      stamp "$tag"
    done
  done
}
size=(--size "${SIZE:-1024}")
unet=("${size[@]}" --steps "${STEPS:-30}")
few=("${size[@]}" --steps "${STEPS:-4}")
stamp "start $PARTS"
if want sdxlcn; then
  make "${SDXL_MODEL:-sdxl}" "$W/sdxl"; make "${CN_MODEL:-sdxl-controlnet}" "$W/sdxl-controlnet"; stamp made_sdxlcn
  sides sdxlcn "$W/sdxl" "${unet[@]}" --controlnet "$W/sdxl-controlnet" --control-scale 1.0
  drop "$W/sdxl-controlnet"
  want sdxl || drop "$W/sdxl"
fi
if want sdxl; then
  make "${SDXL_MODEL:-sdxl}" "$W/sdxl"; stamp made_sdxl
  sides sdxl "$W/sdxl" "${unet[@]}"
  drop "$W/sdxl"
fi
if want klein; then
  make "${KLEIN_MODEL:-klein-4b}" "$W/klein"; stamp made_klein
  sides klein "$W/klein" "${few[@]}"
  drop "$W/klein"
fi
if want sd3; then
  make "${SD3_MODEL:-sd3.5-medium}" "$W/sd3"; stamp made_sd3
  sides sd3 "$W/sd3" "${few[@]}"
  drop "$W/sd3"
fi
logs=$(for p in $PARTS; do ls "$L/${p}"_*_[0-9]*.txt 2>/dev/null; done)
# shellcheck disable=SC2086
[ -z "$logs" ] || python3 bench/speed_gpu.py table $logs > "$L/table.md" 2>&1
python3 - "$L" > "$L/ruler.md" 2>&1 <<'PY'
import json, sys
from pathlib import Path
L = Path(sys.argv[1])
smi = {}
if (L / "ruler.txt").exists():
    smi = {r["tag"]: r for r in map(json.loads, (L / "ruler.txt").read_text().splitlines())}
print("| process | s/step | second image, same prompt s | footprint run peak GiB (device for the process) | "
      "nvidia-smi in use less idle, peak GiB |")
print("|---|---|---|---|---|")
for fp in sorted(L.glob("fp_*.json")):
    tag = fp.stem[3:]
    d = json.loads(fp.read_text())
    result = [json.loads(line[6:]) for line in d["run"]["stdout"].splitlines() if line.startswith("RESULT")]
    r = result[-1] if result else {}
    step = f"{r['step_s']:.4f}" if r.get("step_s") is not None else "-"
    same = f"{r['second_same_s']:.2f}" if r.get("second_same_s") is not None else "FAILED"
    outside = f"{smi[tag]['process_peak_gib']:.2f}" if tag in smi else "-"
    print(f"| {tag} | {step} | {same} | {(d['summary']['peak'] or 0) / 1024 ** 3:.2f} | {outside} |")
PY
stamp JOB-DONE
cat "$L/table.md" "$L/ruler.md" 2>/dev/null
