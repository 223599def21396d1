"""One sampler interface for every family, and the one table `--scheduler` / `generate(scheduler=)` names.

A sampler holds its schedule as diffusers' scheduler holds it after `set_timesteps` and steps the latents:
    timesteps             the denoiser's t at each step (numpy float32)
    sigmas                the noise level at each step, with the terminal one (numpy float32)
    init_noise_sigma      the initial noise's scale
    ancestral             whether `step` takes fresh noise each step
    scale_model_input(x, i)             the denoiser's input at step i
    add_noise(clean, noise, i)          clean latents noised to step i (image-to-image's start, inpainting's blend)
    step(model_output, i, x, noise)     the latents at step i + 1
Two kinds of model take different samplers: flow-matching models (SD3.5, FLUX.1, FLUX.2, Chroma, Z-Image,
Qwen-Image: a velocity, x = (1 - sigma) x0 + sigma noise) and discrete-time ones (the UNet family: epsilon or v over
a DDPM beta schedule). A name applies to a kind where diffusers has that sampler for it, and is refused in one line
where not (DDIM's or PLMS's update assumes the DDPM forward process; a flow pipeline's custom sigmas are not taken
by diffusers' DPMSolverMultistepScheduler).
"""

from . import ldm_schedulers
from .errors import MlxdiffError
from .schedulers import FlowMatchEulerSampler

FLOW, DISCRETE = "flow-matching", "discrete-time"

# --scheduler NAME -> {kind of model: the diffusers scheduler class it is for that kind}
SAMPLERS = {name: {DISCRETE: cls} for name, (cls, _, _) in ldm_schedulers.SCHEDULERS.items()}
SAMPLERS["euler"][FLOW] = "FlowMatchEulerDiscreteScheduler"   # the same Euler step: (x - x0) / sigma is the velocity


def names_for(kind) -> list:
    return [name for name, kinds in SAMPLERS.items() if kind in kinds]


def check_name(name, kind, title):
    """generate(scheduler=) checked before anything is loaded: None (the model's own) or a name that applies to this
    kind of model; else one line with the names that do."""
    if name is None or kind in SAMPLERS.get(name, {}):
        return name
    if name not in SAMPLERS:
        raise MlxdiffError(f"scheduler={name!r} does not exist; use one of {', '.join(SAMPLERS)}")
    raise MlxdiffError(f"scheduler={name!r}: {SAMPLERS[name][DISCRETE]} is a sampler of discrete-time models (a "
                       f"UNet's epsilon or v over a DDPM beta schedule); {title} is a {kind} model: use "
                       f"{' or '.join(names_for(kind))} or leave --scheduler out")


def flow_sampler(name, schedule):
    """A flow-matching family's sampler over its schedule (sigmas, timesteps): flow-match Euler (name None or
    'euler', checked by check_name)."""
    return FlowMatchEulerSampler(schedule)


def discrete_sampler(name, config: dict, steps: int):
    """A discrete-time family's sampler `name` over its scheduler config (ldm_schedulers)."""
    return ldm_schedulers.make_sampler(name, config, steps)
