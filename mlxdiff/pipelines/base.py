"""The skeleton every pipeline shares: the Pipeline base (specs, the run policy, residency, the prompt cache, the
request checks and defaults), the denoise loop and the decode tail.

A run is encode -> free -> denoise -> free -> decode. Each model lives only inside `Pipeline.use(...)`, so the peak is
the largest phase, not the sum. On leaving, the module is emptied in place (a reference the caller still holds
becomes an empty shell) and MLX's buffer cache is returned, so the next phase starts from near zero. A family
(sd3.py, flux2.py) supplies only what is its own: prompt encoding, its velocity and its latent packing.
"""

import threading
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
from tqdm.auto import tqdm

from .. import backend
import mlx.core as mx

from .. import lora, samplers
from ..arguments import check_generate, check_images, check_latents, check_loras
from ..errors import MlxdiffError
from ..memory import budget_bytes
from ..models.fused import forget_compiled
from ..pacing import pace, settle
from ..policy import RunPolicy, current, current_dtype, installed
from .family import check_options, family_named
from .images import to_pil
from .previews import latent_preview, load_tiny_vae
from .report import Result, finish, new_run
from .residency import Residency
from .step_cache import parse as parse_step_cache


def progress(iterable, total, desc, enabled=True):
    if not enabled:
        return iterable
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


def record_step_cache(run):
    """What a run's step cache did, on its Result: a note, the steps it reused, its per-kind changes."""
    if run.step_cache is not None:
        run.result.notes.append(run.step_cache.note())
        run.result.cached_steps = run.step_cache.reused_steps()
        run.result.cache_changes = {k: c.changes for k, c in run.step_cache.contexts.items()}


def evaluate_each_block(*outputs):
    """The memory policy the pipelines pass to a transformer: each block's outputs are paced (mlxdiff/pacing.py),
    so transient buffers are freed block by block instead of piling up over the whole stack, without the device
    waiting for Python between blocks."""
    pace(*[o for o in outputs if o is not None])


def guidance_pair(group, uncond, cond):
    """(uncond(), cond()): both here, or, guidance-parallel over a group of two ranks (mlxdiff/distributed.py),
    rank 0 computes the first and rank 1 the second, and one all_gather gives both to each."""
    if group is None:
        return uncond(), cond()
    mine = (uncond if group.rank() == 0 else cond)()
    both = mx.distributed.all_gather(mine, group=group)
    return both[:mine.shape[0]], both[mine.shape[0]:]


def negative_prompts(prompts: list, negative_prompt) -> list:
    """One negative prompt per prompt, as the Qwen-style encode_prompt takes them: "" when none is given, a string
    for every prompt, else a list of one per prompt."""
    negative_prompt = "" if negative_prompt is None else negative_prompt
    negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
    if len(negs) != len(prompts):
        raise MlxdiffError(f"{len(negs)} negative prompts for {len(prompts)} prompts; give one per prompt")
    return negs


class TapsEncoding:
    """The encode hooks of a family whose encode_prompt takes max_sequence_length and text_encoder_out_layers (the
    LLM encoder's hidden-state taps): FLUX.2's and FLUX 3's. Before Pipeline in the bases."""

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"],
                                  text_encoder_out_layers=run.options["text_encoder_out_layers"])

    def encode_settings(self, run):
        return (repr(run.negative_prompt), run.options["max_sequence_length"],
                repr(run.options["text_encoder_out_layers"]))


class Cancelled(MlxdiffError):
    """A run stopped between two denoising steps: on_step returned False or Pipeline.cancel() was called. Nothing
    was decoded; the components were kept or released as `keep` says. An MlxdiffError, so that the CLI says it in
    one line (exit 2) and an app that catches MlxdiffError needs nothing more."""


class Step:
    """What generate(on_step=...) gets after each denoising step: `index` (0-based) of `total` (the steps this run
    makes), `timestep`, `latents` (the transformer's layout) and `preview`, a PIL image made on first access (the
    family's latent-to-RGB projection: pipelines/previews.py)."""

    def __init__(self, index, total, timestep, latents, make_preview):
        self.index, self.total, self.timestep, self.latents = index, total, timestep, latents
        self._make_preview = make_preview

    @cached_property
    def preview(self):
        return self._make_preview(self.latents)


def denoise(velocity, step, x, timesteps, callback=None, progress_bar=True, on_step=None):
    """The denoising loop: `velocity(i, x)` is the family's prediction at step i (CFG, skip-layer or embedded
    guidance included), `step(i, x, prediction)` its sampler's update (flow-match Euler, or a UNet family sampler).
    Latents stay float32 whatever the compute dtype; each step is evaluated. `on_step(i, t, x)` after each step may
    raise Cancelled (Pipeline.watch)."""
    steps = len(timesteps)
    for i in progress(range(steps), steps, "denoise", progress_bar):
        x = step(i, x, velocity(i, x).astype(mx.float32))
        mx.eval(x)
        settle()
        if callback is not None:
            callback(i, float(timesteps[i]), x)
        if on_step is not None:
            on_step(i, float(timesteps[i]), x)
    return x


def decode_array(vae, z):
    """vae.decode(z) in z's dtype within the installed policy's budget: evaluated stage by stage, convolutions in
    exact row bands where their working buffer would be large (the policy's conv_band, memory.conv_band_bytes), tiles
    only when even that does not fit the budget."""
    policy = current() or RunPolicy()
    vae.set_memory_policy(after_stage=evaluate_each_block, band_bytes=policy.conv_band)
    return vae.decode(z, tiling=vae.decode_bytes(z.shape, z.dtype) > budget_bytes(policy))


def decode(vae, latents) -> list:
    """Denoised latents -> PIL images in the installed policy's compute dtype: the VAE undoes its own latent scaling
    (`unscale_latents`), decodes (decode_array), and the output is mapped from [-1, 1] to [0, 1]."""
    image = decode_array(vae, vae.unscale_latents(latents).astype(current_dtype()))
    image = mx.clip(image.astype(mx.float32) / 2 + 0.5, 0, 1)
    mx.eval(image)
    return to_pil(np.array(image))


@dataclass(eq=False)
class Run:
    """One generate() call as the template fills it in, step by step: the checked request first, then what each step
    adds. A family's hooks may keep their own state on it (position ids, reference tokens, ...)."""
    prompt: object
    negative_prompt: object
    seed: int
    image_names: list
    images: list                  # PIL images: img2img's init image, or FLUX.2's reference images
    strength: float | None        # image-to-image when not None
    options: dict                 # the family's own generate() keywords (Pipeline.OPTIONS), checked
    width: int | None = None      # None until the request fills in the default (a family may first: references)
    height: int | None = None
    steps: int = 0
    guidance: float = 0.0
    cfg: bool = False             # two forwards per step: against the negative prompt
    start: int = 0                # the first step run (image-to-image starts later in the schedule)
    conditioning: object = None
    batch: int = 1
    sampler: object = None        # samplers.py's interface: the schedule and the step (set by prepare_latents)
    result: Result = None
    step_cache: object = None     # pipelines/step_cache's FirstBlockCache or TaylorSeerCache (generate(cache=...))
    state: dict = field(default_factory=dict)    # the family's own, between its hooks

    @property
    def timesteps(self):
        return self.sampler.timesteps

    @property
    def sigmas(self):
        return self.sampler.sigmas

    def forward(self, name: str, call):
        """One transformer forward of one kind ("cond", "uncond"): call(step_cache) runs it, passing step_cache= to
        the model (a first-block cache's state for that kind, else None); with a step cache it decides whether the
        forward runs (pipelines/step_cache.py)."""
        return call(None) if self.step_cache is None else self.step_cache.forward(name, call)

    @property
    def img2img(self) -> bool:
        return bool(self.images) and self.strength is not None


class Pipeline:
    """What every family holds and runs: specs (no weights), tokenizers, scheduler settings, the compute dtype, the
    run policy, and `generate`, the one template of a run. A family supplies its hooks (the methods that raise
    NotImplementedError here) and the generate() keywords only it has (OPTIONS)."""
    family = ""
    DENOISER = "transformer"            # the component the denoise phase runs (the UNet family's: "unet")
    patch_size = 1                      # latent pixels per transformer token side, on top of the VAE's factor
    # generate() keywords of this family only -> their defaults (a family's OPTIONS add to these, which all take)
    OPTIONS = {"scheduler": None}       # the sampler (samplers.SAMPLERS; None: the model's own)
    SAMPLER_KIND = samplers.FLOW        # which samplers apply (samplers.py: flow-matching or discrete-time)
    IMG2IMG_STRENGTH = None             # the strength when an init image is given without one (None: references)
    SIZE_OF_IMAGE = False               # an init image sets the output size the caller leaves out (the CLI's too)
    STEP_CACHE = True                   # whether generate(cache=...) can skip its denoiser's blocks
    STREAM_DTYPE = True                 # whether its denoiser can keep its streams wider ("float16-mixed")

    PROMPT_CACHE = 16     # conditionings kept (a few MB each at the real sizes)

    def __init__(self, sources, keep="none", policy: RunPolicy | None = None, group=None):
        self.pipeline_class = sources.pipeline_class
        self.components = sources.components     # name -> ComponentSpec (or None for an absent text_encoder_3)
        self.tokenizers = sources.tokenizers
        self.scheduler_config = sources.scheduler_config
        self.options = sources.options
        self.policy = policy or RunPolicy()     # how runs spend memory and time, their dtype (mlxdiff/policy.py)
        if self.stream_dtype is not None and not self.STREAM_DTYPE:
            raise MlxdiffError(f"dtype {self.dtype_name!r} keeps a transformer's residual streams in float32; this "
                               f"pipeline ({self.pipeline_class}) has no such streams: use --dtype float16")
        self.residency = Residency(keep)
        self.group = group       # guidance-parallel over two ranks (mlxdiff/distributed.py), or None
        self._prompts = {}       # encode settings -> Conditioning, most recent last
        self._sizes = {}         # spec key -> loaded bytes (for keep="auto")
        self._encoding = None    # the Result of the run whose encode phase is running
        self._cancel = threading.Event()     # cancel(): the running generate stops at its next step boundary
        self.preview_decoder = None          # set_preview_vae: a tiny VAE for on_step's previews
        backend.warn_if_slow_blas()

    @property
    def dtype(self):
        """The compute dtype: the run policy's (chosen once, load(dtype=) / --dtype)."""
        return self.policy.compute_dtype

    @property
    def stream_dtype(self):
        """None, or float32 under "float16-mixed": the policy's."""
        return self.policy.stream_dtype

    @property
    def dtype_name(self) -> str:
        """The compute dtype as a user names it: "float16-mixed" when the streams are kept in float32."""
        name = str(self.dtype).replace("mlx.core.", "")
        return f"{name}-mixed" if self.stream_dtype is not None else name

    def use(self, spec, result=None):
        """A component for one phase, through the residency policy (see Residency). `result`: the run's Result
        (what was reused, load times, notes); the encode phase's own (encode_phase) when not given."""
        result = result if result is not None else self._encoding
        others = 0
        if self.residency.keep == "auto":
            others = max((self._loaded_nbytes(s) for s in self.components.values()
                          if s is not None and s.name != spec.name), default=0)
        return self.residency.use(spec, self.policy, result, others)

    def _loaded_nbytes(self, spec):
        key = Residency.key(spec)
        if key not in self._sizes:
            self._sizes[key] = spec.loaded_nbytes()
        return self._sizes[key]

    def set_preview_vae(self, path):
        """on_step's previews decoded by a tiny VAE (TAESD / TAESDXL / TAESD3 / TAEF1 / TAEF2: diffusers'
        AutoencoderTiny or madebyollin's decoder file) instead of the latent-to-RGB projection; None: back to it.
        Returns the pipeline."""
        vae = self.components.get("vae")
        channels = getattr(getattr(vae, "args", None), "latent_channels", None)
        self.preview_decoder = None if path is None else load_tiny_vae(path, channels)
        return self

    def cancel(self):
        """Stop the run in progress (from any thread) after its current denoising step: generate raises Cancelled.
        Without a run in progress it does nothing (the next generate starts afresh)."""
        self._cancel.set()

    def release(self):
        """Free every component kept loaded (keep="auto" / "all") and the prompt cache."""
        self.residency.clear()
        self._prompts.clear()

    def load_lora(self, file, scale=1.0):
        """Add a LoRA file at `scale` (times the file's alpha / rank): diffusers/PEFT, kohya/ComfyUI or
        original-named safetensors (mlxdiff/lora/), to the transformer and, where the file has them, SD3.5's text
        encoders. It is checked against each component's layers before any weight is read; a component kept loaded
        (keep=) gets it in place, a later one is built with it. Returns the pipeline."""
        ((file, scale),) = check_loras([(file, scale)])
        names = sorted({self.DENOISER if n in lora.DENOISERS else n for n in lora.components(file)})
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
        for name, spec in list(self.components.items()):
            if spec is not None and spec.loras:
                self._set_loras(name, (), lora.remove_loras)
        return self

    def _set_loras(self, name, loras, change):
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


    # -- the template ------------------------------------------------------------------------------------------
    def generate(self, prompt=None, *, negative_prompt=None, conditioning=None, width=None, height=None, steps=None,
                 guidance=None, seed=0, latents=None, image=None, strength=None, callback=None, progress_bar=True,
                 cache=None, on_step=None, **options) -> Result:
        """One image (or a batch of prompts): the steps in order; see the family's docstring for its keywords.
        `latents`: the initial noise in diffusers' layout; `image`: a PIL image or file (or a list): the init image
        of image-to-image with `strength`, FLUX.2's reference images without. `cache`: "first-block[:threshold]"
        skips a step's blocks after the first where their result barely changes, "taylorseer[:interval[:order]]"
        predicts whole forwards between the ones it runs (pipelines/step_cache.py). `on_step(step)`: a Step after each
        denoising step; returning False stops the run (Cancelled), as cancel() from another thread does."""
        self._cancel.clear()
        # 1. check: the images, the family's own keywords and the step cache, before anything is loaded
        names, images = check_images(image, strength)
        self.check_images(names, images, strength)
        run = Run(prompt, negative_prompt, seed, names, images, self.default_strength(options) if images and
                  strength is None else strength, self.family_options(options), width, height,
                  step_cache=self.new_step_cache(cache))
        self.check_inputs(run)
        # 2. request: every argument checked, None filled in with the defaults
        run.width, run.height, run.steps, run.guidance = self.request(
            run.width, run.height, steps, guidance, options, seed=seed, prompt=prompt, negative_prompt=negative_prompt,
            latents=latents, **run.options)
        # 3. where the schedule starts (image-to-image: later), whether the step runs CFG
        run.start = self.img2img_start(run.steps, run.strength) if run.img2img else 0
        if run.start >= run.steps:
            raise MlxdiffError(f"strength={run.strength:g} with {run.steps} steps denoises no step; raise the "
                               "strength or the steps")
        run.cfg = self.uses_cfg(run)
        self.check_run(run)
        run.result, phase = new_run(self.policy.phase_markers)
        with installed(self.policy):
            # 4. encode phase: the prompt cache, else the family's encoders
            run.conditioning = self.encode_phase(phase, prompt, conditioning, run.cfg, lambda: self.encode(run),
                                                 self.encode_settings(run), run.result)
            # 5. latents: the noise (and the family's packing, position ids, schedule)
            x = self.prepare_latents(run, latents)
            # 6. reference phase: the VAE encodes the input images, and is freed before the transformer loads
            if self.reference_phase(run):
                with phase("reference"), self.use(self.components["vae"], run.result) as vae:
                    x = self.encode_images(run, vae, x)
                run.result.notes.append(self.images_note(run, run.result.timings["reference"]))
            # 7. denoise (stopped between steps by on_step or cancel())
            x = self.denoise_phase(run, phase, x, callback, progress_bar, on_step)
            # 8. decode
            x = self.unpack(run, x)
            with phase("decode"), self.use(self.components["vae"], run.result) as vae:
                decoded = decode(vae, x)
        # 9. finish
        return finish(run.result, self.finish_images(run, decoded), x)

    def denoise_phase(self, run, phase, x, callback, progress_bar, on_step):
        """The template's step 7: the denoiser through the schedule from run.start, watched between steps."""
        watch = self.watch(run, on_step, len(run.timesteps) - run.start)
        watch(-1, None, None)       # a cancel() during encode stops the run before the denoiser loads
        with phase("denoise"), self.use(self.components[self.DENOISER], run.result) as denoiser:
            x = denoise(lambda i, x: self.velocity(run, denoiser, run.start + i, x),
                        lambda i, x, prediction: self.step(run, run.start + i, x, prediction), x,
                        run.timesteps[run.start:], callback, progress_bar, watch)
        record_step_cache(run)
        return x

    def watch(self, run, on_step, total):
        """denoise's on_step: cancel() seen, then the caller's on_step given the step's Step (its preview made from
        the unpacked latents on demand); Cancelled when either says stop. Step -1: before the first step."""
        rgb = family_named(self.family).latent_rgb(self.pipeline_class)

        def preview(x):
            return latent_preview(np.array(self.preview_layout(run, x)), rgb, run.width, run.height,
                                  self.preview_decoder)

        def watch(i, t, x):
            stop = (on_step is not None and i >= 0 and not self._cancel.is_set()
                    and on_step(Step(i, total, t, x, preview)) is False)
            if stop or self._cancel.is_set():       # the event seen after on_step too: a cancel() while it ran
                raise Cancelled(f"cancelled {'before the first step' if i < 0 else f'after step {i + 1} of {total}'}"
                                "; no image was made")
        return watch

    def new_step_cache(self, cache):
        """generate(cache=...) checked: a fresh pipelines/step_cache cache, or None; one line where the
        spec is wrong or this family's denoiser has no block sequence to skip."""
        step_cache = parse_step_cache(cache)
        if step_cache is not None and not self.STEP_CACHE:
            raise MlxdiffError(f"cache={cache!r}: the denoiser of {self.title} models has no transformer block "
                               "sequence to skip; leave the cache out")
        return step_cache

    def default_strength(self, options: dict):
        """The strength of a run given an init image and no strength: IMG2IMG_STRENGTH; `options`, generate()'s
        family keywords, for a family whose default depends on them (a mask: inpainting's own default)."""
        return self.IMG2IMG_STRENGTH

    def family_options(self, options: dict) -> dict:
        """The family's own keywords taken out of `options` (what is left is refused by request), defaults filled,
        the sampler's name checked against the family's kind."""
        taken = {name: options.pop(name, default) for name, default in self.OPTIONS.items()}
        samplers.check_name(taken["scheduler"], self.SAMPLER_KIND, self.title)
        return taken

    def images_note(self, run, seconds) -> str:
        """Result.notes' line for the reference phase (a family with reference images says more)."""
        return (f"image-to-image from {run.image_names[0]}: strength {run.strength:g}, steps {run.start + 1} to "
                f"{run.steps} of {run.steps} run (init image encoded in {seconds:.2f} s)")

    def steps_run(self, steps, strength=None, **options) -> int:
        """The denoising steps a run makes (image-to-image with `strength` starts later in the schedule); `options`:
        the family's generate() keywords that change it (the UNet family's scheduler)."""
        return steps if strength is None else steps - self.img2img_start(steps, strength)

    # -- img2img's posterior noise (SD3.5 and the UNet family's `image_noise` keyword) --------------------------
    def take_image_noise(self, run):
        """check_inputs' part: `image_noise` checked, and only with an init image."""
        run.options["image_noise"] = check_latents(run.options["image_noise"])
        if run.options["image_noise"] is not None and not run.images:
            raise MlxdiffError("image_noise: the VAE posterior's noise of image-to-image; give image= too, or leave "
                               "it out")

    def check_image_noise(self, run):
        """check_run's part: `image_noise` has the VAE latents' shape at the output size."""
        noise, factor = run.options["image_noise"], self.vae_scale_factor()
        expected = (1, self.components["vae"].args.latent_channels, run.height // factor, run.width // factor)
        if noise is not None and tuple(noise.shape) != expected:
            raise MlxdiffError(f"image_noise has shape {tuple(noise.shape)}, expected {expected} (the VAE latents of "
                               "the output size)")

    def posterior_noise(self, run, shape):
        """The VAE posterior's standard-normal noise: `image_noise`, else a second stream of the seed."""
        noise = run.options["image_noise"]
        if noise is None:
            return mx.random.normal((1, *shape[1:]), key=mx.random.split(mx.random.key(run.seed))[1])
        return mx.array(noise.astype("float32"))

    # -- the family's hooks ------------------------------------------------------------------------------------
    def check_images(self, names, images, strength) -> None:
        """How this family takes generate()'s images (files already read and checked by arguments.check_images):
        here image-to-image from one init image; a family with reference images says more."""
        if len(images) > 1:
            raise MlxdiffError(f"image: {len(images)} images; {self.title} image-to-image starts from one image (it "
                               "takes no reference images); give one --image")

    @property
    def title(self) -> str:
        return family_named(self.family).title

    def check_inputs(self, run):
        """Step 1: the family's keywords and images, before the request (may set run.state, and run.width/height
        where the caller gave none)."""

    def reference_phase(self, run) -> bool:
        """Whether step 6 runs: input images (init or reference), or what else the family's VAE encodes first (a
        ControlNet's control images: pipelines/controls.py)."""
        return bool(run.images)

    def img2img_start(self, steps, strength) -> int:
        """The index of the first step image-to-image runs."""
        raise NotImplementedError

    def uses_cfg(self, run) -> bool:
        raise NotImplementedError

    def check_run(self, run):
        """Step 3: checks that need the request (sizes, steps)."""

    def encode(self, run):
        """Step 4: the conditioning of run.prompt (the family's encode_prompt with the run's settings)."""
        raise NotImplementedError

    def encode_settings(self, run) -> tuple:
        """Every encode setting besides the prompt and CFG: the prompt cache's key."""
        raise NotImplementedError

    def prepare_latents(self, run, latents):
        """Step 5: the initial latents (from `latents` or run.seed) in the transformer's layout; sets run.batch and
        run.sampler (self.new_sampler over the family's schedule)."""
        raise NotImplementedError

    def encode_images(self, run, vae, x):
        """Step 6: the input images through the VAE: img2img's noised init latents (returned in x's place) or
        reference tokens (kept on run.state; x returned)."""
        raise NotImplementedError

    def velocity(self, run, transformer, i, x):
        """Step 7: the family's prediction at schedule index i (CFG, guidance, references included)."""
        raise NotImplementedError

    def step(self, run, i, x, prediction):
        """Step 7: the sampler's update from schedule index i to i + 1."""
        return run.sampler.step(prediction, i, x)

    def new_sampler(self, run, schedule):
        """prepare_latents' part: the run's sampler over the family's schedule (sigmas, timesteps)."""
        return samplers.flow_sampler(run.options["scheduler"], schedule)

    def unpack(self, run, x):
        """Step 8: denoised latents in the transformer's layout -> the VAE's (diffusers' `latents` layout)."""
        return x

    def preview_layout(self, run, x):
        """Step 7's previews: a step's latents in diffusers' layout, as unpack gives them, without what else unpack
        does at the end of the denoise phase (a family whose unpack does more overrides this)."""
        return self.unpack(run, x)

    def finish_images(self, run, images) -> list:
        """Step 9: the decoded PIL images as the family returns them (cropped back to a padded input, say)."""
        return images


def as_numpy(conditioning) -> dict:
    """A conditioning dataclass's arrays as float32 numpy (None stays None)."""
    return {k: None if v is None else np.array(v.astype(mx.float32)) for k, v in vars(conditioning).items()}
