"""Flow-matching Euler sampling: diffusers' FlowMatchEulerDiscreteScheduler, as plain functions and as a sampler on
the interface every family's denoise loop uses (samplers.py; `FlowMatchEulerSampler`).

`sd3_sigmas` and `flux2_sigmas` return what `scheduler.sigmas` / `scheduler.timesteps` hold after the pipelines'
`set_timesteps` call, bit for bit in float32: the same numpy float64/float32 steps in the same order. `euler_step`
is `scheduler.step`. The scheduler config is the dict in scheduler/scheduler_config.json.
"""

import math

import numpy as np

from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .errors import MlxdiffError

# FlowMatchEulerDiscreteScheduler.__init__ defaults: what diffusers uses for keys the JSON leaves out
SCHEDULER_DEFAULTS = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False, "shift_terminal": None,
    "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
    "time_shift_type": "exponential", "stochastic_sampling": False,
}
UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
               "stochastic_sampling")


def scheduler_config(config=None, **overrides) -> dict:
    """The scheduler config with diffusers' defaults filled in; rejects options these samplers do not implement."""
    full = dict(SCHEDULER_DEFAULTS)
    full.update({k: v for k, v in (config or {}).items() if not k.startswith("_")})
    full.update({k: v for k, v in overrides.items() if v is not None})
    on = [k for k in UNSUPPORTED if full.get(k)]
    if on:
        raise MlxdiffError(f"scheduler_config.json: {', '.join(on)} not supported by mlxdiff's flow-match Euler "
                           "sampler; set it to false or use the model's original scheduler config")
    if full["time_shift_type"] not in ("exponential", "linear"):
        raise MlxdiffError(f"scheduler_config.json: time_shift_type {full['time_shift_type']!r} must be "
                           "'exponential' or 'linear'")
    for key in ("num_train_timesteps", "shift", "base_shift", "max_shift", "shift_terminal"):
        value = full[key]
        if value is None and key in ("base_shift", "max_shift", "shift_terminal"):
            continue
        whole = key == "num_train_timesteps"
        if isinstance(value, bool) or not (isinstance(value, int) if whole else
                                           isinstance(value, (int, float)) and math.isfinite(value)):
            raise MlxdiffError(f"scheduler_config.json: {key} is {value!r}; expected a finite "
                               f"{'whole ' if whole else ''}number, as the model's original scheduler config has it")
    if not 1 <= full["num_train_timesteps"] <= 100000:
        raise MlxdiffError(f"scheduler_config.json: num_train_timesteps is {full['num_train_timesteps']}; expected "
                           "1 to 100000 (the released models' is 1000)")
    if full["shift"] <= 0:
        raise MlxdiffError(f"scheduler_config.json: shift must be positive, got {full['shift']!r}")
    if full["shift_terminal"] is not None and not 0 <= full["shift_terminal"] < 1:
        raise MlxdiffError(f"scheduler_config.json: shift_terminal is {full['shift_terminal']!r}; expected a number "
                           "from 0 (off) to below 1, or null")
    return full


def _static_shift(shift, sigmas):
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _time_shift(config, mu, t):
    """Resolution-dependent shift (sigma = 1 in diffusers' time_shift)."""
    if config["time_shift_type"] == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
    return mu / (mu + (1 / t - 1) ** 1.0)


def _train_sigma_range(config):
    """sigma_max, sigma_min of the scheduler after __init__ (float32 arithmetic, like the torch tensors there)."""
    n = config["num_train_timesteps"]
    ends = np.array([n, 1], dtype=np.float32)  # the first and last of linspace(1, n, n)[::-1]
    sigmas = ends / n
    if not config["use_dynamic_shifting"]:
        sigmas = _static_shift(config["shift"], sigmas)
    return float(sigmas[0]), float(sigmas[1])


def set_timesteps(config: dict, num_steps: int, sigmas=None, mu=None):
    """FlowMatchEulerDiscreteScheduler.set_timesteps: -> (sigmas [num_steps + 1] with the terminal 0,
    timesteps [num_steps]), both float32 numpy. `config` must come from `scheduler_config`."""
    if num_steps < 1:
        raise MlxdiffError(f"steps must be at least 1, got {num_steps}")
    if config["use_dynamic_shifting"] and mu is None:
        raise MlxdiffError("this scheduler config uses dynamic shifting; a mu (from the image size) is needed")
    n = config["num_train_timesteps"]
    if sigmas is None:
        sigma_max, sigma_min = _train_sigma_range(config)
        sigmas = np.linspace(sigma_max * n, sigma_min * n, num_steps) / n  # float64, as diffusers
    else:
        sigmas = np.asarray(sigmas).astype(np.float32)
        if len(sigmas) != num_steps:
            raise MlxdiffError(f"{len(sigmas)} custom sigmas given for {num_steps} steps")
    if config["use_dynamic_shifting"]:
        sigmas = _time_shift(config, mu, sigmas)
    else:
        sigmas = _static_shift(config["shift"], sigmas)
    if config["shift_terminal"]:
        one_minus = 1 - sigmas
        sigmas = 1 - one_minus / (one_minus[-1] / (1 - config["shift_terminal"]))
    sigmas = np.asarray(sigmas).astype(np.float32)
    timesteps = sigmas * np.float32(n)
    return np.append(sigmas, np.float32(0.0)), timesteps


def calculate_shift(image_seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """SD3 pipeline's mu for schedulers with use_dynamic_shifting (linear in the token count)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def sd3_sigmas(num_steps: int, config: dict = None, shift: float = None, image_seq_len: int = None,
               mu: float = None):
    """StableDiffusion3Pipeline's schedule: (sigmas [num_steps + 1], timesteps [num_steps]) float32.

    With the SD3.5 config (static shift 3.0) the shift is applied twice, once to the training range in
    __init__ and again in set_timesteps, exactly as diffusers and the Stability reference sampler do.
    `shift` overrides the config's. A config with use_dynamic_shifting needs `image_seq_len` (the number of
    transformer patches, (H/16) * (W/16)) or `mu`.
    """
    config = scheduler_config(config, shift=shift)
    if config["use_dynamic_shifting"] and mu is None:
        if image_seq_len is None:
            raise MlxdiffError("this flow-match scheduler config uses dynamic shifting; pass image_seq_len")
        mu = calculate_shift(image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])
    return set_timesteps(config, num_steps, mu=mu)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """Flux2Pipeline's mu: a fit in the token count, interpolated in the step count below 4300 tokens."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def flux2_sigmas(num_steps: int, image_seq_len: int, config: dict = None, sigmas=None, mu: float = None):
    """Flux2Pipeline / Flux2KleinPipeline's schedule: custom sigmas linspace(1, 1/N, N) shifted with
    mu = compute_empirical_mu(image_seq_len, N) (image_seq_len = (H/16) * (W/16) latent tokens).
    Returns (sigmas [N + 1] with the terminal 0, timesteps [N]) float32."""
    config = scheduler_config(config)
    if sigmas is None and not config.get("use_flow_sigmas"):
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    if mu is None:
        mu = compute_empirical_mu(image_seq_len, num_steps)
    return set_timesteps(config, num_steps, sigmas=sigmas, mu=mu)


def euler_step(sample, model_output, sigma, sigma_next):
    """scheduler.step: x + (sigma_next - sigma) * v in float32, returned in the model output's dtype.

    torch computes dt * v in v's dtype (dt is rounded to it first, then the product) and adds that to the
    float32 sample; the same roundings here keep bf16 steps bit-identical.
    """
    dt = mx.array(float(np.float32(sigma_next) - np.float32(sigma)), dtype=model_output.dtype)
    update = (model_output.astype(mx.float32) * dt.astype(mx.float32)).astype(model_output.dtype)
    return (sample.astype(mx.float32) + update).astype(model_output.dtype)


def scale_noise(clean, noise, sigma):
    """The flow-matching forward process at sigma: sigma * noise + (1 - sigma) * clean (the scheduler's
    scale_noise; mflux's add_noise_by_interpolation), in float32."""
    one_minus = float(np.float32(1.0) - np.float32(sigma))      # in float32, as the scheduler's tensors
    return (float(np.float32(sigma)) * noise + one_minus * clean).astype(mx.float32)


class FlowMatchEulerSampler:
    """FlowMatchEulerDiscreteScheduler after set_timesteps, on the sampler interface (samplers.py): the family's
    schedule `(sigmas [N + 1] with the terminal 0, timesteps [N])`, Euler steps in sigma space over the velocity."""
    init_noise_sigma = 1.0
    ancestral = False

    def __init__(self, schedule):
        self.sigmas, self.timesteps = schedule

    def scale_model_input(self, x, i):
        return x

    def add_noise(self, clean, noise, i):
        """Image-to-image's start and inpainting's kept area: clean latents at sigma i (scale_noise)."""
        return scale_noise(clean, noise, self.sigmas[i])

    def step(self, model_output, i, x, noise=None):
        return euler_step(x, model_output, self.sigmas[i], self.sigmas[i + 1])
