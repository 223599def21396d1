"""Embedding mlxdiff in an app: load once, encode prompts separately, generate with a progress callback.

    python examples/embed_in_app.py [MODEL]      (default: the embedded default model, weights/klein-shapes)
"""

import sys
import time

import mlxdiff
from mlxdiff import default_model


def main(model=None):
    pipe = mlxdiff.load(model or default_model.folder())   # resolves files and configs only; weights load per phase
    cond = pipe.encode_prompt("a large yellow triangle at the top on a black background")  # encoder loads, runs, frees

    def on_step(step, timestep, latents):   # called after every denoising step with MLX latents
        if step % 10 == 9:
            print(f"  step {step + 1}: t={timestep:.3f}")

    start = time.perf_counter()
    result = pipe.generate(conditioning=cond, seed=3, callback=on_step, progress_bar=False)   # the model's defaults
    result.image.save("embedded.png")
    print(f"{time.perf_counter() - start:.1f} s; phases: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items()) + "; image written to embedded.png")
    print(result.memory_report())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
