"""End to end: mlxdiff's SD3 pipeline against diffusers' StableDiffusion3Pipeline on the same injected noise: final
latents within 1e-4 and images within 2 levels, the prompt, negative prompt, CFG scale and skip-layer guidance each
shown to move diffusers' own output (tests/parity.py)."""

import gc
import numpy as np
import pytest
import torch

import mlxdiff
from helpers import max_rel_err
from parity import IMAGE_LEVELS, LATENT_TOL, assert_inputs_matter, levels, rel_diff

H, W = 40, 24  # non-square; multiples of vae_scale_factor (2) * patch_size (2)


def _noise(seed, batch=1):
    return np.random.default_rng(seed).standard_normal((batch, 16, H // 2, W // 2)).astype(np.float32)


def _diffusers(pipe, noise, **kw):
    """diffusers' run from the injected noise: (its final latents, before the VAE's scaling is undone, as mlxdiff's
    Result.latents; its HWC float image in [0, 1])."""
    final = {}

    def keep_latents(_, i, t, tensors):
        final["latents"] = tensors["latents"].numpy()
        return {}
    out = pipe(height=H, width=W, latents=torch.from_numpy(noise), output_type="np",
               callback_on_step_end=keep_latents, **kw)
    return final["latents"], out.images[0]


def _ours(folder, noise, **kw):
    return mlxdiff.load(str(folder)).generate(width=W, height=H, latents=noise, progress_bar=False, **kw)


SLG = dict(skip_guidance_layers=[1], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=0.8,
           skip_layer_guidance_scale=2.0)


@pytest.mark.parametrize("case", ["cfg_negative", "no_cfg", "skip_layer_guidance"])
def test_pipeline_matches_diffusers(sd3_tiny, case):
    folder, pipe = sd3_tiny
    noise = _noise(1)
    kw = dict(prompt="a red fox in the snow", num_inference_steps=4, guidance_scale=4.5)
    ours_kw = dict(prompt="a red fox in the snow", steps=4, guidance=4.5)
    changes = {"the prompt": dict(prompt="a lighthouse by the sea")}
    if case == "cfg_negative":
        kw["negative_prompt"] = ours_kw["negative_prompt"] = "blurry, low quality"
        changes.update({"the negative prompt": dict(negative_prompt=None),    # diffusers' uncond is then ""
                        "guidance": dict(guidance_scale=7.0)})
    if case == "no_cfg":
        kw["guidance_scale"] = ours_kw["guidance"] = 1.0
    if case == "skip_layer_guidance":
        kw.update(SLG)
        ours_kw.update(SLG)
        changes = {"the skip-layer guidance scale": dict(skip_layer_guidance_scale=4.0),
                   "the skipped layer": dict(skip_guidance_layers=[2])}
    ref_latents, ref = assert_inputs_matter(lambda **k: _diffusers(pipe, noise, **k), kw, changes)
    result = _ours(folder, noise, **ours_kw)
    assert rel_diff(result.latents, ref_latents) <= LATENT_TOL
    assert levels(result.image, ref) <= IMAGE_LEVELS
    assert set(result.timings) == {"encode", "denoise", "decode"}


def test_encode_prompt_matches_diffusers(sd3_tiny):
    folder, pipe = sd3_tiny
    long_prompt = "a very long prompt " * 40  # over both CLIP's 77 and T5's 256 token limits
    for prompt, neg in (("a cat", "dog"), (long_prompt, "")):
        ref = pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None, negative_prompt=neg,
                                 do_classifier_free_guidance=True)
        cond = mlxdiff.load(str(folder)).encode_prompt(prompt, neg)
        ours = cond.as_numpy()
        for name, r in zip(("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                            "negative_pooled_prompt_embeds"), ref):
            assert max_rel_err(ours[name], r.detach().numpy()) <= 1e-4, name


def test_truncation_reported_once(sd3_tiny, capsys):
    folder, _ = sd3_tiny
    mlxdiff.load(str(folder)).encode_prompt("a very long prompt " * 40, None)
    err = capsys.readouterr().err
    assert err.count("warning: prompt longer") == 1


def test_text_encoders_released_before_denoiser(sd3_tiny):
    """After the encode phase MLX's active memory is back near zero: no encoder weights survive into denoise."""
    import mlx.core as mx
    folder, _ = sd3_tiny
    pipe = mlxdiff.load(str(folder))      # specs only: no weights yet
    # what the process holds before the run (arrays earlier tests in this worker left): not this run's
    gc.collect()
    baseline = mx.get_active_memory()
    seen = {}

    def callback(step, t, latents):
        seen.setdefault("active_at_first_step", mx.get_active_memory())

    result = pipe.generate("a cat", width=W, height=H, steps=2, guidance=3.0, latents=_noise(2), callback=callback,
                           progress_bar=False)
    enc_bytes = sum(pipe.components[n].nbytes() for n in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    den_bytes = pipe.components["transformer"].nbytes()
    # after encode: only the conditioning (a few KB) may remain, far below the encoders' weights
    assert result.memory["encode"]["after"] - baseline < 0.05 * enc_bytes
    # during denoise: transformer weights + activations, but not the encoders (which are larger than all of it here)
    assert seen["active_at_first_step"] - baseline < den_bytes * 4 + 2_000_000
    assert result.memory["decode"]["after"] - baseline < 0.05 * enc_bytes


def test_bf16_stays_finite_and_close(sd3_tiny):
    """bfloat16 compute (the GPU default) against float32: as close as diffusers' own bfloat16 run is to its float32
    run on the same folder and noise. (Before the float32 weights of this tiny model were cast to the compute dtype,
    they silently promoted the activations to float32, and the "bf16" run was 6.0e-3 from float32.)"""
    import copy
    folder, pipe = sd3_tiny
    noise = _noise(3)
    kw = dict(width=W, height=H, steps=2, guidance=4.0, latents=noise, progress_bar=False)
    f32 = mlxdiff.load(str(folder)).generate("a cat", **kw)
    bf16 = mlxdiff.load(str(folder), dtype="bfloat16").generate("a cat", **kw)
    assert np.isfinite(bf16.latents).all()
    theirs = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = pipe if dtype == pipe.transformer.dtype else copy.deepcopy(pipe).to(dtype)   # the fixture's own: float32
        theirs[dtype] = ref(prompt="a cat", height=H, width=W, num_inference_steps=2, guidance_scale=4.0,
                            latents=torch.from_numpy(noise).to(dtype), output_type="latent").images.float().numpy()
    their_err = max_rel_err(theirs[torch.bfloat16], theirs[torch.float32])
    ours_err = max_rel_err(bf16.latents, f32.latents)
    print(f"bf16 vs float32 latents: mlxdiff {ours_err:.2e}, diffusers {their_err:.2e}")
    # a broken bf16 path gives O(1) errors; a correct one stays within twice diffusers' own bf16 error
    assert ours_err < 2 * their_err + 1e-3, (ours_err, their_err)
    diff = np.abs(np.asarray(bf16.image, np.int16) - np.asarray(f32.image, np.int16)).max()
    assert diff <= 4
