#!/usr/bin/env bash
# Compare mlxdiff's footprint with the PyTorch path, each run in its own process and sampled from outside.
# Needs the `reference` extra. MODEL: any SD3.5 pipeline folder (e.g. one made by bench/make_random_models.py).
set -euo pipefail
MODEL=${1:-weights/bench-sd3.5-medium-random}
python -m mlxdiff.footprint compare --model "$MODEL" --width 512 --height 512 --steps 2 --out footprint-out
# Any command can be sampled the same way:
python -m mlxdiff.footprint run -- python -m mlxdiff.generate --model "$MODEL" --steps 2 --width 512 --height 512
