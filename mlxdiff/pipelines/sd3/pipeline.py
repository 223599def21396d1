"""Stable Diffusion 3 / 3.5 (Medium, Large), following diffusers' StableDiffusion3Pipeline step by step.

    encode:  CLIP-L, CLIP-G, T5 one after another (each freed before the next) -> prompt_embeds (B, 77+T, 4096)
    reference (only with image=): img2img's init latents, VAE-encoded (image_inputs.py), as
             StableDiffusion3Img2ImgPipeline
    inpainting (image= and mask=, or outpaint=): StableDiffusion3InpaintPipeline with SD3.5's 16-channel
             transformer: the mask binarized at the output size and taken at every 8th pixel (image_inputs.latent_mask),
             after each step the kept area put back as the init latents noised to the next sigma (clean after the
             last); its masked_image_latents only reach a 33-channel transformer (none is published), so they are
             not computed. Its decode drops the VAE's shift_factor (diffusers #13611, fixed by #14671); mlxdiff
             decodes as every other SD3 pipeline does, (latents / scaling) + shift
    denoise: MMDiT(-X) + flow-match Euler, CFG and skip-layer guidance
    ControlNet (load(controlnets=), generate(control_images=)): StableDiffusion3ControlNetPipeline (several: its
             SD3MultiControlNetModel): each control image resized to the output size, a sample of its VAE posterior,
             (z - shift) * scaling with the shift left out for ControlNets that force zero pooled projections
             (InstantX's; diffusers reads the first ControlNet's config for all); at each step each ControlNet within
             its [control_start, control_end] runs on the same latents, prompt and timestep as the transformer (both
             CFG halves; zero pooled projections where its config says), and the sums of their block residuals join
             the transformer's image stream (pipelines/controls.py). No skip-layer guidance there, as in diffusers
    decode:  SD3 VAE
"""

from dataclasses import dataclass

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate, check_layers
from ...errors import MlxdiffError
from ...tokenizers import tokenize, report_truncation
from .. import image_inputs
from ..controls import CONTROL_OPTIONS, ControlNets, acting, control_latents
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `np.asarray(field)` converts one."""
    prompt_embeds: mx.array
    pooled_prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_pooled_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class SD3Pipeline(ControlNets, image_inputs.LatentInpainting, Pipeline):
    """`generate(..., image=, strength=)` is image-to-image as diffusers' StableDiffusion3Img2ImgPipeline (strength
    0 < s <= 1, default 0.6 as there): the image resized to the output size (whose default is the model's, not the
    image's, as there), a sample of the VAE posterior, noised to the sigma of the first step run, steps
    int(steps - steps * strength) + 1 to `steps` run. `latents`: the noise (img2img: the noise mixed into the init
    latents, diffusers' `noise` in prepare_latents); `image_noise`: the posterior sample's standard-normal noise
    (diffusers draws it first from the generator, in vae.encode(...).latent_dist.sample), shaped like the VAE
    latents; by default both are drawn from `seed`. `mask=` with image= (white repaints, black keeps, any size:
    resized to the output's; `mask_blur` blurs it first) inpaints as StableDiffusion3InpaintPipeline (strength
    default 0.6, as there); `outpaint=(left, top, right, bottom)` pads the image and repaints the border (the output
    size defaults to the canvas's, cut to a multiple of 16). `control_images=[...]` (one per ControlNet given to load),
    `control_scales` (replacing load's), `control_start` / `control_end` (shares of the schedule, one or one per
    ControlNet), `control_noise` (each control image's VAE posterior noise; default from the seed): ControlNet as
    StableDiffusion3ControlNetPipeline. The other keywords are diffusers' (OPTIONS)."""
    family = "sd3"
    patch_size = 2
    OPTIONS = {**Pipeline.OPTIONS, "skip_guidance_layers": None, "skip_layer_guidance_scale": 2.8, "skip_layer_guidance_start": 0.01,
               "skip_layer_guidance_stop": 0.2, "clip_skip": None, "max_sequence_length": 256, "image_noise": None,
               **image_inputs.MASK_OPTIONS, **{name: None for name in CONTROL_OPTIONS}}
    CONTROL_PIPELINE = "StableDiffusion3ControlNetPipeline"
    IMG2IMG_STRENGTH = 0.6        # StableDiffusion3Img2ImgPipeline's default strength (and the inpaint pipeline's)

    def defaults(self):
        return {"steps": 28, "guidance": 7.0}

    def default_size(self):
        return self.components["transformer"].args.sample_size * self.vae_scale_factor()

    def check_clip_skip(self, clip_skip):
        """_clip reads hidden state -(clip_skip + 2) of each CLIP's L + 1: at most L - 1, from the configs."""
        if clip_skip is None:
            return
        check_generate(clip_skip=clip_skip)
        layers = min(self.components[n].args.num_hidden_layers for n in ("text_encoder", "text_encoder_2"))
        if clip_skip > layers - 1:
            raise MlxdiffError(f"clip_skip={clip_skip}: this model's CLIP text encoders have {layers} layers, so "
                               f"clip_skip can be at most {layers - 1}; give a smaller --clip-skip")

    # -- encode ---------------------------------------------------------------------------------------------
    def _clip(self, index, prompts, clip_skip, truncated):
        self.check_clip_skip(clip_skip)     # before the encoder loads (encode_prompt does not pass check_run)
        name, tok = ("text_encoder", "tokenizer") if index == 0 else ("text_encoder_2", "tokenizer_2")
        max_length = self.tokenizers["tokenizer"].model_max_length  # diffusers uses tokenizer 1's limit for both
        ids = tokenize(self.tokenizers[tok], prompts, max_length, truncated)
        with self.use(self.components[name]) as encoder:
            out = encoder(mx.array(ids))
            layer = -2 if clip_skip is None else -(clip_skip + 2)
            embeds, pooled = out.hidden_states[layer], out.text_embeds
            mx.eval(embeds, pooled)
        return embeds, pooled

    def _t5(self, prompts, max_sequence_length, truncated):
        spec = self.components.get("text_encoder_3")
        if spec is None:
            joint = self.components["transformer"].args.joint_attention_dim
            return mx.zeros((len(prompts), max_sequence_length, joint), dtype=self.dtype)
        ids = tokenize(self.tokenizers["tokenizer_3"], prompts, max_sequence_length, truncated)
        with self.use(spec) as encoder:
            out = encoder(mx.array(ids))
            mx.eval(out)
        return out

    def encode_prompt(self, prompt, negative_prompt=None, *, prompt_2=None, prompt_3=None, negative_prompt_2=None,
                      negative_prompt_3=None, do_classifier_free_guidance=True, clip_skip=None,
                      max_sequence_length=256) -> Conditioning:
        """CLIP-L, CLIP-G and T5, each loaded, run on the positive and negative prompts together, and freed."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, prompt_2=prompt_2, prompt_3=prompt_3,
                       max_sequence_length=max_sequence_length, clip_skip=clip_skip)   # T5's limit: 512
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        as_list = lambda p, default: default if p is None else ([p] * batch if isinstance(p, str) else list(p))
        texts = [prompts, as_list(prompt_2, prompts), as_list(prompt_3, prompts)]
        if do_classifier_free_guidance:
            neg = as_list(negative_prompt or "", None)
            negs = [neg, as_list(negative_prompt_2, neg), as_list(negative_prompt_3, neg)]
            if len(neg) != batch:
                raise MlxdiffError(f"negative_prompt has {len(neg)} entries but prompt has {batch}")
        truncated = []
        clip_embeds, pooled = [], []
        for index in (0, 1):
            e, p = self._clip(index, texts[index], clip_skip, truncated)
            if do_classifier_free_guidance:
                # the negative path always uses clip_skip=None in diffusers
                ne, np_ = self._clip(index, negs[index], None, truncated)
                e, p = mx.concatenate([e, ne]), mx.concatenate([p, np_])
            clip_embeds.append(e)
            pooled.append(p)
        t5 = self._t5(texts[2] + (negs[2] if do_classifier_free_guidance else []), max_sequence_length, truncated)
        report_truncation(truncated, f"CLIP {self.tokenizers['tokenizer'].model_max_length} tokens, "
                                     f"T5 {max_sequence_length} tokens")
        clip = mx.concatenate(clip_embeds, axis=-1).astype(self.dtype)
        clip = mx.pad(clip, [(0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])])
        embeds = mx.concatenate([clip, t5.astype(self.dtype)], axis=1)
        pooled = mx.concatenate(pooled, axis=-1).astype(self.dtype)
        mx.eval(embeds, pooled)
        if not do_classifier_free_guidance:
            return Conditioning(embeds, pooled)
        return Conditioning(embeds[:batch], pooled[:batch], embeds[batch:], pooled[batch:])

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def img2img_start(self, steps, strength):
        return image_inputs.sd3_start(steps, strength)

    def uses_cfg(self, run):
        return run.guidance > 1

    def check_inputs(self, run):
        self.take_image_noise(run)
        image_inputs.take_mask(run, self.vae_scale_factor() * self.patch_size)
        self.take_controls(run)

    def check_run(self, run):
        run.options["skip_guidance_layers"] = check_layers(
            "skip_guidance_layers", run.options["skip_guidance_layers"], self.components["transformer"].args.num_layers)
        self.check_clip_skip(run.options["clip_skip"])
        self.check_image_noise(run)
        if "controls" in run.state and run.options["skip_guidance_layers"]:
            raise MlxdiffError("skip_guidance_layers with a ControlNet: StableDiffusion3ControlNetPipeline has no "
                               "skip-layer guidance; leave --skip-guidance-layers out")
        if run.step_cache is not None and run.cfg and self.group is not None:
            raise MlxdiffError("cache: a step cache decides once per step for both halves of a CFG batch, which "
                               "guidance-parallel ranks compute apart; leave out --cache or --split guidance")

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  clip_skip=run.options["clip_skip"],
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return repr(run.negative_prompt), run.options["clip_skip"], run.options["max_sequence_length"]

    def prepare_latents(self, run, latents):
        cond = run.conditioning
        run.batch = cond.prompt_embeds.shape[0]
        run.state["embeds"], run.state["pooled"] = cond.prompt_embeds, cond.pooled_prompt_embeds
        if run.cfg:  # diffusers' batch order: [negative, positive]
            run.state["embeds"] = mx.concatenate([cond.negative_prompt_embeds, cond.prompt_embeds])
            run.state["pooled"] = mx.concatenate([cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds])
        factor = self.vae_scale_factor()
        run.state["shape"] = shape = (run.batch, self.components["transformer"].args.in_channels,
                                      run.height // factor, run.width // factor)
        run.sampler = self.new_sampler(run, schedulers.sd3_sigmas(run.steps, self.scheduler_config))
        return initial_latents(latents, shape, run.seed)

    def encode_images(self, run, vae, x):
        if "controls" in run.state:     # the control images' latents (diffusers reads the first net's config)
            first = self.components[self.controlnets[0]].args
            shift = 0.0 if first.force_zeros_for_pooled_projection else (vae.args.shift_factor or 0.0)
            rows = 2 * run.batch if run.cfg else run.batch     # diffusers encodes the CFG batch's copies
            run.state["control_latents"] = [control_latents(run, vae, k, shift, rows)
                                            for k in range(len(self.controlnets))]
            return x
        shape = run.state["shape"]
        init = mx.broadcast_to(image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                                             self.posterior_noise(run, shape)), shape)
        if "mask" in run.state:     # each step's blend: the noise, the init latents, the latent mask
            run.state.update(noise=x, image_latents=init, latent_mask=mx.array(image_inputs.latent_mask(
                run.state["mask"], run.width, run.height, self.vae_scale_factor())))
        x = run.sampler.add_noise(init, x, run.start)
        mx.eval(x)
        return x

    def velocity(self, run, transformer, i, x):
        batch, cond, o = run.batch, run.conditioning, run.options
        t = mx.full((2 * batch if run.cfg else batch,), run.timesteps[i], dtype=mx.float32)
        embeds, pooled = run.state["embeds"], run.state["pooled"]
        x_in = mx.concatenate([x, x]) if run.cfg else x
        controls = self.control_residuals(run, transformer, i, x_in.astype(self.dtype), t, embeds, pooled)
        # one cache context: a CFG batch decides once, as diffusers' hooks on its batched forward do
        if not run.cfg:
            return run.forward("cond", lambda cache: transformer(
                x.astype(self.dtype), embeds, pooled, t, after_block=evaluate_each_block, step_cache=cache,
                stream_dtype=self.stream_dtype, block_controlnet_hidden_states=controls))
        if self.group is None:    # one batch of two: [uncond; cond]
            v = run.forward("cond", lambda cache: transformer(
                x_in.astype(self.dtype), embeds, pooled, t, after_block=evaluate_each_block,
                step_cache=cache, stream_dtype=self.stream_dtype, block_controlnet_hidden_states=controls))
            v_uncond, v_cond = v[:batch], v[batch:]
        else:                     # guidance-parallel: each rank its half
            def half(k):
                part = None if controls is None else [r[k * batch:(k + 1) * batch] for r in controls]
                return lambda: transformer(x.astype(self.dtype), embeds[k * batch:(k + 1) * batch],
                                           pooled[k * batch:(k + 1) * batch], t[:batch],
                                           after_block=evaluate_each_block, stream_dtype=self.stream_dtype,
                                           block_controlnet_hidden_states=part)
            v_uncond, v_cond = guidance_pair(self.group, half(0), half(1))
        v = v_uncond + run.guidance * (v_cond - v_uncond)
        layers = o["skip_guidance_layers"]
        if layers and run.steps * o["skip_layer_guidance_start"] < i < run.steps * o["skip_layer_guidance_stop"]:
            v_skip = transformer(x.astype(self.dtype), cond.prompt_embeds, cond.pooled_prompt_embeds, t[:batch],
                                 skip_layers=list(layers), after_block=evaluate_each_block,
                                 stream_dtype=self.stream_dtype)
            v = v + (v_cond - v_skip) * o["skip_layer_guidance_scale"]
        return v

    def control_residuals(self, run, transformer, i, x, t, embeds, pooled):
        """The summed block residuals of the ControlNets acting at schedule index i (SD3MultiControlNetModel), on
        the transformer's batch x (both CFG halves); None without ControlNets or where none acts."""
        if "controls" not in run.state:
            return None
        nets, latents = self.control_models(run), run.state["control_latents"]
        if nets[0].args.force_zeros_for_pooled_projection:     # InstantX's: zero pooled projections
            pooled = mx.zeros_like(pooled)
        total = None
        for k, scale in acting(run.state["controls"], i, len(run.timesteps)):
            net = nets[k]
            cond = mx.broadcast_to(latents[k], (x.shape[0], *latents[k].shape[1:])).astype(self.dtype)
            out = net(x, cond, scale, embeds if net.args.joint_attention_dim is not None else None, pooled, t,
                      pos_embed=transformer.pos_embed, after_block=evaluate_each_block)
            total = out if total is None else [a + b for a, b in zip(total, out)]
        return total

    def images_note(self, run, seconds):
        if "controls" in run.state:
            return self.control_note(run, seconds)
        return super().images_note(run, seconds)

    def unpack(self, run, x):
        self.release_controls(run)
        return super().unpack(run, x)

    def preview_layout(self, run, x):
        return x                            # unpack's layout, the ControlNets left in place (on_step's previews)
