"""SD3.5 inpainting: mlxdiff's SD3Pipeline with image= and mask= against diffusers' StableDiffusion3InpaintPipeline
on the session's tiny SD3.5 folder (conftest.sd3_tiny), at strength 0.6 with CFG and at 1.0, with an image and a
mask each of another size than the output (both resized to it, as diffusers does); the mask blurred as
VaeImageProcessor.blur; bad input.

Noise: diffusers' inpainting ignores the image when `latents=` is given, so it gets a torch Generator; it draws, in
this order, the init image's VAE posterior noise and the noise scale_noise mixes in (and each step's blend). The test
draws the same two arrays from an equally seeded Generator and gives them to mlxdiff as `image_noise=` and
`latents=`; the third draw (the masked image's posterior) feeds only a 33-channel transformer.

Decode: StableDiffusion3InpaintPipeline decodes `latents / scaling_factor`, dropping the VAE's shift_factor (diffusers
issue #13611, issue 1; fixed by pull request #14671), where its other SD3 pipelines and its own encode use the
shift. mlxdiff decodes as they do, so the reference image here is diffusers' final latents (output_type="latent")
decoded by diffusers' VAE as that fix does: (latents / scaling_factor) + shift_factor."""

import re

import numpy as np
import PIL.Image
import pytest

import mlxdiff
import parity
from helpers import max_rel_err
from inpaint_helpers import (H, IMAGE, MASK, PROMPT, STEPS, W, draws, reference,  # noqa: F401  (sd3_inpaint:
                             sd3_inpaint)                                                 # the fixture)
from twins import picture
from zimage_helpers import mask_picture


@pytest.mark.parametrize("strength,guidance", [(0.6, 4.5), (1.0, 1.0)], ids=["s0.6_cfg", "s1.0"])
def test_inpaint_matches_diffusers(sd3_inpaint, strength, guidance):
    """The mask, the init image, the prompt and the negative prompt each move diffusers' result at 0.6 with CFG; the
    mask at 1.0."""
    _, inpaint, ours = sd3_inpaint
    init, mask = picture(*IMAGE, 4), mask_picture(*MASK)
    image_noise, noise = draws(11)
    base = dict(prompt=PROMPT, image=init, mask_image=mask, strength=strength, guidance_scale=guidance)
    changes = {"the mask": dict(mask_image=mask_picture(MASK[1], MASK[0]))}
    if guidance > 1:     # at 1.0 the mask alone: the init image and the text paths are shown here
        base["negative_prompt"] = "blurry"
        changes.update({"the init image": dict(image=picture(*IMAGE, 14)),
                        "the prompt": dict(prompt="a lighthouse by the sea"),
                        "the negative prompt": dict(negative_prompt="sharp, vivid colours")})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference(inpaint, 11, **kw), base, changes)
    got = ours.generate(PROMPT, negative_prompt=base.get("negative_prompt"), image=init, mask=mask, strength=strength,
                        width=W, height=H, steps=STEPS, guidance=guidance, latents=noise, image_noise=image_noise,
                        progress_bar=False)
    err, shift = max_rel_err(got.latents, ref_latents), parity.levels(got.image, ref)
    print(f"SD3.5 inpaint strength {strength}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    assert any(n.startswith("inpainting where #1 (a PIL image) is white") for n in got.notes), got.notes
    assert any("another aspect ratio, so the mask is stretched" in n for n in got.notes), got.notes


def test_mask_blur_is_diffusers_blur(sd3_inpaint):
    """mask_blur=N is the mask through VaeImageProcessor.blur(mask, blur_factor=N) before the pipeline sees it; the
    blur moves diffusers' result."""
    _, inpaint, ours = sd3_inpaint
    init, mask = picture(*IMAGE, 5), mask_picture(*MASK)
    image_noise, noise = draws(3)
    blurred = inpaint.mask_processor.blur(mask, blur_factor=3)
    ref_latents, ref = reference(inpaint, 3, prompt=PROMPT, image=init, mask_image=blurred, strength=1.0,
                                 guidance_scale=1.0)
    plain, plain_image = reference(inpaint, 3, prompt=PROMPT, image=init, mask_image=mask, strength=1.0,
                                   guidance_scale=1.0)
    parity.assert_moves("the mask blur", plain, ref_latents, plain_image, ref)
    got = ours.generate(PROMPT, image=init, mask=mask, mask_blur=3, strength=1.0, width=W, height=H, steps=STEPS,
                        guidance=1.0, latents=noise, image_noise=image_noise, progress_bar=False)
    assert max_rel_err(got.latents, ref_latents) <= parity.LATENT_TOL
    assert parity.levels(got.image, ref) <= parity.IMAGE_LEVELS


def test_bad_masks_are_one_line(sd3_inpaint, tmp_path):
    folder, _, ours = sd3_inpaint
    init = picture(*IMAGE, 1)
    (tmp_path / "mask.txt").write_text("not an image")
    black = PIL.Image.new("L", MASK, 127)          # below mid grey everywhere: binarizes to all black
    kw = dict(width=W, height=H, steps=2, progress_bar=False)
    for given, needle in (
            (dict(image=init, mask=str(tmp_path / "mask.txt")), f"mask {tmp_path / 'mask.txt'}: not an image"),
            (dict(image=init, mask=black), "all black (no pixel at or above mid grey, 128): nothing to repaint"),
            (dict(mask=mask_picture(*MASK)), "give image= (--image) too"),
            (dict(image=init, mask=[black, black]), "2 masks"),
            (dict(image=init, mask_blur=4), "mask_blur: blurs a mask; give mask= (--mask) or outpaint="),
            (dict(image=init, mask=mask_picture(*MASK), mask_blur=-1), "mask_blur=-1: must be an integer"),
            (dict(image=init, mask=np.zeros((4, 4))), "mask=<numpy.ndarray of shape (4, 4)")):
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(needle)) as e:
            ours.generate(PROMPT, **given, **kw)
        assert "\n" not in str(e.value), str(e.value)
