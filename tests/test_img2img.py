"""Image-to-image. SD3.5 against diffusers' StableDiffusion3Img2ImgPipeline at two strengths; FLUX.2 (klein and dev;
diffusers has no FLUX.2 img2img pipeline) against a test-side recomputation of mflux's recipe on diffusers'
components: the init image resized to the output size, its VAE latent mean patchified and bn-normalised
(Flux2Pipeline._encode_vae_image), mixed with the noise at the sigma of mflux's start step, then diffusers'
transformer and scheduler from that step on.

Noise: diffusers' img2img ignores the image when `latents=` is given, so it gets a torch Generator instead; it
draws, in this order, the VAE posterior sample's noise (vae.encode(...).latent_dist.sample) and the noise that
scale_noise mixes in (prepare_latents). The test draws the same two arrays from an equally seeded Generator and
gives them to mlxdiff as `image_noise=` and `latents=`."""

import numpy as np
import PIL.Image
import pytest
import torch

import mlxdiff
from helpers import max_rel_err
from twins import H as FH, SEQ, TAPS, W as FW, build_pipeline, picture

H, W = 40, 24      # the SD3 tiny pipeline's test size (tests/test_sd3_pipeline.py)
PROMPT = "a red fox in the snow"


def _u8(ref):
    return (ref * 255).round() / 255.0


@pytest.mark.parametrize("strength", [0.6, 0.35])
def test_sd3_img2img_matches_diffusers(sd3_tiny, strength):
    from diffusers import StableDiffusion3Img2ImgPipeline
    folder, pipe = sd3_tiny
    img2img = StableDiffusion3Img2ImgPipeline(**pipe.components)
    init = picture(30, 44, 1)                           # resized to 24x40 by both
    shape = (1, 16, H // 2, W // 2)
    g = torch.Generator().manual_seed(7)
    image_noise, noise = torch.randn(shape, generator=g).numpy(), torch.randn(shape, generator=g).numpy()
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].numpy()
        return {}
    ref = img2img(prompt=PROMPT, image=init, strength=strength, height=H, width=W, num_inference_steps=4,
                  guidance_scale=4.5, generator=torch.Generator().manual_seed(7), output_type="np",
                  callback_on_step_end=keep_latents).images[0]
    result = mlxdiff.load(str(folder)).generate(PROMPT, image=init, strength=strength, width=W, height=H, steps=4,
                                                guidance=4.5, latents=noise, image_noise=image_noise,
                                                progress_bar=False)
    ours = np.asarray(result.image).astype(np.float32) / 255.0
    assert ours.shape == ref.shape
    assert np.abs(ours - _u8(ref)).max() <= 2 / 255
    assert max_rel_err(result.latents, final["latents"]) <= 1e-4
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


def flux2_img2img_reference(pipe, kind, init, noise, strength, steps, guidance):
    """mflux's FLUX.2 img2img recipe, step by step, on diffusers' components (float32)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
    with torch.no_grad():
        embeds, txt_ids = pipe.encode_prompt(prompt=PROMPT, device="cpu", max_sequence_length=SEQ,
                                             text_encoder_out_layers=TAPS)
        pixels = np.asarray(init.convert("RGB").resize((FW, FH), PIL.Image.LANCZOS)).astype(np.float32) / 255
        pixels = torch.from_numpy(2 * pixels - 1).permute(2, 0, 1)[None]
        clean = pipe._pack_latents(pipe._encode_vae_image(pixels, generator=None))
        noise_t = torch.from_numpy(noise)
        img_ids = pipe._prepare_latent_ids(noise_t)
        x = pipe._pack_latents(noise_t)
        n = x.shape[1]
        retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                           mu=compute_empirical_mu(n, steps))
        start = mflux_start(steps, strength)
        sigma = pipe.scheduler.sigmas[start]
        x = sigma * x + (1 - sigma) * clean
        pipe.scheduler.set_begin_index(start)
        g = torch.full([1], guidance) if kind == "dev" else None
        for t in pipe.scheduler.timesteps[start:]:
            v = pipe.transformer(hidden_states=x, timestep=t.expand(1) / 1000, guidance=g,
                                 encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids,
                                 return_dict=False)[0]
            x = pipe.scheduler.step(v, t, x, return_dict=False)[0]
        latents = x.permute(0, 2, 1).reshape(noise_t.shape)
        mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        image = pipe.vae.decode(pipe._unpatchify_latents(latents * std + mean), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")[0], latents.numpy()


@pytest.fixture(scope="module", params=["klein_distilled", "dev"])
def flux2_pipeline(request, tmp_path_factory):
    return build_pipeline(request.param, tmp_path_factory.mktemp(f"i2i_{request.param}"))


@pytest.mark.parametrize("strength", [0.6, 0.3])
def test_flux2_img2img_matches_mflux_recipe(flux2_pipeline, strength):
    kind, folder, pipe = flux2_pipeline
    init = picture(52, 30, 2)                           # resized (squashed) to 40x24, as mflux does
    noise = np.random.default_rng(5).standard_normal((1, 20, FH // 4, FW // 4)).astype(np.float32)
    guidance = 3.5 if kind == "dev" else 1.0
    ref, ref_latents = flux2_img2img_reference(pipe, kind, init, noise, strength, 3, guidance)
    result = mlxdiff.load(str(folder)).generate(PROMPT, image=init, strength=strength, width=FW, height=FH,
                                                steps=3, guidance=guidance, latents=noise, max_sequence_length=SEQ,
                                                text_encoder_out_layers=TAPS, progress_bar=False)
    ours = np.asarray(result.image).astype(np.float32) / 255.0
    assert ours.shape == ref.shape
    assert np.abs(ours - _u8(ref)).max() <= 2 / 255
    assert max_rel_err(result.latents, ref_latents) <= 1e-4
    assert any(f"steps {mflux_start(3, strength) + 1} to 3" in n for n in result.notes), result.notes


def test_flux2_strength_one_is_text_to_image(flux2_pipeline):
    """strength 1: the init image is mixed with weight 0 at sigma 1, so the run is the text-to-image run."""
    kind, folder, _ = flux2_pipeline
    noise = np.random.default_rng(6).standard_normal((1, 20, FH // 4, FW // 4)).astype(np.float32)
    pipe = mlxdiff.load(str(folder))
    kw = dict(width=FW, height=FH, steps=1, latents=noise, max_sequence_length=SEQ, text_encoder_out_layers=TAPS,
              progress_bar=False)
    plain = pipe.generate(PROMPT, **kw)
    full = pipe.generate(PROMPT, image=picture(40, 24, 3), strength=1.0, **kw)
    assert np.array_equal(plain.latents, full.latents)
