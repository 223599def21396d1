"""LoRAs on the transformer: load with `loras=[(file, scale)]`, or add one to a pipeline with `pipe.load_lora`;
with keep="all" the kept transformer is changed in place (no reload) by load_lora and unload_loras.

    python examples/lora.py [LORA.safetensors [MODEL]]

Without a LoRA file, a random one in kohya's naming is written for the embedded default model (weights/klein-shapes),
so that the script runs anywhere; it changes the image, not for the better.
"""

import json
import sys

import numpy as np

import mlxdiff
import mlx.core as mx
from mlxdiff import default_model


def random_kohya_lora(path, folder, rank=4, alpha=4.0, seed=0):
    """lora_unet_<BFL name>.lora_down / .lora_up / .alpha for every double-block attention of a FLUX.2 folder."""
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg["num_layers"]):
        for name, rows in ((f"double_blocks_{i}_img_attn_qkv", 3 * dim), (f"double_blocks_{i}_img_attn_proj", dim)):
            tensors[f"lora_unet_{name}.lora_down.weight"] = mx.array(rng.normal(0, 0.3, (rank, dim)), mx.float32)
            tensors[f"lora_unet_{name}.lora_up.weight"] = mx.array(rng.normal(0, 0.3, (rows, rank)), mx.float32)
            tensors[f"lora_unet_{name}.alpha"] = mx.array(alpha)
    mx.save_safetensors(str(path), tensors)
    return path


def main(lora_file=None, model=None):
    model = model or default_model.folder()
    if lora_file is None:
        lora_file = random_kohya_lora("random-lora.safetensors", default_model.FOLDER)
    prompt = "a large red circle on the left on a white background"
    pipe = mlxdiff.load(model, loras=[(lora_file, 0.5)], keep="all")
    pipe.generate(prompt, seed=1, progress_bar=False).image.save("lora-0.5.png")
    pipe.load_lora(lora_file, scale=0.5)             # the same file again: 0.5 + 0.5, on the kept transformer
    pipe.generate(prompt, seed=1, progress_bar=False).image.save("lora-1.0.png")
    pipe.unload_loras().generate(prompt, seed=1, progress_bar=False).image.save("lora-none.png")
    pipe.release()
    print("images written to lora-0.5.png, lora-1.0.png and lora-none.png")


if __name__ == "__main__":
    main(*sys.argv[1:3])
