# The outside ruler the GPU jobs share (sourced; bench/qwen_zimage_gpu.sh, bench/speed_round3_gpu.sh): nvidia-smi's
# memory.used every 0.1 s while one process runs alone, less the idle reading before it. NO_SMI=1: no sampler (CPU).
smi_used() { [ -n "${NO_SMI:-}" ] && echo 0 || nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
# smi_start CSV: the sampler in the background, its pid in SMI_PID; smi_stop ends it
smi_start() {
  SMI_PID=
  [ -n "${NO_SMI:-}" ] && return
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$1" &
  SMI_PID=$!
}
smi_stop() { [ -z "${SMI_PID:-}" ] || { kill "$SMI_PID"; wait "$SMI_PID" 2>/dev/null; SMI_PID=; }; }
# smi_peak CSV IDLE_MIB PHASES JSON_FIELDS: one json line, JSON_FIELDS ({"model": ...}) and the peaks less idle: over
# the whole process, and between PHASES' "forward" and "done" marks where that file exists
smi_peak() {
  [ -n "${NO_SMI:-}" ] || python3 - "$@" <<'PY'
import datetime, json, os, sys
smi, idle, phases, fields = sys.argv[1], float(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
start = end = None
if os.path.exists(phases):
    marks = dict(line.split() for line in open(phases))
    start, end = float(marks["forward"]), float(marks["done"])
peak_all = peak_fwd = 0.0
for line in open(smi):
    ts, used = [x.strip() for x in line.split(",")]
    t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
    peak_all = max(peak_all, float(used))
    if start is not None and start <= t <= end:
        peak_fwd = max(peak_fwd, float(used))
out = dict(fields, idle_mib=idle)
if start is not None:
    out["forward_peak_gib"] = (peak_fwd - idle) / 1024
out["process_peak_gib"] = (peak_all - idle) / 1024
print(json.dumps(out))
PY
}
