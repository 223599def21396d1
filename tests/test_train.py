"""The training script (tools.train_klein_shapes.train) runs end to end at a toy scale on the CPU and writes a klein pipeline
folder that both diffusers and mlxdiff load; a save-only re-run keeps the training record and the folder's notes."""

import json

import numpy as np
import torch

import mlxdiff
from tools.train_klein_shapes import train

# one step of each stage on a few images, batches of 2: the script's bookkeeping and the saved layout are under test,
# not the training (the VAE and transformer run under bf16 autocast, which crawls on this CPU: their cost is per image)
IMAGES = 8
TOY = ["--device", "cpu", "--threads", "2", "--images", str(IMAGES), "--vae-steps", "1", "--vae-batch", "2",
       "--text-steps", "1", "--transformer-steps", "1", "--transformer-batch", "2", "--no-final-eval"]


def test_toy_training_writes_a_loadable_pipeline(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    train.main(["--out", str(out), "--work", str(work), *TOY])
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["text_encoder_out_layers"] == list(train.TAPS)
    [run] = index["_training"]["runs"]
    assert run["transformer_steps"] == 1 and run["images"] == IMAGES and not run["resumed"]
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (out / name).is_dir(), name

    (out / "README.md").write_text("notes")
    train.main(["--out", str(out), "--work", str(work), *TOY, "--resume-transformer", "--transformer-steps", "0"])
    assert (out / "README.md").read_text() == "notes"
    assert json.loads((out / "model_index.json").read_text())["_training"]["runs"] == [run]
    train.main(["--out", str(out), "--work", str(work), *TOY, "--resume-transformer", "--transformer-seed", "9"])
    runs = json.loads((out / "model_index.json").read_text())["_training"]["runs"]
    assert len(runs) == 2 and runs[1]["resumed"] and runs[1]["transformer_seed"] == 9

    from diffusers import Flux2KleinPipeline
    ref = Flux2KleinPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    assert ref.transformer.config.num_single_layers == train.TRANSFORMER_CONFIG["num_single_layers"]
    image = mlxdiff.load(str(out)).generate("a red circle on the left", steps=2, progress_bar=False).image
    assert image.size == (64, 64) and np.asarray(image).std() > 0
