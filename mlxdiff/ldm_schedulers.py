"""Discrete-time samplers of the UNet family (SD 1.5, SDXL): diffusers' EulerDiscreteScheduler and
EulerAncestralDiscreteScheduler (one small class over their shared sigma schedule), DDIMScheduler (eta 0) and
DPMSolverMultistepScheduler as DPM++ 2M (dpmsolver++, second order, midpoint), with and without Karras sigmas, and
PNDMScheduler's PLMS steps (skip_prk_steps, as SD 1.5's config has it; one more model call than steps).

The schedule (`sigmas`, `timesteps`, `init_noise_sigma`) is computed as diffusers computes it after `set_timesteps`,
in the same numpy float64/float32 order, so it is equal bit for bit; `scale_model_input` and `step` are the
schedulers' own. The config is the dict in scheduler/scheduler_config.json. Latents stay float32.
"""

import math

import numpy as np

from . import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .errors import MlxdiffError

# the schedulers' __init__ defaults: what diffusers uses for keys the JSON leaves out
DEFAULTS = {
    "num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
    "trained_betas": None, "prediction_type": "epsilon", "timestep_spacing": "linspace", "steps_offset": 0,
    "interpolation_type": "linear", "use_karras_sigmas": False, "final_sigmas_type": "zero",
    "timestep_type": "discrete", "rescale_betas_zero_snr": False, "sigma_min": None, "sigma_max": None,
}
# name (the --scheduler value) -> (diffusers class name, ancestral, config overrides)
SCHEDULERS = {
    "euler": ("EulerDiscreteScheduler", False, {}),
    "euler_karras": ("EulerDiscreteScheduler", False, {"use_karras_sigmas": True}),
    "euler_a": ("EulerAncestralDiscreteScheduler", True, {}),
    "ddim": ("DDIMScheduler", False, {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", False, {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", False, {"use_karras_sigmas": True}),
    "pndm": ("PNDMScheduler", False, {}),
}
# DPMSolverMultistepScheduler's settings mlxdiff implements (DPM++ 2M): its defaults, and refused otherwise
DPM_SETTINGS = {"solver_order": 2, "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
                "lower_order_final": True, "euler_at_final": False, "lambda_min_clipped": -float("inf"),
                "variance_type": None, "use_lu_lambdas": False, "use_flow_sigmas": False}
# each class's __init__ defaults where they differ from the Euler schedulers' (DEFAULTS)
OWN_DEFAULTS = {
    "DDIMScheduler": {"clip_sample": True, "set_alpha_to_one": True, "timestep_spacing": "leading",
                      "thresholding": False, "clip_sample_range": 1.0},
    "PNDMScheduler": {"set_alpha_to_one": False, "skip_prk_steps": False, "timestep_spacing": "leading"},
}
_NOT_IMPLEMENTED = {"use_exponential_sigmas", "use_beta_sigmas", "rescale_betas_zero_snr", "trained_betas",
                    "thresholding"}


def _number(config, key, integer=False):
    """config[key] as a finite number (a whole one for `integer`), else one line naming the key."""
    value = config[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok:
        raise MlxdiffError(f"scheduler_config.json: {key} is {value!r}; expected a finite "
                           f"{'whole ' if integer else ''}number, as the model's original scheduler config has it")
    return value


def check_values(config):
    """The schedule's numbers: at least 2 training steps, betas strictly between 0 and 1 and rising from beta_start
    to beta_end (a falling or degenerate schedule gives no valid sigmas), an offset that keeps the timesteps in the
    training range. One line each, naming the key."""
    n = _number(config, "num_train_timesteps", integer=True)
    if not 2 <= n <= 100000:
        raise MlxdiffError(f"scheduler_config.json: num_train_timesteps is {n}; expected 2 to 100000 (SD's is 1000)")
    start, end = _number(config, "beta_start"), _number(config, "beta_end")
    for key, value in (("beta_start", start), ("beta_end", end)):
        if not 0 < value < 1:
            raise MlxdiffError(f"scheduler_config.json: {key} is {value!r}; a beta must lie strictly between 0 and 1 "
                               "(SD's: 0.00085 to 0.012)")
    if start >= end:
        raise MlxdiffError(f"scheduler_config.json: beta_start {start!r} is not below beta_end {end!r}; the noise "
                           "schedule rises from beta_start to beta_end (SD's: 0.00085 to 0.012)")
    offset = _number(config, "steps_offset", integer=True)
    if not 0 <= offset < n:
        raise MlxdiffError(f"scheduler_config.json: steps_offset is {offset}; expected 0 to {n - 1} (within "
                           "num_train_timesteps)")
    for key in ("sigma_min", "sigma_max"):
        if config.get(key) is not None and not _number(config, key) > 0:
            raise MlxdiffError(f"scheduler_config.json: {key} is {config[key]!r}; expected a positive number or null")


def _check(config):
    check_values(config)
    on = sorted(k for k in _NOT_IMPLEMENTED if config.get(k))
    if on:
        raise MlxdiffError(f"scheduler_config.json: {', '.join(on)} not supported by mlxdiff's samplers; use the "
                           "model's original scheduler config")
    choices = {"beta_schedule": ("linear", "scaled_linear"), "prediction_type": ("epsilon", "v_prediction"),
               "timestep_spacing": ("linspace", "leading", "trailing"), "interpolation_type": ("linear",),
               "final_sigmas_type": ("zero",), "timestep_type": ("discrete",)}
    for key, allowed in choices.items():
        if config[key] not in allowed:
            raise MlxdiffError(f"scheduler_config.json: {key} {config[key]!r} is not supported; use one of "
                               f"{', '.join(map(repr, allowed))}")


def _linspace_f32(start, end, n) -> np.ndarray:
    """torch.linspace(start, end, n, dtype=float32) bit for bit: a float32 step, each half counted from its own end
    with one rounding (torch's fused multiply-add), as ATen's CPU kernel does."""
    start, end = np.float32(start), np.float32(end)
    step = np.float64((end - start) / np.float32(n - 1))
    i = np.arange(n)
    return np.where(i < n // 2, np.float64(start) + step * i, np.float64(end) - step * (n - 1 - i)).astype(np.float32)


def train_sigmas(config) -> tuple:
    """The training schedule: (sigmas, alphas_cumprod), sigma = sqrt((1 - alphas_cumprod) / alphas_cumprod), in
    numpy (no torch at run time). betas and alphas_cumprod are torch's float32 values bit for bit (its linspace as
    above; its cumprod accumulates in float64); the square root is correctly rounded, where torch's vectorized pow
    is not, so sigmas may differ from a torch CPU run by one unit in the last place."""
    n, start, end = config["num_train_timesteps"], config["beta_start"], config["beta_end"]
    if config["beta_schedule"] == "linear":
        betas = _linspace_f32(start, end, n)
    else:
        betas = _linspace_f32(start ** 0.5, end ** 0.5, n) ** 2
    cumprod = np.cumprod((np.float32(1.0) - betas).astype(np.float64)).astype(np.float32)
    return np.sqrt((np.float32(1.0) - cumprod) / cumprod), cumprod


def _spaced_timesteps(config, steps):
    n = config["num_train_timesteps"]
    if config["timestep_spacing"] == "linspace":
        return np.linspace(0, n - 1, steps, dtype=np.float32)[::-1].copy()
    if config["timestep_spacing"] == "leading":
        ratio = n // steps
        return (np.arange(0, steps) * ratio).round()[::-1].copy().astype(np.float32) + config["steps_offset"]
    return np.arange(n, 0, -n / steps).round().copy().astype(np.float32) - 1


def _integer_timesteps(config, steps):
    """Descending int64 training timesteps, `steps` of them, as DDIM / DPM++ / PNDM's set_timesteps space them
    (linspace rounded, leading from steps_offset, trailing from the end); one copy for the three samplers."""
    n = config["num_train_timesteps"]
    if config["timestep_spacing"] == "linspace":
        spaced = np.linspace(0, n - 1, steps).round()[::-1]
    elif config["timestep_spacing"] == "leading":
        spaced = (np.arange(0, steps) * (n // steps)).round()[::-1] + config["steps_offset"]
    else:
        spaced = np.arange(n, 0, -n / steps).round() - 1
    return spaced.copy().astype(np.int64)


def _sigma_to_t(sigma, log_sigmas):
    log_sigma = np.log(np.maximum(sigma, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return ((1 - w) * low + w * (low + 1)).reshape(np.shape(sigma))


def _karras(sigmas, steps, config):
    sigma_min = config["sigma_min"] if config["sigma_min"] is not None else sigmas[-1].item()
    sigma_max = config["sigma_max"] if config["sigma_max"] is not None else sigmas[0].item()
    rho = 7.0
    ramp = np.linspace(0, 1, steps)
    return (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


class EulerSampler:
    """Euler (and, with `ancestral`, Euler ancestral) in sigma space: x_{i+1} = x_i + (x_i - x0) / sigma_i * dt."""

    def __init__(self, config: dict, steps: int, ancestral=False):
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        self.config, self.ancestral = config, ancestral
        timesteps = _spaced_timesteps(config, steps)
        train, _ = train_sigmas(config)
        sigmas = np.interp(timesteps, np.arange(0, len(train)), train)
        if config["use_karras_sigmas"]:
            sigmas = _karras(sigmas, steps, config)
            timesteps = np.array([_sigma_to_t(s, np.log(train)) for s in sigmas])
        self.sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        self.timesteps = timesteps.astype(np.float32)
        peak = float(self.sigmas.max())
        self.init_noise_sigma = peak if config["timestep_spacing"] in ("linspace", "trailing") else (
            float((np.float32(peak) ** 2 + 1) ** 0.5))

    def scale_model_input(self, x, i):
        return x / ((float(self.sigmas[i]) ** 2 + 1) ** 0.5)

    def add_noise(self, clean, noise, i):
        """Image-to-image's start: clean latents noised to step i (the scheduler's add_noise at begin_index i)."""
        return clean + noise * float(self.sigmas[i])

    def step(self, model_output, i, x, noise=None):
        """x at step i+1 from the model's output at step i. Euler ancestral adds `noise` (standard normal, like x)."""
        sigma, sigma_next = float(self.sigmas[i]), float(self.sigmas[i + 1])
        x = x.astype(mx.float32)
        out = model_output.astype(mx.float32)
        if self.config["prediction_type"] == "epsilon":
            x0 = x - sigma * out
        else:
            x0 = out * (-sigma / (sigma ** 2 + 1) ** 0.5) + x / (sigma ** 2 + 1)
        if not self.ancestral:
            return x + (x - x0) / sigma * (sigma_next - sigma)
        sigma_up = (sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2) ** 0.5
        sigma_down = (sigma_next ** 2 - sigma_up ** 2) ** 0.5
        x = x + (x - x0) / sigma * (sigma_down - sigma)
        if noise is None:
            raise MlxdiffError("Euler ancestral needs noise for every step")
        return x + noise.astype(mx.float32) * sigma_up


class DDIMSampler:
    """DDIM with eta 0 (deterministic): x0 and the noise from the model's output, then x at the previous timestep."""
    init_noise_sigma = 1.0

    def __init__(self, config: dict, steps: int):
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        self.config, self.ancestral = config, False
        n = config["num_train_timesteps"]
        timesteps = _integer_timesteps(config, steps)
        self.timesteps = timesteps.astype(np.float32)
        _, self.alphas_cumprod = train_sigmas(config)
        final = 1.0 if config["set_alpha_to_one"] else float(self.alphas_cumprod[0])
        previous = timesteps - n // steps
        self.sigmas = _equivalent_sigmas(self.alphas_cumprod, self.timesteps)
        self.alpha_prev = [float(self.alphas_cumprod[t]) if t >= 0 else final for t in previous]

    def scale_model_input(self, x, i):
        return x

    def add_noise(self, clean, noise, i):
        return _add_noise_at(self.alphas_cumprod, clean, noise, self.timesteps[i])

    def step(self, model_output, i, x, noise=None):
        alpha = float(self.alphas_cumprod[int(self.timesteps[i])])
        alpha_prev, beta = self.alpha_prev[i], 1 - alpha
        x, out = x.astype(mx.float32), model_output.astype(mx.float32)
        if self.config["prediction_type"] == "epsilon":
            x0, eps = (x - beta ** 0.5 * out) / alpha ** 0.5, out
        else:
            x0, eps = alpha ** 0.5 * x - beta ** 0.5 * out, alpha ** 0.5 * out + beta ** 0.5 * x
        if self.config["clip_sample"]:
            x0 = mx.clip(x0, -self.config["clip_sample_range"], self.config["clip_sample_range"])
        return alpha_prev ** 0.5 * x0 + (1 - alpha_prev) ** 0.5 * eps


def _equivalent_sigmas(alphas_cumprod, timesteps):
    """The noise level of each DDPM timestep in sigma space, sqrt((1 - a) / a), and the terminal 0: the samplers'
    shared `sigmas` (DDIM and PLMS step in alpha space; this is what their schedule means to the others)."""
    alphas = np.asarray([alphas_cumprod[int(t)] for t in timesteps], dtype=np.float64)
    return np.append(((1 - alphas) / alphas) ** 0.5, 0.0).astype(np.float32)


def _add_noise_at(alphas_cumprod, clean, noise, t):
    """DDPM's forward process at training timestep t: sqrt(a) clean + sqrt(1 - a) noise (DDIM's, PNDM's add_noise)."""
    alpha = float(alphas_cumprod[int(t)])
    return alpha ** 0.5 * clean + (1 - alpha) ** 0.5 * noise


def _alpha_sigma(sigma):
    alpha = 1 / (sigma ** 2 + 1) ** 0.5
    return alpha, sigma * alpha


class DPMSolver2MSampler:
    """DPM++ 2M: each step from the model's x0 prediction at this and the previous step (first order at the first
    and the last step, as diffusers with a zero final sigma)."""

    def __init__(self, config: dict, steps: int):
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        self.config, self.ancestral = config, False
        # diffusers' DPMSolverMultistepScheduler spaces steps + 1 points and drops the last, except when trailing
        timesteps = (_integer_timesteps(config, steps) if config["timestep_spacing"] == "trailing" else
                     _integer_timesteps(config, steps + 1)[:-1].copy())
        train, _ = train_sigmas(config)
        if config["use_karras_sigmas"]:
            sigmas = _karras(np.flip(train).copy(), steps, config)
            timesteps = np.array([_sigma_to_t(s, np.log(train)) for s in sigmas]).round()
        else:
            sigmas = np.interp(timesteps, np.arange(0, len(train)), train)
        self.sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        self.timesteps = timesteps.astype(np.float32)
        self.init_noise_sigma = 1.0
        self.previous_x0 = None

    def scale_model_input(self, x, i):
        return x

    def add_noise(self, clean, noise, i):
        alpha, sigma = _alpha_sigma(float(self.sigmas[i]))
        return alpha * clean + sigma * noise

    def step(self, model_output, i, x, noise=None):
        sigma, sigma_next = float(self.sigmas[i]), float(self.sigmas[i + 1])
        x, out = x.astype(mx.float32), model_output.astype(mx.float32)
        alpha_s, sigma_s = _alpha_sigma(sigma)
        if self.config["prediction_type"] == "epsilon":
            x0 = (x - sigma_s * out) / alpha_s
        else:
            x0 = alpha_s * x - sigma_s * out
        previous, self.previous_x0 = self.previous_x0, x0
        if sigma_next == 0:          # the last step: x0 itself (diffusers' first-order update at lambda = inf)
            return x0
        alpha_t, sigma_t = _alpha_sigma(sigma_next)
        h = (np.log(alpha_t) - np.log(sigma_t)) - (np.log(alpha_s) - np.log(sigma_s))
        x_next = (sigma_t / sigma_s) * x - (alpha_t * (np.exp(-h) - 1.0)) * x0
        if i == 0 or previous is None:
            return x_next
        alpha_p, sigma_p = _alpha_sigma(float(self.sigmas[i - 1]))
        r = ((np.log(alpha_s) - np.log(sigma_s)) - (np.log(alpha_p) - np.log(sigma_p))) / h
        return x_next - 0.5 * (alpha_t * (np.exp(-h) - 1.0)) * (1.0 / r) * (x0 - previous)


class PNDMSampler:
    """PLMS (pseudo linear multistep): the noise prediction extrapolated from up to four previous ones; the second
    model call re-runs the first timestep's update with the mean of two predictions (diffusers' counter == 1)."""
    init_noise_sigma = 1.0

    def __init__(self, config: dict, steps: int):
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        self.config, self.ancestral = config, False
        n = config["num_train_timesteps"]
        spaced = _integer_timesteps(config, steps)[::-1]     # ascending, as PNDM builds its PLMS order from it
        self.timesteps = np.concatenate([spaced[:-1], spaced[-2:-1], spaced[-1:]])[::-1].astype(np.int64).astype(
            np.float32)
        _, self.alphas_cumprod = train_sigmas(config)
        self.final = 1.0 if config["set_alpha_to_one"] else float(self.alphas_cumprod[0])
        self.sigmas = _equivalent_sigmas(self.alphas_cumprod, self.timesteps)
        self.ratio = n // steps
        self.ets, self.counter, self.first_x = [], 0, None

    def scale_model_input(self, x, i):
        return x

    def add_noise(self, clean, noise, i):
        return _add_noise_at(self.alphas_cumprod, clean, noise, self.timesteps[i])

    def _previous(self, x, t, t_prev, eps):
        alpha = float(self.alphas_cumprod[t])
        alpha_prev = float(self.alphas_cumprod[t_prev]) if t_prev >= 0 else self.final
        beta, beta_prev = 1 - alpha, 1 - alpha_prev
        if self.config["prediction_type"] == "v_prediction":
            eps = alpha ** 0.5 * eps + beta ** 0.5 * x
        denominator = alpha * beta_prev ** 0.5 + (alpha * beta * alpha_prev) ** 0.5
        return (alpha_prev / alpha) ** 0.5 * x - (alpha_prev - alpha) * eps / denominator

    def step(self, model_output, i, x, noise=None):
        t = int(self.timesteps[i])
        t_prev = t - self.ratio
        x, eps = x.astype(mx.float32), model_output.astype(mx.float32)
        if self.counter != 1:
            self.ets = self.ets[-3:] + [eps]
        else:
            t_prev, t = t, t + self.ratio
        e = self.ets
        if len(e) == 1 and self.counter == 0:
            self.first_x = x
        elif len(e) == 1 and self.counter == 1:
            eps, x, self.first_x = (eps + e[-1]) / 2, self.first_x, None
        elif len(e) == 2:
            eps = (3 * e[-1] - e[-2]) / 2
        elif len(e) == 3:
            eps = (23 * e[-1] - 16 * e[-2] + 5 * e[-3]) / 12
        else:
            eps = (1 / 24) * (55 * e[-1] - 59 * e[-2] + 37 * e[-3] - 9 * e[-4])
        self.counter += 1
        return self._previous(x, t, t_prev, eps)


def make_sampler(name: str, config: dict, steps: int):
    """The sampler `name` (SCHEDULERS) over the folder's scheduler config (diffusers' defaults filled in)."""
    if name not in SCHEDULERS:
        raise MlxdiffError(f"--scheduler {name!r} does not exist; use one of {', '.join(SCHEDULERS)}")
    cls, ancestral, overrides = SCHEDULERS[name]
    full = dict(DEFAULTS, **OWN_DEFAULTS.get(cls, {}))
    full.update({k: v for k, v in (config or {}).items() if not k.startswith("_")})
    full.update(overrides)
    if name.startswith("dpmpp"):
        for key, value in DPM_SETTINGS.items():
            if full.setdefault(key, value) != value:
                raise MlxdiffError(f"scheduler_config.json: {key} {full[key]!r} is not DPM++ 2M's ({value!r}); "
                                   "mlxdiff implements DPM++ 2M only: drop the key or use another --scheduler")
    if name == "pndm":
        if not full["skip_prk_steps"]:
            raise MlxdiffError("scheduler_config.json: PNDM with skip_prk_steps false (Runge-Kutta warm-up steps) is "
                               "not supported; set \"skip_prk_steps\": true (PLMS steps from the first, no warm-up) "
                               "or use another --scheduler")
    _check(full)
    if name == "pndm":
        return PNDMSampler(full, steps)
    if name.startswith("dpmpp"):
        return DPMSolver2MSampler(full, steps)
    if name == "ddim":
        return DDIMSampler(full, steps)
    return EulerSampler(full, steps, ancestral)
