"""One sampler interface for every family (samplers.py): each family names its kind of sampler and takes
`scheduler=`; flow-match Euler is diffusers' FlowMatchEulerDiscreteScheduler (step, scale_noise) on that interface;
a name that does not apply to a model's kind is one line, in the API and the CLI."""

import numpy as np
import pytest
import torch

import mlxdiff
from mlxdiff import default_model, ldm_schedulers, samplers, schedulers
from mlxdiff.errors import MlxdiffError
from mlxdiff.pipelines import FAMILIES

import mlx.core as mx

INTERFACE = ("timesteps", "sigmas", "init_noise_sigma", "ancestral", "scale_model_input", "add_noise", "step")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_takes_a_sampler_of_its_kind(family):
    pipe = family.pipeline
    assert pipe.SAMPLER_KIND in (samplers.FLOW, samplers.DISCRETE)
    assert "scheduler" in pipe.OPTIONS and pipe.OPTIONS["scheduler"] is None
    assert samplers.names_for(pipe.SAMPLER_KIND), "no sampler applies to this family's kind"


def test_both_kinds_have_the_interface():
    flow = samplers.flow_sampler(None, schedulers.sd3_sigmas(4))
    config = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
              "skip_prk_steps": True}     # SD 1.5's
    for sampler in [flow, *(samplers.discrete_sampler(name, config, 4) for name in ldm_schedulers.SCHEDULERS)]:
        missing = [name for name in INTERFACE if not hasattr(sampler, name)]
        assert not missing, f"{type(sampler).__name__} lacks {missing}"
        assert len(sampler.timesteps) >= 4


def test_flow_match_euler_is_diffusers():
    """step and add_noise against FlowMatchEulerDiscreteScheduler itself (SD3.5's config: static shift 3), float32."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(5)
    ours = samplers.flow_sampler("euler", schedulers.sd3_sigmas(5, {"shift": 3.0}))
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy())
    rng = np.random.default_rng(0)
    x, v, clean = (rng.standard_normal((1, 6, 5, 7)).astype(np.float32) for _ in range(3))
    for i, t in enumerate(ref.timesteps):
        expected = ref.step(torch.from_numpy(v), t, torch.from_numpy(x)).prev_sample.numpy()
        np.testing.assert_allclose(np.array(ours.step(mx.array(v), i, mx.array(x))), expected, rtol=0, atol=1e-6)
        noised = ref.scale_noise(torch.from_numpy(clean), t[None], torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(np.array(ours.add_noise(mx.array(clean), mx.array(x), i)), noised, rtol=0,
                                   atol=1e-6)


def test_euler_on_a_flow_model_is_its_default():
    """The embedded default (FLUX.2 klein shapes): scheduler='euler' is the run it makes without one, bit for bit."""
    pipe = mlxdiff.load(str(default_model.FOLDER))
    kwargs = dict(steps=3, guidance=4.0, seed=3, width=64, height=64, progress_bar=False)
    plain = pipe.generate("a red circle on the left", **kwargs)
    named = pipe.generate("a red circle on the left", scheduler="euler", **kwargs)
    assert np.array_equal(plain.latents, named.latents)


@pytest.mark.parametrize("name,words", [("ddim", "DDIMScheduler is a sampler of discrete-time"),
                                        ("dpmpp_2m_karras", "use euler or leave --scheduler out"),
                                        ("heun_9", "does not exist; use one of euler")])
def test_a_sampler_that_does_not_apply_is_one_line(name, words):
    pipe = mlxdiff.load(str(default_model.FOLDER))
    with pytest.raises(MlxdiffError) as e:
        pipe.generate("a cat", scheduler=name, steps=2, progress_bar=False)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_discrete_sampler_on_a_flow_model(tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "mlxdiff.generate", "--no-progress", "--prompt", "a cat",
                           "--scheduler", "pndm", "--steps", "2", "--output", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PNDMScheduler is a sampler of discrete-time" in lines[0], done.stderr
    assert not (tmp_path / "x.png").exists()
