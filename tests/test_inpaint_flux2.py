"""FLUX.2 klein inpainting: mlxdiff's Flux2Pipeline with image= and mask= against diffusers'
Flux2KleinInpaintPipeline on the tiny klein base folder of tests/twins.py (CFG: the init image's reference tokens
ride in both passes), at strength 0.8 (its default) and 1.0, with a mask of another size than the image (resized to
the output, then interpolated bilinearly to the token grid, as there); the output size is the image's, cut to a
multiple of 4 (the tiny VAE's 2 x the 2x2 patches); FLUX.2 dev refuses a mask.

Noise: Flux2KleinInpaintPipeline ignores the image when `latents=` is given, so it gets a torch Generator; its one
draw is the noise (the init image's latents are the posterior's mean, drawn from nothing), which the test draws from
an equally seeded Generator and gives to mlxdiff as `latents=`."""

import re

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err
from mlxdiff.pipelines import image_inputs
from inpaint_helpers import canvas_of
from zimage_helpers import mask_picture
from twins import TAPS, build_pipeline, picture, text_length

IMAGE, MASK = (42, 27), (30, 21)         # the image cut to 40 x 24 (the output), the mask resized to it
H, W = 24, 40
PROMPT = "a red fox in the snow"
STEPS = 3
SEQ = text_length("klein_base")


@pytest.fixture(scope="module")
def klein_inpaint(tmp_path_factory):
    """(folder, diffusers' Flux2KleinInpaintPipeline on the klein base twin's components, mlxdiff's pipeline)."""
    from diffusers import Flux2KleinInpaintPipeline
    _, folder, pipe = build_pipeline("klein_base", tmp_path_factory.mktemp("klein_inpaint"))
    inpaint = Flux2KleinInpaintPipeline(**pipe.components, is_distilled=False)
    return folder, inpaint, mlxdiff.load(str(folder), dtype="float32")


def noise_of(seed):
    """Flux2KleinInpaintPipeline's one draw: the noise (1, 4 x 5 latent channels, H/4, W/4)."""
    return torch.randn((1, 20, H // 4, W // 4), generator=torch.Generator().manual_seed(seed)).numpy()


def reference(pipe, seed, **kw):
    """diffusers' run: (final latents (1, C, h, w) before the VAE's de-normalisation, image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].permute(0, 2, 1).reshape(1, 20, H // 4, W // 4).numpy()
        return {}
    image = pipe(num_inference_steps=STEPS, max_sequence_length=SEQ, text_encoder_out_layers=TAPS, output_type="np",
                 generator=torch.Generator().manual_seed(seed), callback_on_step_end=keep_latents, **kw).images[0]
    return final["latents"], image


def test_inpaint_matches_diffusers(klein_inpaint):
    """At strength 0.6 (steps 2 to 3: the init image reaches both the noised start and the reference tokens), the
    mask, the init image and the prompt each move diffusers' result."""
    _, pipe, ours = klein_inpaint
    init, mask = picture(*IMAGE, 4), mask_picture(*MASK)
    base = dict(prompt=PROMPT, image=init, mask_image=mask, strength=0.6, guidance_scale=3.5)
    changes = {"the mask": dict(mask_image=mask_picture(MASK[1], MASK[0])),
               "the init image": dict(image=picture(*IMAGE, 14)),
               "the prompt": dict(prompt="a lighthouse by the sea")}
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference(pipe, 11, **kw), base, changes)
    got = ours.generate(PROMPT, image=init, mask=mask, strength=0.6, steps=STEPS, guidance=3.5, latents=noise_of(11),
                        max_sequence_length=SEQ, text_encoder_out_layers=TAPS, progress_bar=False)
    assert got.image.size == (W, H)
    err, shift = max_rel_err(got.latents, ref_latents), parity.levels(got.image, ref)
    print(f"FLUX.2 klein inpaint strength 0.6: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    assert any(n.startswith("inpainting where #1 (a PIL image) is white") and "strength 0.6, steps 2 to 3" in n
               for n in got.notes), got.notes


def test_default_strength_and_start_are_the_inpaint_pipelines(klein_inpaint):
    """No strength with a mask: Flux2KleinInpaintPipeline's 0.8; its first step is get_timesteps' (4 steps: int(4 -
    3.2) = 0, so steps 1 to 4 run), not mflux's img2img start (max(1, int(4 x 0.2)) = 1)."""
    _, _, ours = klein_inpaint
    got = ours.generate(PROMPT, image=picture(*IMAGE, 2), mask=mask_picture(*MASK), steps=4, guidance=1.0,
                        max_sequence_length=SEQ, text_encoder_out_layers=TAPS, progress_bar=False)
    assert any("strength 0.8, steps 1 to 4" in n for n in got.notes), got.notes


def test_outpaint_is_inpainting_the_canvas(klein_inpaint):
    """outpaint= on klein: the output size is the canvas's, and the run is inpainting the canvas (edge pixels) with
    a mask white over the border, bit for bit (test_outpaint.py does the same on SD3.5, and against diffusers)."""
    _, _, ours = klein_inpaint
    image = picture(W - 4, H - 10, 5)            # PAD (4, 6, 0, 4) makes it 40 x 24
    canvas, canvas_mask = canvas_of(image)
    kw = dict(steps=2, guidance=3.5, latents=noise_of(2), max_sequence_length=SEQ, text_encoder_out_layers=TAPS,
              progress_bar=False)
    out = ours.generate(PROMPT, image=image, outpaint=(4, 6, 0, 4), **kw)
    inpainted = ours.generate(PROMPT, image=canvas, mask=canvas_mask, **kw)
    assert out.image.size == (W, H)
    assert np.array_equal(out.latents, inpainted.latents)
    assert np.array_equal(np.asarray(out.image), np.asarray(inpainted.image))


def test_token_mask_is_diffusers(klein_inpaint):
    """mask_processor.preprocess (resize, grayscale, binarize), then prepare_mask_latents' bilinear interpolation to
    the token grid: soft (0.25 / 0.5 / 0.75) at the edges."""
    _, pipe, _ = klein_inpaint
    for mask in (mask_picture(*MASK), mask_picture(97, 61).convert("L"), mask_picture(W, H)):
        condition = pipe.mask_processor.preprocess(mask, height=H, width=W)
        ref = pipe.prepare_mask_latents(condition, 1, 1, H, W, torch.float32, "cpu")
        got = image_inputs.bilinear_mask(mask, W, H, 4)
        assert np.array_equal(got.reshape(1, -1, 1), ref.numpy())
        assert ((got > 0) & (got < 1)).any()


def test_dev_takes_no_mask(tmp_path):
    _, folder, _ = build_pipeline("dev", tmp_path)
    dev = mlxdiff.load(str(folder), dtype="float32")
    for given, flag in ((dict(mask=mask_picture(*MASK)), "mask"), (dict(outpaint=(0, 0, 8, 0)), "outpaint")):
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(f"{flag}: FLUX.2 dev has no inpainting")) as e:
            dev.generate(PROMPT, image=picture(*IMAGE, 1), steps=1, progress_bar=False, **given)
        assert "\n" not in str(e.value)
