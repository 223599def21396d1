"""Qwen-Image-Edit (issue 40): the Qwen2.5-VL vision tower (mlx-vlm's, models/vision_qwen25vl.py) and its image
processor against transformers' Qwen2_5_VisionTransformerPretrainedModel and Qwen2VLImageProcessorPil; the Edit and
Edit-Plus prompt embeddings against diffusers' _get_qwen_prompt_embeds; QwenImageEditPipeline (one input image, true
CFG) and QwenImageEditPlusPipeline (two input images) end to end against diffusers from the same injected noise, each
input image shown to move diffusers' result; the size rule; how a folder is recognised as Edit; the refusals."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import mlxdiff
import mlx.core as mx
import parity
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import vision_qwen25vl
from mlxdiff.pipelines.qwenimage import edit as ours_edit
import fixture_guard
from qwenimage_helpers import (EDIT_H, EDIT_PROCESSOR, EDIT_W, check_parity, edit_image, edit_noise, edit_reference,
                               scaled_areas)
from qwenimage_helpers import qwen_edit_tiny  # noqa: F401  (the fixture)

PROMPT, NEGATIVE = "turn the sky purple", "blurry"
# input images of unequal sizes and aspects (each resized to its ~1/64 MP size, then by the processor)
IMAGE = edit_image(1, (150, 100))
OTHER = edit_image(2, (150, 100))
SECOND = edit_image(3, (90, 120))
OTHER_SECOND = edit_image(6, (90, 120))     # the second image changed, its size (the output's default) kept


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['qwen_edit_tiny'])


def test_vision_tower_and_processor_match_transformers(qwen_edit_tiny):
    """Two images of other sizes through the processor (resized by smart_resize, BICUBIC) and the tower (windowed
    block 0, full block 1, the merger), read from the Edit folder's text_encoder/ as the pipeline reads it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    _, pipe, ours = qwen_edit_tiny["edit"]
    images = [edit_image(4, (61, 37)), edit_image(5, (40, 50))]
    ref = Qwen2VLImageProcessorPil(**EDIT_PROCESSOR)(images=images, return_tensors="np")
    pixels, grid = vision_qwen25vl.preprocess(images, ours.processor)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    assert grid.tolist() == [[1, 10, 16], [1, 12, 10]]     # several windows of 2 x 2 merged tokens, padded
    assert max_rel_err(pixels, ref["pixel_values"]) <= 1e-5
    with torch.no_grad():
        out = pipe.text_encoder.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid))
    expected = (out.pooler_output if hasattr(out, "pooler_output") else out).numpy()
    tower = ours.components["vision"].build()
    got = np.array(tower(mx.array(pixels), grid))
    err = max_rel_err(got, expected)
    print(f"vision tower: max_rel_err {err:.2e}")
    assert got.shape == expected.shape == (70, 40) and err <= 1e-4


@pytest.mark.parametrize("name", ["edit", "plus"])
def test_edit_prompt_embeds_match_diffusers(qwen_edit_tiny, name):
    """The template with the image placeholder(s) expanded to the images' merged patches, the tower's features in
    their place, 64 template tokens dropped: one image (Edit), two images of other sizes (Plus)."""
    _, pipe, ours = qwen_edit_tiny[name]
    images = [IMAGE.resize((128, 80))] if name == "edit" else [IMAGE.resize((64, 40)), SECOND.resize((48, 64))]
    with torch.no_grad():
        embeds, mask = pipe._get_qwen_prompt_embeds(PROMPT, images if name == "plus" else images[0], device="cpu")
    got = ours.encode_prompt(PROMPT, images).as_numpy()
    assert got["prompt_embeds"].shape == tuple(embeds.shape)
    np.testing.assert_array_equal(got["prompt_embeds_mask"], mask.numpy())
    err = max_rel_err(got["prompt_embeds"], embeds.float().numpy())
    print(f"{name} prompt_embeds {tuple(embeds.shape)}: max_rel_err {err:.2e}")
    assert err <= 1e-4


def reference(pipe, **kwargs):
    with scaled_areas():
        return edit_reference(pipe, prompt=PROMPT, num_inference_steps=2, **kwargs)


def test_edit_matches_diffusers(qwen_edit_tiny):
    """QwenImageEditPipeline with true CFG (the negative prompt encoded with the image too) at a size of its own:
    the input image (its latents appended, its vision features in the prompt) moves diffusers' result; mlxdiff's
    matches it."""
    _, pipe, ours = qwen_edit_tiny["edit"]
    base = dict(image=IMAGE, negative_prompt=NEGATIVE, true_cfg_scale=2.5)
    latents, image = parity.assert_inputs_matter(lambda **kw: reference(pipe, **kw), base,
                                                 {"the input image": dict(image=OTHER)})
    got = ours.generate(PROMPT, image=IMAGE, negative_prompt=NEGATIVE, true_cfg_scale=2.5, steps=2, width=EDIT_W,
                        height=EDIT_H, latents=edit_noise(), progress_bar=False)
    check_parity(got, latents, image, "QwenImageEditPipeline, true CFG")
    assert any("1 input image at 160x96" in note for note in got.notes), got.notes


def test_edit_plus_two_images_match_diffusers(qwen_edit_tiny):
    """QwenImageEditPlusPipeline with two input images of different aspects, the output size left to the
    pipelines (the last image's: 96 x 160): the second image (its latents appended after the first's, its
    "Picture 2" tokens) moves diffusers' result; mlxdiff's matches it."""
    _, pipe, ours = qwen_edit_tiny["plus"]
    size = dict(height=160, width=96)
    latents, image = parity.assert_inputs_matter(
        lambda **kw: reference(pipe, default_size=True, **size, **kw), dict(image=[IMAGE, SECOND]),
        {"the second image": dict(image=[IMAGE, OTHER_SECOND])})
    got = ours.generate(PROMPT, image=[IMAGE, SECOND], steps=2, latents=edit_noise(**size), progress_bar=False)
    assert got.image.size == (96, 160)
    check_parity(got, latents, image, "QwenImageEditPlusPipeline, two images")
    assert any("2 input images at 160x96, 96x160" in note for note in got.notes), got.notes


def test_size_rule_follows_diffusers():
    """calculate_dimensions at the real 1 MP and 384 x 384 areas, over aspects that round differently."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    for ratio in (1.0, 1.5, 0.75, 16 / 9, 0.31, 3.7):
        for area in (1024 * 1024, 384 * 384):
            assert ours_edit.calculate_dimensions(area, ratio) == plus.calculate_dimensions(area, ratio)


def test_an_edit_folder_is_recognised_by_its_class(qwen_edit_tiny, tmp_path):
    """model_index.json's class makes the Edit pipeline (with the vision component and the processor); without the
    processor folder, or with a processor whose patches the tower does not take, one line."""
    folder, _, ours = qwen_edit_tiny["edit"]
    assert type(ours).__name__ == "QwenImageEditPipeline" and not ours.plus
    assert qwen_edit_tiny["plus"][2].plus
    assert type(ours).family == "qwenimage" and "vision" in ours.components
    copy = tmp_path / "edit"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "processor")
    with pytest.raises(MlxdiffError, match="processor"):
        mlxdiff.load(str(copy))
    shutil.copytree(folder / "processor", copy / "processor")
    where = copy / "processor" / "preprocessor_config.json"
    where.write_text(json.dumps({**json.loads(where.read_text()), "patch_size": 7}))
    with pytest.raises(MlxdiffError, match="does not belong"):
        mlxdiff.load(str(copy))


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "give image="),
    (dict(image=[IMAGE, SECOND]), "takes one input image"),
    (dict(image=IMAGE, strength=0.5), "no image-to-image"),
    (dict(image=IMAGE, mask_blur=2), "mask"),     # with mask= it inpaints (tests/test_qwenimage_edit_inpaint.py)
    (dict(image=IMAGE, prompt=["a", "b"]), "one prompt"),
])
def test_bad_input_is_one_line(qwen_edit_tiny, kwargs, match):
    ours = qwen_edit_tiny["edit"][2]
    prompt = kwargs.pop("prompt", PROMPT)
    with pytest.raises(MlxdiffError, match=match) as caught:
        ours.generate(prompt, steps=1, progress_bar=False, **kwargs)
    assert "\n" not in str(caught.value)


NO_TORCH = """
import sys
import mlxdiff
pipe = mlxdiff.load(sys.argv[1])
pipe.VAE_AREA, pipe.CONDITION_AREA = pipe.VAE_AREA / 64, pipe.CONDITION_AREA / 64     # qwenimage_helpers.AREA_SCALE
result = pipe.generate("a red door", image=[sys.argv[2], sys.argv[2]], steps=2, progress_bar=False)
print(result.image.size, sorted(m for m in ("torch", "diffusers", "mlx_vlm", "mlx_lm") if m in sys.modules))
"""


def test_an_edit_run_imports_no_torch(qwen_edit_tiny, tmp_path):
    """Qwen-Image-Edit-Plus from a folder and two image files: mlx-vlm's vision tower read without its package (nor
    mlx-lm's), and no torch (tests/test_no_torch.py's standard)."""
    path = tmp_path / "input.png"
    SECOND.save(path)
    run = subprocess.run([sys.executable, "-c", NO_TORCH, str(qwen_edit_tiny["plus"][0]), str(path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "(96, 160) []", run.stdout
