"""Streaming below the weights, one image per process (bench/RESULTS.md, "Streaming below the weights").

    python bench/streaming_gpu.py run FOLDER [--transformer F.gguf] [--memory-limit GB] [--size 1024] [--steps 4]
                                      [--guidance G] [--negative-prompt TEXT] --out DIR
    python bench/streaming_gpu.py compare DIR_A DIR_B      # same latents? (0 levels of difference in the image)
    python bench/streaming_gpu.py rate FILE...             # read rate of files (bytes / s), as the run reads them

`run`: a throwaway image at the same size with 1 step (--warmup-steps; MLX's CUDA kernels are compiled at run time
on first use), then the measured image (--steps, default 4, seed 1, keep="none"; --guidance and --negative-prompt
go to both images when given: Z-Image-Turbo runs with --steps 8 --guidance 0, Qwen-Image's true CFG needs a
negative prompt) in a new pipeline object; writes latents.npy, image.png and
result.json (timings, the transformer's load seconds, s/step = (denoise - load) / steps, memory per phase, notes)
to DIR and prints one RESULT json line. Run it under `python -m mlxdiff.footprint run` for the whole process's
memory. Random weights: only memory and speed mean anything.

CPU chain check at tiny size (issue 40's folders; bench/make_random_models.py *-tiny):
    python bench/make_random_models.py zimage-turbo-tiny --out /tmp/zt
    python bench/streaming_gpu.py run /tmp/zt --size 64 --steps 2 --guidance 0 --out /tmp/zt_none
    python bench/streaming_gpu.py run /tmp/zt --size 64 --steps 2 --guidance 0 --memory-limit 0.01 --out /tmp/zt_lim
    python bench/streaming_gpu.py compare /tmp/zt_none /tmp/zt_lim
and the same with qwen-image-tiny and --negative-prompt " " --warmup-steps 2 (no --guidance).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "a photo of a fox in the snow"


def record_streamed(names):
    """Appends each streamed component's plan note (loading/streaming.py) to `names`: which ran below its weights."""
    from mlxdiff.loading import streaming
    original = streaming.load_streamed

    def load_streamed(spec, *args, **kw):
        model, plan = original(spec, *args, **kw)
        names.append(plan.note(spec.name))
        return model, plan
    streaming.load_streamed = load_streamed


def run(a):
    import mlxdiff
    import mlx.core as mx
    streamed = []
    record_streamed(streamed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(transformer=a.transformer, memory_limit=a.memory_limit, keep="none")
    gen = {k: v for k, v in (("guidance", a.guidance), ("negative_prompt", a.negative_prompt)) if v is not None}
    t = time.perf_counter()
    mlxdiff.load(a.folder, **kw).generate(PROMPT, width=a.size, height=a.size, steps=a.warmup_steps, seed=0,
                                          progress_bar=False, **gen)
    mx.synchronize()
    warm = time.perf_counter() - t
    pipe = mlxdiff.load(a.folder, **kw)
    del streamed[:]     # the measured image's only
    t = time.perf_counter()
    result = pipe.generate(PROMPT, width=a.size, height=a.size, steps=a.steps, seed=1, progress_bar=False, **gen)
    mx.synchronize()
    total = time.perf_counter() - t
    np.save(out / "latents.npy", result.latents)
    result.image.save(out / "image.png")
    load = result.load_seconds.get("transformer", 0.0)
    row = {"memory_limit": a.memory_limit, "steps": a.steps, **gen, "warmup_s": warm, "image_s": total,
           "timings": result.timings,
           "transformer_load_s": load, "step_s": (result.timings["denoise"] - load) / a.steps,
           "memory": result.memory, "notes": result.notes, "streamed": streamed}
    (out / "result.json").write_text(json.dumps(row, indent=1, default=str))
    print(result.memory_report())
    print("RESULT" + json.dumps(row, default=str), flush=True)


def compare(a):
    x, y = (np.load(Path(d) / "latents.npy") for d in (a.a, a.b))
    import PIL.Image
    i, j = (np.asarray(PIL.Image.open(Path(d) / "image.png"), np.int16) for d in (a.a, a.b))
    row = {"same_latents": bool(np.array_equal(x, y)), "latents_max_abs_diff": float(np.abs(x - y).max()),
           "latents_max_rel": float(np.abs(x - y).max() / np.abs(x).max()), "image_max_levels": int(np.abs(i - j).max())}
    print("RESULT" + json.dumps(row), flush=True)


def rate(a):
    t, n = time.perf_counter(), 0
    for f in a.files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    seconds = time.perf_counter() - t
    print("RESULT" + json.dumps({"bytes": n, "seconds": seconds, "bytes_per_s": n / seconds}), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("folder")
    r.add_argument("--transformer")
    r.add_argument("--memory-limit", type=float)
    r.add_argument("--size", type=int, default=1024)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--warmup-steps", type=int, default=1, help="2 for Qwen-Image (its shift_terminal refuses 1)")
    r.add_argument("--guidance", type=float)
    r.add_argument("--negative-prompt")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    s = sub.add_parser("rate")
    s.add_argument("files", nargs="+")
    a = p.parse_args()
    {"run": run, "compare": compare, "rate": rate}[a.cmd](a)


if __name__ == "__main__":
    main()
