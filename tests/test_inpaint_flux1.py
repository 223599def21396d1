"""FLUX.1 latent inpainting (dev, schnell, Krea; not Fill): mlxdiff's Flux1Pipeline with image= and mask= against
diffusers' FluxInpaintPipeline on a tiny FLUX.1 dev folder (tests/flux1_helpers.flux1_components), at strength
0.6 and at 1.0 with true CFG, an image and a mask each of another size than the output; Kontext refuses a mask.

Noise: FluxInpaintPipeline ignores the image when `latents=` is given, so it gets a torch Generator; it draws, in
this order, the init image's VAE posterior noise and the noise scale_noise mixes in (and each step's blend). The test
draws the same two arrays from an equally seeded Generator and gives them to mlxdiff as `image_noise=` and `latents=`
(packed); the third draw (the masked image's posterior) feeds only masked_image_latents, which its loop never
reads."""

import re

import pytest
import torch

import mlxdiff
import parity
from mlxdiff.generate import main
from helpers import max_rel_err
from flux1_helpers import H, LATENT, W, flux1_components
from zimage_helpers import mask_picture
from twins import picture

IMAGE, MASK = (30, 44), (20, 35)        # both resized to 24 x 40 (the output)
PROMPT = "a red fox in the snow"
STEPS = 3
SEQ = 64


@pytest.fixture(scope="module")
def flux1_inpaint(tmp_path_factory):
    """(folder, diffusers' FluxInpaintPipeline read from it, mlxdiff's pipeline) of a tiny FLUX.1 dev."""
    from diffusers import FluxInpaintPipeline, FluxPipeline
    folder = tmp_path_factory.mktemp("flux1_inpaint")
    FluxPipeline(**flux1_components("dev", seed=3)).save_pretrained(str(folder))
    return folder, FluxInpaintPipeline.from_pretrained(str(folder)), mlxdiff.load(str(folder), dtype="float32")


def draws(pipe, seed):
    """(image_noise (1, C, H/2, W/2), packed noise): FluxInpaintPipeline's first two draws."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, LATENT, H // 2, W // 2)
    posterior, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return posterior.numpy(), pipe._pack_latents(noise, 1, LATENT, H // 2, W // 2).numpy()


def reference(pipe, seed, **kw):
    """diffusers' run: (final latents unpacked to the VAE's layout, image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"]
        return {}
    image = pipe(height=H, width=W, num_inference_steps=STEPS, max_sequence_length=SEQ, output_type="np",
                 generator=torch.Generator().manual_seed(seed), callback_on_step_end=keep_latents, **kw).images[0]
    return pipe._unpack_latents(final["latents"], H, W, pipe.vae_scale_factor).numpy(), image


@pytest.mark.parametrize("strength,negative", [(0.6, None), (1.0, "blurry")], ids=["s0.6", "s1.0_true_cfg"])
def test_inpaint_matches_diffusers(flux1_inpaint, strength, negative):
    """The mask, the init image and the prompt each move diffusers' result (with true CFG: the mask and the negative
    prompt)."""
    _, pipe, ours = flux1_inpaint
    init, mask = picture(*IMAGE, 4), mask_picture(*MASK)
    image_noise, noise = draws(pipe, 11)
    base = dict(prompt=PROMPT, image=init, mask_image=mask, strength=strength, guidance_scale=3.5)
    changes = {"the mask": dict(mask_image=mask_picture(MASK[1], MASK[0]))}
    if negative:     # the init image and the prompt are shown at 0.6; here what true CFG adds
        base.update(negative_prompt=negative, true_cfg_scale=2.5)
        changes["the negative prompt"] = dict(negative_prompt="sharp, vivid colours")
    else:
        changes.update({"the init image": dict(image=picture(*IMAGE, 14)),
                        "the prompt": dict(prompt="a lighthouse by the sea")})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference(pipe, 11, **kw), base, changes)
    got = ours.generate(PROMPT, negative_prompt=negative, true_cfg_scale=2.5, image=init, mask=mask,
                        strength=strength, width=W, height=H, steps=STEPS, guidance=3.5, latents=noise,
                        image_noise=image_noise, max_sequence_length=SEQ, progress_bar=False)
    err, shift = max_rel_err(got.latents, ref_latents), parity.levels(got.image, ref)
    print(f"FLUX.1 inpaint strength {strength}: latents max_rel_err {err:.2e}, image {shift}/255")
    assert err <= parity.LATENT_TOL and shift <= parity.IMAGE_LEVELS
    assert any(n.startswith("inpainting where #1 (a PIL image) is white") and
               f"strength {strength:g}, steps {int(STEPS - STEPS * strength) + 1} to {STEPS}" in n
               for n in got.notes), got.notes


def test_default_strength_is_the_inpaint_pipelines(flux1_inpaint):
    """No strength with a mask: FluxInpaintPipeline's 0.6."""
    _, _, ours = flux1_inpaint
    got = ours.generate(PROMPT, image=picture(*IMAGE, 2), mask=mask_picture(*MASK), width=W, height=H, steps=5,
                        max_sequence_length=SEQ, progress_bar=False)
    assert any("strength 0.6, steps 3 to 5" in n for n in got.notes), got.notes


def test_kontext_takes_no_mask(flux1_inpaint, tmp_path, capsys):
    """A FluxKontextPipeline folder (model_index.json says so) refuses a mask and outpainting in one line, exit 2
    through the CLI."""
    import json
    import shutil
    folder, _, _ = flux1_inpaint
    copy = tmp_path / "kontext"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    kontext = mlxdiff.load(str(copy), dtype="float32")
    for given, flag in ((dict(mask=mask_picture(*MASK)), "mask"), (dict(outpaint=(0, 0, 8, 0)), "outpaint")):
        with pytest.raises(mlxdiff.MlxdiffError, match=re.escape(f"{flag}: this FLUX.1 Kontext model takes no mask"
                                                                 )) as e:
            kontext.generate(PROMPT, image=picture(*IMAGE, 1), steps=1, progress_bar=False, **given)
        assert "\n" not in str(e.value)
    image, mask, out = tmp_path / "in.png", tmp_path / "mask.png", tmp_path / "out.png"
    picture(*IMAGE, 1).save(image)
    mask_picture(*MASK).save(mask)
    assert main(["--model", str(copy), "--prompt", PROMPT, "--image", str(image), "--mask", str(mask), "--steps", "1",
                 "--no-progress", "--output", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "mask: this FLUX.1 Kontext model takes no mask" in lines[0], lines
    assert not out.exists()
