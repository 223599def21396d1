"""Issue 44's ruler check: for each run of a bench/streaming_gpu.sh job, the peak its outside sampler
(`python -m mlxdiff.footprint run`, fp_<run>.json: mlxdiff.memory.process_memory of the child) read, beside the peak of
nvidia-smi's memory.used (smi.csv, sampled every 0.1 s from outside through the whole job) less its idle reading
before the job, within the run's window (steps.txt: a run ends at its stamp; it starts at the stamp before it).
    python3 bench/ruler_check.py LOGS_DIR"""

import datetime
import json
import sys
from pathlib import Path

MiB = 2 ** 20
GiB = 2 ** 30


def main(logs):
    logs = Path(logs)
    smi = []
    for line in (logs / "smi.csv").read_text().splitlines():
        stamp, used = [x.strip() for x in line.split(",")]
        smi.append((datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f"), int(used) * MiB))
    idle = smi[0][1]
    day = smi[0][0].date()
    stamps = []
    for line in (logs / "steps.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and ":" in parts[0]:
            stamps.append((datetime.datetime.combine(day, datetime.time.fromisoformat(parts[0])), parts[1]))
    print(f"idle before the job: {idle / MiB:.0f} MiB")
    print("| run | footprint run's reading, peak GiB (kind) | nvidia-smi in use less idle, peak GiB | difference MiB |")
    print("|---|---|---:|---:|")
    for (start, _), (end, name) in zip(stamps, stamps[1:]):
        if not name.startswith("run_"):
            continue
        fp = logs / f"fp_{name[4:]}.json"
        if not fp.exists():
            continue
        data = json.loads(fp.read_text())["run"]
        ours = max((b for _, b in data.get("samples", [])), default=0)
        outside = max((u for t, u in smi if start <= t <= end), default=idle) - idle
        print(f"| {name[4:]} | {ours / GiB:.2f} ({', '.join(data.get('measured', []))}) | {outside / GiB:.2f} | "
              f"{(ours - outside) / MiB:+.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
