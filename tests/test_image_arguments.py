"""Input images and strength refused in one line (the pattern of test_bad_arguments.py: each case in its own forked
child, tests/adversarial.py): a missing or unreadable image file, strength outside (0, 1], too many reference
images, strength without an image or with several, a reference below diffusers' minimum size, SD3.5-only options on
FLUX.2. Each ends with exit 2 and one `mlxdiff: error:` line naming what was wrong, and writes no output."""

import os
import sys

import numpy as np
import PIL.Image
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from adversarial import refused, run_cases  # noqa: E402

from mlxdiff import default_model  # noqa: E402
from mlxdiff.arguments import MAX_REFERENCES  # noqa: E402

MODEL = str(default_model.FOLDER)
CHEAP = ["--model", MODEL, "--steps", "1", "--width", "64", "--height", "64", "--no-progress"]


def gen(*argv):
    return {"cli": "mlxdiff.generate", "argv": [*CHEAP, "--output", "{out}", *argv]}


API = ("import mlxdiff, PIL.Image\n"
       f"pipe = mlxdiff.load({MODEL!r})\nKW = dict(steps=1, width=64, height=64, progress_bar=False)\n")

CASES = {
    "missing image": (gen("--image", "{tmp}/missing.png"), "missing.png: no such file"),
    "not an image": (gen("--image", "{tmp}/not-an-image.png"), "not-an-image.png: not an image"),
    "image is a folder": (gen("--image", "{tmp}"), "cannot read it"),
    "strength 0": (gen("--image", "{tmp}/ref.png", "--strength", "0"), "strength=0"),
    "strength 1.5": (gen("--image", "{tmp}/ref.png", "--strength", "1.5"), "strength=1.5"),
    "strength nan": (gen("--image", "{tmp}/ref.png", "--strength", "nan"), "strength=nan"),
    "too many references": (gen(*["--image", "{tmp}/ref.png"] * (MAX_REFERENCES + 1)),
                            f"at most {MAX_REFERENCES} reference images"),
    "strength without image": (gen("--strength", "0.5"), "needs an init image"),
    "strength with two images": (gen("--image", "{tmp}/ref.png", "--image", "{tmp}/ref.png", "--strength", "0.5"),
                                 "starts from one image"),
    "reference too small": (gen("--image", "{tmp}/small.png"), "small.png: 16x16 is too small"),
    "reference too narrow": (gen("--image", "{tmp}/narrow.png"), "aspect ratio"),
    "api: image=[]": ({"api": API + "pipe.generate('a', image=[], **KW)"}, "image=[]"),
    "api: image=5": ({"api": API + "pipe.generate('a', image=5, **KW)"}, "image=5"),
    "api: strength=True": ({"api": API + "pipe.generate('a', image='{tmp}/ref.png', strength=True, **KW)"},
                           "strength=True"),
    "api: image_noise on FLUX.2": ({"api": API + "pipe.generate('a', image_noise=[0.0], **KW)"}, "SD3.5"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image-arguments")
    rng = np.random.default_rng(0)
    for name, (w, h) in (("ref", (64, 64)), ("small", (16, 16)), ("narrow", (640, 64))):
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp / f"{name}.png")
    (tmp / "not-an-image.png").write_text("this is text, not a PNG")
    outs = {name: tmp / f"case-{i}.png" for i, name in enumerate(CASES)}

    def fill(case, out):
        sub = lambda text: text.replace("{out}", str(out)).replace("{tmp}", str(tmp))
        return {**case, "argv": [sub(a) for a in case["argv"]]} if "argv" in case else {"api": sub(case["api"])}
    cases = [fill(case, outs[name]) for name, (case, _) in CASES.items()]
    return outs, dict(zip(CASES, run_cases(cases, tmp)))


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line(outcomes, name):
    outs, results = outcomes
    outcome, needle = results[name], CASES[name][1]
    assert refused(outcome), outcome.describe()
    line = [line for line in outcome.stderr.splitlines() if line.strip()][0]
    assert line.startswith("mlxdiff: error: ") and needle in line, (needle, outcome.describe())
    assert not outs[name].exists()
