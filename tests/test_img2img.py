"""Image-to-image. SD3.5 against diffusers' StableDiffusion3Img2ImgPipeline at two strengths; FLUX.2 (klein and dev)
against a test-side recomputation of mflux's recipe on diffusers' components: the init image resized to the output
size, its VAE latent mean patchified and bn-normalised (Flux2Pipeline._encode_vae_image), mixed with the noise at
the sigma of mflux's start step, then diffusers' transformer and scheduler from that step on. Final latents within
1e-4 and images within 2 levels; the prompt, the init image, the strength (and guidance where it acts) each shown
to move the reference (tests/parity.py).

Noise: diffusers' img2img ignores the image when `latents=` is given, so it gets a torch Generator instead; it
draws, in this order, the VAE posterior sample's noise (vae.encode(...).latent_dist.sample) and the noise that
scale_noise mixes in (prepare_latents). The test draws the same two arrays from an equally seeded Generator and
gives them to mlxdiff as `image_noise=` and `latents=`."""

import copy

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff
from twins import H as FH, TAPS, W as FW, build_pipeline, picture, text_length

H, W = 40, 24      # the SD3 tiny pipeline's test size (tests/test_sd3_pipeline.py)
PROMPT, OTHER = "a red fox in the snow", "a lighthouse by the sea"
SD3_OTHER_STRENGTH = {0.6: 0.35, 0.35: 0.6}     # another start step at 4 steps (1 <-> 2)
FLUX2_OTHER_STRENGTH = {0.6: 0.3, 0.3: 0.6}      # another start step at 3 steps (1 <-> 2)


@pytest.mark.parametrize("strength", [0.6, 0.35])
def test_sd3_img2img_matches_diffusers(sd3_tiny, strength):
    from diffusers import StableDiffusion3Img2ImgPipeline
    folder, pipe = sd3_tiny
    img2img = StableDiffusion3Img2ImgPipeline(**pipe.components)
    init = picture(30, 44, 1)                           # resized to 24x40 by both
    shape = (1, 16, H // 2, W // 2)
    g = torch.Generator().manual_seed(7)
    image_noise, noise = torch.randn(shape, generator=g).numpy(), torch.randn(shape, generator=g).numpy()

    def reference(**kw):
        final = {}

        def keep_latents(_, i, t, tensors):
            final["latents"] = tensors["latents"].numpy()
            return {}
        image = img2img(height=H, width=W, num_inference_steps=4, generator=torch.Generator().manual_seed(7),
                        output_type="np", callback_on_step_end=keep_latents, **kw).images[0]
        return final["latents"], image
    base = dict(prompt=PROMPT, image=init, strength=strength, guidance_scale=4.5)
    changes = {"the init image": dict(image=picture(30, 44, 8)), "strength": dict(strength=SD3_OTHER_STRENGTH[strength])}
    if strength == 0.6:     # the text paths are those of text-to-image: shown once, to save runs
        changes.update({"the prompt": dict(prompt=OTHER), "guidance": dict(guidance_scale=7.0)})
    ref_latents, ref = assert_inputs_matter(reference, base, changes)
    result = mlxdiff.load(str(folder)).generate(PROMPT, image=init, strength=strength, width=W, height=H, steps=4,
                                                guidance=4.5, latents=noise, image_noise=image_noise,
                                                progress_bar=False)
    assert rel_diff(result.latents, ref_latents) <= LATENT_TOL
    assert levels(result.image, ref) <= IMAGE_LEVELS
    start = int(4 - 4 * strength)
    assert any(f"steps {start + 1} to 4" in n for n in result.notes), result.notes


def test_sd3_takes_one_init_image(sd3_tiny):
    from mlxdiff.errors import MlxdiffError
    folder, _ = sd3_tiny
    with pytest.raises(MlxdiffError, match="SD3.5 image-to-image starts from one image"):
        mlxdiff.load(str(folder)).generate(PROMPT, image=[picture(24, 40, 1)] * 2, width=W, height=H, steps=2,
                                           progress_bar=False)
    kw = dict(width=W, height=H, steps=2, progress_bar=False)
    with pytest.raises(MlxdiffError, match="give image= too"):
        mlxdiff.load(str(folder)).generate(PROMPT, image_noise=np.zeros((1, 16, H // 2, W // 2)), **kw)
    with pytest.raises(MlxdiffError, match=r"image_noise has shape \(1, 16, 2, 2\), expected \(1, 16, 20, 12\)"):
        mlxdiff.load(str(folder)).generate(PROMPT, image=picture(24, 40, 1), image_noise=np.zeros((1, 16, 2, 2)),
                                           **kw)


def mflux_start(steps, strength):
    """mflux 0.24 Config.init_time_step with its image strength 1 - strength (0: text-to-image)."""
    image_strength = round(1 - strength, 9)       # the decimal a user of mflux would type
    return max(1, int(steps * image_strength)) if image_strength > 0 else 0


# Why a recipe recomputed here and not an independent reference: mflux (where the recipe comes from) cannot be
# installed beside this mlx (`pip install --dry-run mflux` on Linux: mflux 0.24.0 pins mlx 0.32.2 and pulls
# mlx-cuda-13 over our mlx 0.32.4), and diffusers 0.42.1 has no FLUX.2 img2img: its Flux2KleinInpaintPipeline
# always adds the init image's latents as reference tokens (ref_images = [image_latents_encoded]), so even an
# all-white mask is not img2img, and it has no dev variant. Every step below is diffusers' own code; only the start
# step (mflux_start) and the noising at its sigma are the recipe's.
def flux2_img2img_reference(pipe, kind, init, noise, strength, steps, guidance, prompt=PROMPT):
    """mflux's FLUX.2 img2img recipe, step by step, on diffusers' components (float32): (latents, image)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
    scheduler = copy.deepcopy(pipe.scheduler)     # the module's pipeline keeps its own
    with torch.no_grad():
        embeds, txt_ids = pipe.encode_prompt(prompt=prompt, device="cpu", max_sequence_length=text_length(kind),
                                             text_encoder_out_layers=TAPS)
        pixels = np.asarray(init.convert("RGB").resize((FW, FH), PIL.Image.LANCZOS)).astype(np.float32) / 255
        pixels = torch.from_numpy(2 * pixels - 1).permute(2, 0, 1)[None]
        clean = pipe._pack_latents(pipe._encode_vae_image(pixels, generator=None))
        noise_t = torch.from_numpy(noise)
        img_ids = pipe._prepare_latent_ids(noise_t)
        x = pipe._pack_latents(noise_t)
        n = x.shape[1]
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                           mu=compute_empirical_mu(n, steps))
        start = mflux_start(steps, strength)
        sigma = scheduler.sigmas[start]
        x = sigma * x + (1 - sigma) * clean
        scheduler.set_begin_index(start)
        g = torch.full([1], guidance) if kind == "dev" else None
        for t in scheduler.timesteps[start:]:
            v = pipe.transformer(hidden_states=x, timestep=t.expand(1) / 1000, guidance=g,
                                 encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids,
                                 return_dict=False)[0]
            x = scheduler.step(v, t, x, return_dict=False)[0]
        latents = x.permute(0, 2, 1).reshape(noise_t.shape)
        mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        image = pipe.vae.decode(pipe._unpatchify_latents(latents * std + mean), return_dict=False)[0]
        return latents.numpy(), pipe.image_processor.postprocess(image, output_type="np")[0]


@pytest.fixture(scope="module", params=["klein_distilled", "dev"])
def flux2_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"i2i_{request.param}"))


@pytest.mark.parametrize("strength", [0.6, 0.3])
def test_flux2_img2img_matches_mflux_recipe(flux2_pipeline, strength):
    kind, folder, pipe = flux2_pipeline
    init = picture(52, 30, 2)                           # resized (squashed) to 40x24, as mflux does
    noise = np.random.default_rng(5).standard_normal((1, 20, FH // 4, FW // 4)).astype(np.float32)
    guidance = 3.5 if kind == "dev" else 1.0
    base = dict(init=init, strength=strength, guidance=guidance, prompt=PROMPT)
    changes = {"the init image": dict(init=picture(52, 30, 8)), "strength": dict(strength=FLUX2_OTHER_STRENGTH[strength]),
               "the prompt": dict(prompt=OTHER)}
    if kind == "dev":       # klein distilled runs without guidance
        changes["guidance"] = dict(guidance=5.0)
    ref_latents, ref = assert_inputs_matter(
        lambda init, strength, guidance, prompt: flux2_img2img_reference(pipe, kind, init, noise, strength, 3,
                                                                         guidance, prompt), base, changes)
    result = mlxdiff.load(str(folder)).generate(PROMPT, image=init, strength=strength, width=FW, height=FH,
                                                steps=3, guidance=guidance, latents=noise,
                                                max_sequence_length=text_length(kind), text_encoder_out_layers=TAPS,
                                                progress_bar=False)
    assert rel_diff(result.latents, ref_latents) <= LATENT_TOL
    assert levels(result.image, ref) <= IMAGE_LEVELS
    assert any(f"steps {mflux_start(3, strength) + 1} to 3" in n for n in result.notes), result.notes


def test_flux2_strength_one_is_text_to_image(flux2_pipeline):
    """strength 1: the init image is mixed with weight 0 at sigma 1, so the run is the text-to-image run."""
    kind, folder, _ = flux2_pipeline
    noise = np.random.default_rng(6).standard_normal((1, 20, FH // 4, FW // 4)).astype(np.float32)
    pipe = mlxdiff.load(str(folder))
    kw = dict(width=FW, height=FH, steps=1, latents=noise, max_sequence_length=text_length(kind),
              text_encoder_out_layers=TAPS, progress_bar=False)
    plain = pipe.generate(PROMPT, **kw)
    full = pipe.generate(PROMPT, image=picture(40, 24, 3), strength=1.0, **kw)
    assert np.array_equal(plain.latents, full.latents)
