"""The skeleton every pipeline shares: phases that load a model, use it and free it; the denoise loop; the decode
tail; the Result; progress; the request checks and defaults.

A run is encode -> free -> denoise -> free -> decode. Each model lives only inside `Pipeline.use(...)`, so the peak is
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
from ..arguments import check_generate, check_options
from ..errors import MlxdiffError
from ..loading.quantize import materialize
from ..models.fused import forget_compiled, set_block_compilation
from ..pacing import pace, set_in_flight, settle
from .. import memory as memory_module
from ..memory import budget_bytes, check_fits, conv_band_bytes, fmt_gb, reset_footprint_peak, snapshot
from .images import to_pil
from .matmul import use_strategy


# the size columns of Result.memory_report, in order
MEMORY_COLUMNS = ("weights", "MLX peak", "overhead", "MLX after", "process peak", "process after")


@dataclass
class Result:
    image: object                 # PIL.Image.Image (the first image of the batch)
    latents: np.ndarray           # final latents, diffusers layout (before the VAE's scaling is undone)
    timings: dict = field(default_factory=dict)   # phase -> seconds
    memory: dict = field(default_factory=dict)    # phase -> {"peak": bytes, "after": bytes, ...}
    images: list = field(default_factory=list)    # every image of the batch
    load_seconds: dict = field(default_factory=dict)  # component -> seconds to map and read its weights
    reused: list = field(default_factory=list)    # what came from an earlier call: components kept loaded
                                                  # (keep=), "conditioning" (the prompt cache)
    notes: list = field(default_factory=list)     # choices the memory budget made (e.g. a GGUF layout)

    def summary(self) -> str:
        """Time and peak memory per phase (what the CLI prints)."""
        rows = [f"{'phase':<9} {'seconds':>8} {'MLX peak':>10} {'process peak':>13}"]
        for name, seconds in self.timings.items():
            m = self.memory.get(name, {})
            rows.append(f"{name:<9} {seconds:8.2f} {fmt_gb(m.get('peak')):>10} {fmt_gb(m.get('footprint_peak')):>13}")
        return "\n".join(rows + [f"note: {n}" for n in self.notes])

    def memory_report(self) -> str:
        """The per-phase memory table (--report-memory): the phase's weights (its floor: the largest model it
        held), its MLX peak, the overhead above the floor, and what remains after it. Its size columns are
        MEMORY_COLUMNS, in that order (mlxdiff.footprint reads them by name)."""
        widths = [max(10, len(c) + 1) for c in MEMORY_COLUMNS]
        rows = [f"{'phase':<9} {'load s':>7} " + " ".join(f"{c:>{w}}" for c, w in zip(MEMORY_COLUMNS, widths))]
        loads = {"denoise": self.load_seconds.get("transformer"), "decode": self.load_seconds.get("vae")}
        for name in self.timings:
            m = self.memory.get(name, {})
            load = loads.get(name)
            floor, peak = m.get("floor"), m.get("peak")
            overhead = None if floor is None or peak is None else max(peak - floor, 0)
            sizes = (floor, peak, overhead, m.get("after"), m.get("footprint_peak"), m.get("footprint"))
            rows.append(f"{name:<9} {'-' if load is None else f'{load:.2f}':>7} "
                        + " ".join(f"{fmt_gb(v):>{w}}" for v, w in zip(sizes, widths)))
        return "\n".join(rows + [f"note: {n}" for n in self.notes])


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
            mx.clear_cache()   # a freed model was collected where it was freed (Residency.use); gc.collect here
                               # cost ~66 ms per phase on this CPU and found nothing
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


def build_model(spec, compute_dtype, result: Result | None = None):
    """(model, resident bytes): the model a ComponentSpec describes, checked against the budget before anything is
    read, built, given its matmul strategy and evaluated one module at a time."""
    fitted = check_fits(spec, compute_dtype)  # refuse before loading anything that cannot fit
    if fitted.gguf_layout != spec.gguf_layout and result is not None:
        result.notes.append(f"{spec.name}: GGUF weights kept as the file's {fitted.gguf_layout} blocks "
                            f"({fmt_gb(fitted.loaded_nbytes(compute_dtype=compute_dtype))}) to fit the memory budget")
    spec = fitted
    start, before = time.perf_counter(), mx.get_active_memory()
    model = spec.build(compute_dtype)
    use_strategy(model, spec.matmul or backend.default_matmul_strategy())
    materialize(model)  # one module at a time: bounded peak, also when quantizing while loading
    nbytes = mx.get_active_memory() - before
    _phase_floor[0] = max(_phase_floor[0], nbytes)
    if result is not None:
        result.load_seconds[spec.name] = time.perf_counter() - start
    return model, nbytes


KEEP_POLICIES = ("none", "auto", "all")
AUTO_SHARE = 0.75   # keep="auto" without a memory limit: components stay while they fit in this share of memory


def physical_memory() -> int:
    """The machine's memory (Metal: the recommended working set), for keep="auto" without a memory limit."""
    try:
        info = mx.device_info()
        size = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if size:
            return int(size)
    except Exception:  # device_info is backend specific
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Residency:
    """Which components a pipeline keeps loaded across generate() calls (keep=):
    - "none": load, use, free in every phase (the peak is the largest phase);
    - "all": keep every component once loaded (repeated calls load nothing);
    - "auto": keep a component while it, the others kept, and the largest other component together fit the
      budget (memory_limit, else AUTO_SHARE of physical memory), so that any next phase still fits; otherwise
      free it as "none" does. A run that does not fit behaves as "none"."""

    def __init__(self, keep="none"):
        if keep not in KEEP_POLICIES:
            raise MlxdiffError(f"keep={keep!r}: use one of {', '.join(KEEP_POLICIES)}")
        self.keep = keep
        self.models = {}    # spec key -> (model, resident bytes)

    @staticmethod
    def key(spec):
        return (spec.name, tuple(str(f) for f in spec.files), repr(sorted(spec.config.items())), repr(spec.quantize),
                spec.matmul, tuple(getattr(spec, "loras", ())))

    def held_bytes(self) -> int:
        return sum(n for _, n in self.models.values())

    def keeps(self, nbytes, largest_other) -> bool:
        if self.keep != "auto":
            return self.keep == "all"
        budget = memory_module.memory_limit or AUTO_SHARE * physical_memory()
        return self.held_bytes() + nbytes + largest_other <= budget

    @contextmanager
    def use(self, spec, compute_dtype, result=None, largest_other=0):
        """The model of `spec`: kept from an earlier call, else built as `loaded` builds it; kept or emptied on
        leaving by the policy."""
        key = self.key(spec)
        held = self.models.pop(key, None)
        if held is not None:
            model, nbytes = held
            if result is not None and spec.name not in result.reused:   # SD3.5's CLIPs serve two prompts
                result.reused.append(spec.name)
        else:
            model, nbytes = build_model(spec, compute_dtype, result)
        depth = set_in_flight(memory_module.in_flight_for())   # with this phase's weights in memory
        set_block_compilation(memory_module.compile_blocks_for(model), policy=True)
        if result is not None and depth > 1:
            result.notes.append(f"{spec.name}: {depth} pieces of work in flight (memory to spare)")
        try:
            yield model
        finally:
            if self.keeps(nbytes, largest_other):
                self.models[key] = (model, nbytes)
            else:
                model.clear()
                del model
                release()

    def clear(self):
        for model, _ in self.models.values():
            model.clear()
        self.models.clear()
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
    """The memory policy the pipelines pass to a transformer: each block's outputs are paced (mlxdiff/pacing.py),
    so transient buffers are freed block by block instead of piling up over the whole stack, without the device
    waiting for Python between blocks."""
    pace(*[o for o in outputs if o is not None])


def denoise(velocity, x, sigmas, timesteps, callback=None, progress_bar=True):
    """The flow-match Euler loop: `velocity(i, x)` is the family's prediction at step i (CFG, skip-layer or
    embedded guidance included). Latents stay float32 whatever the compute dtype; each step is evaluated."""
    steps = len(timesteps)
    for i in progress(range(steps), steps, "denoise", progress_bar):
        x = schedulers.euler_step(x, velocity(i, x).astype(mx.float32), sigmas[i], sigmas[i + 1])
        mx.eval(x)
        settle()
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

    PROMPT_CACHE = 16     # conditionings kept (a few MB each at the real sizes)

    def __init__(self, sources, dtype=None, keep="none"):
        self.pipeline_class = sources.pipeline_class
        self.components = sources.components     # name -> ComponentSpec (or None for an absent text_encoder_3)
        self.tokenizers = sources.tokenizers
        self.scheduler_config = sources.scheduler_config
        self.options = sources.options
        self.dtype = backend.compute_dtype(dtype)
        self.residency = Residency(keep)
        self._prompts = {}       # encode settings -> Conditioning, most recent last
        self._sizes = {}         # spec key -> loaded bytes (for keep="auto")
        self._encoding = None    # the Result of the run whose encode phase is running
        backend.warn_if_slow_blas()

    def use(self, spec, result=None):
        """A component for one phase, through the residency policy (see Residency). `result`: the run's Result
        (what was reused, load times, notes); the encode phase's own (encode_phase) when not given."""
        result = result if result is not None else self._encoding
        others = 0
        if self.residency.keep == "auto":
            others = max((self._loaded_nbytes(s) for s in self.components.values()
                          if s is not None and s.name != spec.name), default=0)
        return self.residency.use(spec, self.dtype, result, others)

    def _loaded_nbytes(self, spec):
        key = Residency.key(spec)
        if key not in self._sizes:
            self._sizes[key] = spec.loaded_nbytes()
        return self._sizes[key]

    def release(self):
        """Free every component kept loaded (keep="auto" / "all") and the prompt cache."""
        self.residency.clear()
        self._prompts.clear()

    def load_lora(self, file, scale=1.0):
        """Add a LoRA file at `scale` (times the file's alpha / rank): diffusers/PEFT, kohya/ComfyUI or
        original-named safetensors (mlxdiff/lora.py), to the transformer and, where the file has them, SD3.5's text
        encoders. It is checked against each component's layers before any weight is read; a component kept loaded
        (keep=) gets it in place, a later one is built with it. Returns the pipeline."""
        from .. import lora
        from ..arguments import check_loras
        ((file, scale),) = check_loras([(file, scale)])
        names = lora.components(file)
        for name in names:
            if self.components.get(name) is None:
                raise MlxdiffError(f"{file}: has LoRA layers for {name}, which this {self.family} pipeline does not "
                                   f"have (it has {', '.join(n for n, s in self.components.items() if s)})")
            lora.check(self.components[name], file, scale)
        for name in names:
            spec = self.components[name]
            self._set_loras(name, tuple(spec.loras) + ((file, scale),),
                            lambda model, spec=spec: lora.apply_loras(model, spec.arch, [(file, scale)],
                                                                      component=spec.name))
        return self

    def unload_loras(self):
        """Take every LoRA off every component (a kept one in place). Returns the pipeline."""
        from .. import lora
        for name, spec in list(self.components.items()):
            if spec is not None and spec.loras:
                self._set_loras(name, (), lora.remove_loras)
        return self

    def _set_loras(self, name, loras, change):
        from dataclasses import replace
        spec = self.components[name]
        new = replace(spec, loras=loras)
        held = self.residency.models.pop(Residency.key(spec), None)
        if held is not None:       # kept loaded: changed in place and kept under its new key
            model, _ = held
            before = mx.get_active_memory()
            change(model)
            forget_compiled(model)     # compiled blocks hold the layers they were traced with
            self.residency.models[Residency.key(new)] = (model, held[1] + mx.get_active_memory() - before)
        self.components[name] = new
        return self

    def defaults(self) -> dict:
        """The steps and guidance a run gets when the caller gives none (the CLI's defaults too)."""
        raise NotImplementedError

    def default_size(self) -> int:
        raise NotImplementedError

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.components["vae"].args.block_out_channels) - 1)

    def request(self, width, height, steps, guidance, options=None, **given) -> tuple:
        """The run's (width, height, steps, guidance): these and every other argument in `given` (seed, prompts,
        latents, ...) checked against arguments.RULES (the CLI checks with the same table), sizes against the
        family's multiple, then None filled in with the defaults. `options`: keywords this family does not take."""
        check_options(self.family, options or {})
        checked = check_generate(width=width, height=height, steps=steps, guidance=guidance, **given)
        defaults = self.defaults()
        steps = defaults["steps"] if checked["steps"] is None else checked["steps"]
        guidance = defaults["guidance"] if checked["guidance"] is None else checked["guidance"]
        width = self.default_size() if checked["width"] is None else checked["width"]
        height = self.default_size() if checked["height"] is None else checked["height"]
        factor = self.vae_scale_factor() * self.patch_size
        if width % factor or height % factor:
            raise MlxdiffError(f"width and height must be positive multiples of {factor}, got {width}x{height}; "
                               f"try {max(factor, width - width % factor)}x{max(factor, height - height % factor)}")
        return width, height, steps, guidance

    def encode_phase(self, phase, prompt, conditioning, cfg, encode, settings=(), result=None):
        """The encode phase: the given conditioning (checked for CFG), else the prompt cache's entry for these
        `settings` (the prompts and every encode option), else `encode()`, which is then cached."""
        with phase("encode"):
            if conditioning is None:
                if prompt is None:
                    raise MlxdiffError("give a prompt or a conditioning")
                key = (repr(prompt), cfg, settings, tuple(Residency.key(s) for s in self.components.values()
                                                         if s is not None and s.name.startswith("text_encoder")))
                if key in self._prompts:
                    self._prompts[key] = self._prompts.pop(key)     # most recent last
                    if result is not None:
                        result.reused.append("conditioning")
                    return self._prompts[key]
                self._encoding = result
                try:
                    conditioning = self._prompts[key] = encode()
                finally:
                    self._encoding = None
                while len(self._prompts) > self.PROMPT_CACHE:
                    self._prompts.pop(next(iter(self._prompts)))
                return conditioning
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
