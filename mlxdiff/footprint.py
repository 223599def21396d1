"""Footprint sampling from outside the process, and side-by-side comparison with the PyTorch path.

    python -m mlxdiff.footprint run [--interval 0.2] [--json F] -- COMMAND ...
    python -m mlxdiff.footprint compare --model M [--transformer F] [--width --height --steps] [--out DIR]

Each process is sampled every --interval seconds (macOS: phys_footprint, what Activity Monitor shows; Linux: RSS).
Processes that print `MLXDIFF_PHASE <name> start|end <time>` lines on stderr get per-phase figures (mlxdiff does
with MLXDIFF_PHASE_MARKERS=1; so does mlxdiff.reference). `compare` runs mlxdiff, diffusers as is and diffusers'
sequential recipe, each in its own process, on the same weights; it prints a table and writes the raw JSON and a
timeline (PNG with matplotlib installed, else a text timeline).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .errors import MlxdiffError
from .memory import GB, process_footprint


def sample(cmd, interval=0.2, env=None, echo=True) -> dict:
    start = time.time()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    phases, open_phases, tail = [], {}, []

    def read_stderr():
        for line in proc.stderr:
            if line.startswith("MLXDIFF_PHASE "):
                _, name, event, t = line.split()
                if event == "start":
                    open_phases[name] = float(t) - start
                elif name in open_phases:
                    phases.append((name, open_phases.pop(name), float(t) - start))
            else:
                tail.append(line)
                del tail[:-50]
                if echo:
                    sys.stderr.write(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    samples = []
    while proc.poll() is None:
        fp = process_footprint(proc.pid)["footprint"]
        if fp is not None:
            samples.append((time.time() - start, fp))
        time.sleep(interval)
    reader.join(timeout=5)
    return {"cmd": cmd, "rc": proc.returncode, "samples": samples, "phases": phases, "stderr_tail": "".join(tail)}


def summarize(run: dict) -> dict:
    samples = run["samples"]
    out = {"peak": max((m for _, m in samples), default=0), "phases": {}}
    for name, a, b in run["phases"]:
        inside = [m for t, m in samples if a <= t <= b]
        out["phases"][name] = {"peak": max(inside, default=None), "seconds": b - a}
    den = [m for t, m in samples for name, a, b in run["phases"] if name == "denoise" and a <= t <= b]
    out["steady"] = sorted(den)[len(den) // 2] if den else None
    return out


def timeline(runs: dict, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines = []
        for label, run in runs.items():
            lines.append(f"# {label}")
            lines += [f"{t:8.1f} s  {m / GB:7.2f} GB" for t, m in run["samples"][::max(1, len(run['samples']) // 60)]]
        path = path.with_suffix(".txt")
        path.write_text("\n".join(lines) + "\n")
        return path
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, run in runs.items():
        ax.plot([t for t, _ in run["samples"]], [m / GB for _, m in run["samples"]], label=label)
        for name, a, b in run["phases"]:
            ax.axvline(a, color="grey", lw=0.3)
    ax.set_xlabel("seconds")
    ax.set_ylabel("footprint (GB)")
    ax.legend()
    ax.set_title("process footprint over time")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def compare(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = dict(size=args.width, steps=args.steps)
    mlx_cmd = [sys.executable, "-m", "mlxdiff.generate", "--model", args.model, "--width", str(args.width),
               "--height", str(args.height), "--steps", str(args.steps), "--no-progress",
               "--output", str(out / "mlxdiff.png")]
    if args.transformer:
        mlx_cmd += ["--transformer", args.transformer]
    if args.quantize:
        mlx_cmd += ["--quantize", args.quantize]
    ref = lambda mode: [sys.executable, "-m", "mlxdiff.reference.sd3",
                        json.dumps({"model": args.model, "mode": mode, **size})]
    runs = {"mlxdiff": sample(mlx_cmd, args.interval, {"MLXDIFF_PHASE_MARKERS": "1"}, echo=False)}
    if not args.mlxdiff_only:
        runs["diffusers as is"] = sample(ref("as_is"), args.interval, echo=False)
        runs["diffusers sequential"] = sample(ref("sequential"), args.interval, echo=False)
    for label, run in runs.items():
        if run["rc"] != 0:
            raise MlxdiffError(f"{label} run failed (exit {run['rc']}): {run['stderr_tail'][-500:]}")
    summaries = {label: summarize(run) for label, run in runs.items()}
    labels = list(runs)
    print("| phase | " + " | ".join(f"{l} peak GB" for l in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for phase in ("load", "encode", "denoise", "decode"):
        cells = []
        for l in labels:
            p = summaries[l]["phases"].get(phase)
            cells.append("-" if not p or p["peak"] is None else f"{p['peak'] / GB:.2f}")
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print("| overall peak | " + " | ".join(f"{summaries[l]['peak'] / GB:.2f}" for l in labels) + " |")
    print("| steady (denoise median) | " + " | ".join(
        "-" if summaries[l]["steady"] is None else f"{summaries[l]['steady'] / GB:.2f}" for l in labels) + " |")
    base = summaries["mlxdiff"]["peak"]
    print("| peak ratio vs mlxdiff | " + " | ".join(f"{summaries[l]['peak'] / base:.2f}" for l in labels) + " |")
    (out / "footprint.json").write_text(json.dumps({"runs": runs, "summaries": summaries}, indent=1))
    print(f"timeline: {timeline(runs, out / 'timeline.png')}; raw: {out / 'footprint.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdiff.footprint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--interval", type=float, default=0.2)
    r.add_argument("--json", default=None)
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare")
    c.add_argument("--model", required=True)
    c.add_argument("--transformer", default=None)
    c.add_argument("--quantize", default=None)
    c.add_argument("--width", type=int, default=512)
    c.add_argument("--height", type=int, default=512)
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--interval", type=float, default=0.25)
    c.add_argument("--out", default="footprint-out")
    c.add_argument("--mlxdiff-only", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.what == "run":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                raise MlxdiffError("footprint run: give a command after --")
            run = sample(cmd, args.interval)
            s = summarize(run)
            print(f"peak {s['peak'] / GB:.2f} GB over {run['samples'][-1][0] if run['samples'] else 0:.1f} s; "
                  + ", ".join(f"{k}: {v['peak'] / GB:.2f} GB" for k, v in s["phases"].items() if v["peak"]))
            if args.json:
                Path(args.json).write_text(json.dumps({"run": run, "summary": s}, indent=1))
            return run["rc"]
        return compare(args)
    except MlxdiffError as e:
        print(f"mlxdiff: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
