"""Embedding mlxdiff in an app: load once, encode prompts separately, generate with a progress callback.

    python examples/embed_in_app.py [MODEL]      (default: the embedded default model)
"""

import sys
import time

import mlxdiff
from mlxdiff import default_model


def main(model=None):
    model = model or default_model.ensure()
    pipe = mlxdiff.load(model)          # resolves files and configs only; weights load per phase
    cond = pipe.encode_prompt("a red circle on a blue background", "blurry")   # text encoders load, run, free

    def on_step(step, timestep, latents):   # called after every denoising step with MLX latents
        print(f"  step {step + 1}: t={timestep:.1f}")

    start = time.perf_counter()
    result = pipe.generate(conditioning=cond, width=256, height=256, steps=8, guidance=4.0, seed=3,
                           callback=on_step, progress_bar=False)
    result.image.save("embedded.png")
    print(f"{time.perf_counter() - start:.1f} s; phases: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items()))
    print(result.memory_report())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
