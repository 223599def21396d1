"""Render examples/default_grid.png: prompts beside what the embedded default model (weights/klein-shapes) draws.

    /work/venv/bin/python examples/make_default_grid.py [--steps 50] [--seed 0] [--output examples/default_grid.png]

The first rows are held-out prompts (colour/shape/position combinations never seen in training), the rest are
two-shape and free-wording prompts. Generated with mlxdiff at the folder's settings (taps, 64 text tokens, 64x64).
"""

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

import mlxdiff
from mlxdiff import default_model
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tools/
from tools.train_klein_shapes import dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FOLDER = default_model.FOLDER
EXTRA = ["a large red circle on the left and a large blue square on the right on a white background",
         "a yellow triangle at the top and a green circle at the bottom, black background",
         "a small cyan diamond in the centre on a gray background",
         "a magenta square on the right over black",
         "a large blue triangle in the middle with a white background",
         "a green diamond on the left and a red triangle on the right on a gray background"]
SCALE = 2           # 64x64 images shown at 128x128


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(ROOT / "examples" / "default_grid.png"))
    args = p.parse_args(argv)
    prompts = [p for p, _, _ in dataset.held_out_prompts(10)] + EXTRA
    # the folder's defaults: 64x64, 64 text tokens, taps (1, 2, 3), from its model_index.json
    result = mlxdiff.load(str(FOLDER)).generate(prompts, steps=args.steps, guidance=4.0, seed=args.seed,
                                                progress_bar=False)
    side = result.images[0].width

    cell, text_w, cols = side * SCALE, 330, 2
    rows = (len(prompts) + cols - 1) // cols
    pad = 6
    grid = Image.new("RGB", (cols * (cell + text_w + pad), rows * (cell + pad) + 24), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    draw.text((pad, 4), f"klein-shapes via mlxdiff, {args.steps} steps, guidance 4, seed {args.seed}; "
                        "first 10 prompts: held-out colour/shape/position combinations", fill=(0, 0, 0), font=font)
    for i, (prompt, image) in enumerate(zip(prompts, result.images)):
        r, c = divmod(i, cols)
        x, y = c * (cell + text_w + pad) + pad, r * (cell + pad) + 24
        grid.paste(image.resize((cell, cell), Image.NEAREST), (x, y))
        words, lines = prompt.split(), [""]
        for w in words:   # wrap to the text column
            if draw.textlength(lines[-1] + " " + w, font=font) > text_w - 12:
                lines.append(w)
            else:
                lines[-1] = (lines[-1] + " " + w).strip()
        tag = "held out: " if i < 10 else ""
        draw.multiline_text((x + cell + 6, y + 6), tag + "\n".join(lines) if not tag else tag + "\n" + "\n".join(lines),
                            fill=(0, 0, 0), font=font, spacing=3)
    grid.save(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
