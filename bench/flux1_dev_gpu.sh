#!/usr/bin/env bash
# FLUX.1-dev's transformer step (1024x1024: 4096 image + 512 text tokens, bf16, random weights at the real config),
# mlxdiff beside diffusers in one job, the sides alternating (A B A B; REPEAT pairs, default 2). One ruler for both:
# the device memory in use (nvidia-smi --query-gpu=memory.used, every 0.1 s, from outside) less the idle reading
# taken before each process, its peak while that side's timed forwards run (bench/forward_gpu.py --phase-file).
# Run on the GPU machine after the device recipe's activate step; logs in $LOGS.
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/logs}
mkdir -p "$L"
for rep in $(seq 1 "${REPEAT:-2}"); do
  for side in mlxdiff diffusers; do
    idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    phases="$L/phases_${side}_$rep.txt"; rm -f "$phases"
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$L/smi_${side}_$rep.csv" &
    smi=$!
    python3 bench/forward_gpu.py "$side" --model flux1-dev --phase-file "$phases" > "$L/forward_${side}_$rep.txt" 2>&1
    kill $smi; wait $smi 2>/dev/null
    python3 - "$L/smi_${side}_$rep.csv" "$phases" "$idle" "$side" "$rep" <<'PY' >> "$L/ruler.txt"
import datetime, json, sys
smi, phases, idle, side, rep = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
marks = dict(line.split() for line in open(phases))
start, end = float(marks["forward"]), float(marks["done"])
peak_all = peak_fwd = 0.0
for line in open(smi):
    ts, used = [x.strip() for x in line.split(",")]
    t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
    peak_all = max(peak_all, float(used))
    if start <= t <= end:
        peak_fwd = max(peak_fwd, float(used))
print(json.dumps({"side": side, "rep": rep, "idle_mib": idle, "forward_peak_gib": (peak_fwd - idle) / 1024,
                  "process_peak_gib": (peak_all - idle) / 1024}))
PY
  done
done
cat "$L/ruler.txt"; grep -h RESULT "$L"/forward_*.txt
