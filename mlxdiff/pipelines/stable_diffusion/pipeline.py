"""Stable Diffusion 1.x / 2.x and SDXL (the UNet family), following diffusers' StableDiffusionPipeline and
StableDiffusionXLPipeline (and their Img2Img, Inpaint and ControlNet twins) step by step.

    encode:  SD: CLIP-L's last hidden state (after its final norm); SDXL: CLIP-L's and OpenCLIP-bigG's penultimate
             hidden states side by side, bigG's projected pool (each encoder freed before the next)
    reference (only with image=): img2img's init latents, VAE-encoded and noised by the sampler to its first step
    denoise: UNet + a discrete-time sampler (ldm_schedulers.py: the folder's scheduler, or `scheduler=`), CFG;
             SDXL's micro-conditioning (sizes and crop) as added time ids
    decode:  the SD VAE (latents / scaling_factor)

Inpainting (image= and mask=), as StableDiffusion(XL)InpaintPipeline: the mask (blurred first with mask_blur=, as
VaeImageProcessor.blur; outpaint= pads the image and makes the mask: image_inputs.take_mask) resized (LANCZOS) to
the output size, grayscale, binarized at 0.5 (white repaints); an inpainting UNet (9 input channels) takes the
latents, the mask at the latent size (every factor-th pixel: interpolate "nearest") and the latents of the image
with the repainted area blacked out (a VAE posterior sample) on its channels; a text-to-image UNet (4 channels) gets
its kept area put back after each step (the init latents noised to the next step; clean after the last). At strength
1 (SD's default) the run starts from pure noise, below it from the init latents noised to the first step run; SDXL's
default strength is 0.9999, and denoising_start= starts from the clean init latents at that share of the schedule,
as there.

ControlNet (load(controlnets=), generate(control_images=)), as StableDiffusion(XL)ControlNetPipeline (MultiControlNet
for several): each control image resized (LANCZOS) to the output size in [0, 1] (the output size defaults to the first
control image's, cut to the VAE's factor, as there); at each step each ControlNet within its [control_start,
control_end] share of the schedule runs on the same latents and prompt as the UNet (both CFG halves), and the sums of
their residuals times their scales are added to the UNet's skips and middle block.
"""

from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import samplers
from ...arguments import check_generate, check_images, check_latents, check_number
from ...config_checks import MAX_IMAGE_SIZE
from ...errors import MlxdiffError
from ...tokenizers import report_truncation, tokenize
from .. import image_inputs
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents
from ..image_inputs import encode_moments, latent_mask, resized, to_array
from .folder import LDM_SCHEDULERS

# SDXL's micro-conditioning keywords: (height, width) / (top, left) pairs that become the UNet's added time ids
SIZE_OPTIONS = ("original_size", "crops_coords_top_left", "target_size", "negative_original_size",
                "negative_crops_coords_top_left", "negative_target_size")
# inpainting's (beside image_inputs.MASK_OPTIONS: mask, mask_blur, outpaint) and ControlNet's keywords
INPAINT_OPTIONS = ("masked_image_noise", "denoising_start")
CONTROL_OPTIONS = ("control_images", "control_scales", "control_start", "control_end")


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
    SDXL: `original_size`, `crops_coords_top_left`, `target_size` and their `negative_` forms, as diffusers'.
    `image=, mask=` (a PIL image or file; white repaints, black keeps): inpainting as StableDiffusion(XL)
    InpaintPipeline (strength default 1.0 for SD, 0.9999 for SDXL; the output size defaults to the model's, as
    there); `mask_blur`: the mask blurred first (VaeImageProcessor.blur); `outpaint=(left, top, right, bottom)`:
    the image padded (edge pixels) and the border repainted, the output size defaulting to the canvas's cut to
    the VAE's factor (image_inputs.take_mask); `masked_image_noise`: the posterior noise of the masked image's
    latents (an inpainting UNet's; default: from the seed); SDXL `denoising_start` (0 < d < 1): start from the
    clean init latents at that share of the schedule (strength ignored). `control_images=[...]` (one per
    ControlNet given to load), `control_scales` (replacing load's), `control_start` / `control_end` (shares of
    the schedule, one or one per ControlNet)."""
    family = "sd"
    DENOISER = "unet"
    STEP_CACHE = False
    STREAM_DTYPE = False      # a UNet has no residual stream to widen: float16 as it is
    SAMPLER_KIND = samplers.DISCRETE
    SIZE_OF_IMAGE = True      # an init image sets the size left out, on the command line too (README)
    OPTIONS = {**Pipeline.OPTIONS, "clip_skip": None, "image_noise": None, **image_inputs.MASK_OPTIONS,
               **{name: None for name in SIZE_OPTIONS + INPAINT_OPTIONS + CONTROL_OPTIONS}}

    def __init__(self, sources, *args, **kwargs):
        super().__init__(sources, *args, **kwargs)
        self.xl = "text_encoder_2" in self.components
        self.IMG2IMG_STRENGTH = 0.3 if self.xl else 0.8
        self.INPAINT_STRENGTH = 0.9999 if self.xl else 1.0     # StableDiffusion(XL)InpaintPipeline's defaults
        # an inpainting UNet: the latents, the mask and the masked image's latents on its input channels
        self.inpainting_unet = (self.components["unet"].args.in_channels
                                != self.components["vae"].args.latent_channels)
        self.controlnets = [name for name in self.components if name.startswith("controlnet")]
        self.control_scales = list(self.options.get("controlnet_scales", [1.0] * len(self.controlnets)))
        self._controls = None      # generate()'s ExitStack: the ControlNets loaded for its denoise phase

    def generate(self, *args, **kwargs):
        """Pipeline.generate; see the class docstring for the keywords. The ControlNets the denoise phase loads
        are released when it ends (unpack), and in any case when the run does."""
        with ExitStack() as stack:
            self._controls = stack
            try:
                return super().generate(*args, **kwargs)
            finally:
                self._controls = None

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
        self.check_clip_skip(clip_skip)
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

    def check_clip_skip(self, clip_skip):
        """clip_skip within the encoders' layers, from their configs (nothing loaded): SD takes hidden state
        -(clip_skip + 1) of its L layers' L + 1, SDXL -(clip_skip + 2) of each encoder's."""
        if clip_skip is None:
            return
        names = ("text_encoder", "text_encoder_2") if self.xl else ("text_encoder",)
        layers = min(self.components[n].args.num_hidden_layers for n in names)
        most = layers - 1 if self.xl else layers
        if clip_skip > most:
            raise MlxdiffError(f"clip_skip={clip_skip}: this model's text encoder has {layers} layers, so clip_skip "
                               f"can be at most {most}; give a smaller --clip-skip (1 or 2, as UIs use it)")

    def default_strength(self, options):
        return self.INPAINT_STRENGTH if image_inputs.inpainting(options) else self.IMG2IMG_STRENGTH

    def check_inputs(self, run):
        o = run.options
        self.take_image_noise(run)
        if o["clip_skip"] is not None:
            check_generate(clip_skip=o["clip_skip"])
            self.check_clip_skip(o["clip_skip"])
        for name in SIZE_OPTIONS:
            if o[name] is not None and not self.xl:
                raise MlxdiffError(f"{name}: SDXL's micro-conditioning; this is an SD 1.x / 2.x model")
            o[name] = _pair(name, o[name], 0 if "crops" in name else 1)
        self._take_inpainting(run)
        self._take_controls(run)
        factor = self.vae_scale_factor()
        sized_by = None if "mask" in run.state else run.images[0] if run.img2img else (
            run.state["controls"]["images"][0] if "controls" in run.state else None)
        if sized_by is not None:   # diffusers' Img2Img and ControlNet pipelines: the image's size, cut to the factor
            w, h = sized_by.size
            run.width = run.width or max(factor, w - w % factor)
            run.height = run.height or max(factor, h - h % factor)

    def _take_inpainting(self, run):
        """check_inputs' part: the mask, its blur and outpainting (image_inputs.take_mask: only with the one init
        image; outpainting's output size the canvas's), the inpainting UNet's need of one, masked_image_noise and
        SDXL's denoising_start."""
        o = run.options
        image_inputs.take_mask(run, self.vae_scale_factor())
        masked = "mask" in run.state
        if self.inpainting_unet and not masked:
            raise MlxdiffError("this model's UNet is an inpainting one (9 input channels: the latents, a mask and "
                               "the masked image); give image= and mask= (--image FILE --mask FILE) or "
                               "outpaint= (--outpaint L,T,R,B)")
        o["masked_image_noise"] = check_latents(o["masked_image_noise"])
        if o["masked_image_noise"] is not None and not (masked and self.inpainting_unet):
            raise MlxdiffError("masked_image_noise: the VAE posterior's noise of an inpainting UNet's masked image; "
                               "give it with image= and mask= (or outpaint=) to a 9-channel inpainting model, or "
                               "leave it out")
        start = o["denoising_start"] = check_number("denoising_start", o["denoising_start"])
        if start is not None:
            if not (self.xl and masked):
                raise MlxdiffError("denoising_start: SDXL inpainting's (StableDiffusionXLInpaintPipeline) start at "
                                   "a share of the schedule; give it to an SDXL model with image= and mask= (or "
                                   "outpaint=)")
            if start >= 1:
                raise MlxdiffError(f"denoising_start={start:g}: must be above 0 and below 1")

    def _take_controls(self, run):
        """check_inputs' part: one control image per ControlNet loaded, its scale (generate's replace load's) and
        its [start, end] share of the schedule -> run.state["controls"]."""
        o = run.options
        n = len(self.controlnets)
        if not n:
            given = [name for name in CONTROL_OPTIONS if o[name] is not None]
            if given:
                raise MlxdiffError(f"{given[0]}: this pipeline has no ControlNet; load one with "
                                   "controlnets=[(path, scale)] (--controlnet PATH[:SCALE])")
            return
        if o["control_images"] is None:
            raise MlxdiffError(f"control_images: this pipeline has {n} ControlNet{'s' if n > 1 else ''}; give one "
                               "control image for each (control_images=[...], --control-image FILE)")
        if run.images:
            raise MlxdiffError("control_images with image=: mlxdiff runs ControlNets text-to-image (diffusers' "
                               "StableDiffusion(XL)ControlNetPipeline); leave image= (and mask=) out")
        names, images = check_images(o["control_images"])
        if len(images) != n:
            raise MlxdiffError(f"control_images: {len(images)} control image{'s' if len(images) > 1 else ''} for {n} "
                               f"ControlNet{'s' if n > 1 else ''}; give one per ControlNet, in their order "
                               "(one --control-image per --controlnet)")

        def per_net(name, value, default, rule):
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise MlxdiffError(f"{name}: {len(values)} values for {n} ControlNets; give one, or one per ControlNet")
            return [check_number(rule, d if v is None else v) for v, d in zip(values, default)]
        scales = per_net("control_scales", o["control_scales"], self.control_scales, "controlnet_scale")
        starts = per_net("control_start", o["control_start"], [0.0] * n, "control_step")
        ends = per_net("control_end", o["control_end"], [1.0] * n, "control_step")
        for start, end in zip(starts, ends):
            if start >= end:
                raise MlxdiffError(f"control_start {start:g} is not below control_end {end:g}; a ControlNet acts "
                                   "from its start to its end share of the schedule")
        run.state["controls"] = dict(names=names, images=images, scales=scales, starts=starts, ends=ends)

    def check_run(self, run):
        self.check_image_noise(run)
        noise, expected = run.options["masked_image_noise"], self._latent_shape(run, 1)
        if noise is not None and tuple(noise.shape) != expected:
            raise MlxdiffError(f"masked_image_noise has shape {tuple(noise.shape)}, expected {expected} (the VAE "
                               "latents of the output size)")
        start = run.options["denoising_start"]
        if start is not None:     # StableDiffusionXLInpaintPipeline.get_timesteps with denoising_start
            timesteps = self.sampler(run.options["scheduler"], run.steps).timesteps
            n = self.scheduler_config.get("num_train_timesteps", 1000)
            cutoff = int(round(n - start * n))
            kept = int((np.asarray(timesteps) < cutoff).sum())
            if kept < 1:
                raise MlxdiffError(f"denoising_start={start:g} with {run.steps} steps denoises no step; lower it or "
                                   "raise the steps")
            run.start = len(timesteps) - kept

    def _latent_shape(self, run, batch):
        factor = self.vae_scale_factor()
        return (batch, self.components["vae"].args.latent_channels, run.height // factor, run.width // factor)

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  clip_skip=run.options["clip_skip"])

    def encode_settings(self, run):
        return repr(run.negative_prompt), run.options["clip_skip"]

    def _time_ids(self, run, negative=False):
        """SDXL's added time ids: original size + crop's top-left + target size (diffusers' _get_add_time_ids); the
        negative ones differ only when both negative sizes are given, as there; inpainting's (StableDiffusionXL
        InpaintPipeline) take each negative size given (else the positive one) and the positive crop."""
        o, size = run.options, (run.height, run.width)
        if negative and "mask" in run.state:
            ids = (*(o["negative_original_size"] or o["original_size"] or size),
                   *(o["crops_coords_top_left"] or (0, 0)), *(o["negative_target_size"] or o["target_size"] or size))
        elif negative and o["negative_original_size"] and o["negative_target_size"]:
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
        run.state["shape"] = shape = self._latent_shape(run, run.batch)
        run.sampler = sampler = self.sampler(run.options["scheduler"], run.steps)
        # the ancestral sampler's per-step noise: a third stream of the seed (the first is the initial noise, the
        # second img2img's posterior noise, the fourth an inpainting UNet's masked image's)
        run.state["step_keys"] = mx.random.split(mx.random.split(mx.random.key(run.seed), 3)[2], len(run.timesteps))
        if "controls" in run.state:     # diffusers' control_image_processor: RGB, resized, in [0, 1]
            run.state["control_pixels"] = [mx.array(np.asarray(resized(im.convert("RGB"), run.width, run.height))
                                                    .astype(np.float32).transpose(2, 0, 1)[None] / 255.0)
                                           for im in run.state["controls"]["images"]]
        noise = run.state["noise"] = initial_latents(latents, shape, run.seed)
        return noise if run.img2img and not self._from_pure_noise(run) else noise * sampler.init_noise_sigma

    def _from_pure_noise(self, run) -> bool:
        """The inpainting pipelines' is_strength_max: at strength 1 the run starts from the noise alone."""
        return "mask" in run.state and run.strength == 1.0 and run.options["denoising_start"] is None

    def encode_images(self, run, vae, x):
        shape = run.state["shape"]
        if "mask" not in run.state:
            init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                                 self.posterior_noise(run, shape))
            x = run.sampler.add_noise(mx.broadcast_to(init, shape), x, run.start)
            mx.eval(x)
            return x
        return self._encode_inpainting(run, vae, x)

    def _encode_inpainting(self, run, vae, x):
        """StableDiffusion(XL)InpaintPipeline's prepare_latents and prepare_mask_latents: the init latents (a
        4-channel UNet's blend, or a start below strength 1), the mask at the latent size and, for an inpainting UNet,
        the latents of the image with the repainted area blacked out."""
        st, shape = run.state, run.state["shape"]
        mask = mx.array(latent_mask(st["mask"], run.width, run.height, self.vae_scale_factor()))
        pure = self._from_pure_noise(run)
        if not self.inpainting_unet or not pure:
            init = mx.broadcast_to(image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                                                 self.posterior_noise(run, shape)), shape)
            if run.options["denoising_start"] is not None:    # the clean init latents (diffusers' add_noise=False)
                x = init
            elif not pure:
                x = run.sampler.add_noise(init, st["noise"], run.start)
            if not self.inpainting_unet:
                st["blend"] = (mask, init)
        if self.inpainting_unet:
            full = latent_mask(st["mask"], run.width, run.height, 1)
            pixels = to_array(resized(run.images[0], run.width, run.height)) * (full < 0.5)
            mean, logvar = encode_moments(vae, pixels)
            noise = run.options["masked_image_noise"]
            noise = (mx.random.normal(mean.shape, key=mx.random.split(mx.random.key(run.seed), 4)[3])
                     if noise is None else mx.array(noise.astype(np.float32)))
            masked = vae.scale_latents(mean.astype(mx.float32) + mx.exp(0.5 * logvar.astype(mx.float32)) * noise)
            st["unet_extra"] = mx.concatenate([mask, masked.astype(mx.float32)], axis=1)   # (1, 1 + C, h, w)
        mx.eval(x, *(st["blend"] if "blend" in st else ()), *([st["unet_extra"]] if "unet_extra" in st else []))
        return x

    def images_note(self, run, seconds):
        return image_inputs.inpaint_note(run, super().images_note(run, seconds))

    def velocity(self, run, unet, i, x):
        """The UNet's noise (or v) prediction at schedule index i, with CFG against the negative conditioning."""
        x_in = run.sampler.scale_model_input(x, i).astype(self.dtype)
        embeds, added, batch = run.state["embeds"], run.state["added"], run.batch
        t = mx.array(run.timesteps[i])
        if not run.cfg:
            return self._forward(run, unet, i, x_in, t, embeds, added)
        if self.group is None:    # one batch of two: [uncond; cond]
            out = self._forward(run, unet, i, mx.concatenate([x_in, x_in]), t, embeds, added)
            uncond, cond = out[:batch], out[batch:]
        else:                     # guidance-parallel: each rank its half
            def half(k):
                part = None if added is None else {n: v[k * batch:(k + 1) * batch] for n, v in added.items()}
                return lambda: self._forward(run, unet, i, x_in, t, embeds[k * batch:(k + 1) * batch], part)
            uncond, cond = guidance_pair(self.group, half(0), half(1))
        return uncond + run.guidance * (cond - uncond)

    def _forward(self, run, unet, i, x_in, t, embeds, added):
        """One UNet forward on the scaled latents x_in: the ControlNets' residuals added, an inpainting UNet's mask
        and masked-image latents on its input channels."""
        down, mid = self._control_residuals(run, i, x_in, t, embeds, added)
        if "unet_extra" in run.state:
            extra = run.state["unet_extra"].astype(x_in.dtype)
            x_in = mx.concatenate([x_in, mx.broadcast_to(extra, (x_in.shape[0], *extra.shape[1:]))], axis=1)
        return unet(x_in, t, embeds, added, after_block=evaluate_each_block, down_block_additional_residuals=down,
                    mid_block_additional_residual=mid)

    def _control_residuals(self, run, i, x_in, t, embeds, added):
        """The summed residuals of the ControlNets acting at schedule index i (diffusers' controlnet_keep: outside
        [start, end] a ControlNet's scale is 0, so it is not run), each times its scale; (None, None) without."""
        controls = run.state.get("controls")
        if controls is None:
            return None, None
        if "controlnet_models" not in run.state:     # loaded once, for the denoise phase (released by unpack)
            stack = run.state["control_stack"] = self._controls.enter_context(ExitStack())
            run.state["controlnet_models"] = [stack.enter_context(self.use(self.components[name], run.result))
                                              for name in self.controlnets]
        n, down, mid = len(run.timesteps), None, None
        for net, pixels, scale, start, end in zip(run.state["controlnet_models"], run.state["control_pixels"],
                                                  controls["scales"], controls["starts"], controls["ends"]):
            if i / n < start or (i + 1) / n > end or scale == 0:
                continue
            cond = mx.broadcast_to(pixels, (x_in.shape[0], *pixels.shape[1:]))
            d, m = net(x_in, t, embeds, cond, scale, added, after_block=evaluate_each_block)
            down = d if down is None else [a + b for a, b in zip(down, d)]
            mid = m if mid is None else mid + m
        return down, mid

    def step(self, run, i, x, prediction):
        noise = None
        if run.sampler.ancestral:
            noise = mx.random.normal(x.shape, key=run.state["step_keys"][i])
        x = run.sampler.step(prediction, i, x, noise)
        if "blend" in run.state:    # a 4-channel UNet's inpainting: the kept area is the init latents at step i + 1
            mask, init = run.state["blend"]
            kept = init if i + 1 >= len(run.timesteps) else run.sampler.add_noise(init, run.state["noise"], i + 1)
            x = (1 - mask) * kept + mask * x
        return x

    def unpack(self, run, x):
        if "control_stack" in run.state:    # the ControlNets leave with the denoise phase
            run.state["control_stack"].close()
        if "controls" in run.state:
            c = run.state["controls"]
            run.result.notes.append("ControlNet " + "; ".join(
                f"{self.components[name].source} on {image}: scale {scale:g}, from {start:g} to {end:g} of the steps"
                for name, image, scale, start, end in zip(self.controlnets, c["names"], c["scales"], c["starts"],
                                                          c["ends"])))
        return x

    def preview_layout(self, run, x):
        return x                            # unpack's layout, the ControlNets left in place (on_step's previews)
