"""Qwen-Image-Edit inpainting and Qwen-Image-Edit-2511 (issue 40): an Edit folder with mask= against diffusers'
QwenImageEditInpaintPipeline from the same injected noise (the mask and the image each shown to move diffusers'
result); a QwenImageEditInpaintPipeline folder read as Edit; the transformer's zero_cond_t path against diffusers'
QwenImageTransformer2DModel(zero_cond_t=True); a 2511-style Plus folder end to end; the refusals.

Noise: diffusers' Edit inpainting cannot take `latents=` (its prepare_latents then returns one tensor where three
are unpacked), so it gets a torch Generator; its first two draws (the VAE posterior's noise, then scale_noise's) are
drawn again from an equally seeded Generator and given to mlxdiff as image_noise= and latents= (edit_inpaint_draws).
"""

import inspect
import json
import re
import shutil

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
import parity
from helpers import load_ours, max_rel_err
from mlxdiff.models import qwenimage
from mlxdiff.policy import RunPolicy, installed
import fixture_guard
from qwenimage_helpers import (CONFIG, check_parity, edit_image, edit_inpaint_draws, edit_noise, edit_reference,
                               load_edit_at, make_inputs, make_torch_model, make_zero_cond_torch_model, mlx_forward,
                               reference, save_zero_cond_folder, scaled_edit_areas, text_mask, torch_forward)
from qwenimage_helpers import qwen_edit_tiny  # noqa: F401  (the fixture)
from zimage_helpers import mask_picture

PROMPT = "put a red hat on it"
IMAGE, OTHER = edit_image(7, (120, 60)), edit_image(8, (120, 60))
MASK = mask_picture(100, 50)       # another size than the image's (its aspect)
OTHER_MASK = MASK.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
# diffusers' areas (1 MP, Plus's 384 x 384 px) at 1/256: the image's size 96 x 32 (6 x 2 tokens), the output's;
# Plus's vision image 32 x 32. Smaller than qwenimage_helpers.AREA_SCALE's: the VAE is most of a run's time
SCALE = 1 / 256
SIZE = (96, 32)
STEPS, STRENGTH = 3, 0.6   # QwenImageEditInpaintPipeline's default strength: steps 2 and 3 run


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['qwen_edit_tiny', 'inpaint_ours'])


@pytest.fixture(scope="module")
def inpaint_ours(qwen_edit_tiny):
    """mlxdiff's pipeline of the tiny Edit folder at SCALE."""
    return load_edit_at(qwen_edit_tiny["edit"][0], SCALE)


def inpaint_reference(pipe, **kwargs):
    """One QwenImageEditInpaintPipeline run (the Edit components) at SCALE, seeded 21: (its final latents unpacked,
    its image)."""
    from diffusers import QwenImageEditInpaintPipeline
    inpaint = QwenImageEditInpaintPipeline(**pipe.components)
    with scaled_edit_areas(SCALE):
        latents, image = reference(inpaint, prompt=PROMPT, num_inference_steps=STEPS, strength=STRENGTH,
                                   generator=torch.Generator().manual_seed(21), **kwargs)
    assert image.shape[:2] == SIZE[::-1]
    return inpaint._unpack_latents(latents, SIZE[1], SIZE[0], inpaint.vae_scale_factor)[:, :, 0].numpy(), image


def test_edit_inpaint_matches_diffusers(qwen_edit_tiny, inpaint_ours):
    """An Edit folder given image, mask and prompt (no strength: 0.6, as diffusers'): the mask and the image each
    move diffusers' result; mlxdiff's matches it, the output at the image's size."""
    from diffusers import QwenImageEditInpaintPipeline
    assert inspect.signature(QwenImageEditInpaintPipeline.__call__).parameters["strength"].default == STRENGTH
    pipe, ours = qwen_edit_tiny["edit"][1], inpaint_ours
    latents, image = parity.assert_inputs_matter(
        lambda **kw: inpaint_reference(pipe, **kw), dict(image=IMAGE, mask_image=MASK),
        {"the mask": dict(mask_image=OTHER_MASK), "the image": dict(image=OTHER)})
    image_noise, noise = edit_inpaint_draws(pipe, 21, *SIZE)
    got = ours.generate(PROMPT, image=IMAGE, mask=MASK, steps=STEPS, latents=noise, image_noise=image_noise,
                        progress_bar=False)
    assert got.image.size == SIZE
    check_parity(got, latents, image, "Qwen-Image-Edit inpainting")
    assert any(n.startswith("inpainting where #1 (a PIL image) is white; strength 0.6, steps 2 to 3")
               and "1 input image at 96x32" in n for n in got.notes), got.notes


def test_an_edit_inpaint_folder_is_read_as_edit(qwen_edit_tiny, tmp_path):
    """A folder saved as QwenImageEditInpaintPipeline (its model_index.json's class) is Qwen-Image-Edit, not Plus."""
    folder, _, _ = qwen_edit_tiny["edit"]
    copy = tmp_path / "inpaint"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditInpaintPipeline"}))
    pipe = mlxdiff.load(str(copy), dtype="float32")
    assert type(pipe).__name__ == "QwenImageEditPipeline" and not pipe.plus and "vision" in pipe.components


def test_zero_cond_t_transformer_matches_diffusers(tmp_path):
    """zero_cond_t (Qwen-Image-Edit-2511): the reference grid's tokens modulated at timestep 0. The switch moves
    diffusers' output (the same weights without it); mlxdiff's matches it, with and without the text mask, its blocks
    compiled and not fused too."""
    base = make_torch_model()
    torch_model = make_zero_cond_torch_model(base)
    torch_model.save_pretrained(str(tmp_path))
    ours = load_ours(tmp_path, qwenimage)
    assert ours.args.zero_cond_t
    inputs, mask = make_inputs("edit-plus"), text_mask()
    ref = torch_forward(torch_model, inputs, "edit-plus", mask)
    assert max_rel_err(torch_forward(base, inputs, "edit-plus", mask), ref) > 1e-3
    for m in (mask, None):
        err = max_rel_err(mlx_forward(ours, inputs, "edit-plus", m), torch_forward(torch_model, inputs, "edit-plus", m))
        print(f"Qwen-Image transformer zero_cond_t, mask {'on' if m is not None else 'off'}: max_rel_err {err:.2e}")
        assert err <= 1e-4
    for policy in (RunPolicy(compile_blocks=True), RunPolicy(fuse=False)):     # compiled blocks, plain MLX ops
        with installed(policy):
            assert max_rel_err(mlx_forward(ours, inputs, "edit-plus", mask), ref) <= 1e-4, policy


def test_a_2511_folder_matches_diffusers(qwen_edit_tiny, tmp_path):
    """A Plus folder whose transformer has zero_cond_t (2511's config) against diffusers' QwenImageEditPlusPipeline
    over that transformer: the switch moves diffusers' result (the Plus folder's, same weights); mlxdiff's matches."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    folder, plus, _ = qwen_edit_tiny["plus"]
    folder = save_zero_cond_folder(folder, tmp_path / "2511")
    transformer = QwenImageTransformer2DModel.from_pretrained(str(folder / "transformer")).eval()
    assert transformer.config.zero_cond_t
    pipe = QwenImageEditPlusPipeline(**{**plus.components, "transformer": transformer})
    size = dict(height=SIZE[1], width=SIZE[0])      # the image's, left to the pipelines
    with scaled_edit_areas(SCALE):
        base, base_image = edit_reference(plus, default_size=True, prompt=PROMPT, image=[IMAGE],
                                          num_inference_steps=2, **size)
        latents, image = edit_reference(pipe, default_size=True, prompt=PROMPT, image=[IMAGE],
                                        num_inference_steps=2, **size)
    parity.assert_moves("zero_cond_t", base, latents, base_image, image)
    ours = load_edit_at(folder, SCALE)
    got = ours.generate(PROMPT, image=[IMAGE], steps=2, latents=edit_noise(**size), progress_bar=False)
    check_parity(got, latents, image, "Qwen-Image-Edit-2511-style Plus folder")


@pytest.mark.parametrize("name, kwargs, needle", [
    ("edit", dict(image=IMAGE, mask=MASK, width=128, height=32), "inpaints at the input image's ~1 MP size, 96x32"),
    ("edit", dict(image=IMAGE, mask=MASK, padding_mask_crop=8), "padding_mask_crop"),
    ("edit", dict(image=IMAGE, image_noise=np.zeros((1, 6, 4, 12), np.float32)), "only when inpainting"),
    ("edit", dict(image=IMAGE, mask_blur=2), "only when inpainting"),
    ("plus", dict(image=[IMAGE], mask=MASK), "takes no mask"),
])
def test_bad_input_is_one_line(qwen_edit_tiny, inpaint_ours, name, kwargs, needle):
    ours = inpaint_ours if name == "edit" else qwen_edit_tiny[name][2]
    with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(needle)) as e:
        ours.generate(PROMPT, steps=2, progress_bar=False, **kwargs)
    assert "\n" not in str(e.value), str(e.value)


def test_layered_switches_stay_refused():
    for key in ("use_additional_t_cond", "use_layer3d_rope"):
        with pytest.raises(mlxdiff.MlxdiffError, match=key):
            qwenimage.ModelArgs.from_dict({**CONFIG, key: True})
    assert qwenimage.ModelArgs.from_dict({**CONFIG, "zero_cond_t": True}).zero_cond_t
