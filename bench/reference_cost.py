"""What FLUX.2 reference images cost: the same run with 0, 1, 2, ... references, per run the "reference" phase (the
VAE encoding them) and the denoise phase, seconds and MLX peak above the phase's weights.

    python bench/reference_cost.py [--model weights/klein-shapes] [--size 256] [--steps 4] [--max-refs 2]

References are random images of the output size (size/16 squared tokens each). On the CPU the denoise peak follows
MLX's attention scores, heads x sequence^2 float32 (klein-shapes, 6 heads: 1088 -> 2112 -> 3136 tokens).
"""

import argparse

import numpy as np
import PIL.Image

import mlxdiff
from mlxdiff import default_model


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(default_model.FOLDER))
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-refs", type=int, default=2)
    args = p.parse_args()
    pipe = mlxdiff.load(args.model)
    rng = np.random.default_rng(0)
    refs = [PIL.Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
            for _ in range(args.max_refs)]
    kw = dict(width=args.size, height=args.size, steps=args.steps, seed=1, progress_bar=False)
    pipe.generate("a red circle", **kw)   # warm-up
    mib = lambda m: (m["peak"] - m["floor"]) / 2 ** 20
    for n in range(args.max_refs + 1):
        r = pipe.generate("a red circle", image=refs[:n] or None, **kw)
        line = f"{n} references: denoise {r.timings['denoise']:.2f} s, {mib(r.memory['denoise']):.1f} MiB above weights"
        if n:
            line += (f"; reference phase {r.timings['reference']:.2f} s, {mib(r.memory['reference']):.1f} MiB above "
                     "the VAE weights")
        print(line, flush=True)


if __name__ == "__main__":
    main()
