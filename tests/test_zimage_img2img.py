"""Z-Image image-to-image and inpainting: mlxdiff's ZImagePipeline with image= / mask= against diffusers'
ZImageImg2ImgPipeline and ZImageInpaintPipeline on the tiny folder of tests/test_zimage_pipeline.py, at two
strengths; the mask of another size than the image (resized as diffusers' mask_processor does); the CLI; bad input.

Noise: diffusers' img2img ignores the image when `latents=` is given (and its inpainting does not noise it), so
diffusers gets a torch Generator; both pipelines draw, in this order, the init image's VAE posterior noise
(vae.encode(...).latent_dist.sample) and the noise scale_noise mixes in (prepare_latents; inpainting blends with
it each step). The test draws the same two arrays from an equally seeded Generator and gives them to mlxdiff as
`image_noise=` and `latents=`. (Inpainting's third draw, the masked image's posterior, feeds only diffusers'
masked_image_latents, which its loop never reads.)"""

import re

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err
from twins import picture
import fixture_guard
from zimage_helpers import LATENT, SEQ, check_parity, mask_picture, reference_run
from zimage_helpers import zimage_tiny  # noqa: F401  (the tiny folder)

PROMPT = "a red fox in the snow"
IMAGE = (50, 35)        # cut to 48 x 32 (multiples of 4: the tiny VAE's 2 x the patches' 2) by both sides
H, W = 32, 48
SHAPE = (1, LATENT, H // 2, W // 2)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['zimage_tiny'])


def draws(seed):
    """(image_noise, noise): the posterior's noise, then the mixed-in noise, as diffusers draws them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).numpy(), torch.randn(SHAPE, generator=g).numpy()


def diffusers_run(cls, pipe, seed, **kwargs):
    """One run of diffusers' `cls` on the fixture's components, its generator seeded afresh: (image, latents)."""
    latents, image = reference_run(cls(**pipe.components), generator_seed=seed, **{"prompt": PROMPT, **kwargs})
    return image, latents


def check_against(result, ref_image, ref_latents):
    check_parity(result, ref_latents, ref_image, "Z-Image")


def matters(cls, pipe, seed, base, changes):
    """diffusers' (image, latents) for `base`, after checking that each of `changes` moves them."""
    latents, image = parity.assert_inputs_matter(
        lambda **kw: reference_run(cls(**pipe.components), generator_seed=seed, num_inference_steps=3, **kw),
        dict(prompt=PROMPT, **base), changes)
    return image, latents


@pytest.mark.parametrize("strength,guidance", [(0.6, 3.5), (1.0, 0.0)], ids=["s0.6_cfg", "s1.0"])
def test_img2img_matches_diffusers(zimage_tiny, strength, guidance):
    """The prompt moves diffusers' result; below strength 1 (where the image is more than noised away) the init
    image and the strength too, and the CFG scale where there is CFG."""
    from diffusers import ZImageImg2ImgPipeline
    _, pipe, ours = zimage_tiny
    init = picture(*IMAGE, 3)
    image_noise, noise = draws(7)
    changes = {"the prompt": dict(prompt="a blue car")}
    if strength < 1:
        changes.update({"the init image": dict(image=picture(*IMAGE, 13)), "the strength": dict(strength=0.3)})  # 1 step, not 2
    if guidance:
        changes["the CFG scale"] = dict(guidance_scale=1.5)
    ref_image, ref_latents = matters(ZImageImg2ImgPipeline, pipe, 7, dict(image=init, strength=strength,
                                                                          guidance_scale=guidance), changes)
    result = ours.generate(PROMPT, image=init, strength=strength, steps=3, guidance=guidance, latents=noise,
                           image_noise=image_noise, max_sequence_length=SEQ, progress_bar=False)
    check_against(result, ref_image, ref_latents)
    start = int(3 - 3 * strength)
    assert any(f"steps {start + 1} to 3" in n for n in result.notes), result.notes


@pytest.mark.parametrize("strength,guidance", [(0.6, 0.0), (1.0, 3.5)], ids=["s0.6", "s1.0_cfg"])
def test_inpaint_matches_diffusers(zimage_tiny, strength, guidance):
    """The mask, the init image and the prompt move diffusers' result; with CFG the negative prompt too."""
    from diffusers import ZImageInpaintPipeline
    _, pipe, ours = zimage_tiny
    init, mask = picture(*IMAGE, 4), mask_picture(40, 26)
    image_noise, noise = draws(11)
    changes = {"the mask": dict(mask_image=mask_picture(26, 40)), "the init image": dict(image=picture(*IMAGE, 14)),
               "the prompt": dict(prompt="a blue car")}
    if guidance:
        changes["the negative prompt"] = dict(negative_prompt="sharp, vivid colours")
    ref_image, ref_latents = matters(ZImageInpaintPipeline, pipe, 11, dict(image=init, mask_image=mask,
                                                                           strength=strength,
                                                                           guidance_scale=guidance), changes)
    result = ours.generate(PROMPT, image=init, mask=mask, strength=strength, steps=3, guidance=guidance,
                           latents=noise, image_noise=image_noise, max_sequence_length=SEQ, progress_bar=False)
    check_against(result, ref_image, ref_latents)
    assert any(n.startswith("inpainting where") for n in result.notes), result.notes


def test_inpaint_keeps_black_and_defaults_to_strength_one(zimage_tiny):
    """Without strength, inpainting is ZImageInpaintPipeline's 1.0 (all 3 steps); the black area's latents are the
    init image's own latents exactly (the last blend takes them clean)."""
    from diffusers import ZImageInpaintPipeline
    _, pipe, ours = zimage_tiny
    init, mask = picture(*IMAGE, 5), mask_picture(40, 26)
    image_noise, noise = draws(3)
    ref_image, ref_latents = diffusers_run(ZImageInpaintPipeline, pipe, 3, image=init, mask_image=mask,
                                           guidance_scale=0.0, num_inference_steps=3)
    result = ours.generate(PROMPT, image=init, mask=mask, steps=3, guidance=0.0, latents=noise,
                           image_noise=image_noise, max_sequence_length=SEQ, progress_bar=False)
    check_against(result, ref_image, ref_latents)
    assert any("strength 1, steps 1 to 3" in n for n in result.notes), result.notes
    with torch.no_grad():
        pixels = pipe.image_processor.preprocess(init)
        latent_dist = pipe.vae.encode(pixels).latent_dist
        clean = ((latent_dist.mean + latent_dist.std * torch.from_numpy(image_noise)
                  - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor).numpy()
    from mlxdiff.pipelines.zimage.pipeline import latent_mask
    keep = latent_mask(mask, W, H, 2) == 0
    keep = np.broadcast_to(keep, clean.shape)
    assert keep.any() and (~keep).any()
    assert max_rel_err(np.asarray(result.latents)[keep], clean[keep]) <= 1e-4


def test_latent_mask_is_diffusers(zimage_tiny):
    """mask_processor.preprocess (resize, grayscale, binarize) then interpolate "nearest" to the latent size."""
    _, pipe, _ = zimage_tiny
    from diffusers import ZImageInpaintPipeline
    from mlxdiff.pipelines.zimage.pipeline import latent_mask
    inpaint = ZImageInpaintPipeline(**pipe.components)
    for mask in (mask_picture(40, 26), mask_picture(97, 61).convert("L"), mask_picture(W, H)):
        ref = inpaint.mask_processor.preprocess(mask, height=H, width=W)
        ref = torch.nn.functional.interpolate(ref, size=(H // 2, W // 2), mode="nearest").numpy()
        got = latent_mask(mask, W, H, 2)
        assert got.shape == ref.shape and np.array_equal(got, ref)
        assert 0 < got.mean() < 1


def test_cli_is_the_api(zimage_tiny, tmp_path, capsys):
    """--image [--strength] [--mask] on the command line: the API's image, at the image's size (48 x 32); with a mask
    and no --strength, inpainting's default 1.0."""
    from mlxdiff.generate import main
    folder, _, ours = zimage_tiny
    image, mask = str(tmp_path / "in.png"), str(tmp_path / "mask.png")
    picture(*IMAGE, 6).save(image)
    mask_picture(40, 26).save(mask)
    out = tmp_path / "out.png"
    for argv, given, strength in ((["--strength", "0.6", "--mask", mask], dict(strength=0.6, mask=mask), "0.6"),
                                  (["--strength", "0.6"], dict(strength=0.6), "0.6"),
                                  (["--mask", mask], dict(mask=mask), "1.0")):
        assert main(["--model", str(folder), "--prompt", PROMPT, "--image", image, *argv, "--steps", "3",
                     "--guidance", "0", "--seed", "5", "--dtype", "float32", "--no-progress", "--output",
                     str(out)]) == 0
        api = ours.generate(PROMPT, image=image, steps=3, guidance=0.0, seed=5, progress_bar=False, **given)
        cli = PIL.Image.open(out)
        assert cli.size == (W, H) == api.image.size
        assert np.array_equal(np.asarray(cli.convert("RGB")), np.asarray(api.image))
        assert cli.text["mlxdiff:strength"] == strength and ("mlxdiff:mask" in cli.text) == ("mask" in given)


def test_bad_input_is_one_line(zimage_tiny, tmp_path, capsys):
    from mlxdiff.generate import main
    folder, _, ours = zimage_tiny
    init, mask = picture(*IMAGE, 1), mask_picture(40, 26)
    kw = dict(steps=2, guidance=0.0, max_sequence_length=SEQ, progress_bar=False)
    cases = [(dict(mask=mask), "give image= (--image) too"),
             (dict(image=init, strength=0.0), "strength"),
             (dict(image=init, strength=1.5), "strength"),
             (dict(image=init, mask=mask, strength=-0.2), "strength"),
             (dict(image=init, mask=[mask, mask]), "2 masks"),
             (dict(image=[init, init], strength=0.5), "starts from one image"),
             (dict(image=init, image_noise=np.zeros((1, LATENT, 2, 2))), "image_noise has shape"),
             (dict(strength=0.5), "needs an init image")]
    for given, needle in cases:
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(needle)) as e:
            ours.generate(PROMPT, **given, **kw)
        assert "\n" not in str(e.value)
    mask.save(tmp_path / "mask.png")
    init.save(tmp_path / "in.png")
    out = tmp_path / "out.png"
    for argv, needle in ((["--mask", str(tmp_path / "mask.png")], "give --image FILE too"),
                         (["--image", str(tmp_path / "in.png"), "--strength", "1.5"], "strength"),
                         (["--image", str(tmp_path / "in.png"), "--strength", "0"], "strength")):
        assert main(["--model", str(folder), "--prompt", PROMPT, *argv, "--steps", "2", "--no-progress",
                     "--output", str(out)]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mlxdiff: error: ") and needle in lines[0], lines
        assert not out.exists()
