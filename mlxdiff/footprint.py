"""Footprint sampling from outside the process, and side-by-side comparison with the PyTorch path.

    python -m mlxdiff.footprint run [--interval 0.2] [--json F] -- COMMAND ...
    python -m mlxdiff.footprint compare [--model M] [--transformer F] [--width --height --steps] [--out DIR]
                                        [--quantize Q] [--reference-dtype bfloat16|float32]
    python -m mlxdiff.footprint show DIR/footprint.json

Each process is sampled every --interval seconds (macOS: phys_footprint, what Activity Monitor shows; Linux: RSS).
Processes that print `MLXDIFF_PHASE <name> start|end <time>` lines on stderr get per-phase figures (mlxdiff does
with MLXDIFF_PHASE_MARKERS=1; so does mlxdiff.reference). On CUDA, RSS misses what lives on the device: the
reference runs also print `MLXDIFF_GPU <phase> <allocated> <reserved>` (torch's allocator peaks over the phase) and
mlxdiff's per-phase MLX peak is read from its --report-memory table.

`compare` runs mlxdiff, diffusers as is and diffusers' sequential recipe, each in its own process, on the same
weights (the diffusers side by family: mlxdiff.reference.sd3, .flux2 or .stable_diffusion (SD 1.x / 2.x, SDXL),
from model_index.json's _class_name; --reference-dtype float32 runs the SD one in float32, where torch's bf16
crawls); it prints a table and writes the raw JSON and a timeline (PNG with matplotlib installed, else text).
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import backend, cli, default_model
from .arguments import check_number, read_json_capped
from .cli import ArgumentParser, check_writable, write_error
from .errors import MlxdiffError
from .memory import GB, gpu_snapshot, process_memory


def sample(cmd, interval=0.2, env=None, echo=True) -> dict:
    """Run `cmd`, sampling its footprint every `interval` s. Returns the samples, the phases its stderr markers
    name, the peaks it reports itself per phase (`MLXDIFF_RSS <phase> <bytes>`: its VmHWM over the phase, which a
    phase shorter than the interval needs; `MLXDIFF_GPU <phase> <allocated> <reserved>`: torch's CUDA allocator),
    its stdout and the tail of its other stderr."""
    device = "cpu" if backend.on_cpu() else "gpu"    # the children run where this process's MLX does
    baseline = gpu_snapshot() if device == "gpu" else None   # this process's context and the others there
    start = time.time()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})})
    except OSError as e:
        raise MlxdiffError(f"{cmd[0]}: cannot run it ({e.strerror or e})") from None
    phases, open_phases, tail, gpu, rss, stdout = [], {}, [], {}, {}, []

    def read_stderr():
        for line in proc.stderr:
            if line.startswith("MLXDIFF_PHASE "):
                _, name, event, t = line.split()
                if event == "start":
                    open_phases[name] = float(t) - start
                elif name in open_phases:
                    phases.append((name, open_phases.pop(name), float(t) - start))
            elif line.startswith("MLXDIFF_RSS "):
                _, name, peak = line.split()
                rss[name] = int(peak)
            elif line.startswith("MLXDIFF_GPU "):
                _, name, allocated, reserved = line.split()
                gpu[name] = {"allocated": int(allocated), "reserved": int(reserved)}
            else:
                tail.append(line)
                del tail[:-50]
                if echo:
                    sys.stderr.write(line)

    def read_stdout():
        for line in proc.stdout:
            stdout.append(line)
            if echo:
                sys.stdout.write(line)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stderr, read_stdout)]
    for r in readers:
        r.start()
    samples, kinds = [], set()
    while proc.poll() is None:
        now = process_memory(proc.pid, device=device, gpu_baseline=baseline)
        if now["footprint"] is not None:
            samples.append((time.time() - start, now["footprint"]))
            kinds.add(now["kind"])
        time.sleep(interval)
    for r in readers:
        r.join(timeout=5)
    return {"cmd": cmd, "rc": proc.returncode, "samples": samples, "measured": sorted(kinds), "phases": phases,
            "rss_peaks": rss, "gpu": gpu,
            "stdout": "".join(stdout), "stderr_tail": "".join(tail)}


def _bytes(text):
    if text == "-":
        return None
    value, unit = text.split()
    return int(float(value) * (GB if unit == "GB" else 2 ** 20))


def report_peaks(stdout: str) -> dict:
    """From mlxdiff.generate's phase table (--report-memory; its size columns are phases.MEMORY_COLUMNS):
    {"mlx": {phase: MLX peak bytes}, "process": {phase: process peak bytes}} (sizes as printed, to 0.01 GB or
    0.1 MB; a "-" is left out)."""
    from .pipelines.report import MEMORY_COLUMNS  # heavy: mlxdiff.pipelines imports MLX and every family (about 0.6 s)
    columns = {"mlx": MEMORY_COLUMNS.index("MLX peak"), "process": MEMORY_COLUMNS.index("process peak")}
    out = {"mlx": {}, "process": {}}
    for line in stdout.splitlines():
        tokens = line.split()
        if len(tokens) >= 3 and tokens[0] in PHASES:
            # a size is digits with at most one point (a forged "1.2.3 MB" or a 400-digit one is no size)
            sizes = re.findall(r"-(?=\s|$)|(?<![\d.])\d{1,15}(?:\.\d{1,6})? [MG]B", " ".join(tokens[2:]))
            if len(sizes) != len(MEMORY_COLUMNS):
                continue   # not a row of the table
            for key, i in columns.items():
                if _bytes(sizes[i]) is not None:
                    out[key][tokens[0]] = _bytes(sizes[i])
    return out


PHASES = ("load", "encode", "denoise", "decode")


def summarize(run: dict) -> dict:
    """Peaks overall and per phase: the larger of what was sampled inside the phase and the peak the process
    reported for it (a phase shorter than the sampling interval has no sample)."""
    samples, reported = run["samples"], run.get("rss_peaks") or {}
    if run.get("measured", ["RSS"]) != ["RSS"] and not run.get("peaks_same_ruler"):
        reported = {}   # a process's own host VmHWM is not the GPU memory its samples measured
    out = {"peak": max([m for _, m in samples] + list(reported.values()), default=0), "phases": {},
           "gpu": run.get("gpu") or {}}
    for name, a, b in run["phases"]:
        inside = [m for t, m in samples if a <= t <= b]
        sampled = max(inside, default=None)
        peaks = [p for p in (sampled, reported.get(name)) if p is not None]
        out["phases"][name] = {"peak": max(peaks, default=None), "sampled": sampled, "reported": reported.get(name),
                               "seconds": b - a}
    den = [m for t, m in samples for name, a, b in run["phases"] if name == "denoise" and a <= t <= b]
    out["steady"] = sorted(den)[len(den) // 2] if den else None
    return out


def write_text(path: Path, text: str):
    """A result file; a failed write (disk full, read-only place) is one line."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise write_error(path, e) from None


def timeline(runs: dict, path: Path):
    try:
        import matplotlib  # optional: matplotlib draws the timeline when installed
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: as matplotlib
    except ImportError:
        lines = []
        for label, run in runs.items():
            lines.append(f"# {label}")
            lines += [f"{t:8.1f} s  {m / GB:7.2f} GB" for t, m in run["samples"][::max(1, len(run['samples']) // 60)]]
        path = path.with_suffix(".txt")
        write_text(path, "\n".join(lines) + "\n")
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
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as e:
        raise write_error(path, e) from None
    return path


def reference_family(model) -> tuple:
    """(the family, the local path) of what the user named: a pipeline folder by model_index.json's _class_name (a
    cached hub id too), a single file by the family that claims its tensors (pipelines.family_of_file)."""
    from .loading.sources import read_json, resolve_path  # heavy: mlxdiff.loading imports MLX and the models (about 0.6 s)
    from .pipelines import by_pipeline_class, family_of_file  # heavy: as above
    path = resolve_path(model)
    if path.is_dir():
        index = path / "model_index.json"
        cls = read_json(index, "model_index.json", path).get("_class_name")   # checked: a JSON object
        owners = by_pipeline_class()
        if not isinstance(cls, str) or cls not in owners:
            raise MlxdiffError(f"{index}: no diffusers reference for pipeline {cls!r:.80}; supported: "
                               + ", ".join(sorted(owners)))
        return owners[cls], path
    return family_of_file(path), path


def reference_for(model) -> tuple:
    """(the family's diffusers reference module, the local path) for what the user named (reference_family)."""
    family, path = reference_family(model)
    return family.reference, path


def measured(runs: dict, interval: float) -> str:
    """What the table's figures are, on this machine: every side by the same ruler (memory.process_memory)."""
    kinds = sorted({k for run in runs.values() for k in run.get("measured", [])}) or ["process footprint"]
    how = (f"memory: what each process holds, {', '.join(kinds)}, sampled from outside every {interval:g} s, the "
           "same ruler for every side")
    if kinds == ["RSS"]:
        how += " (per phase also the process's own VmHWM over the phase)"
    if any(run.get("gpu") for run in runs.values()):
        how += ("; GPU rows, the breakdown: torch max_memory_allocated / max_memory_reserved per phase, mlxdiff's "
                "MLX active peak")
    return how


def _gb(n):
    return "-" if n is None else f"{n / GB:.2f}"


def _gpu_overall(gpu: dict) -> str:
    """The largest allocated (/ reserved) figure over the phases."""
    if not gpu:
        return "-"
    reserved = [g["reserved"] for g in gpu.values() if g["reserved"] is not None]
    return _gb(max(g["allocated"] or 0 for g in gpu.values())) + (f" / {_gb(max(reserved))}" if reserved else "")


SLOW_BF16_BYTES = 2 * GB   # above this much weight, diffusers' bf16 runs on a CPU without bf16 units take hours


def slow_reference_warning(path: Path, transformer, cpuinfo: str, torch_on_cpu):
    """The warning to print before diffusers' runs, or None: on an x86 CPU without bf16 matrix instructions (no
    AVX512-BF16, no AMX-BF16 among /proc/cpuinfo's flags) torch's bf16 matmuls run at 1-14 GFLOP/s (an AVX2 AMD
    EPYC: bench/torch_cpu_bf16.py, bench/RESULTS.md), so a real-size model's diffusers runs take hours.
    `torch_on_cpu()` is asked last (it may import torch)."""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    if not flags or "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    size = sum(f.stat().st_size for f in files) + (transformer.stat().st_size if transformer else 0)
    # the size before torch: importing torch costs seconds, and a small model needs no warning wherever torch runs
    if size < SLOW_BF16_BYTES or not torch_on_cpu():
        return None
    return (f"mlxdiff: warning: this CPU has no bf16 matrix instructions (no AVX512-BF16 or AMX), where torch's "
            f"bf16 matmuls run at about 1-14 GFLOP/s; diffusers' runs on these {size / GB:.1f} GB of weights may "
            "take hours (--mlxdiff-only skips them)")


def _torch_on_cpu() -> bool:
    """Whether mlxdiff.reference will run torch on the CPU."""
    from .reference.common import device  # optional: mlxdiff.reference is the torch extra's side
    return device() == "cpu"


def table(runs: dict, mlx_on_gpu: bool) -> tuple:
    """(summaries, the markdown table) of compare's runs; mlxdiff's per-phase MLX and process peaks come from its
    --report-memory table (on a GPU, MLX's peak is device memory: the GPU rows)."""
    mlx = runs["mlxdiff"]
    reported = report_peaks(mlx["stdout"])
    # its own process peak per phase, read by the same ruler as the samples (memory.PeakSampler)
    mlx["mlx_peak"], mlx["rss_peaks"], mlx["peaks_same_ruler"] = reported["mlx"], reported["process"], True
    if mlx_on_gpu:
        mlx["gpu"] = {name: {"allocated": peak, "reserved": None} for name, peak in mlx["mlx_peak"].items()}
    summaries = {label: summarize(run) for label, run in runs.items()}
    labels = list(runs)
    rows = ["| phase | " + " | ".join(f"{l} peak GB" for l in labels) + " |", "|---|" + "---|" * len(labels)]
    for phase in PHASES:
        cells = []
        for l in labels:
            p = summaries[l]["phases"].get(phase)
            cells.append("-" if not p or p["peak"] is None else f"{p['peak'] / GB:.2f}")
        rows.append(f"| {phase} | " + " | ".join(cells) + " |")
    rows.append("| overall peak | " + " | ".join(f"{summaries[l]['peak'] / GB:.2f}" for l in labels) + " |")
    rows.append("| steady (denoise median) | " + " | ".join(
        "-" if summaries[l]["steady"] is None else f"{summaries[l]['steady'] / GB:.2f}" for l in labels) + " |")
    base = summaries["mlxdiff"]["peak"]
    rows.append("| peak ratio vs mlxdiff | " + " | ".join(
        f"{summaries[l]['peak'] / base:.2f}" if base else "-" for l in labels) + " |")
    if any(summaries[l]["gpu"] for l in labels):
        for phase in PHASES:
            cells = []
            for l in labels:
                g = summaries[l]["gpu"].get(phase)
                cells.append("-" if not g else _gb(g["allocated"]) + (
                    "" if g["reserved"] is None else f" / {_gb(g['reserved'])}"))
            rows.append(f"| GPU {phase} | " + " | ".join(cells) + " |")
        rows.append("| GPU overall peak | " + " | ".join(_gpu_overall(summaries[l]["gpu"]) for l in labels) + " |")
    return summaries, "\n".join(rows)


SAVED_BYTES = 256 << 20    # a footprint.json: samples every 0.25 s for a day of runs are a few tens of MB
SAVED_DEPTH = 12           # its deepest nesting is 5 (summaries -> label -> phases -> name -> figures)


class _Bad(Exception):
    """What is wrong with a saved footprint.json, at a JSON path (runs.mlxdiff.samples[3])."""


def _number(value, where, optional=False):
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{where} is {type(value).__name__}, expected a number" + (" or null" if optional else ""))
    try:
        finite = math.isfinite(value)
    except OverflowError:   # an integer past float's range
        finite = False
    if not finite or value < -1e15 or value > 1e18:
        raise _Bad(f"{where} is {value!r:.40}, expected a finite number of seconds or bytes")


def _object(value, where) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{where} is {type(value).__name__}, expected an object")
    return value


def _list(value, where) -> list:
    if not isinstance(value, list):
        raise _Bad(f"{where} is {type(value).__name__}, expected a list")
    return value


def _text(value, where, one_line=False):
    if not isinstance(value, str) or (one_line and (not value or len(value) > 200 or not value.isprintable())):
        raise _Bad(f"{where} is {type(value).__name__ if not isinstance(value, str) else 'not a one-line name'}, "
                   "expected " + ("a one-line name" if one_line else "text"))


def check_saved(saved):
    """The structure `show` reads from a footprint.json, checked whole before any of it is used (the file is the
    user's to edit, move or damage): the runs by label (mlxdiff's among them), each with its samples ([seconds,
    bytes] pairs), phases ([name, start, end]), per-phase peaks and GPU figures, stdout text; numbers finite. Raises
    _Bad naming where."""
    _object(saved, "the file")
    if "measured" in saved:
        _text(saved["measured"], "measured")
    runs = _object(saved.get("runs"), "runs")
    if "mlxdiff" not in runs:
        raise _Bad("runs has no \"mlxdiff\" run")
    for label, run in runs.items():
        at = f"runs[{label!r:.60}]"
        _text(label, at, one_line=True)
        _object(run, at)
        for pair_no, pair in enumerate(_list(run.get("samples"), f"{at}.samples")):
            if not isinstance(pair, list) or len(pair) != 2:
                raise _Bad(f"{at}.samples[{pair_no}] is not a [seconds, bytes] pair")
            _number(pair[0], f"{at}.samples[{pair_no}][0]")
            _number(pair[1], f"{at}.samples[{pair_no}][1]")
        for i, phase in enumerate(_list(run.get("phases"), f"{at}.phases")):
            if not isinstance(phase, list) or len(phase) != 3:
                raise _Bad(f"{at}.phases[{i}] is not a [name, start, end] triple")
            _text(phase[0], f"{at}.phases[{i}][0]", one_line=True)
            _number(phase[1], f"{at}.phases[{i}][1]")
            _number(phase[2], f"{at}.phases[{i}][2]")
        if label == "mlxdiff" or "stdout" in run:
            _text(run.get("stdout"), f"{at}.stdout")
        for name, peak in _object(run.get("rss_peaks") or {}, f"{at}.rss_peaks").items():
            _number(peak, f"{at}.rss_peaks[{name!r:.40}]")
        for name, figures in _object(run.get("gpu") or {}, f"{at}.gpu").items():
            where = f"{at}.gpu[{name!r:.40}]"
            _object(figures, where)
            for key in ("allocated", "reserved"):
                if key not in figures:
                    raise _Bad(f"{where} has no {key!r}")
                _number(figures[key], f"{where}.{key}", optional=True)
        measured = run.get("measured", [])
        if not isinstance(measured, list) or not all(isinstance(m, str) for m in measured):
            raise _Bad(f"{at}.measured is not a list of names")
        if not isinstance(run.get("peaks_same_ruler", False), bool):
            raise _Bad(f"{at}.peaks_same_ruler is not true or false")


def show(path) -> int:
    """Print the table of a saved compare (its footprint.json) again, read with this version's parser: the file
    read as a user's file (a regular file, bounded: files.read_capped) and its structure checked whole
    (check_saved) before any of it is used."""

    what = f"{path}: not a footprint.json written by `footprint compare`"
    try:
        saved = read_json_capped(path, SAVED_BYTES, str(path), "pass the footprint.json of one compare",
                                 depth=SAVED_DEPTH)
        check_saved(saved)
    except MlxdiffError as e:   # it says what to do
        raise MlxdiffError(f"{what}: {str(e).removeprefix(f'{path}: ')}") from None
    except _Bad as e:
        raise MlxdiffError(f"{what} ({e}); pass the file from its --out folder") from None
    runs = saved["runs"]
    _, text = table(runs, mlx_on_gpu=bool(runs["mlxdiff"].get("gpu")))
    print(saved.get("measured", ""))
    print(text)
    return 0


def _make_out(out: Path) -> None:
    """compare's --out folder made and probed before the runs, not after minutes of them; a folder made here and
    then refused is removed again."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    try:
        check_writable(out / "footprint.json", "--out", "footprint.json")
    except MlxdiffError:
        if made:
            out.rmdir()
        raise


def compare(args) -> int:
    out = Path(args.out)
    model = args.model or str(default_model.folder())
    family, path = reference_family(model)
    module = family.reference
    if args.reference_dtype is not None and args.reference_dtype not in family.reference_dtypes:
        raise MlxdiffError(f"--reference-dtype {args.reference_dtype}: "
                           + (f"expected one of {', '.join(family.reference_dtypes)}" if family.reference_dtypes
                              else f"{module} runs diffusers in bfloat16 only; leave it out"))
    if family.reference_file_refusal and not path.is_dir() and not args.mlxdiff_only:
        raise MlxdiffError(f"{path.name}: {family.reference_file_refusal}; the diffusers reference needs a pipeline "
                           "folder (pass the folder, or --mlxdiff-only)")
    transformer = None
    if args.transformer:
        transformer = Path(args.transformer).expanduser()
        if not transformer.is_file():
            raise MlxdiffError(f"--transformer {args.transformer}: no such file")
        if not path.is_dir():
            raise MlxdiffError(f"--transformer with the single file {path.name}: the diffusers reference needs a "
                               "pipeline folder (it reads the transformer's config there); pass the folder")
    _make_out(out)      # after the model's checks (a mistake there leaves no empty folder), before any run
    prompt = args.prompt
    if prompt is None:
        is_default = path.resolve() == default_model.FOLDER.resolve()
        prompt = default_model.PROMPT if is_default else "a photo of a fox in the snow"
    mlx_cmd = [sys.executable, "-m", "mlxdiff.generate", "--model", model, "--prompt", prompt, "--width",
               str(args.width), "--height", str(args.height), "--steps", str(args.steps), "--no-progress",
               "--report-memory", "--output", str(out / "mlxdiff.png")]
    if args.guidance is not None:
        mlx_cmd += ["--guidance", str(args.guidance)]
    if transformer:
        mlx_cmd += ["--transformer", str(transformer)]
    if args.quantize:
        mlx_cmd += ["--quantize", args.quantize]
    request = {"model": str(path), "prompt": prompt, "size": args.width, "width": args.width, "height": args.height,
               "steps": args.steps}
    if args.guidance is not None:
        request["guidance"] = args.guidance
    if transformer:
        request["transformer"] = str(transformer)
    if args.reference_dtype is not None:
        request["dtype"] = args.reference_dtype
    ref = lambda mode: [sys.executable, "-m", module, json.dumps({**request, "mode": mode})]
    if not args.mlxdiff_only and args.reference_dtype != "float32" and sys.platform.startswith("linux"):
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
        warning = slow_reference_warning(path, transformer, cpuinfo, _torch_on_cpu)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    runs = {"mlxdiff": sample(mlx_cmd, args.interval, {"MLXDIFF_PHASE_MARKERS": "1"}, echo=False)}
    if not args.mlxdiff_only:
        runs["diffusers as is"] = sample(ref("as_is"), args.interval, echo=False)
        if not args.no_sequential:
            runs["diffusers sequential"] = sample(ref("sequential"), args.interval, echo=False)
    for label, run in runs.items():
        if run["rc"] != 0:
            raise MlxdiffError(f"{label} run failed (exit {run['rc']}): {run['stderr_tail'][-500:]}")
    summaries, text = table(runs, mlx_on_gpu=not backend.on_cpu())
    print(measured(runs, args.interval))
    print(text)
    write_text(out / "footprint.json", json.dumps({"measured": measured(runs, args.interval), "runs": runs,
                                                   "summaries": summaries}, indent=1))
    print(f"timeline: {timeline(runs, out / 'timeline.png')}; raw: {out / 'footprint.json'}")
    return 0


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m mlxdiff.footprint", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--interval", type=float, default=0.2)
    r.add_argument("--json", default=None)
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare")
    c.add_argument("--model", default=None, help="pipeline folder, cached hub id or SD3.5 single file "
                                                  "(default: the embedded default model)")
    c.add_argument("--prompt", default=None)
    c.add_argument("--guidance", type=float, default=None, help="default: each family's (as mlxdiff.generate)")
    c.add_argument("--transformer", default=None)
    c.add_argument("--quantize", default=None)
    c.add_argument("--width", type=int, default=512)
    c.add_argument("--height", type=int, default=512)
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--interval", type=float, default=0.25)
    c.add_argument("--out", default="footprint-out")
    c.add_argument("--reference-dtype", default=None, help="what diffusers loads and computes in (SD 1.x / SDXL "
                   "only): bfloat16 (default) or float32, for a CPU without bf16 units")
    c.add_argument("--mlxdiff-only", action="store_true")
    c.add_argument("--no-sequential", action="store_true", help="leave out diffusers' sequential recipe")
    sh = sub.add_parser("show", help="print a saved compare's table again (its footprint.json)")
    sh.add_argument("json")
    args = p.parse_args(argv)

    def work():
        if args.what == "show":
            return show(args.json)
        check_number("interval", args.interval)
        if args.what == "compare":
            return compare(args)
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            raise MlxdiffError("footprint run: give a command after --")
        if args.json:
            check_writable(args.json, "--json", "footprint.json")               # before the run, not after it
        run_ = sample(cmd, args.interval)
        s = summarize(run_)
        print(f"{', '.join(run_['measured']) or 'process memory'}: peak {s['peak'] / GB:.2f} GB over {run_['samples'][-1][0] if run_['samples'] else 0:.1f} s; "
              + ", ".join(f"{k}: {v['peak'] / GB:.2f} GB" for k, v in s["phases"].items() if v["peak"]))
        if args.json:
            write_text(args.json, json.dumps({"run": run_, "summary": s}, indent=1))
        return run_["rc"]
    return cli.run(work)


if __name__ == "__main__":
    cli.main_exit(main)
