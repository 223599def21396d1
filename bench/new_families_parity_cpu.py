"""The bench's two sides compute the same thing: bench/forward_gpu.py's krea2-tiny / flux3-klein-tiny inputs (its
krea2_inputs / flux3_inputs: same masks, ids, timesteps) through diffusers' model and through mlxdiff's, the same
float32 weights (diffusers' randomized, saved, loaded by mlxdiff's loader with the model's sanitize, as the parity
tests do). Prints the max relative error of each forward (the tests' standard: <= 1e-4). CPU, seconds:

    python bench/new_families_parity_cpu.py
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import mlxdiff  # noqa: E402,F401  (OpenBLAS preload before mlx)
import mlx.core as mx  # noqa: E402
from diffusers import Flux3Transformer2DModel, Krea2Transformer2DModel  # noqa: E402

import forward_gpu as bench  # noqa: E402
from helpers import load_ours, max_rel_err, randomize_  # noqa: E402
from mlxdiff.models import flux3, krea2  # noqa: E402

SIZE = 64


def twins(cls, arch, cfg, folder):
    torch.manual_seed(3)
    theirs = randomize_(cls(**cfg), seed=3).eval()
    theirs.save_pretrained(folder)
    return theirs, load_ours(folder, arch)


def krea2_errors(folder):
    cfg = bench.CONFIGS["krea2-tiny"]
    theirs, ours = twins(Krea2Transformer2DModel, krea2, cfg, folder)
    img, txts, masks, ids = bench.krea2_inputs(SIZE, cfg, bench.TEXT_TOKENS["krea2-tiny"])
    t = np.array([0.5], np.float32)
    errs = []
    for txt, mask in zip(txts, masks):          # the prompt's forward, the negative's
        with torch.no_grad():
            ref = theirs(hidden_states=torch.from_numpy(img), encoder_hidden_states=torch.from_numpy(txt),
                         timestep=torch.from_numpy(t), position_ids=torch.from_numpy(ids),
                         encoder_attention_mask=torch.from_numpy(mask), return_dict=False)[0].numpy()
        out = ours(mx.array(img), mx.array(txt), mx.array(t), ids, mx.array(mask.astype(np.int32)))
        errs.append(max_rel_err(np.array(out.astype(mx.float32)), ref))
    return errs


def flux3_errors(folder):
    cfg = bench.CONFIGS["flux3-klein-tiny"]
    theirs, ours = twins(Flux3Transformer2DModel, flux3, cfg, folder)
    img, txt, img_ids, txt_ids = bench.flux3_inputs(SIZE, cfg, bench.TEXT_TOKENS["flux3-klein-tiny"])
    t, target = (np.array([v], np.float32) for v in bench.FLUX3_TIMESTEPS)
    with torch.no_grad():
        ref = theirs(hidden_states=torch.from_numpy(img), encoder_hidden_states=torch.from_numpy(txt),
                     timestep=torch.from_numpy(t), target_timestep=torch.from_numpy(target),
                     img_ids=torch.from_numpy(img_ids), txt_ids=torch.from_numpy(txt_ids), return_dict=False)[0].numpy()
    out = ours(mx.array(img), mx.array(txt), mx.array(t), mx.array(img_ids), mx.array(txt_ids),
               target_timestep=mx.array(target))
    return [max_rel_err(np.array(out.astype(mx.float32)), ref)]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for name, errors in (("krea2-tiny", krea2_errors), ("flux3-klein-tiny", flux3_errors)):
            folder = Path(tmp) / name
            errs = errors(str(folder))
            print(f"{name}: max_rel_err per forward {', '.join(f'{e:.2e}' for e in errs)}"
                  f" ({'ok' if max(errs) <= 1e-4 else 'ABOVE 1e-4'})", flush=True)
