"""Qwen-Image inpainting: mlxdiff's QwenImagePipeline with image= and mask= against diffusers'
QwenImageInpaintPipeline on the tiny folder of tests/test_qwenimage_pipeline.py, at strength 0.6 (no CFG) and 1.0
(true CFG), with an image and a mask each of another size than the output; the CLI; bad input.

Noise: diffusers' inpainting cannot take `latents=` (its prepare_latents then returns one tensor where three are
unpacked), so it gets a torch Generator; it draws, in this order, the init image's VAE posterior noise and the noise
scale_noise mixes in (and each step's blend too). The test draws the same two arrays from an equally seeded
Generator and gives them to mlxdiff as `image_noise=` and `latents=` (packed). Its third draw, the masked image's
posterior, feeds only masked_image_latents, which its loop never reads."""

import re

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from qwenimage_helpers import (H, NEGATIVE, PROMPT, SEQ, W, Z, check_parity,  # noqa: F401  (the fixture)
                               qwen_tiny, reference_unpacked)
from zimage_helpers import mask_picture
from twins import picture
import fixture_guard

IMAGE, MASK = (44, 30), (40, 26)        # both resized to 48 x 32 (the output) by both sides
STEPS = 4


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['qwen_tiny'])


def draws(pipe, seed):
    """(image_noise (1, Z, H/4, W/4), packed latent noise): QwenImageInpaintPipeline's first two draws."""
    h, w = H // 4, W // 4
    g = torch.Generator().manual_seed(seed)
    posterior, noise = torch.randn((1, Z, 1, h, w), generator=g), torch.randn((1, 1, Z, h, w), generator=g)
    return posterior[:, :, 0].numpy(), pipe._pack_latents(noise, 1, Z, h, w).numpy()


@pytest.mark.parametrize("strength,negative", [(0.6, None), (1.0, NEGATIVE)], ids=["s0.6", "s1.0_true_cfg"])
def test_inpaint_matches_diffusers(qwen_tiny, strength, negative):
    """The mask, the init image and the prompt (and the negative prompt) each move diffusers' result."""
    from diffusers import QwenImageInpaintPipeline
    _, pipe, ours = qwen_tiny
    init, mask = picture(*IMAGE, 4), mask_picture(*MASK)
    image_noise, noise = draws(pipe, 11)
    base = dict(prompt=PROMPT, negative_prompt=negative, image=init, mask_image=mask, strength=strength, height=H,
                width=W, num_inference_steps=STEPS, true_cfg_scale=3.0, max_sequence_length=SEQ, generator_seed=11)
    changes = {"the mask": dict(mask_image=mask_picture(MASK[1], MASK[0])),
               "the init image": dict(image=picture(*IMAGE, 14)),
               "the prompt": dict(prompt="a blue car parked in the desert at noon")}
    if negative:
        changes["the negative prompt"] = dict(negative_prompt="sharp, vivid colours")
    inpaint = QwenImageInpaintPipeline(**pipe.components)
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_unpacked(inpaint, **kw), base, changes)
    got = ours.generate(PROMPT, negative_prompt=negative, image=init, mask=mask, strength=strength, width=W,
                        height=H, steps=STEPS, true_cfg_scale=3.0, latents=noise, image_noise=image_noise,
                        max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, f"inpaint strength {strength}")
    start = int(STEPS - STEPS * strength)
    assert any(n.startswith("inpainting where #1 (a PIL image) is white") for n in got.notes), got.notes
    assert any(f"strength {strength:g}, steps {start + 1} to {STEPS}" in n for n in got.notes), got.notes


def test_packed_mask_is_diffusers(qwen_tiny):
    """mask_processor.preprocess (resize, grayscale, binarize), then prepare_mask_latents (interpolate "nearest" to
    the latent size, repeated over the channels, packed); its masked image given as latents, so nothing is drawn."""
    from diffusers import QwenImageInpaintPipeline
    from mlxdiff.pipelines.qwenimage.pipeline import packed_latent_mask
    _, pipe, _ = qwen_tiny
    inpaint = QwenImageInpaintPipeline(**pipe.components)
    for mask in (mask_picture(*MASK), mask_picture(97, 61).convert("L"), mask_picture(W, H)):
        condition = inpaint.mask_processor.preprocess(mask, height=H, width=W)
        ref, _ = inpaint.prepare_mask_latents(condition, torch.zeros(1, Z, 1, H // 4, W // 4), 1, Z, 1, H, W,
                                              torch.float32, "cpu", None)
        got = np.asarray(packed_latent_mask(mask, W, H, 4, Z))
        assert got.shape == tuple(ref.shape) and np.array_equal(got, ref.numpy())
        assert 0 < got.mean() < 1


def test_cli_is_the_api(qwen_tiny, tmp_path):
    """--image --mask without --strength: QwenImageInpaintPipeline's default 0.6, the API's image."""
    import PIL.Image
    from mlxdiff.generate import main
    folder, _, ours = qwen_tiny
    image, mask = str(tmp_path / "in.png"), str(tmp_path / "mask.png")
    picture(*IMAGE, 6).save(image)
    mask_picture(*MASK).save(mask)
    out = tmp_path / "out.png"
    assert main(["--model", str(folder), "--prompt", PROMPT, "--image", image, "--mask", mask, "--width", str(W),
                 "--height", str(H), "--steps", "3", "--seed", "5", "--dtype", "float32", "--no-progress",
                 "--output", str(out)]) == 0
    api = ours.generate(PROMPT, image=image, mask=mask, width=W, height=H, steps=3, seed=5, progress_bar=False)
    assert any("strength 0.6, steps 2 to 3" in n for n in api.notes), api.notes
    cli = PIL.Image.open(out)
    assert cli.size == (W, H) == api.image.size
    assert np.array_equal(np.asarray(cli.convert("RGB")), np.asarray(api.image))
    assert cli.text["mlxdiff:strength"] == "0.6" and "mlxdiff:mask" in cli.text


def test_bad_input_is_one_line(qwen_tiny):
    _, _, ours = qwen_tiny
    init, mask = picture(*IMAGE, 1), mask_picture(*MASK)
    kw = dict(width=W, height=H, steps=2, max_sequence_length=SEQ, progress_bar=False)
    for given, needle in ((dict(mask=mask), "mask: a mask says where to repaint an image; give image= (--image) too"),
                          (dict(image=init, mask=[mask, mask]), "2 masks"),
                          (dict(image=init, mask=mask, padding_mask_crop=8), "padding_mask_crop")):
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(needle)) as e:
            ours.generate(PROMPT, **given, **kw)
        assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("cls", ["QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"])
def test_folders_of_the_img2img_and_inpaint_classes_load(qwen_tiny, tmp_path, cls):
    """A folder saved by either pipeline (its model_index.json names it) is read as the Qwen-Image family."""
    import json
    import shutil
    folder, _, _ = qwen_tiny
    copy = tmp_path / cls
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "_class_name": cls}))
    pipe = mlxdiff.load(str(copy), dtype="float32")
    assert pipe.family == "qwenimage" and "mask" in pipe.OPTIONS
