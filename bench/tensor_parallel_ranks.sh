#!/usr/bin/env bash
# Per-rank whole-process peaks of a tensor-parallel run on this CPU (issue 27): the embedded default with a
# mid-size random FLUX.2 transformer (D = 1024: 8 heads of 128, 8 double + 24 single blocks, 0.54 B parameters,
# 1.09 GB in bf16) in place of its own, generated through the CLI in one process and under
# `mlx.launch --backend ring -n N -- python -m mlxdiff.generate ... --split tensor --report-memory` for N = 2, 4
# (RANKS); each rank prints its own per-phase table (process peak: RSS sampled through the phase, VmHWM too).
# Logs in $LOGS (default /tmp/tp-ranks).
set -u
cd "$(dirname "$0")/.."
L=${LOGS:-/tmp/tp-ranks}
M=${MODEL:-/tmp/tp-mid}
mkdir -p "$L"
[ -f "$M/model_index.json" ] || python3 - "$M" <<'PY'
import shutil, sys, torch
from pathlib import Path
from diffusers import Flux2Transformer2DModel
sys.path.insert(0, ".")
from mlxdiff import default_model
folder = Path(sys.argv[1])
shutil.copytree(default_model.folder(), folder)
shutil.rmtree(folder / "transformer")
torch.manual_seed(0)
model = Flux2Transformer2DModel(patch_size=1, in_channels=32, out_channels=None, num_layers=8, num_single_layers=24,
                                attention_head_dim=128, num_attention_heads=8, joint_attention_dim=192,
                                timestep_guidance_channels=64, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                                rope_theta=2000, eps=1e-6, guidance_embeds=False).to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.5)
model.save_pretrained(str(folder / "transformer"))
print("made", folder)
PY
ARGS=(-m mlxdiff.generate --model "$M" --prompt "a red circle on the left" --width 256 --height 256 --steps 2
      --seed 3 --report-memory)
python3 "${ARGS[@]}" --output "$L/one.png" > "$L/ranks_1.txt" 2>&1
LAUNCH=$(command -v mlx.launch || echo "$(dirname "$(command -v python3)")/mlx.launch")
for n in ${RANKS:-2 4}; do
  "$LAUNCH" --backend ring -n "$n" -- "$(command -v python3)" "${ARGS[@]}" --split tensor \
    --output "$L/tp$n.png" > "$L/ranks_$n.txt" 2>&1
done
python3 - "$L" <<'PY'
import sys
import numpy as np
from PIL import Image
L = sys.argv[1]
one = np.asarray(Image.open(f"{L}/one.png")).astype(int)
for n in (2, 4):
    try:
        print(f"{n} ranks: image vs one process, max levels", int(np.abs(np.asarray(Image.open(f"{L}/tp{n}.png")).astype(int) - one).max()))
    except FileNotFoundError:
        print(f"{n} ranks: no image")
PY
