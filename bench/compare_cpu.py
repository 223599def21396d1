"""A real-config pipeline (random bf16 weights), mlxdiff beside diffusers, on the same files, on this CPU.

    python bench/make_random_models.py sd3.5-medium          # once: ~16 GB under weights/
    python bench/compare_cpu.py --model weights/bench-sd3.5-medium-random [--size 512] [--steps 2]
    python bench/make_random_models.py klein-4b              # once: ~16 GB
    python bench/compare_cpu.py --model weights/bench-klein-4b-random --steps 1 --guidance 1

Each path runs in its own process. Reported per phase: seconds and peak process RSS (VmHWM, reset at every phase
start via /proc/self/clear_refs), plus MLX's own peak for mlxdiff. diffusers runs as is (from_pretrained in bf16,
everything resident), the way people run it; on the CPU it computes in bf16, mlxdiff in float32 over bf16 weights.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1024 ** 3

MLXDIFF_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import mlxdiff
import numpy as np
args = json.loads(sys.argv[1])
from mlxdiff.cli import parse_quantize
pipe = mlxdiff.load(args["model"], quantize=parse_quantize(args.get("quantize")))
size, steps = args["size"], args["steps"]
shape = (1, 16, size // 8, size // 8) if pipe.family == "sd3" else (1, 128, size // 16, size // 16)
r = pipe.generate("a photo of a fox in the snow", width=size, height=size, steps=steps, guidance=args["guidance"],
                  latents=np.random.default_rng(0).standard_normal(shape).astype(np.float32), progress_bar=False)
den = r.timings["denoise"] - r.load_seconds.get("transformer", 0)
out = {"timings": r.timings, "load_seconds": r.load_seconds, "memory": r.memory,
       "seconds_per_step": den / steps, "total": time.perf_counter() - t0,
       "finite": bool(np.isfinite(r.latents).all())}
print("RESULT" + json.dumps(out))
"""

DIFFUSERS_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, torch
import diffusers
sys.path.insert(0, sys.argv[2])
from mlxdiff.memory import reset_footprint_peak, process_footprint
args = json.loads(sys.argv[1])
timings, memory = {}, {}
def mark(name, start):
    timings[name] = time.perf_counter() - start
    memory[name] = {"footprint_peak": process_footprint()["peak"], "footprint": process_footprint()["footprint"]}
index = json.load(open(args["model"] + "/model_index.json"))
cls = getattr(diffusers, index["_class_name"])
sd3 = index["_class_name"] == "StableDiffusion3Pipeline"
reset_footprint_peak(); s = time.perf_counter()
pipe = cls.from_pretrained(args["model"], torch_dtype=torch.bfloat16)
mark("load", s)
size, steps, g = args["size"], args["steps"], args["guidance"]
prompt = "a photo of a fox in the snow"
reset_footprint_peak(); s = time.perf_counter()
with torch.no_grad():
    if sd3:
        pe, npe, pp, npp = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=g > 1)
        cond = dict(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=pp,
                    negative_pooled_prompt_embeds=npp)
    else:
        pe, _ = pipe.encode_prompt(prompt)
        cond = dict(prompt_embeds=pe)
mark("encode", s)
shape = (1, 16, size // 8, size // 8) if sd3 else (1, 128, size // 16, size // 16)
lat = torch.from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
reset_footprint_peak(); s = time.perf_counter()
with torch.no_grad():
    lat_out = pipe(**cond, height=size, width=size, num_inference_steps=steps, guidance_scale=g, latents=lat,
                   output_type="latent").images
mark("denoise", s)
reset_footprint_peak(); s = time.perf_counter()
with torch.no_grad():
    z = lat_out / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor if sd3 else lat_out
    img = pipe.vae.decode(z, return_dict=False)[0]
mark("decode", s)
out = {"timings": timings, "memory": memory, "seconds_per_step": timings["denoise"] / steps,
       "total": time.perf_counter() - t0, "finite": bool(torch.isfinite(img.float()).all())}
print("RESULT" + json.dumps(out))
"""


def run_child(code, args, extra=()):
    p = subprocess.run([sys.executable, "-c", code, json.dumps(args), *extra], capture_output=True, text=True,
                       cwd=ROOT)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    if not lines:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        raise SystemExit("child failed")
    return json.loads(lines[0][6:])


def fmt(n):
    return "-" if n is None else f"{n / GB:.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "weights" / "bench-sd3.5-medium-random"))
    ap.add_argument("--guidance", type=float, default=7.0)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--quantize", default=None, help="mlxdiff side only, as the CLI's --quantize "
                                                      "(e.g. text_encoder_3=8)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    args = {"model": str(Path(a.model).resolve()), "size": a.size, "steps": a.steps, "guidance": a.guidance,
            "quantize": a.quantize}
    results = {"mlxdiff": run_child(MLXDIFF_CHILD, args)}
    if not a.skip_diffusers:
        results["diffusers"] = run_child(DIFFUSERS_CHILD, args, [str(ROOT)])
    import mlx.core as mx
    print(f"{Path(a.model).name}: real config, random bf16 weights, {a.size}x{a.size}, {a.steps} steps, "
          f"guidance {a.guidance}" + (f", mlxdiff --quantize {a.quantize}" if a.quantize else ""))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.1f} GiB; mlx {mx.__version__} (CPU, "
          f"float32 compute, OpenBLAS); diffusers bf16 on torch CPU\n")
    print("| phase | mlxdiff s | mlxdiff peak RSS GB | mlxdiff MLX peak GB | diffusers s | diffusers peak RSS GB |")
    print("|---|---|---|---|---|---|")
    m, d = results["mlxdiff"], results.get("diffusers", {"timings": {}, "memory": {}})
    for ph in ("load", "encode", "denoise", "decode"):
        mm = m["memory"].get(ph, {})
        dm = d["memory"].get(ph, {})
        ms = m["timings"].get(ph)
        ds = d["timings"].get(ph)
        print(f"| {ph} | {'-' if ms is None else f'{ms:.1f}'} | {fmt(mm.get('footprint_peak'))} | {fmt(mm.get('peak'))} "
              f"| {'-' if ds is None else f'{ds:.1f}'} | {fmt(dm.get('footprint_peak'))} |")
    mpk = max(v.get("footprint_peak") or 0 for v in m["memory"].values())
    line = f"\nmlxdiff: overall peak RSS {mpk / GB:.2f} GB, {m['seconds_per_step']:.1f} s/step (denoise minus load), " \
           f"transformer load {m['load_seconds'].get('transformer', 0):.1f} s"
    if d["memory"]:
        dpk = max(v.get("footprint_peak") or 0 for v in d["memory"].values())
        line += f"\ndiffusers: overall peak RSS {dpk / GB:.2f} GB, {d['seconds_per_step']:.1f} s/step, " \
                f"load {d['timings']['load']:.1f} s\nratio (mlxdiff / diffusers): peak {mpk / dpk:.2f}, " \
                f"s/step {m['seconds_per_step'] / d['seconds_per_step']:.2f}"
    print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
