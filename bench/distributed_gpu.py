"""Several GPUs, one job (issue 28): what each rank holds and how fast, beside the single GPU, random weights.

    python bench/distributed_gpu.py run FOLDER [--transformer F.gguf] [--split tensor|guidance] --out DIR
    mlx.launch --backend nccl -n 2 -- python bench/distributed_gpu.py run FOLDER ... --split tensor --out DIR
    python bench/distributed_gpu.py images FOLDER --count 8 --out DIR          # alone or under mlx.launch
    python bench/distributed_gpu.py table LOGS                                 # RESULT lines as one table

Latents and images of two runs compared: `python bench/streaming_gpu.py compare DIR_A DIR_B` (the files `run` writes).

`run` measures as bench/streaming_gpu.py's does: a throwaway 1-step image (MLX's CUDA kernels are compiled on
first use in every process), then the measured image in a new pipeline (keep="none", as one CLI image runs): s/step = (denoise - transformer load) / steps, each
phase's process peak as mlxdiff reports it (NVML: this rank's process on its GPU), and the bytes the transformer
hands to all_sum / all_gather per forward, counted where the graph is built (an eager forward; a compiled block is
traced once, so the largest count over the process's forwards is one whole forward's). Rank 0 writes latents.npy
and image.png. Every rank prints one RESULT json line.

`images`: a data-parallel job of --count images of one prompt (encoded once, as the CLI does), every rank making
its share (mlxdiff.distributed.share); one untimed image first, then the ranks start together (an all_sum) and
images per second = count / the slowest rank's seconds. Random weights: only memory and speed mean anything.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from streaming_gpu import PROMPT  # noqa: E402  (bench/ is this script's folder)


class CollectiveBytes:
    """Bytes handed to mx.distributed.all_sum / all_gather inside each transformer forward (payload per rank, as
    the layers call them; a ring all-sum moves 2 (N - 1) / N of it over each rank's link)."""

    def __init__(self):
        import mlx.core as mx
        self.per_forward = []
        self.inside = False
        for name in ("all_sum", "all_gather"):
            setattr(mx.distributed, name, self._counted(getattr(mx.distributed, name)))

    def _counted(self, collective):
        def call(x, *args, **kw):
            if self.inside:
                self.per_forward[-1] += x.nbytes
            return collective(x, *args, **kw)
        return call

    def watch(self, model_class):
        counter, forward = self, model_class.__call__

        def call(model, *args, **kw):
            counter.per_forward.append(0)
            counter.inside = True
            try:
                return forward(model, *args, **kw)
            finally:
                counter.inside = False
        model_class.__call__ = call


def _load(a, group):
    import mlxdiff
    kw = dict(transformer=a.transformer, keep=a.keep)
    if a.split:
        kw.update(group=group, split=a.split)
    return mlxdiff.load(a.folder, **kw)


def _generate_kw(a, steps):
    kw = dict(width=a.size, height=a.size, steps=steps, progress_bar=False)
    if a.guidance is not None:
        kw["guidance"] = a.guidance
    return kw


def run(a):
    import mlx.core as mx
    from mlxdiff import distributed
    from mlxdiff.models import flux2, mmdit
    counter = CollectiveBytes()
    for model_class in (flux2.Model, mmdit.Model):
        counter.watch(model_class)
    group = distributed.job_group()
    rank, ranks = (group.rank(), group.size()) if group else (0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    _load(a, group).generate(PROMPT, seed=0, **_generate_kw(a, 1))
    mx.synchronize()
    warm = time.perf_counter() - t
    pipe = _load(a, group)
    t = time.perf_counter()
    result = pipe.generate(PROMPT, seed=1, **_generate_kw(a, a.steps))
    mx.synchronize()
    total = time.perf_counter() - t
    if rank == 0:
        np.save(out / "latents.npy", result.latents)
        result.image.save(out / "image.png")
    load = result.load_seconds.get("transformer", 0.0)
    row = {"rank": rank, "ranks": ranks, "split": a.split, "size": a.size, "steps": a.steps, "warmup_s": warm,
           "image_s": total, "timings": result.timings, "transformer_load_s": load,
           "step_s": (result.timings["denoise"] - load) / a.steps, "memory": result.memory,
           "collective_bytes_per_forward": max(counter.per_forward, default=0),
           "forwards_counted": len(counter.per_forward), "notes": result.notes}
    (out / f"result_rank{rank}.json").write_text(json.dumps(row, indent=1, default=str))
    print(result.memory_report())
    print("RESULT" + json.dumps(row, default=str), flush=True)


def images(a):
    import mlx.core as mx
    from mlxdiff import distributed
    group = distributed.job_group()
    rank, ranks = (group.rank(), group.size()) if group else (0, 1)
    pipe = _load(a, None)       # data-parallel: every rank the whole model, its own images
    cond = pipe.encode_prompt(PROMPT)
    pipe.generate(conditioning=cond, seed=10_000, **_generate_kw(a, 1))     # compiles the kernels: not timed
    mx.synchronize()
    if group:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))     # the ranks start together
    mine = distributed.share(a.count, group)
    t = time.perf_counter()
    for i in mine:
        pipe.generate(conditioning=cond, seed=i, **_generate_kw(a, a.steps))
    mx.synchronize()
    seconds = time.perf_counter() - t
    slowest = seconds
    if group:
        slowest = mx.distributed.all_gather(mx.array([seconds]), group=group).max().item()
    row = {"rank": rank, "ranks": ranks, "images": len(mine), "count": a.count, "size": a.size, "steps": a.steps,
           "seconds": seconds, "slowest_rank_s": slowest, "images_per_s": a.count / slowest}
    print("RESULT" + json.dumps(row), flush=True)


def table(a):
    """Every RESULT line of LOGS/*.txt, one row each (file, rank, step or image rate, per-phase process peaks)."""
    gib = 2 ** 30
    print("| log | rank | s/step or images/s | bytes per forward | process peak GiB: encode / denoise / decode |")
    print("|---|---|---|---|---|")
    for path in sorted(Path(a.logs).glob("*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("RESULT"):
                continue
            row = json.loads(line[len("RESULT"):])
            if "images_per_s" in row:
                print(f"| {path.stem} | {row['rank']}/{row['ranks']} | {row['images_per_s']:.3f} img/s "
                      f"({row['images']} here, {row['seconds']:.1f} s) | | |")
            elif "step_s" in row:
                peaks = " / ".join(f"{row['memory'].get(p, {}).get('footprint_peak', float('nan')) / gib:.2f}"
                                   for p in ("encode", "denoise", "decode"))
                print(f"| {path.stem} | {row['rank']}/{row['ranks']} | {row['step_s']:.4f} s | "
                      f"{row['collective_bytes_per_forward'] / 1e9:.3f} GB | {peaks} |")
            else:
                print(f"| {path.stem} | | {json.dumps(row)} | | |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "images"):
        s = sub.add_parser(name)
        s.add_argument("folder")
        s.add_argument("--transformer")
        s.add_argument("--size", type=int, default=1024)
        s.add_argument("--guidance", type=float)
        s.add_argument("--out", default="/tmp/distributed")
        s.add_argument("--keep", default="none" if name == "run" else "auto")
    sub.choices["run"].add_argument("--split", choices=("tensor", "guidance"))
    sub.choices["run"].add_argument("--steps", type=int, default=4)
    sub.choices["images"].add_argument("--steps", type=int, default=28)
    sub.choices["images"].add_argument("--count", type=int, default=8)
    sub.choices["images"].set_defaults(split=None)
    t = sub.add_parser("table")
    t.add_argument("logs")
    a = p.parse_args()
    {"run": run, "images": images, "table": table}[a.cmd](a)


if __name__ == "__main__":
    main()
