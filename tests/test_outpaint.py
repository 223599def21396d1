"""Outpainting (generate(outpaint=(left, top, right, bottom)) / --outpaint L,T,R,B), on the session's tiny SD3.5
folder (conftest.sd3_tiny): it is inpainting the padded canvas with the mask made for it, bit for bit (the canvas
and mask built here independently: numpy's edge padding, white over the added pixels, the given mask inside);
against diffusers' StableDiffusion3InpaintPipeline given that canvas and mask; the CLI; bad input, one line and
exit 2 through the CLI."""

import re

import numpy as np
import PIL.Image
import pytest

import mlxdiff
import parity
from helpers import max_rel_err
from mlxdiff.generate import main
from inpaint_helpers import PAD, PROMPT, canvas_of, draws, reference, sd3_inpaint  # noqa: F401  (the fixture)
from twins import picture
from zimage_helpers import mask_picture

IMAGE = (20, 30)              # padded: 24 x 40, SD3 tiny's test size (a multiple of 4: the output's size as it is)
H, W = 40, 24
STEPS = 3


def test_canvas_is_edge_pixels_and_a_white_border():
    from mlxdiff.pipelines.image_inputs import outpaint_canvas
    image, mask = picture(*IMAGE, 2), mask_picture(*IMAGE).convert("L")
    for given in (None, mask):
        canvas, canvas_mask = outpaint_canvas(image, given, PAD)
        want, want_mask = canvas_of(image, given)
        assert canvas.size == canvas_mask.size == (W, H)
        assert np.array_equal(np.asarray(canvas), np.asarray(want))
        assert np.array_equal(np.asarray(canvas_mask), np.asarray(want_mask))


def test_outpaint_is_inpainting_the_canvas(sd3_inpaint):
    """Bit for bit: the latents and the image; the output size defaults to the canvas's; the given mask goes inside
    the border, and mask_blur applies to the mask made (border and given mask together)."""
    _, _, ours = sd3_inpaint
    image, mask = picture(*IMAGE, 3), mask_picture(*IMAGE).convert("L")
    canvas, canvas_mask = canvas_of(image, mask)
    image_noise, noise = draws(5)
    kw = dict(steps=STEPS, guidance=4.5, latents=noise, image_noise=image_noise, strength=0.7, mask_blur=2,
              progress_bar=False)
    out = ours.generate(PROMPT, image=image, outpaint=PAD, mask=mask, **kw)
    inpainted = ours.generate(PROMPT, image=canvas, mask=canvas_mask, width=W, height=H, **kw)
    assert out.image.size == (W, H)
    assert np.array_equal(out.latents, inpainted.latents)
    assert np.array_equal(np.asarray(out.image), np.asarray(inpainted.image))
    assert any("inpainting where the outpainted border (4, 6, 0, 4 pixels left, top, right, bottom) and #1 (a PIL "
               "image) is white" in n for n in out.notes), out.notes


def test_outpaint_matches_diffusers_on_the_canvas(sd3_inpaint):
    """diffusers' StableDiffusion3InpaintPipeline given the canvas and its mask; the padding's fill (edge pixels,
    not grey) moves its result at strength 0.7."""
    _, inpaint, ours = sd3_inpaint
    image = picture(*IMAGE, 4)
    canvas, canvas_mask = canvas_of(image)
    grey = PIL.Image.new("RGB", (W, H), (127, 127, 127))
    grey.paste(image, PAD[:2])
    image_noise, noise = draws(7)
    base = dict(prompt=PROMPT, image=canvas, mask_image=canvas_mask, strength=0.7, guidance_scale=4.5)
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference(inpaint, 7, **kw), base,
                                                   {"the padding's fill": dict(image=grey)})
    got = ours.generate(PROMPT, image=image, outpaint=PAD, strength=0.7, steps=4, guidance=4.5, latents=noise,
                        image_noise=image_noise, progress_bar=False)
    err, shift = max_rel_err(got.latents, ref_latents), parity.levels(got.image, ref)
    print(f"SD3.5 outpaint: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS


def test_cli_is_the_api(sd3_inpaint, tmp_path):
    """--image --outpaint --mask-blur: the API's image, at the canvas's size, with both in the PNG's metadata."""
    folder, _, ours = sd3_inpaint
    image = tmp_path / "in.png"
    picture(*IMAGE, 6).save(image)
    out = tmp_path / "out.png"
    assert main(["--model", str(folder), "--prompt", PROMPT, "--image", str(image), "--outpaint", "4,6,0,4",
                 "--mask-blur", "2", "--steps", "1", "--seed", "5", "--dtype", "float32", "--no-progress",
                 "--output", str(out)]) == 0
    api = ours.generate(PROMPT, image=str(image), outpaint=PAD, mask_blur=2, steps=1, seed=5, progress_bar=False)
    cli = PIL.Image.open(out)
    assert cli.size == (W, H) == api.image.size
    assert np.array_equal(np.asarray(cli.convert("RGB")), np.asarray(api.image))
    assert cli.text["mlxdiff:outpaint"] == "4,6,0,4" and cli.text["mlxdiff:mask_blur"] == "2"


def test_bad_outpaint_is_one_line(sd3_inpaint, tmp_path, capsys):
    folder, _, ours = sd3_inpaint
    image = picture(*IMAGE, 1)
    kw = dict(steps=2, progress_bar=False)
    for given, needle in ((dict(image=image, outpaint=(-1, 0, 0, 0)), "outpaint=(-1, 0, 0, 0): expected 4 integers"),
                          (dict(image=image, outpaint=(1, 2, 3)), "outpaint=(1, 2, 3): expected 4 integers"),
                          (dict(image=image, outpaint=(0, 0, 0, 0)), "at least one above 0"),
                          (dict(image=image, outpaint=(0, 0, 4090, 0)), "the 20x30 image padded is 4110x30, past "
                                                                        "4096 pixels a side; pad less"),
                          (dict(outpaint=PAD), "outpaint: pads an image; give image= (--image) too")):
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(needle)) as e:
            ours.generate(PROMPT, **given, **kw)
        assert "\n" not in str(e.value), str(e.value)
    image.save(tmp_path / "in.png")
    out = tmp_path / "out.png"
    with_image = ["--image", str(tmp_path / "in.png")]
    for argv, needle in (([*with_image, "--outpaint=-1,0,0,0"], "outpaint='-1,0,0,0': expected 4 integers"),
                         ([*with_image, "--outpaint", "1,2,3"], "expected 4 integers"),
                         ([*with_image, "--outpaint", "a,b,c,d"], "expected 4 integers"),
                         ([*with_image, "--outpaint", "0,0,4090,0"], "past 4096 pixels a side"),
                         (["--outpaint", "4,0,0,0"], "--outpaint 4,0,0,0: pads an image; give --image FILE too"),
                         ([*with_image, "--mask-blur", "3"], "--mask-blur 3: blurs a mask; give --mask FILE or "
                                                             "--outpaint too"),
                         ([*with_image, "--outpaint", "4,0,0,0", "--mask-blur", "-2"], "mask_blur=-2: must be an "
                                                                                        "integer")):
        assert main(["--model", str(folder), "--prompt", PROMPT, *argv, "--steps", "2", "--no-progress",
                     "--output", str(out)]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mlxdiff: error: ") and needle in lines[0], lines
        assert not out.exists()
