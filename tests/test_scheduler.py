"""Flow-match schedules and the Euler step against diffusers' FlowMatchEulerDiscreteScheduler, called the way the
SD3 and FLUX.2 pipelines call it. Sigmas and timesteps must be bit-identical float32."""

import numpy as np
import pytest

import mlxdiff  # noqa: F401
import mlx.core as mx
from mlxdiff import schedulers
from mlxdiff.errors import MlxdiffError

SD3_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.31.0",
              "num_train_timesteps": 1000, "shift": 3.0}
# FLUX.2-dev's scheduler_config.json
FLUX2_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                "max_image_seq_len": 4096, "time_shift_type": "exponential"}


def reference(config):
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler.from_config(config)


def assert_exact(ours, theirs):
    sigmas, timesteps = ours
    assert sigmas.dtype == np.float32 and timesteps.dtype == np.float32
    np.testing.assert_array_equal(sigmas, theirs.sigmas.numpy())
    np.testing.assert_array_equal(timesteps, theirs.timesteps.numpy())


@pytest.mark.parametrize("steps", [1, 2, 4, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 1.15, 6.5])
def test_sd3_static_shift_matches_diffusers(steps, shift):
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps
    config = dict(SD3_CONFIG, shift=shift)
    sched = reference(config)
    retrieve_timesteps(sched, steps, "cpu", sigmas=None)
    assert_exact(schedulers.sd3_sigmas(steps, config), sched)


def test_sd3_shift_argument_overrides_config():
    sched = reference(dict(SD3_CONFIG, shift=5.0))
    sched.set_timesteps(8)
    assert_exact(schedulers.sd3_sigmas(8, SD3_CONFIG, shift=5.0), sched)


def test_sd3_known_values():
    # spec section 5: the endpoint is shifted twice (0.008929), N=4 -> 1000, 857.69, 602.15, 8.93
    sigmas, timesteps = schedulers.sd3_sigmas(4, SD3_CONFIG)
    np.testing.assert_allclose(timesteps, [1000, 857.69, 602.15, 8.93], atol=0.01)
    assert sigmas[-1] == 0 and abs(sigmas[-2] - 0.008929) < 1e-6


@pytest.mark.parametrize("steps,seq_len", [(4, 64), (28, 1024), (10, 4096)])
def test_sd3_dynamic_shift_matches_pipeline(steps, seq_len):
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
    config = dict(SD3_CONFIG, use_dynamic_shifting=True)
    sched = reference(config)
    c = sched.config
    mu = calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.16))
    sched.set_timesteps(steps, mu=mu)
    assert_exact(schedulers.sd3_sigmas(steps, config, image_seq_len=seq_len), sched)
    with pytest.raises(MlxdiffError):
        schedulers.sd3_sigmas(steps, config)


@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096, 4301, 16384])
@pytest.mark.parametrize("steps", [1, 4, 28, 50])
def test_compute_empirical_mu(seq_len, steps):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    assert schedulers.compute_empirical_mu(seq_len, steps) == compute_empirical_mu(seq_len, steps)


@pytest.mark.parametrize("time_shift_type", ["exponential", "linear"])
@pytest.mark.parametrize("steps,seq_len", [(1, 256), (4, 4096), (28, 1024), (50, 4096), (50, 16384)])
def test_flux2_matches_pipeline(steps, seq_len, time_shift_type):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
    config = dict(FLUX2_CONFIG, time_shift_type=time_shift_type)
    sched = reference(config)
    # as Flux2Pipeline.__call__: custom sigmas and the empirical mu
    sigmas = np.linspace(1.0, 1 / steps, steps)
    retrieve_timesteps(sched, steps, "cpu", sigmas=sigmas, mu=compute_empirical_mu(seq_len, steps))
    assert_exact(schedulers.flux2_sigmas(steps, seq_len, config), sched)


def test_flux2_known_values():
    # flux2.md: 1024^2 (4096 tokens), 4 steps -> sigmas 1.0, 0.967384, 0.908144, 0.767200, 0
    sigmas, timesteps = schedulers.flux2_sigmas(4, 4096, FLUX2_CONFIG)
    np.testing.assert_allclose(sigmas, [1.0, 0.967384, 0.908144, 0.767200, 0.0], atol=2e-6)
    np.testing.assert_array_equal(timesteps, sigmas[:-1] * np.float32(1000))


def test_flux2_static_config_and_shift_terminal():
    """A config without dynamic shifting shifts the custom sigmas statically; shift_terminal stretches them."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    for config in (dict(SD3_CONFIG), dict(FLUX2_CONFIG, shift_terminal=0.05)):
        sched = reference(config)
        sigmas = np.linspace(1.0, 1 / 12, 12)
        sched.set_timesteps(12, sigmas=sigmas, mu=compute_empirical_mu(512, 12))
        assert_exact(schedulers.flux2_sigmas(12, 512, config), sched)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_euler_step_matches_diffusers(dtype):
    import torch
    sched = reference(FLUX2_CONFIG)
    sigmas = np.linspace(1.0, 1 / 6, 6)
    sched.set_timesteps(6, sigmas=sigmas, mu=1.3)
    ours_sigmas, _ = schedulers.flux2_sigmas(6, 100, FLUX2_CONFIG, mu=1.3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    tdtype = getattr(torch, dtype)
    sample_t, sample_m = torch.from_numpy(x), mx.array(x)
    for i, t in enumerate(sched.timesteps):
        v = rng.standard_normal((2, 5, 3)).astype(np.float32)
        v_t = torch.from_numpy(v).to(tdtype)
        v_m = mx.array(v).astype(getattr(mx, dtype))
        sample_t = sched.step(v_t, t, sample_t, return_dict=False)[0]
        sample_m = schedulers.euler_step(sample_m, v_m, ours_sigmas[i], ours_sigmas[i + 1])
        assert sample_m.dtype == getattr(mx, dtype)
        np.testing.assert_array_equal(np.array(sample_m.astype(mx.float32)), sample_t.float().numpy())


def test_unsupported_options_are_named():
    with pytest.raises(MlxdiffError, match="use_karras_sigmas"):
        schedulers.sd3_sigmas(4, dict(SD3_CONFIG, use_karras_sigmas=True))
    with pytest.raises(MlxdiffError, match="steps"):
        schedulers.sd3_sigmas(0, SD3_CONFIG)
