"""End to end: mlxdiff's FLUX.1 pipeline against diffusers' FluxPipeline on the same injected noise, for dev
(embedded guidance, dynamic shifting), schnell (neither) and true CFG with a negative prompt."""

import numpy as np
import pytest
import torch

import mlxdiff
import parity
from helpers import max_rel_err, randomize_
from mlxdiff.errors import MlxdiffError
import fixture_guard
from flux1_helpers import H, LATENT, W, check_parity, flux1_components, packed_noise, reference_run


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['flux1_tiny', 'kontext_tiny', 'fill_tiny', 'control_tiny'])


@pytest.fixture(scope="module", params=["dev", "schnell"])
def flux1_tiny(request, tmp_path_factory):
    """(variant, folder, diffusers pipeline read back from the folder)."""
    from diffusers import FluxPipeline
    folder = tmp_path_factory.mktemp(f"flux1_{request.param}")
    FluxPipeline(**flux1_components(request.param)).save_pretrained(str(folder))
    return request.param, folder, FluxPipeline.from_pretrained(str(folder))


@pytest.mark.parametrize("case", ["guidance", "true_cfg"])
def test_pipeline_matches_diffusers(flux1_tiny, case):
    variant, folder, pipe = flux1_tiny
    noise = packed_noise(1)
    sequence = 512 if variant == "dev" else 256       # our defaults: dev's and schnell's
    base = dict(prompt="a red fox in the snow", num_inference_steps=3, guidance_scale=3.5,
                max_sequence_length=sequence)
    ours_kw = dict(steps=3, guidance=3.5)
    changes = {"the prompt": dict(prompt="a blue car in the desert")}
    if variant == "dev":        # schnell has no guidance embedder: diffusers and mlxdiff ignore the scale
        changes["the embedded guidance"] = dict(guidance_scale=1.5)
    if case == "true_cfg":
        base.update(negative_prompt="blurry, low quality", true_cfg_scale=2.5)
        ours_kw.update(negative_prompt="blurry, low quality", true_cfg_scale=2.5)
        changes.update({"the negative prompt": dict(negative_prompt="sharp, vivid colours"),
                        "true_cfg_scale": dict(true_cfg_scale=1.5)})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate(base["prompt"], width=W, height=H, latents=noise, progress_bar=False,
                                                **ours_kw)
    check_parity(result, ref_latents, ref, f"{variant} {case}")
    assert set(result.timings) == {"encode", "denoise", "decode"}


# dev alone: flux1_components builds both variants' CLIP and T5 from the same seed (they differ in the transformer and
# the scheduler only), and the sequence length is given, so schnell's encode is the same run on the same weights
@pytest.mark.parametrize("flux1_tiny", ["dev"], indirect=True)
def test_encode_prompt_matches_diffusers(flux1_tiny):
    variant, folder, pipe = flux1_tiny
    long_prompt = "a very long prompt " * 40      # over CLIP's 77 tokens and T5's 256
    ours_pipe = mlxdiff.load(str(folder))
    for prompt in ("a cat", long_prompt):
        pe, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=256)
        ours = ours_pipe.encode_prompt(prompt, max_sequence_length=256).as_numpy()
        assert max_rel_err(ours["prompt_embeds"], pe.detach().numpy()) <= 1e-4
        assert max_rel_err(ours["pooled_prompt_embeds"], pooled.detach().numpy()) <= 1e-4


def test_defaults_are_the_variants(flux1_tiny):
    variant, folder, _ = flux1_tiny
    pipe = mlxdiff.load(str(folder))
    assert pipe.defaults() == ({"steps": 28, "guidance": 3.5} if variant == "dev" else {"steps": 4, "guidance": 0.0})
    assert pipe.default_sequence_length() == (512 if variant == "dev" else 256)


# dev alone: schnell's latents pass the same FLUX.1 shape check (the variants differ in guidance and schedule only)
@pytest.mark.parametrize("flux1_tiny", ["dev"], indirect=True)
def test_latents_of_another_shape_are_one_line(flux1_tiny):
    _, folder, _ = flux1_tiny
    with pytest.raises(MlxdiffError, match="packed layout"):
        mlxdiff.load(str(folder)).generate("a cat", width=W, height=H, steps=1,
                                           latents=np.zeros((1, LATENT, H // 2, W // 2), np.float32))


# -- Kontext: reference-image editing (FluxKontextPipeline) ------------------------------------------------------------

@pytest.fixture(scope="module")
def kontext_tiny(tmp_path_factory):
    from diffusers import FluxKontextPipeline
    folder = tmp_path_factory.mktemp("flux1_kontext")
    FluxKontextPipeline(**flux1_components("dev", seed=2)).save_pretrained(str(folder))
    return folder, FluxKontextPipeline.from_pretrained(str(folder))


def reference_picture(width, height, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


@pytest.mark.parametrize("case", ["own_size", "other_size_cfg"])
def test_kontext_matches_diffusers(kontext_tiny, case):
    """The reference at its own size (auto_resize=False: the preferred Kontext resolutions are 1 MP, too many tokens
    for a CPU test) beside the noise tokens, the output area kept (max_area = H x W); and a reference of another size
    (cut to a multiple of 4 pixels here) with true CFG. The reference image, the prompt (and the negative prompt)
    each move diffusers' result."""
    folder, pipe = kontext_tiny
    size, seed = ((28, 44), 0) if case == "own_size" else ((37, 30), 1)
    noise = packed_noise(5)
    base = dict(image=reference_picture(*size, seed=seed), prompt="make it a watercolor", num_inference_steps=3,
                guidance_scale=2.5, max_area=H * W, _auto_resize=False, max_sequence_length=512)
    ours_kw = dict(steps=3, guidance=2.5, max_area=H * W, auto_resize=False)
    changes = {"the reference image": dict(image=reference_picture(*size, seed=seed + 20)),
               "the prompt": dict(prompt="a pencil sketch of it")}
    if case == "other_size_cfg":
        base.update(negative_prompt="blurry", true_cfg_scale=2.0)
        ours_kw.update(negative_prompt="blurry", true_cfg_scale=2.0)
        changes["the negative prompt"] = dict(negative_prompt="sharp, vivid colours")
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate(base["prompt"], image=base["image"], width=W, height=H,
                                                latents=noise, progress_bar=False, **ours_kw)
    check_parity(result, ref_latents, ref, f"kontext {case}")


# flux1_tiny is only the non-Kontext pipeline refusing max_area (the same FLUX.1 check for dev and schnell): dev alone
@pytest.mark.parametrize("flux1_tiny", ["dev"], indirect=True)
def test_kontext_size_and_inputs(kontext_tiny, flux1_tiny):
    folder, _ = kontext_tiny
    pipe = mlxdiff.load(str(folder))
    # diffusers' sizing: the requested aspect at max_area pixels, cut to a multiple of the VAE factor x 2
    result = pipe.generate("a cat", width=W, height=H, steps=1, max_area=2 * H * W, progress_bar=False)
    assert result.image.size == (round((2 * H * W * W / H) ** 0.5) // 4 * 4, round((2 * H * W * H / W) ** 0.5) // 4 * 4)
    with pytest.raises(MlxdiffError, match="FLUX.1 Kontext edits the image it is given"):
        pipe.generate("a cat", image=reference_picture(16, 16), strength=0.5, width=W, height=H, steps=1)
    with pytest.raises(MlxdiffError, match="edits one reference image"):
        pipe.generate("a cat", image=[reference_picture(16, 16)] * 2, width=W, height=H, steps=1)
    _, other, _ = flux1_tiny
    with pytest.raises(MlxdiffError, match="max_area: an option of FLUX.1 Kontext only"):
        mlxdiff.load(str(other)).generate("a cat", width=W, height=H, steps=1, max_area=H * W)


# -- Fill: inpainting and outpainting (FluxFillPipeline) --------------------------------------------------------------

@pytest.fixture(scope="module")
def fill_tiny(tmp_path_factory):
    """A tiny FluxFillPipeline: the transformer takes 4 x 5 noise + 4 x 5 masked-image + 4 x 2 x 2 mask channels
    (56; the real 64 + 64 + 256) and gives 20."""
    from diffusers import FluxFillPipeline, FluxTransformer2DModel
    components = flux1_components("dev", seed=6)
    torch.manual_seed(6)
    components["transformer"] = randomize_(FluxTransformer2DModel(
        patch_size=1, in_channels=8 * LATENT + 16, out_channels=4 * LATENT, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=3, joint_attention_dim=44, pooled_projection_dim=36,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)), seed=61, scale=0.15).eval()
    folder = tmp_path_factory.mktemp("flux1_fill")
    FluxFillPipeline(**components).save_pretrained(str(folder))
    return folder, FluxFillPipeline.from_pretrained(str(folder))


def fill_mask_picture(width, height, box):
    from PIL import Image, ImageDraw
    mask = Image.new("L", (width, height), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


# Fill's own default guidance is 30: its embedding's sinusoid of 30 x 1000 rounds in float32 differently in MLX and
# torch (an ulp of 30000 is 2e-3 rad), which gave 5.8e-5 / 6.1e-5 here against 4e-6 at 3.5; the parity runs at 3.5
GUIDANCE = 3.5


@pytest.mark.parametrize("case", ["inpaint", "outpaint"])
def test_fill_matches_diffusers(fill_tiny, case):
    """The image with the mask's area blanked, its VAE posterior sampled with the same noise diffusers draws from
    its generator, the mask's pixel patches: inpainting a box, and outpainting a padded border. The mask, the image
    and the prompt each move diffusers' result."""
    from PIL import Image
    folder, pipe = fill_tiny
    image = reference_picture(W, H, seed=3)
    if case == "inpaint":
        mask = fill_mask_picture(W, H, (5, 9, 17, 30))
    else:       # the picture in the middle of a padded canvas; the mask covers the pad
        inner = reference_picture(W - 8, H - 12, seed=4)
        image = Image.new("RGB", (W, H), (127, 127, 127))
        image.paste(inner, (4, 6))
        mask = Image.new("L", (W, H), 255)
        mask.paste(0, (4, 6, W - 4, H - 6))
    noise = packed_noise(7)
    posterior = torch.randn((1, LATENT, H // 2, W // 2), generator=torch.Generator().manual_seed(8))
    base = dict(image=image, mask_image=mask, prompt="a red door", num_inference_steps=3, guidance_scale=GUIDANCE,
                max_sequence_length=512, generator_seed=8)
    changes = {"the mask": dict(mask_image=fill_mask_picture(W, H, (0, 0, 8, 8))),
               "the image": dict(image=reference_picture(W, H, seed=13)),
               "the prompt": dict(prompt="a green window")}
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate("a red door", image=image, mask=mask, steps=3, guidance=GUIDANCE,
                                                latents=noise, image_noise=posterior.numpy(), progress_bar=False)
    assert result.image.size == (W, H)                       # the image's size by default
    check_parity(result, ref_latents, ref, f"fill {case}")


# flux1_tiny is only the non-Fill pipeline refusing a mask without an image (the same FLUX.1 check for dev and
# schnell): dev alone, so the Fill checks run once
@pytest.mark.parametrize("flux1_tiny", ["dev"], indirect=True)
def test_fill_inputs_are_one_line(fill_tiny, flux1_tiny):
    folder, _ = fill_tiny
    pipe = mlxdiff.load(str(folder))
    assert pipe.defaults() == {"steps": 50, "guidance": 30.0}
    image = reference_picture(W, H)
    with pytest.raises(MlxdiffError, match="give both --image and --mask"):
        pipe.generate("a cat", image=image, steps=1)
    with pytest.raises(MlxdiffError, match="give both --image and --mask"):
        pipe.generate("a cat", steps=1, width=W, height=H)
    # a mask of another size is resized to the output's, as diffusers' mask_processor does, with a note
    other_size = pipe.generate("a cat", image=image, mask=fill_mask_picture(W + 4, H, (0, 0, 4, 4)), steps=1,
                               progress_bar=False)
    assert other_size.image.size == (W, H) and any("another aspect ratio" in n for n in other_size.notes)
    _, other, _ = flux1_tiny       # dev and schnell inpaint too (FluxInpaintPipeline: tests/test_inpaint_flux1.py)
    with pytest.raises(MlxdiffError, match=r"mask: a mask says where to repaint an image; give image= \(--image\)"):
        mlxdiff.load(str(other)).generate("a cat", mask=fill_mask_picture(W, H, (0, 0, 4, 4)), steps=1)


# -- Depth / Canny: a control image on the channels (FluxControlPipeline) ---------------------------------------------

@pytest.fixture(scope="module")
def control_tiny(tmp_path_factory):
    """A tiny FluxControlPipeline: the transformer takes the noise and the control image's latents (8 x 5, the real
    2 x 64) and gives 20."""
    from diffusers import FluxControlPipeline, FluxTransformer2DModel
    components = flux1_components("dev", seed=7)
    torch.manual_seed(7)
    components["transformer"] = randomize_(FluxTransformer2DModel(
        patch_size=1, in_channels=8 * LATENT, out_channels=4 * LATENT, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=3, joint_attention_dim=44, pooled_projection_dim=36,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)), seed=71, scale=0.15).eval()
    folder = tmp_path_factory.mktemp("flux1_control")
    FluxControlPipeline(**components).save_pretrained(str(folder))
    return folder, FluxControlPipeline.from_pretrained(str(folder))


def test_control_matches_diffusers(control_tiny):
    """The control image (another size: resized to the output's) encoded with the posterior noise diffusers draws
    from its generator, on the noise tokens' channels. The control image and the prompt each move diffusers'
    result."""
    folder, pipe = control_tiny
    control = reference_picture(30, 50, seed=8)
    noise = packed_noise(9)
    posterior = torch.randn((1, LATENT, H // 2, W // 2), generator=torch.Generator().manual_seed(10))
    base = dict(control_image=control, prompt="a lighthouse", num_inference_steps=3, guidance_scale=3.5,
                max_sequence_length=512, generator_seed=10)
    changes = {"the control image": dict(control_image=reference_picture(30, 50, seed=11)),
               "the prompt": dict(prompt="a red barn")}
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    result = mlxdiff.load(str(folder)).generate("a lighthouse", image=control, width=W, height=H, steps=3,
                                                guidance=3.5, latents=noise, image_noise=posterior.numpy(),
                                                progress_bar=False)
    check_parity(result, ref_latents, ref, "control")
    with pytest.raises(MlxdiffError, match="draw from a control image"):
        mlxdiff.load(str(folder)).generate("a lighthouse", width=W, height=H, steps=1)
    with pytest.raises(MlxdiffError, match="one control image"):
        mlxdiff.load(str(folder)).generate("a lighthouse", image=control, strength=0.5, width=W, height=H, steps=1)
