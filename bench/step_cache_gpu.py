"""Step caching (`--cache first-block[:T]`, mlxdiff/pipelines/step_cache.py) at the real configs, random weights.

    python bench/step_cache_gpu.py mlxdiff   FOLDER [--steps 28] [--out run.json]
    python bench/step_cache_gpu.py diffusers FOLDER --threshold T [--steps 28] [--out run.json]
    python bench/step_cache_gpu.py compare   MLX.json DIFFUSERS.json

mlxdiff side, one pipeline with every component kept (a throwaway image first: MLX's CUDA kernels compile on first
use), 1024x1024, the same prompt and injected noise:
- uncached: the denoise phase's seconds (the baseline);
- `first-block` at diffusers' default threshold (0.05): what it skips and costs on these weights;
- `first-block:1e-9`: every forward computed, the first block's relative change recorded at each (the note's spread),
  so that a threshold T_mid at its median makes about half of the forwards skip on random weights (whose changes
  are far larger than a trained model's: no real skip rate is claimed from them);
- `first-block:T_mid`: time per image, forwards skipped, the image's largest difference from the uncached one;
- `first-block:1e9`: every forward after the first skipped: the cost of a skipped forward (first block + output);
- `taylorseer`, `taylorseer:3:1`, `taylorseer:5:2` (--taylorseer): forwards predicted, time per image, the image's
  mean and largest difference from the uncached one.
diffusers side: diffusers' hook with the tail mended as tests/test_step_cache.py does (diffusers#14359), same
folder and noise, at T_mid: which forwards it skips (compare: against ours, bf16 both).
Each side prints one RESULT json line. Used for bench/RESULTS.md, "Step caching".
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PROMPT = "a photo of a fox in the snow"
SIZE = 1024


def guidance_of(folder):
    index = json.loads((Path(folder) / "model_index.json").read_text())
    if index["_class_name"] == "StableDiffusion3Pipeline":
        return 7.0
    return 1.0 if index.get("is_distilled") else 4.0


def noise_of(folder, size):
    """The injected initial latents both sides start from, in diffusers' layout at SIZE."""
    config = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    vae = json.loads((Path(folder) / "vae" / "config.json").read_text())
    # the VAE's factor; FLUX.2's latents also come in 2x2 patches
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * (1 if "pos_embed_max_size" in config else 2)
    shape = (1, config["in_channels"], size // factor, size // factor)
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


def run_mlxdiff(args):
    import mlxdiff      # first: on the CPU, OpenBLAS takes over mlx-cpu's matmuls (mlxdiff/backend.py)
    import mlx.core as mx
    guidance, noise = guidance_of(args.folder), noise_of(args.folder, args.size)
    pipe = mlxdiff.load(args.folder, dtype="bfloat16", keep="all")
    pipe.generate(PROMPT, width=args.size, height=args.size, steps=2, guidance=guidance, seed=0, progress_bar=False)

    def image(cache):
        mx.synchronize()
        start = time.perf_counter()
        result = pipe.generate(PROMPT, width=args.size, height=args.size, steps=args.steps, guidance=guidance, latents=noise,
                               cache=cache, progress_bar=False)
        mx.synchronize()
        return result, time.perf_counter() - start

    base, base_s = image(None)
    base_img = np.asarray(base.image).astype(np.int16)
    rows = {"uncached": {"image_s": base_s, "denoise_s": base.timings["denoise"]}}
    probe, _ = image("first-block:1e-9")
    changes = sorted(x for values in probe.cache_changes.values() for x in values)
    # halfway between two distinct changes near the median: no forward sits on the threshold (bf16 ratios repeat)
    above = [x for x in changes if x > changes[len(changes) // 2]] if changes else []
    t_mid = (changes[len(changes) // 2] + above[0]) / 2 if above else 1.0
    for name, cache in [("default", "first-block"), ("t_mid", f"first-block:{t_mid:.6g}"), ("all", "first-block:1e9")]:
        result, seconds = image(cache)
        rows[name] = {"cache": cache, "image_s": seconds, "denoise_s": result.timings["denoise"],
                      "skipped": result.cached_steps, "note": result.notes[-1],
                      "image_max_levels": int(np.abs(np.asarray(result.image).astype(np.int16) - base_img).max())}
    for cache in args.taylorseer:     # forwards predicted on a fixed schedule (no threshold to calibrate)
        result, seconds = image(cache)
        diff = np.abs(np.asarray(result.image).astype(np.int16) - base_img)
        rows[cache] = {"cache": cache, "image_s": seconds, "denoise_s": result.timings["denoise"],
                       "skipped": result.cached_steps, "note": result.notes[-1],
                       "image_max_levels": int(diff.max()), "image_mean_levels": round(float(diff.mean()), 3)}
    out = {"side": "mlxdiff", "folder": str(args.folder), "steps": args.steps, "guidance": guidance,
           "t_mid": float(f"{t_mid:.6g}"), "changes": changes, "rows": rows}
    print("RESULT" + json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out))


def run_diffusers(args):
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from step_cache_helpers import FirstBlockCacheRecorder

    class Patch:
        def setattr(self, owner, name, value):
            setattr(owner, name, value)

    guidance = guidance_of(args.folder)
    index = json.loads((Path(args.folder) / "model_index.json").read_text())
    taps = {k: index[k] for k in ("text_encoder_out_layers", "max_sequence_length") if k in index}
    if taps:     # the embedded default's own settings (a check of this script), which diffusers does not read
        taps["text_encoder_out_layers"] = tuple(taps["text_encoder_out_layers"])
    pipe = DiffusionPipeline.from_pretrained(args.folder, torch_dtype=torch.bfloat16).to(args.device)
    recorder = FirstBlockCacheRecorder(Patch(), pipe.transformer, args.threshold)
    _set_cache_context(pipe.transformer, CacheContext("cond"))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    pipe(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=guidance,
         latents=torch.from_numpy(noise_of(args.folder, args.size)).to(args.device, torch.bfloat16), **taps)
    sync()
    out = {"side": "diffusers", "threshold": args.threshold, "image_s": time.perf_counter() - start,
           "skipped": recorder.steps()}
    print("RESULT" + json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out))


def compare(a, b):
    ours, theirs = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    mine = ours["rows"]["t_mid"]["skipped"]
    counts = {k: len(v) for k, v in mine.items()}
    print("RESULT" + json.dumps({"t_mid": ours["t_mid"], "mlxdiff": mine, "diffusers": theirs["skipped"],
                                 "same_forwards": mine == theirs["skipped"], "skipped": counts}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=("mlxdiff", "diffusers", "compare"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--out", default=None)
    p.add_argument("--size", type=int, default=SIZE)
    p.add_argument("--device", default="cuda", help="diffusers' device (cpu: a check of this script)")
    p.add_argument("--taylorseer", nargs="*", default=["taylorseer", "taylorseer:3:1", "taylorseer:5:2"],
                   help="mlxdiff side: TaylorSeer specs run after the first-block rows")
    args = p.parse_args()
    if args.side == "compare":
        return compare(*args.paths)
    args.folder = args.paths[0]
    (run_mlxdiff if args.side == "mlxdiff" else run_diffusers)(args)


if __name__ == "__main__":
    main()
