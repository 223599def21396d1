"""The UNet family's samplers against diffusers' schedulers: the same schedule, and the same trajectory from the same
model outputs (a fixed function of the latents and the timestep) and, for the ancestral sampler, the same noise."""

import numpy as np
import pytest
import torch

from mlxdiff import ldm_schedulers
from mlxdiff.errors import MlxdiffError
import mlx.core as mx

SD15 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
        "timestep_spacing": "leading", "num_train_timesteps": 1000, "clip_sample": False, "set_alpha_to_one": False}
CONFIGS = [SD15, dict(SD15, timestep_spacing="linspace", steps_offset=0),
           dict(SD15, timestep_spacing="trailing", prediction_type="v_prediction"),
           {"beta_schedule": "linear", "num_train_timesteps": 800}]     # the last: each class's own defaults


def fake_model(x, t):
    """A deterministic 'noise prediction' that depends on both inputs, in numpy float32."""
    return (np.tanh(0.7 * x) + 0.01 * np.float32(t) * np.cos(x)).astype(np.float32)


def relative_error(ours, theirs):
    """max |ours - theirs| / max |theirs| (the project's max relative error)."""
    theirs = theirs.numpy()
    return float(np.abs(np.array(ours) - theirs).max() / np.abs(theirs).max())


def diffusers_scheduler(name, config):
    import diffusers
    cls, _, overrides = ldm_schedulers.SCHEDULERS[name]
    return getattr(diffusers, cls).from_config({**config, **overrides})


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_training_schedule_is_torchs_without_torch(config):
    """betas and alphas_cumprod equal torch's float32 values bit for bit, computed in numpy."""
    full = dict(ldm_schedulers.DEFAULTS, **CONFIGS[config])
    n, start, end = full["num_train_timesteps"], full["beta_start"], full["beta_end"]
    betas = (torch.linspace(start, end, n, dtype=torch.float32) if full["beta_schedule"] == "linear" else
             torch.linspace(start ** 0.5, end ** 0.5, n, dtype=torch.float32) ** 2)
    cumprod = torch.cumprod(1.0 - betas, dim=0)
    sigmas, ours = ldm_schedulers.train_sigmas(full)
    np.testing.assert_array_equal(ours, cumprod.numpy())
    np.testing.assert_array_max_ulp(sigmas, (((1 - cumprod) / cumprod) ** 0.5).numpy(), maxulp=1)


@pytest.mark.parametrize("name", list(ldm_schedulers.SCHEDULERS))
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_trajectory_equals_diffusers(name, config):
    config, steps, shape = CONFIGS[config], 7, (1, 4, 6, 5)
    if name == "pndm":       # the PLMS steps only (SD 1.5's config); the Runge-Kutta warm-up is refused
        config = dict(config, skip_prk_steps=True)
    theirs = diffusers_scheduler(name, config)
    theirs.set_timesteps(steps)
    ours = ldm_schedulers.make_sampler(name, config, steps)
    if hasattr(theirs, "sigmas"):   # one float32 ulp: torch's vectorized pow(0.5) is not correctly rounded
        np.testing.assert_array_max_ulp(ours.sigmas, theirs.sigmas.numpy(), maxulp=1)
    else:                           # DDIM, PNDM: the shared interface's sigmas, from diffusers' alphas_cumprod
        alphas = theirs.alphas_cumprod.double().numpy()[theirs.timesteps.numpy().astype(np.int64)]
        np.testing.assert_allclose(ours.sigmas, np.append(((1 - alphas) / alphas) ** 0.5, 0), rtol=1e-6)
    # Karras timesteps are interpolated from those sigmas: the ulp may carry over
    np.testing.assert_array_max_ulp(ours.timesteps, theirs.timesteps.numpy().astype(np.float32), maxulp=2)
    assert ours.init_noise_sigma == pytest.approx(float(theirs.init_noise_sigma), rel=1e-6)
    start = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    drawn = torch.Generator().manual_seed(5)      # diffusers draws one normal sample per step, as here
    noises = [torch.randn(shape, generator=drawn) for _ in range(steps)]
    generator = torch.Generator().manual_seed(5)
    x_t = torch.from_numpy(start) * theirs.init_noise_sigma
    x_m = mx.array(start) * ours.init_noise_sigma
    for i, t in enumerate(theirs.timesteps):
        in_t = theirs.scale_model_input(x_t, t)
        in_m = ours.scale_model_input(x_m, i)
        assert relative_error(in_m, in_t) <= 1e-5, i
        out = fake_model(in_t.numpy(), float(t))
        if ours.ancestral:
            x_t = theirs.step(torch.from_numpy(out), t, x_t, generator=generator).prev_sample
            x_m = ours.step(mx.array(out), i, x_m, noise=mx.array(noises[i].numpy()))
        else:
            x_t = theirs.step(torch.from_numpy(out), t, x_t).prev_sample
            x_m = ours.step(mx.array(out), i, x_m)
        assert relative_error(x_m, x_t) <= 1e-5, i


def test_bad_names_and_options_are_one_line():
    with pytest.raises(MlxdiffError, match="does not exist; use one of euler"):
        ldm_schedulers.make_sampler("dpm_5m", SD15, 4)
    with pytest.raises(MlxdiffError, match="timestep_spacing 'sideways'"):
        ldm_schedulers.make_sampler("euler", dict(SD15, timestep_spacing="sideways"), 4)
    with pytest.raises(MlxdiffError, match="rescale_betas_zero_snr not supported"):
        ldm_schedulers.make_sampler("euler", dict(SD15, rescale_betas_zero_snr=True), 4)
    with pytest.raises(MlxdiffError, match="algorithm_type 'sde-dpmsolver\\+\\+' is not DPM\\+\\+ 2M's"):
        ldm_schedulers.make_sampler("dpmpp_2m", dict(SD15, algorithm_type="sde-dpmsolver++"), 4)
    with pytest.raises(MlxdiffError, match="PNDM with skip_prk_steps false"):
        ldm_schedulers.make_sampler("pndm", SD15, 4)
    with pytest.raises(MlxdiffError, match="steps must be at least 1"):
        ldm_schedulers.make_sampler("euler_a", SD15, 0)
