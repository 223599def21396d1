"""Qwen-Image 2.1's condition images against diffusers' QwenImage21Pipeline(image=...): the vision tower
(models/vision_qwen3vl.py, its deepstack features) and the image processor against transformers'
Qwen3VLVisionModel and Qwen2VLImageProcessorPil, the multimodal positions against Qwen3VLModel.get_rope_index and
the encoder's hidden states (images in the prompt, a batch of two left-padded prompts) against
Qwen3VLForConditionalGeneration; whole runs: two condition images of other sizes and aspects (one RGBA with
transparency), the output at the last one's size, with the prefix KV cache, and one image with true CFG and no
cache, latents within 1e-4 and images within 2 levels, each image moving diffusers' output; bad input in one line."""

import numpy as np
import pytest
import torch

import mlxdiff

import fixture_guard
import parity
from helpers import max_rel_err
from mlxdiff.errors import MlxdiffError
from mlxdiff.models import text_qwen3vl, vision_qwen25vl
from mlxdiff.pipelines.qwenimage21.pipeline import image_template
from qwenimage21_helpers import TEXT, Z, check_parity, save_pipeline
from qwenimage_helpers import edit_image

PROMPT = "a red fox sitting in the snow at dawn"
RESOLUTION = 64          # output_resolution: the images sized to about 64 x 64 px (VAE latents of a few tokens)
STEPS = 2


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ["qi21_images"])


def rgba_image(seed, size):
    """edit_image with an alpha channel: opaque on the left, fading to transparent on the right."""
    from PIL import Image
    image = edit_image(seed, size).convert("RGBA")
    image.putalpha(Image.fromarray(np.tile(np.linspace(255, 0, size[0]).astype(np.uint8), (size[1], 1))))
    return image


@pytest.fixture(scope="module")
def qi21_images(tmp_path_factory):
    """(the tiny folder with its image processor, the diffusers pipeline with transformers' Qwen3VLProcessor, the
    condition images: 40 x 24 RGB and 24 x 32 RGBA)."""
    folder, pipe = save_pipeline(tmp_path_factory.mktemp("qi21_images"), images=True)
    return folder, pipe, [edit_image(1, (40, 24)), rgba_image(2, (24, 32))]


def noise(width, height, seed=2):
    return np.random.default_rng(seed).standard_normal((1, (height // 16) * (width // 16), Z)).astype(np.float32)


def reference(pipe, **kwargs):
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    with torch.no_grad():
        image = pipe(**kwargs, output_type="np", callback_on_step_end=keep_latents).images[0]
    return final["latents"].numpy(), image


def test_vision_tower_and_encoder_match_transformers(qi21_images):
    """Two images through the processor (smart_resize, BICUBIC) and the tower (features and the deepstack merger's);
    two left-padded image-template prompts: get_rope_index's 3-D positions, and the last layer before the final norm
    (QwenImage21Pipeline's hook) with the features and deepstack in place."""
    folder, pipe, images = qi21_images
    ours = mlxdiff.load(str(folder), dtype="float32")
    images = [image.convert("RGB") for image in images]
    processor = pipe.processor
    texts = [image_template(2).format(p) for p in ("a fox", "a much longer prompt about a fox")]
    inputs = processor(text=texts, images=images * 2, padding=True, padding_side="left", return_tensors="pt")
    pixels, grid = vision_qwen25vl.preprocess(images, ours.processor)
    assert max_rel_err(np.tile(pixels, (2, 1)), inputs.pixel_values.numpy()) <= 1e-5
    assert np.array_equal(np.tile(grid, (2, 1)), inputs.image_grid_thw.numpy())
    encoder = pipe.text_encoder
    with torch.no_grad():
        want = encoder.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(grid))
    features, deepstack, counts, _ = ours._vision_features(images)
    err = max(max_rel_err(np.array(features), torch.cat(want.pooler_output).numpy()),
              max_rel_err(np.array(deepstack[0]), torch.cat(want.deepstack_features[0]).numpy()))
    print(f"Qwen3-VL vision tower: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL and len(deepstack) == 1
    ids, mask = inputs.input_ids.numpy(), inputs.attention_mask.numpy()
    token = ours.image_token_id
    with torch.no_grad():
        positions, _ = encoder.model.get_rope_index(inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw,
                                                    None, inputs.attention_mask)
    assert np.array_equal(text_qwen3vl.rope_index(ids, mask, token, np.tile(grid, (2, 1)), 2), positions.numpy())
    handle = encoder.model.language_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        with torch.no_grad():
            ref = encoder(**inputs, output_hidden_states=True).hidden_states[-1].numpy()
    finally:
        handle.remove()
    with ours.use(ours.components["text_encoder"]) as model:
        norm, model.norm = model.norm, lambda x: x
        try:
            got = np.array(ours._with_images(model, ids, mask, features, deepstack, counts, grid))
        finally:
            model.norm = norm
    valid = mask.astype(bool)
    err = max_rel_err(got[valid], ref[valid])
    print(f"Qwen3-VL encoder with images: max_rel_err {err:.2e}")
    assert err <= parity.LATENT_TOL
    assert text_qwen3vl.mrope_settings(TEXT)[2] == TEXT["rope_parameters"]["mrope_section"]


def test_two_condition_images_match_diffusers(qi21_images):
    """Two condition images (the second RGBA): the output at the last one's ~64^2 size (64 x 64), the prefix KV
    cache on; each image moves diffusers' output."""
    folder, pipe, images = qi21_images
    ours = mlxdiff.load(str(folder), dtype="float32")
    width = height = 64
    base = dict(prompt=PROMPT, num_inference_steps=STEPS, output_resolution=RESOLUTION)
    ref = reference(pipe, image=images, latents=torch.from_numpy(noise(width, height)), **base)
    assert ref[1].shape[:2] == (height, width)
    for i, other in enumerate((edit_image(5, (40, 24)), rgba_image(6, (24, 32)))):
        changed = list(images)
        changed[i] = other
        moved = reference(pipe, image=changed, latents=torch.from_numpy(noise(width, height)), **base)
        parity.assert_moves(f"condition image {i + 1}", ref[0], moved[0])
    got = ours.generate(PROMPT, image=images, steps=STEPS, latents=noise(width, height), output_resolution=RESOLUTION,
                        progress_bar=False)
    assert (got.image.width, got.image.height) == (width, height)
    assert any("2 condition images at 96x64, 64x64" in n for n in got.notes), got.notes
    check_parity(got, *ref, "two condition images")


def test_one_condition_image_with_cfg_matches_diffusers(qi21_images):
    """One image, true CFG with a negative prompt (encoded with the same image), no KV cache, an explicit output
    size of another aspect."""
    folder, pipe, images = qi21_images
    ours = mlxdiff.load(str(folder), dtype="float32")
    width, height = 96, 32
    base = dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=STEPS,
                output_resolution=RESOLUTION, width=width, height=height, use_kv_cache=False)
    ref = reference(pipe, image=images[1], latents=torch.from_numpy(noise(width, height)), **base)
    text_only = reference(pipe, **base, latents=torch.from_numpy(noise(width, height)))
    parity.assert_moves("the condition image", ref[0], text_only[0])
    got = ours.generate(PROMPT, negative_prompt="blurry", guidance=3.0, image=images[1], steps=STEPS, width=width,
                        height=height, latents=noise(width, height), output_resolution=RESOLUTION,
                        use_kv_cache=False, progress_bar=False)
    check_parity(got, *ref, "a condition image with true CFG")


def test_bad_condition_image_input(qi21_images, tmp_path):
    """strength (no image-to-image), output_resolution not a size, images sized past the processor's bounds,
    <|image_pad|> in the prompt, a folder without the image processor, a processor not the tower's: each one line."""
    import shutil
    folder, _, images = qi21_images
    ours = mlxdiff.load(str(folder), dtype="float32")
    cases = [(dict(image=images[0], strength=0.5), "condition images"),
             (dict(image=images[0], output_resolution=10), "output_resolution"),
             (dict(image=images[0], output_resolution=64.5), "output_resolution"),
             # sized past the processor's max_pixels (128^2): fewer vision tokens than the latents' image slots
             (dict(image=images[0], output_resolution=256), "must agree"),
             (dict(image=images[0], output_resolution=RESOLUTION, prompt="a <|image_pad|> fox"), "<|image_pad|>")]
    for kwargs, word in cases:
        with pytest.raises(MlxdiffError) as e:
            ours.generate(**{"prompt": PROMPT, "steps": 1, "progress_bar": False, **kwargs})
        assert "\n" not in str(e.value) and word in str(e.value), (kwargs, str(e.value))
    copy = tmp_path / "no-processor"
    shutil.copytree(folder, copy)
    (copy / "processor" / "preprocessor_config.json").unlink()
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(copy)).generate(PROMPT, image=images[0], steps=1, progress_bar=False)
    assert "\n" not in str(e.value) and "preprocessor_config.json" in str(e.value), str(e.value)
    where = copy / "processor" / "preprocessor_config.json"
    shutil.copy(folder / "processor" / "preprocessor_config.json", where)
    where.write_text(where.read_text().replace('"patch_size": 16', '"patch_size": 8'))
    with pytest.raises(MlxdiffError) as e:
        mlxdiff.load(str(copy))
    assert "\n" not in str(e.value) and "does not belong" in str(e.value), str(e.value)


def test_convert_keeps_the_vision_tower(qi21_images, tmp_path):
    """mlxdiff.convert of the folder writes the vision tower into text_encoder/ (vision.safetensors, torch's names
    and layouts): the converted folder's run with a condition image is the original's."""
    from family_files_helpers import assert_identical, converted_run
    folder, _, images = qi21_images
    width, height = 64, 64
    run = dict(image=images[0], steps=1, latents=noise(width, height), output_resolution=RESOLUTION, width=width,
               height=height, progress_bar=False)
    got = converted_run(folder, tmp_path / "converted", PROMPT, run)
    assert (tmp_path / "converted" / "text_encoder" / "vision.safetensors").is_file()
    assert_identical(got, mlxdiff.load(str(folder)).generate(PROMPT, **run), "the converted folder")
