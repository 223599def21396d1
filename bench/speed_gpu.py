"""Whole images, one side per process, on the same random real-config folder: mlxdiff, diffusers, mflux.

    python bench/speed_gpu.py mlxdiff   FOLDER [--transformer F.gguf] [--quantize text_encoder=4] [--keep auto]
    python bench/speed_gpu.py diffusers FOLDER [--transformer F.gguf]
    python bench/speed_gpu.py mlxdiff|diffusers SDXL_FOLDER --controlnet DIR [--control-scale 1.0]   # one ControlNet
    python bench/speed_gpu.py mflux     FOLDER                 # klein-4B only (mflux's Flux2Klein)
    python bench/speed_gpu.py table LOG...                      # the markdown table of RESULTS.md from the logs

Each side prints one RESULT json line. The times are wall clock around whole calls, after the device finished
(mx.synchronize / torch.cuda.synchronize), so lazy graphs (MLX) are timed by their compute, not their building:
- warmup_s (MLX sides): a first image in a throwaway pipeline (MLX's CUDA kernels are compiled at run time on first
  use; the rows below come after it, in a new pipeline object, so they do not include that compilation); diffusers
  has no such run, its one-off CUDA set-up is inside its first_s;
- first_s: load + the first image (prompt A, seed 1); second_same_s: prompt A, seed 2; second_new_s: prompt B;
- step_s: seconds per denoising step of the second image (mlxdiff: its denoise phase / steps, components kept;
  diffusers: the median gap between step callbacks);
- mlxdiff also runs keep="none" (everything loaded again, the prompt cache kept): second_none_s, beside the bound
  compute + bytes re-read / read bandwidth, the bandwidth measured here by reading those files once more;
- peak_gb: MLX peak (mx.get_peak_memory) / torch max_memory_allocated over the measured images.
With --controlnet (SDXL): one ControlNet (mlxdiff: load(controlnets=) + generate(control_images=); diffusers:
StableDiffusionXLControlNetPipeline) and the same synthetic control image on both sides (control_image()).
Random weights: only memory and speed mean anything. Used for bench/RESULTS.md, "Speed".
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GB = 1024 ** 3
PROMPT_A, PROMPT_B = "a photo of a fox in the snow", "a watercolor painting of a lighthouse by the sea"


def family(folder):
    index = json.loads((Path(folder) / "model_index.json").read_text())
    cls = index["_class_name"]
    if cls == "StableDiffusion3Pipeline":
        return cls, 7.0
    if cls in ("StableDiffusionXLPipeline", "StableDiffusionPipeline"):   # diffusers' default guidance_scale
        return cls, 5.0 if cls == "StableDiffusionXLPipeline" else 7.5
    return cls, 1.0 if index.get("is_distilled") else 4.0


def control_image(size):
    """The fixed synthetic control image both sides take: white edges on black (a canny map's look): a square's
    outline, a circle and a diagonal, 3 px wide, drawn at `size` x `size`."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (size, size), "black")
    draw = ImageDraw.Draw(img)
    draw.rectangle([size // 8, size // 8, size * 5 // 8, size * 5 // 8], outline="white", width=3)
    draw.ellipse([size * 3 // 8, size * 3 // 8, size * 7 // 8, size * 7 // 8], outline="white", width=3)
    draw.line([0, size - 1, size - 1, 0], fill="white", width=3)
    return img


def read_bandwidth(files) -> float:
    """Bytes per second reading `files` (the page cache warm, as for a second image)."""
    t, n = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t)


def warm_then_first(load_warm, load, image):
    """The MLX sides: a throwaway image that compiles MLX's CUDA kernels (its own load included), then a fresh load
    and the first image. Returns (warm-up s, first s, the loaded pipeline, the first image's image() result)."""
    import mlx.core as mx
    t = time.perf_counter()
    warm = load_warm()
    image(warm, PROMPT_A, 0)
    warmup = time.perf_counter() - t
    del warm
    mx.clear_cache()
    mx.reset_peak_memory()
    t = time.perf_counter()
    pipe = load()
    result = image(pipe, PROMPT_A, 1)
    return warmup, time.perf_counter() - t, pipe, result


def run_mlxdiff(a):
    import mlxdiff
    import mlx.core as mx
    cls, guidance = family(a.folder)
    quantize = None
    if a.quantize:   # the CLI's form: component=bits,component=bits
        quantize = {k: int(v) for k, v in (item.split("=") for item in a.quantize.split(","))}
    kw = dict(transformer=a.transformer, quantize=quantize)
    gen = dict(width=a.size, height=a.size, steps=a.steps, guidance=guidance, progress_bar=False)
    if a.controlnet:
        kw["controlnets"] = [(a.controlnet, a.control_scale)]
        gen["control_images"] = [control_image(a.size)]

    def image(pipe, prompt, seed):
        t = time.perf_counter()
        r = pipe.generate(prompt, seed=seed, **gen)
        mx.synchronize()
        return time.perf_counter() - t, r

    warmup, first, pipe, (_, r1) = warm_then_first(lambda: mlxdiff.load(a.folder, keep="none", **kw),
                                                   lambda: mlxdiff.load(a.folder, keep=a.keep, **kw), image)
    same, r2 = image(pipe, PROMPT_A, 2)
    new, r3 = image(pipe, PROMPT_B, 3)
    peak = mx.get_peak_memory()
    out = {"side": "mlxdiff", "class": cls, "backend": f"mlx {mx.__version__} {mx.default_device()}",
           "keep": a.keep, "compile_blocks": os.environ.get("MLXDIFF_COMPILE_BLOCKS", "policy"),
           "in_flight": os.environ.get("MLXDIFF_IN_FLIGHT", "policy"), "size": a.size, "steps": a.steps, "warmup_s": warmup, "first_s": first,
           "second_same_s": same, "second_new_s": new, "step_s": r2.timings["denoise"] / a.steps,
           "peak_gb": peak / GB, "timings_second": r2.timings, "reused_second": r2.reused,
           "reused_new": r3.reused, "timings_first": r1.timings, "notes": r2.notes,
           "controlnet": a.controlnet and Path(a.controlnet).name, "control_scale": a.control_scale}
    # keep="none": everything but the cached prompt is loaded again for the second image
    pipe.residency.keep = "none"
    pipe.residency.clear()
    none, r4 = image(pipe, PROMPT_A, 2)
    files = [f for name in (pipe.DENOISER, "vae", *(["controlnet"] if a.controlnet else []))
             for f in pipe.components[name].files]
    if a.transformer:
        files = [Path(a.transformer)] + [f for f in files if Path(f).suffix != ".gguf"]
    nbytes = sum(Path(f).stat().st_size for f in set(map(str, files)))
    bandwidth = read_bandwidth(sorted(set(map(str, files))))
    bound = same + nbytes / bandwidth
    out.update(second_none_s=none, reused_none=r4.reused, timings_none=r4.timings, reread_gb=nbytes / GB,
               read_gb_per_s=bandwidth / GB, none_bound_s=bound, none_vs_bound=none / bound)
    print("RESULT" + json.dumps(out), flush=True)


def run_diffusers(a):
    import torch
    from diffusers import DiffusionPipeline
    cls, guidance = family(a.folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"      # cpu: a check of this code on a small folder
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    encode = {}
    if cls.startswith("Flux2"):    # what mlxdiff reads from model_index.json (taps, max_sequence_length)
        from mlxdiff.reference.flux2 import options
        encode = options(a.folder)["encode"]

    def load():
        extra = {}
        if a.transformer:
            from diffusers import Flux2Transformer2DModel, SD3Transformer2DModel
            from mlxdiff.reference import transformer_file
            tcls = SD3Transformer2DModel if cls.startswith("StableDiffusion3") else Flux2Transformer2DModel
            extra["transformer"] = transformer_file.load(tcls, a.transformer, a.folder, torch.bfloat16)
        if a.controlnet:
            from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline
            net = ControlNetModel.from_pretrained(a.controlnet, torch_dtype=torch.bfloat16)
            return StableDiffusionXLControlNetPipeline.from_pretrained(a.folder, controlnet=net,
                                                                       torch_dtype=torch.bfloat16).to(dev)
        return DiffusionPipeline.from_pretrained(a.folder, torch_dtype=torch.bfloat16, **extra).to(dev)

    stamps = []
    if a.controlnet:
        encode = dict(encode, image=control_image(a.size), controlnet_conditioning_scale=a.control_scale)

    def on_step(pipe, i, t, kwargs):
        sync()
        stamps.append(time.perf_counter())
        return kwargs

    def image(pipe, prompt, seed):
        stamps.clear()
        t = time.perf_counter()
        stamps.append(t)
        pipe(prompt=prompt, width=a.size, height=a.size, num_inference_steps=a.steps, guidance_scale=guidance,
             generator=torch.Generator(dev).manual_seed(seed), callback_on_step_end=on_step, **encode)
        sync()
        return time.perf_counter() - t

    # no throwaway pipeline: torch compiles nothing at run time; its one-off CUDA / cuBLAS set-up is in first_s
    warmup = None
    t = time.perf_counter()
    pipe = load()
    pipe.set_progress_bar_config(disable=True)
    image(pipe, PROMPT_A, 1)
    first = time.perf_counter() - t
    same = image(pipe, PROMPT_A, 2)
    gaps = [b - a_ for a_, b in zip(stamps[1:], stamps[2:])]   # steps 2.. (the first gap includes the encoder)
    new = image(pipe, PROMPT_B, 3)
    print("RESULT" + json.dumps({
        "side": "diffusers", "class": cls, "backend": f"torch {torch.__version__} {dev}", "size": a.size,
        "steps": a.steps, "warmup_s": warmup, "first_s": first, "second_same_s": same, "second_new_s": new,
        "step_s": statistics.median(gaps) if gaps else None,
        "peak_gb": torch.cuda.max_memory_allocated() / GB if dev == "cuda" else None,
        "controlnet": a.controlnet and Path(a.controlnet).name, "control_scale": a.control_scale}), flush=True)


def run_mflux(a):
    import mlx.core as mx
    from mflux.models.common.config.model_config import ModelConfig
    from mflux.models.flux2.variants.txt2img.flux2_klein import Flux2Klein
    cls, guidance = family(a.folder)

    def image(model, prompt, seed):
        t = time.perf_counter()
        out = model.generate_image(seed=seed, prompt=prompt, num_inference_steps=a.steps, height=a.size,
                                   width=a.size, guidance=guidance)
        mx.eval(mx.array(0))
        mx.synchronize()
        _ = out.image
        return time.perf_counter() - t

    load = lambda: Flux2Klein(model_config=ModelConfig.flux2_klein_4b(), model_path=a.folder)
    warmup, first, model, _ = warm_then_first(load, load, image)
    same = image(model, PROMPT_A, 2)
    new = image(model, PROMPT_B, 3)
    print("RESULT" + json.dumps({
        "side": "mflux", "class": cls, "backend": f"mflux 0.24.0, mlx {mx.__version__} {mx.default_device()}",
        "size": a.size, "steps": a.steps, "warmup_s": warmup, "first_s": first, "second_same_s": same,
        "second_new_s": new, "step_s": None, "peak_gb": mx.get_peak_memory() / GB}), flush=True)


def table(logs):
    rows = [dict(json.loads(line[len("RESULT"):]), log=Path(log).stem) for log in logs
            for line in Path(log).read_text().splitlines() if line.startswith("RESULT") and '"warmup_s"' in line]
    for r in rows:   # the ControlNet rows apart from the plain ones (after them, their model named so)
        if r.get("controlnet"):
            r["class"] += f" + ControlNet {r['controlnet']} (scale {r['control_scale']:g})"
    rows.sort(key=lambda r: bool(r.get("controlnet")))
    f = lambda v: "-" if v is None else f"{v:.2f}"
    print("| model | side | first image (load + image) | second, same prompt | second, new prompt | s/step | "
          "peak GiB | kernel warm-up image |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        print(f"| {r['class']} | {r['log']}{' keep=' + r['keep'] if 'keep' in r else ''} | {f(r['first_s'])} | "
              f"{f(r['second_same_s'])} | {f(r['second_new_s'])} | {step} | {f(r['peak_gb'])} | {f(r['warmup_s'])} |")
        if "second_none_s" in r:
            print(f"| {r['class']} | {r['log']} keep=none (second, same prompt) | | {f(r['second_none_s'])} | | | | "
                  f"bound {f(r['none_bound_s'])} s ({r['reread_gb']:.1f} GiB at {r['read_gb_per_s']:.1f} GiB/s): "
                  f"{r['none_vs_bound']:.2f}x |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers", "mflux", "table"))
    p.add_argument("folder", nargs="+")
    p.add_argument("--transformer")
    p.add_argument("--quantize")
    p.add_argument("--keep", default="auto")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--controlnet", help="an SDXL ControlNet folder (diffusers layout): one ControlNet on both sides")
    p.add_argument("--control-scale", type=float, default=1.0)
    a = p.parse_args()
    if a.side == "table":
        table(a.folder)
    else:
        a.folder = a.folder[0]
        {"mlxdiff": run_mlxdiff, "diffusers": run_diffusers, "mflux": run_mflux}[a.side](a)
