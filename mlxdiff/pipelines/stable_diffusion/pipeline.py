"""Stable Diffusion 1.x / 2.x and SDXL (the UNet family), following diffusers' StableDiffusionPipeline and
StableDiffusionXLPipeline (and their Img2Img twins) step by step.

    encode:  SD: CLIP-L's last hidden state (after its final norm); SDXL: CLIP-L's and OpenCLIP-bigG's penultimate
             hidden states side by side, bigG's projected pool (each encoder freed before the next)
    reference (only with image=): img2img's init latents, VAE-encoded and noised by the sampler to its first step
    denoise: UNet + a discrete-time sampler (ldm_schedulers.py: the folder's scheduler, or `scheduler=`), CFG;
             SDXL's micro-conditioning (sizes and crop) as added time ids
    decode:  the SD VAE (latents / scaling_factor)
"""

from dataclasses import dataclass

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import samplers
from ...arguments import check_generate
from ...config_checks import MAX_IMAGE_SIZE
from ...errors import MlxdiffError
from ...tokenizers import report_truncation, tokenize
from .. import image_inputs
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents
from .folder import LDM_SCHEDULERS

# SDXL's micro-conditioning keywords: (height, width) / (top, left) pairs that become the UNet's added time ids
SIZE_OPTIONS = ("original_size", "crops_coords_top_left", "target_size", "negative_original_size",
                "negative_crops_coords_top_left", "negative_target_size")


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it (the pooled fields are SDXL's; None for SD 1.x / 2.x)."""
    prompt_embeds: mx.array
    pooled_prompt_embeds: mx.array | None = None
    negative_prompt_embeds: mx.array | None = None
    negative_pooled_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


def _pair(name, value, low):
    """A (height, width) or (top, left) keyword: two integers from `low` to MAX_IMAGE_SIZE, or None."""
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_IMAGE_SIZE for v in value)):
        raise MlxdiffError(f"{name}={value!r}: expected two whole numbers from {low} to {MAX_IMAGE_SIZE}, "
                           "e.g. (1024, 1024)")
    return tuple(value)


class StableDiffusionPipeline(Pipeline):
    """SD 1.x / 2.x, or SDXL when the model has a second text encoder (`self.xl`).

    `generate(..., scheduler=NAME)` picks the sampler (samplers.SAMPLERS, the discrete-time ones: euler, euler_karras, euler_a,
    ddim, dpmpp_2m, dpmpp_2m_karras, pndm) over the model's scheduler config; by default the one its folder names.
    `image=, strength=`: image-to-image as diffusers' StableDiffusion(XL)Img2ImgPipeline (strength default 0.8 for SD,
    0.3 for SDXL, as there): the image resized to the output size (default: the image's own, rounded down to a
    multiple of 8, as there), a sample of the VAE posterior (`image_noise`: its standard-normal noise), noised by the
    sampler to the first step run. `latents`: the initial noise (img2img: the noise added to the init latents).
    SDXL: `original_size`, `crops_coords_top_left`, `target_size` and their `negative_` forms, as diffusers'."""
    family = "sd"
    DENOISER = "unet"
    STEP_CACHE = False
    STREAM_DTYPE = False      # a UNet has no residual stream to widen: float16 as it is
    SAMPLER_KIND = samplers.DISCRETE
    OPTIONS = {**Pipeline.OPTIONS, "clip_skip": None, "image_noise": None,
               **{name: None for name in SIZE_OPTIONS}}

    def __init__(self, sources, *args, **kwargs):
        super().__init__(sources, *args, **kwargs)
        self.xl = "text_encoder_2" in self.components
        self.IMG2IMG_STRENGTH = 0.3 if self.xl else 0.8

    def defaults(self):
        return {"steps": 50, "guidance": 5.0 if self.xl else 7.5}

    def default_size(self):
        return self.components["unet"].args.sample_size * self.vae_scale_factor()

    def default_scheduler(self) -> str:
        """The sampler the model's scheduler config names (folder.LDM_SCHEDULERS)."""
        return LDM_SCHEDULERS[self.scheduler_config.get("_class_name", "EulerDiscreteScheduler")]

    # -- encode ---------------------------------------------------------------------------------------------
    def _encode_with(self, index, texts, clip_skip, truncated):
        """One encoder's (hidden states, pooled) for `texts`: SD's last hidden state (clip_skip: an earlier one,
        final-normed), SDXL's penultimate (clip_skip: earlier still); the pool is SDXL's second encoder's
        projection."""
        name, tok = ("text_encoder", "tokenizer") if index == 0 else ("text_encoder_2", "tokenizer_2")
        tokenizer = self.tokenizers[tok]
        ids = tokenize(tokenizer, texts, tokenizer.model_max_length, truncated)
        with self.use(self.components[name]) as encoder:
            out = encoder(mx.array(ids))
            if self.xl:
                embeds = out.hidden_states[-2 if clip_skip is None else -(clip_skip + 2)]
            elif clip_skip is None:
                embeds = out.last_hidden_state
            else:
                embeds = encoder.text_model.final_layer_norm(out.hidden_states[-(clip_skip + 1)])
            pooled = out.text_embeds
            mx.eval(embeds, *([] if pooled is None else [pooled]))
        return embeds, pooled

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      clip_skip=None) -> Conditioning:
        """The prompt (and, with CFG, the negative prompt; diffusers encodes it without clip_skip) through each
        encoder in turn. SDXL with no negative prompt uses zeros when the model says so (force_zeros_for_empty_prompt,
        as SDXL base's model_index.json)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, clip_skip=clip_skip)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        zeros = self.xl and negative_prompt is None and self.options.get("force_zeros_for_empty_prompt", True)
        negatives = None
        if do_classifier_free_guidance and not zeros:
            negatives = [negative_prompt or ""] * batch if negative_prompt is None or isinstance(
                negative_prompt, str) else list(negative_prompt)
            if len(negatives) != batch:
                raise MlxdiffError(f"negative_prompt has {len(negatives)} entries but prompt has {batch}")
        truncated, embeds, negative_embeds, pooled, negative_pooled = [], [], [], None, None
        for index in ((0, 1) if self.xl else (0,)):
            e, pooled = self._encode_with(index, prompts, clip_skip, truncated)
            embeds.append(e)
            if negatives is not None:
                ne, negative_pooled = self._encode_with(index, negatives, None, truncated)
                negative_embeds.append(ne)
        report_truncation(truncated, f"CLIP {self.tokenizers['tokenizer'].model_max_length} tokens")
        embeds = mx.concatenate(embeds, axis=-1).astype(self.dtype)
        pooled = None if pooled is None else pooled.astype(self.dtype)
        if not do_classifier_free_guidance:
            return Conditioning(embeds, pooled)
        if zeros:
            negative_embeds = mx.zeros_like(embeds)
            negative_pooled = mx.zeros_like(pooled)
        else:
            negative_embeds = mx.concatenate(negative_embeds, axis=-1).astype(self.dtype)
            negative_pooled = None if negative_pooled is None else negative_pooled.astype(self.dtype)
        mx.eval(embeds, negative_embeds, *[p for p in (pooled, negative_pooled) if p is not None])
        return Conditioning(embeds, pooled, negative_embeds, negative_pooled)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def img2img_start(self, steps, strength):
        """StableDiffusion(XL)Img2ImgPipeline.get_timesteps: int(steps * strength) steps are run."""
        return max(steps - min(int(steps * strength), steps), 0)

    def uses_cfg(self, run):
        return run.guidance > 1

    def check_inputs(self, run):
        o = run.options
        self.take_image_noise(run)
        for name in SIZE_OPTIONS:
            if o[name] is not None and not self.xl:
                raise MlxdiffError(f"{name}: SDXL's micro-conditioning; this is an SD 1.x / 2.x model")
            o[name] = _pair(name, o[name], 0 if "crops" in name else 1)
        if run.img2img:    # diffusers' Img2Img pipelines take the image's size, rounded down to the VAE's factor
            factor = self.vae_scale_factor()
            w, h = run.images[0].size
            run.width = run.width or max(factor, w - w % factor)
            run.height = run.height or max(factor, h - h % factor)

    def check_run(self, run):
        self.check_image_noise(run)

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  clip_skip=run.options["clip_skip"])

    def encode_settings(self, run):
        return repr(run.negative_prompt), run.options["clip_skip"]

    def _time_ids(self, run, negative=False):
        """SDXL's added time ids: original size + crop's top-left + target size (diffusers' _get_add_time_ids); the
        negative ones differ only when both negative sizes are given, as there."""
        o, size = run.options, (run.height, run.width)
        if negative and o["negative_original_size"] and o["negative_target_size"]:
            ids = (*o["negative_original_size"], *(o["negative_crops_coords_top_left"] or (0, 0)),
                   *o["negative_target_size"])
        else:
            ids = (*(o["original_size"] or size), *(o["crops_coords_top_left"] or (0, 0)), *(o["target_size"] or size))
        return mx.array([ids] * run.batch, dtype=self.dtype)

    def sampler(self, name, steps):
        """The sampler `name` (None: the model's own) over the model's scheduler config, for `steps` steps."""
        name, config = name or self.default_scheduler(), self.scheduler_config
        if name == "pndm" and config.get("_class_name") != "PNDMScheduler":
            config = dict(config, skip_prk_steps=True)   # chosen over another class's config: PLMS, as UIs mean it
        return samplers.discrete_sampler(name, config, steps)

    def steps_run(self, steps, strength=None, scheduler=None, **options) -> int:
        """Model calls a run makes: PNDM's PLMS makes one more than its steps."""
        return len(self.sampler(scheduler, steps).timesteps) - (
            0 if strength is None else self.img2img_start(steps, strength))

    def prepare_latents(self, run, latents):
        cond = run.conditioning
        run.batch = cond.prompt_embeds.shape[0]
        embeds, pooled = cond.prompt_embeds, cond.pooled_prompt_embeds
        added = None
        if self.xl:
            time_ids = self._time_ids(run)
            if run.cfg:      # diffusers' batch order: [negative, positive]
                pooled = mx.concatenate([cond.negative_pooled_prompt_embeds, pooled])
                time_ids = mx.concatenate([self._time_ids(run, negative=True), time_ids])
            added = {"text_embeds": pooled, "time_ids": time_ids}
        if run.cfg:
            embeds = mx.concatenate([cond.negative_prompt_embeds, embeds])
        run.state["embeds"], run.state["added"] = embeds, added
        factor = self.vae_scale_factor()
        run.state["shape"] = shape = (run.batch, self.components["unet"].args.in_channels,
                                      run.height // factor, run.width // factor)
        run.sampler = sampler = self.sampler(run.options["scheduler"], run.steps)
        # the ancestral sampler's per-step noise: a third stream of the seed (the first is the initial noise, the
        # second img2img's posterior noise)
        run.state["step_keys"] = mx.random.split(mx.random.split(mx.random.key(run.seed), 3)[2], len(run.timesteps))
        noise = initial_latents(latents, shape, run.seed)
        return noise if run.img2img else noise * sampler.init_noise_sigma

    def encode_images(self, run, vae, x):
        shape = run.state["shape"]
        init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height, self.dtype,
                                             self.posterior_noise(run, shape))
        x = run.sampler.add_noise(mx.broadcast_to(init, shape), x, run.start)
        mx.eval(x)
        return x

    def velocity(self, run, unet, i, x):
        """The UNet's noise (or v) prediction at schedule index i, with CFG against the negative conditioning."""
        x_in = run.sampler.scale_model_input(x, i).astype(self.dtype)
        embeds, added, batch = run.state["embeds"], run.state["added"], run.batch
        t = mx.array(run.timesteps[i])
        if not run.cfg:
            return unet(x_in, t, embeds, added, after_block=evaluate_each_block)
        if self.group is None:    # one batch of two: [uncond; cond]
            out = unet(mx.concatenate([x_in, x_in]), t, embeds, added, after_block=evaluate_each_block)
            uncond, cond = out[:batch], out[batch:]
        else:                     # guidance-parallel: each rank its half
            def half(k):
                part = None if added is None else {n: v[k * batch:(k + 1) * batch] for n, v in added.items()}
                return lambda: unet(x_in, t, embeds[k * batch:(k + 1) * batch], part, after_block=evaluate_each_block)
            uncond, cond = guidance_pair(self.group, half(0), half(1))
        return uncond + run.guidance * (cond - uncond)

    def step(self, run, i, x, prediction):
        noise = None
        if run.sampler.ancestral:
            noise = mx.random.normal(x.shape, key=run.state["step_keys"][i])
        return run.sampler.step(prediction, i, x, noise)
