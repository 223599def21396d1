"""The skeleton every pipeline shares: phases that load a model, use it and free it; the denoise loop; the decode
tail; the Result; progress; the request checks and defaults.

A run is encode -> free -> denoise -> free -> decode. Each model lives only inside `loaded(...)`, so the peak is
the largest phase, not the sum. On leaving, the module is emptied in place (a reference the caller still holds
becomes an empty shell) and MLX's buffer cache is returned, so the next phase starts from near zero. A family
(sd3.py, flux2.py) supplies only what is its own: prompt encoding, its velocity and its latent packing.
"""

import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import backend
import mlx.core as mx

from .. import schedulers
from ..errors import MlxdiffError
from ..loading.quantize import materialize
from ..memory import budget_bytes, check_fits, conv_band_bytes, fmt_gb, reset_footprint_peak, snapshot
from .images import to_pil
from .matmul import use_strategy


@dataclass
class Result:
    image: object                 # PIL.Image.Image (the first image of the batch)
    latents: np.ndarray           # final latents, diffusers layout (before the VAE's scaling is undone)
    timings: dict = field(default_factory=dict)   # phase -> seconds
    memory: dict = field(default_factory=dict)    # phase -> {"peak": bytes, "after": bytes, ...}
    images: list = field(default_factory=list)    # every image of the batch
    load_seconds: dict = field(default_factory=dict)  # component -> seconds to map and read its weights

    def summary(self) -> str:
        """Time and peak memory per phase (what the CLI prints)."""
        rows = [f"{'phase':<9} {'seconds':>8} {'MLX peak':>10} {'process peak':>13}"]
        for name, seconds in self.timings.items():
            m = self.memory.get(name, {})
            rows.append(f"{name:<9} {seconds:8.2f} {fmt_gb(m.get('peak')):>10} {fmt_gb(m.get('footprint_peak')):>13}")
        return "\n".join(rows)

    def memory_report(self) -> str:
        """The per-phase memory table (--report-memory): the phase's weights (its floor: the largest model it
        held), its MLX peak, the overhead above the floor, and what remains after it."""
        rows = [f"{'phase':<9} {'load s':>7} {'weights':>10} {'MLX peak':>10} {'overhead':>10} {'MLX after':>10} "
                f"{'process peak':>13} {'process after':>14}"]
        loads = {"denoise": self.load_seconds.get("transformer"), "decode": self.load_seconds.get("vae")}
        for name in self.timings:
            m = self.memory.get(name, {})
            load = loads.get(name)
            floor, peak = m.get("floor"), m.get("peak")
            overhead = None if floor is None or peak is None else max(peak - floor, 0)
            rows.append(f"{name:<9} {'-' if load is None else f'{load:.2f}':>7} {fmt_gb(floor):>10} "
                        f"{fmt_gb(peak):>10} {fmt_gb(overhead):>10} {fmt_gb(m.get('after')):>10} "
                        f"{fmt_gb(m.get('footprint_peak')):>13} {fmt_gb(m.get('footprint')):>14}")
        return "\n".join(rows)


def new_run():
    """(Result, PhaseLog) for one generate() call."""
    result = Result(image=None, latents=None)
    return result, PhaseLog(result)


class PhaseLog:
    """Records seconds and memory per phase into a Result."""

    def __init__(self, result: Result):
        self.result = result

    @contextmanager
    def __call__(self, name):
        _phase_floor[0] = 0
        mark_phase(name, "start")
        mx.reset_peak_memory()
        reset_footprint_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            mx.synchronize()
            peak = mx.get_peak_memory()
            footprint_peak = snapshot().footprint_peak
            release()
            snap = snapshot()
            self.result.timings[name] = time.perf_counter() - start
            self.result.memory[name] = {"peak": peak, "after": snap.active, "footprint": snap.footprint,
                                        "footprint_peak": footprint_peak, "floor": _phase_floor[0]}
            mark_phase(name, "end")


_phase_floor = [0]   # the largest weights loaded in the current phase (its floor)


def mark_phase(name, event):
    """For `python -m mlxdiff.footprint`, which samples this process from outside: a marker line on stderr."""
    if os.environ.get("MLXDIFF_PHASE_MARKERS"):
        print(f"MLXDIFF_PHASE {name} {event} {time.time():.3f}", file=sys.stderr, flush=True)


def release():
    gc.collect()
    mx.clear_cache()


@contextmanager
def loaded(spec, compute_dtype, result: Result | None = None):
    """Build the model a ComponentSpec describes, evaluate its weights, and empty it on leaving."""
    check_fits(spec)  # refuse before loading anything that cannot fit
    start, before = time.perf_counter(), mx.get_active_memory()
    model = spec.build(compute_dtype)
    use_strategy(model, spec.matmul or backend.default_matmul_strategy())
    materialize(model)  # one module at a time: bounded peak, also when quantizing while loading
    _phase_floor[0] = max(_phase_floor[0], mx.get_active_memory() - before)
    if result is not None:
        result.load_seconds[spec.name] = time.perf_counter() - start
    try:
        yield model
    finally:
        model.clear()  # nn.Module is a dict: drop every parameter and child, even if the caller keeps `model`
        del model
        release()


def progress(iterable, total, desc, enabled=True):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False)


def initial_latents(latents, shape, seed, layout=""):
    """Injected noise (numpy, in diffusers' `latents` layout) or seeded MLX noise; always float32."""
    if latents is None:
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.float32)
    latents = np.asarray(latents)
    if tuple(latents.shape) != tuple(shape):
        raise MlxdiffError(f"latents have shape {tuple(latents.shape)}, expected {tuple(shape)} for this size"
                           + (f" ({layout})" if layout else ""))
    return mx.array(latents.astype(np.float32))


def evaluate_each_block(*outputs):
    """The memory policy the pipelines pass to a transformer: evaluate each block's outputs before the next block
    is built, so transient buffers are freed block by block instead of piling up over the whole stack."""
    mx.eval([o for o in outputs if o is not None])


def denoise(velocity, x, sigmas, timesteps, callback=None, progress_bar=True):
    """The flow-match Euler loop: `velocity(i, x)` is the family's prediction at step i (CFG, skip-layer or
    embedded guidance included). Latents stay float32 whatever the compute dtype; each step is evaluated."""
    steps = len(timesteps)
    for i in progress(range(steps), steps, "denoise", progress_bar):
        x = schedulers.euler_step(x, velocity(i, x).astype(mx.float32), sigmas[i], sigmas[i + 1])
        mx.eval(x)
        if callback is not None:
            callback(i, float(timesteps[i]), x)
    return x


def decode_array(vae, z, dtype):
    """vae.decode(z) within the memory budget: evaluated stage by stage, convolutions in exact row bands where their
    working buffer would be large (memory.conv_band_bytes), tiles only when even that does not fit the budget."""
    vae.set_memory_policy(after_stage=evaluate_each_block, band_bytes=conv_band_bytes())
    return vae.decode(z, tiling=vae.decode_bytes(z.shape, dtype) > budget_bytes())


def decode(vae, latents, dtype) -> list:
    """Denoised latents -> PIL images: the VAE undoes its own latent scaling (`unscale_latents`), decodes
    (decode_array), and the output is mapped from [-1, 1] to [0, 1]."""
    image = decode_array(vae, vae.unscale_latents(latents).astype(dtype), dtype)
    image = mx.clip(image.astype(mx.float32) / 2 + 0.5, 0, 1)
    mx.eval(image)
    return to_pil(np.array(image))


class Pipeline:
    """What both families hold and check: specs (no weights), tokenizers, scheduler settings, the compute dtype."""
    family = ""
    patch_size = 1                      # latent pixels per transformer token side, on top of the VAE's factor

    def __init__(self, sources, dtype=None):
        self.pipeline_class = sources.pipeline_class
        self.components = sources.components     # name -> ComponentSpec (or None for an absent text_encoder_3)
        self.tokenizers = sources.tokenizers
        self.scheduler_config = sources.scheduler_config
        self.options = sources.options
        self.dtype = backend.compute_dtype(dtype)
        backend.warn_if_slow_blas()

    def defaults(self) -> dict:
        """The steps and guidance a run gets when the caller gives none (the CLI's defaults too)."""
        raise NotImplementedError

    def default_size(self) -> int:
        raise NotImplementedError

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.components["vae"].args.block_out_channels) - 1)

    def request(self, width, height, steps, guidance) -> tuple:
        """The run's (width, height, steps, guidance): defaults filled in, then checked."""
        defaults = self.defaults()
        steps = defaults["steps"] if steps is None else steps
        guidance = defaults["guidance"] if guidance is None else guidance
        width, height = width or self.default_size(), height or self.default_size()
        factor = self.vae_scale_factor() * self.patch_size
        if width % factor or height % factor or width <= 0 or height <= 0:
            raise MlxdiffError(f"width and height must be positive multiples of {factor}, got {width}x{height}; "
                               f"try {max(factor, width - width % factor)}x{max(factor, height - height % factor)}")
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        return width, height, steps, guidance

    def encode_phase(self, phase, prompt, conditioning, cfg, encode):
        """The encode phase: the given conditioning (checked for CFG), else `encode()`."""
        with phase("encode"):
            if conditioning is None:
                if prompt is None:
                    raise MlxdiffError("give a prompt or a conditioning")
                return encode()
            if cfg and conditioning.negative_prompt_embeds is None:
                raise MlxdiffError("guidance > 1 needs a conditioning encoded with do_classifier_free_guidance=True")
            return conditioning


def finish(result: Result, images: list, latents) -> Result:
    result.latents = np.array(latents)
    result.images = images
    result.image = images[0]
    return result


def as_numpy(conditioning) -> dict:
    """A conditioning dataclass's arrays as float32 numpy (None stays None)."""
    return {k: None if v is None else np.array(v.astype(mx.float32)) for k, v in vars(conditioning).items()}
