"""End to end: mlxdiff's Z-Image pipeline against diffusers' ZImagePipeline on the same injected noise, at a tiny
config: no CFG (guidance 0, Z-Image-Turbo's way) and CFG with a negative prompt; and the prompt embeddings against
diffusers' `_encode_prompt` (hidden_states[-2] of the Qwen3 encoder, each row's valid tokens)."""

import numpy as np
import pytest
import torch

import parity
from helpers import max_rel_err
import fixture_guard
from zimage_helpers import H, LATENT, SEQ, TEXT, W, check_parity, reference_run
from zimage_helpers import zimage_tiny  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def _shared_fixtures_unchanged(request):
    """The module's shared fixtures are left as built (fixture_guard)."""
    yield from fixture_guard.unchanged(request, ['zimage_tiny'])


def test_encode_prompt_matches_diffusers(zimage_tiny):
    _, pipe, ours = zimage_tiny
    prompts = ["a red fox in the snow", "a lighthouse"]
    with torch.no_grad():
        ref = pipe._encode_prompt(list(prompts), device="cpu", max_sequence_length=SEQ)
    got = ours.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=SEQ).as_numpy()
    for i, r in enumerate(ref):
        valid = got["prompt_embeds"][i][got["prompt_attention_mask"][i] > 0]
        assert valid.shape == tuple(r.shape)
        assert max_rel_err(valid, r.float().numpy()) <= 1e-4


@pytest.mark.parametrize("guidance,negative", [(0.0, None), (3.5, "blurry, dark")], ids=["no_cfg", "cfg"])
def test_zimage_pipeline_matches_diffusers(zimage_tiny, guidance, negative):
    """The prompt moves diffusers' result; with CFG the negative prompt and the scale do too."""
    _, pipe, ours = zimage_tiny
    noise = np.random.default_rng(2).standard_normal((1, LATENT, H // 2, W // 2)).astype(np.float32)
    base = dict(prompt="a red fox in the snow", negative_prompt=negative, height=H, width=W, num_inference_steps=3,
                guidance_scale=guidance)
    changes = {"the prompt": dict(prompt="a blue car in the desert")}
    if guidance:
        changes.update({"the negative prompt": dict(negative_prompt="sharp, vivid colours"),
                        "the CFG scale": dict(guidance_scale=1.5)})
    ref_latents, ref = parity.assert_inputs_matter(lambda **kw: reference_run(pipe, noise, **kw), base, changes)
    got = ours.generate("a red fox in the snow", negative_prompt=negative, width=W, height=H, steps=3,
                        guidance=guidance, latents=noise, max_sequence_length=SEQ, progress_bar=False)
    check_parity(got, ref_latents, ref, f"Z-Image guidance {guidance}")


def test_defaults_are_diffusers():
    from mlxdiff.pipelines.zimage import ZImagePipeline
    assert ZImagePipeline.defaults(None) == {"steps": 50, "guidance": 5.0}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic_shift", "turbo_static_shift"])
def test_schedule_matches_diffusers(dynamic):
    """The sigmas and timesteps ZImagePipeline sets, for a dynamic-shift config and Z-Image-Turbo's (static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas
    from mlxdiff.pipelines.zimage.pipeline import zimage_sigmas
    config = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=dynamic)
    for steps, seq in ((3, 96), (9, 4096), (50, 1024)):
        scheduler = FlowMatchEulerDiscreteScheduler(**config)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), mu=calculate_shift(seq))
        sigmas, timesteps = zimage_sigmas(steps, seq, dict(scheduler.config))
        np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(timesteps, scheduler.timesteps.numpy(), rtol=1e-6, atol=1e-4)
