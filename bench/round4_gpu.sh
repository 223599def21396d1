#!/usr/bin/env bash
# Issue 41's GPU rows in one job: FLUX 3 Klein and Krea 2 at 1024x1024, random bf16 weights at the real configs,
# mlxdiff beside diffusers. Parts, in priority order (ONLY= picks them; default all three):
#   f3prof  FLUX 3 Klein's transformer forward piece by piece, mlxdiff beside diffusers (bench/profile_blocks_gpu.py:
#           embedders, the text / image per-mode blocks, the joint blocks, attention's projections / qk norm + RoPE /
#           SDPA, the feed-forward, the final layer), sides alternating, P_REPEAT pairs (default 2), each process
#           under nvidia-smi (bench/smi_ruler.sh); f3prof_table.md
#   f3      FLUX 3 Klein end to end (bench/streaming_gpu.sh F3_LIMITS, default "none 6": the folder written by
#           bench/make_random_models.py flux3-klein, ~20 GB; 16 steps, no guidance; resident and --memory-limit 6
#           under `python -m mlxdiff.footprint run`, the latents / image of the limit against the resident run; then
#           the whole process beside diffusers' modular pipeline, bench/whole_process_gpu.py pairs, alternating twice,
#           wall clock and nvidia-smi for both sides)
#   k2      Krea 2 the same way (K2_LIMITS, default "none 6"; krea2, ~35 GB; CFG 4.5 against ""; K2_STEPS=4 for the
#           resident and streamed runs, its default 28 steps, K2_WHOLE_STEPS, for the whole process; K2_WHOLE=0 skips
#           that); the FLUX 3 folder is deleted first when the disk cannot hold both (55 GB of the 64 GiB)
# Logs in $LOGS (default /tmp/r4): steps.txt (stamps; a failed side is a FAILED line there and the job goes on),
# f3prof_*.txt, ruler.txt, stream/ (streaming_gpu.sh's: run_*/result.json, fp_*.json, compare_*.txt, whole_*.txt,
# disk_*.txt); at the end summary.txt, the RESULT lines of every row (also printed).
# GPU time, estimated from bench/RESULTS.md's rows (not measured; one H100): f3prof ~2.5 min (4 processes of ~30 s:
# imports, 5.5 B built on the GPU, 7 plain + 5 timed forwards); f3 ~7 min (make ~1.5, resident ~1, streamed ~2 at
# ~3 s a step, whole process 4 x ~30 s); k2 ~11 min (make ~2.5, resident ~1.5, streamed ~3 at ~20 s a CFG step,
# whole process at 28 steps 4 x ~60 s): ~21 min for all three, more than two 10-minute device calls. Run it in the
# background and wait on it, copying the logs back each call (a call that ends leaves a setsid job running while the
# machine stays warm; files under $OUT come back 2 folders deep at most, so one tarball, images and latents left out):
#   call 1: (ONLY="f3prof f3 k2" LOGS=/tmp/r4 setsid nohup bash bench/round4_gpu.sh > /tmp/r4.out 2>&1 &);
#           bash bench/round4_gpu.sh wait 560; tar czf $OUT/r4.tgz --exclude='*.png' --exclude='*.npy' -C /tmp r4 r4.out
#   call 2 and 3 (until steps.txt says JOB-DONE):
#           bash bench/round4_gpu.sh wait 570; tar czf $OUT/r4.tgz --exclude='*.png' --exclude='*.npy' -C /tmp r4 r4.out
# or, each call standing alone (a part writes its folder when it is not there): ONLY=f3prof (~2.5 min),
# ONLY=f3 (~7), ONLY=k2 K2_WHOLE=0 (~7.5), ONLY=k2 K2_LIMITS= (the whole process only, ~4 with the folder there,
# ~6.5 without); each `LOGS=/tmp/r4 bash bench/round4_gpu.sh; tar czf $OUT/r4.tgz ...` as above.
# Run on the GPU machine after the device recipe's activate step.
# CPU chain check (no GPU; tiny folders and transformer, 64x64, 2 steps, RSS instead of NVML):
#   P_MODEL=flux3-klein-tiny P_SIZE=64 P_REPEAT=1 DEVICE=cpu NO_SMI=1 \
#   F3_MODEL=flux3-klein-tiny F3_DIR=/tmp/f3t F3_SIZE=64 F3_STEPS=2 F3_LIMITS="none 0.008" F3_NEED_GB=1 \
#   K2_MODEL=krea2-tiny K2_DIR=/tmp/k2t K2_SIZE=64 K2_STEPS=2 K2_WHOLE_STEPS=2 K2_LIMITS="none 0.006" K2_NEED_GB=1 \
#   MAKE_DEVICE=cpu LOGS=/tmp/r4-cpu bash bench/round4_gpu.sh
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/r4}
if [ "${1:-}" = wait ]; then   # wait SECONDS: until the job stamps JOB-DONE or SECONDS pass; then its stamps
  end=$((SECONDS + ${2:-560}))
  while [ $SECONDS -lt $end ] && ! grep -q JOB-DONE "$L/steps.txt" 2> /dev/null; do sleep 10; done
  cat "$L/steps.txt" 2> /dev/null
  exit 0
fi
PARTS=${ONLY:-f3prof f3 k2}
mkdir -p "$L"
. bench/smi_ruler.sh
stamp() { echo "$(date +%T) $1" >> "$L/steps.txt"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }
stamp "start $PARTS"
if want f3prof; then
  for rep in $(seq 1 "${P_REPEAT:-2}"); do
    for side in mlxdiff diffusers; do
      tag="f3prof_${side}_$rep"
      idle=$(smi_used)
      smi_start "$L/smi_$tag.csv"
      python3 bench/profile_blocks_gpu.py "$side" --model "${P_MODEL:-flux3-klein}" --size "${P_SIZE:-1024}" \
        --device "${DEVICE:-cuda}" > "$L/$tag.txt" 2>&1 || stamp "FAILED $tag (see $tag.txt)"
      smi_stop
      smi_peak "$L/smi_$tag.csv" "$idle" - "{\"tag\": \"$tag\"}" >> "$L/ruler.txt"
      stamp "$tag"
    done
  done
  python3 bench/profile_blocks_gpu.py table "$L"/f3prof_*_[0-9]*.txt > "$L/f3prof_table.md" 2>&1
  cat "$L/f3prof_table.md"
fi
# each family through streaming_gpu.sh alone (its own stamps in stream/steps.txt)
if want f3; then
  F3_LIMITS=${F3_LIMITS-none 6} K2_LIMITS= LIMITS= LOGS="$L/stream" bash bench/streaming_gpu.sh \
    || stamp "FAILED f3 (see stream/)"
  stamp f3_done
fi
if want k2; then
  K2_LIMITS=${K2_LIMITS-none 6} F3_LIMITS= LIMITS= LOGS="$L/stream" bash bench/streaming_gpu.sh \
    || stamp "FAILED k2 (see stream/)"
  stamp k2_done
fi
python3 - "$L" > "$L/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
L = Path(sys.argv[1])
S = L / "stream"
GIB = 1024 ** 3
def lines(f):
    return [json.loads(x[6:]) for x in f.read_text().splitlines() if x.startswith("RESULT")] if f.exists() else []
for f in sorted(L.glob("f3prof_*_[0-9]*.txt")):
    for r in lines(f):
        print("RESULT" + json.dumps({"row": f.stem, "forward_s": r["forward_s"],
                                     "instrumented_ms": r["instrumented_ms"]}))
for fp in sorted(S.glob("fp_*.json")):      # one streamed / resident run: the outside reading and its own
    tag = fp.stem[3:]
    res = S / f"run_{tag}" / "result.json"
    r = json.loads(res.read_text()) if res.exists() else {}
    peak = json.loads(fp.read_text()).get("summary", {}).get("peak")
    print("RESULT" + json.dumps({"row": f"run_{tag}", "process_peak_gib": peak and peak / GIB,
                                 "phase_peak_gib": {k: v.get("footprint_peak", 0) / GIB
                                                    for k, v in r.get("memory", {}).items()},
                                 "step_s": r.get("step_s"), "image_s": r.get("image_s"),
                                 "streamed": r.get("streamed")}))
for f in sorted(S.glob("compare_*.txt")):
    for r in lines(f):
        print("RESULT" + json.dumps({"row": f.stem, **r}))
for f in sorted(S.glob("whole_*.txt")):
    for r in lines(f):
        print("RESULT" + json.dumps({"row": f.stem, **{k: r.get(k) for k in ("side", "rep", "process_s", "rc",
                                                                              "smi_peak_gib", "step_s", "tail")}}))
PY
cat "$L/summary.txt"
stamp JOB-DONE
