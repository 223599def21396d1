"""Z-Image, following diffusers' ZImagePipeline (pipelines/z_image/pipeline_z_image.py), ZImageImg2ImgPipeline with
image= and strength=, ZImageInpaintPipeline with image=, mask= and strength=.

    encode:  Qwen3 through mlx-lm, the user message through the chat template with enable_thinking=True, padded to
             max_sequence_length (512); the features are hidden_states[-2] (the output of the next-to-last layer,
             no final norm), with the tokenizer's mask: the transformer takes each row's valid tokens only
    denoise: the Z-Image DiT on the unpacked latents (B, C, H/8, W/8) (it patchifies them itself), timestep
             (1000 - t) / 1000, velocity = minus its output; flow-match Euler over sigmas linspace(1, 1/N, N)
             shifted by mu from the image token count (the scheduler's dynamic shifting); classifier-free guidance
             whenever guidance > 0, as diffusers: pos + g * (pos - neg), against the negative prompt ("" by default)
    reference (only with image=): the image resized (LANCZOS) to the output size, whose default is the image's own
             cut to a multiple of 16, as there; a sample of its VAE posterior, (z - shift) * scaling
             (image_inputs.sd3_init_latents), noised to the sigma of the first step run (scale_noise); the steps run
             are StableDiffusion3Img2ImgPipeline's get_timesteps, as there
    inpainting (mask=): the mask, resized (LANCZOS) to the output size, grayscale, binarized at 0.5, taken at every
             VAE-factor-th pixel (interpolate "nearest" to the latent size); after each step the latents are
             (1 - mask) * the init latents noised to the next sigma (clean after the last) + mask * the latents:
             white repaints, black keeps. diffusers' masked_image_latents is not used by its loop (only handed to
             callbacks), so it is not computed here
    ControlNet (load(controlnets=), generate(control_images=)): ZImageControlNetPipeline, one ControlNet: the control
             image resized (LANCZOS) to the output size, its VAE posterior's mean (diffusers' sample_mode "argmax"),
             (z - shift) * scaling, zero-padded to the ControlNet's control_in_dim channels (the 2.x files' 33); at
             each step the ControlNet runs on the forward's own latents, prompt and timestep (each CFG half its
             prompt's) and its hints, times the scale, join the transformer's main layers. With image= and mask=
             (ZImageControlNetInpaintPipeline, a 2.x ControlNet): the control input is [the control latents, 1 - the
             latent mask, the latents (posterior mean) of the image with the mask's area set to 0 in [-1, 1]], the
             run from pure noise, no latent blending
    decode:  latents / scaling_factor + shift_factor, the AutoencoderKL

Defaults are ZImagePipeline's own (50 steps, guidance 5.0, 1024 x 1024); Z-Image-Turbo is run with steps=8 or 9
and guidance=0 (no CFG). cfg_truncation and cfg_normalization stay at diffusers' defaults (off).
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...tokenizers import tokenize_klein
from .. import image_inputs
from ..image_inputs import latent_mask
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents
from ..controls import CONTROL_OPTIONS, ControlNets, acting, control_latents


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them. The masks are
    (B, L) of 0 / 1: the valid (non-padding) tokens, the only ones the transformer reads."""
    prompt_embeds: mx.array
    prompt_attention_mask: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_attention_mask: mx.array | None = None

    as_numpy = as_numpy


class ZImagePipeline(ControlNets, image_inputs.LatentInpainting, Pipeline):
    """`generate(..., guidance=)`: the CFG scale (default 5.0; 0: one forward a step, no negative prompt).
    `max_sequence_length`: the prompt's tokens (default 512). `latents`: the noise in diffusers' layout (B, C, H/8,
    W/8); with image= the noise mixed into the init latents (diffusers' prepare_latents `noise`). `image=` with
    `strength` (0 < s <= 1, default 0.6): image-to-image as ZImageImg2ImgPipeline; with `mask=` too (a PIL image
    or file, white repaints, black keeps, any size: resized to the output's) inpainting as ZImageInpaintPipeline
    (strength default 1.0). The output size defaults to the image's, cut to a multiple of 16. `image_noise`: the
    init image's VAE posterior noise (B = 1, C, H/8, W/8) (default: from the seed). `control_images=[image]` (with the
    one ControlNet given to load), `control_scales` (replacing load's), `control_start` / `control_end` (shares of
    the schedule; diffusers' ZImageControlNetPipeline has no such bounds: 0 and 1 are its run): ControlNet as
    ZImageControlNetPipeline; with image= and mask= too, ControlNet inpainting as ZImageControlNetInpaintPipeline."""
    family = "zimage"
    patch_size = 2      # the transformer's 2x2 patches: sizes are multiples of 16
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "image_noise": None, **image_inputs.MASK_OPTIONS,
               **{name: None for name in CONTROL_OPTIONS}}
    CONTROL_PIPELINE = "ZImageControlNetPipeline"
    CONTROL_INPAINT_PIPELINE = "ZImageControlNetInpaintPipeline"
    STEP_CACHE = False
    IMG2IMG_STRENGTH = 0.6         # ZImageImg2ImgPipeline's
    INPAINT_STRENGTH = 1.0         # ZImageInpaintPipeline's
    SIZE_OF_IMAGE = True           # both take the image's size when none is given

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.tokenizer = self.tokenizers["tokenizer"]

    def defaults(self):
        return {"steps": 50, "guidance": 5.0}         # ZImagePipeline's

    def default_size(self):
        return 1024

    def _encode(self, groups, max_sequence_length) -> list:
        """[(embeds, mask)] of each group of prompts, under one load of the encoder (a CFG run's negative prompt does
        not build, or stream the resident part of, the encoder a second time)."""
        tokens = [tokenize_klein(self.tokenizer, prompts, max_sequence_length, enable_thinking=True)
                  for prompts in groups]
        out = []
        with self.use(self.components["text_encoder"]) as encoder:
            for ids, mask in tokens:
                embeds = encoder(mx.array(ids), mx.array(mask))
                mx.eval(embeds)
                out.append((embeds, mx.array(mask)))
        return out

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      max_sequence_length=None) -> Conditioning:
        """prompt_embeds (B, L, hidden) padded to max_sequence_length with their mask (diffusers' list of each row's
        valid tokens is prompt_embeds[i][mask[i] > 0]); with CFG the negative prompt's too ("" by default)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        max_sequence_length = max_sequence_length or 512
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not do_classifier_free_guidance:
            return Conditioning(*self._encode([prompts], max_sequence_length)[0])
        if negative_prompt is None:
            negs = [""] * len(prompts)
        else:
            negs = [negative_prompt] if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negs) != len(prompts):
            raise MlxdiffError(f"{len(negs)} negative prompts for {len(prompts)} prompts; give one per prompt")
        (embeds, mask), (neg_embeds, neg_mask) = self._encode([prompts, negs], max_sequence_length)
        return Conditioning(embeds, mask, neg_embeds, neg_mask)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def default_strength(self, options):
        return self.INPAINT_STRENGTH if image_inputs.inpainting(options) else self.IMG2IMG_STRENGTH

    def check_inputs(self, run):
        self.take_image_noise(run)
        image_inputs.take_mask(run)
        if run.options["control_noise"] is not None:
            raise MlxdiffError("control_noise: ZImageControlNetPipeline encodes the control image to its VAE "
                               "posterior's mean, drawing no noise; leave control_noise out")
        self.take_controls(run)
        if "controls" in run.state and run.images:       # ZImageControlNetInpaintPipeline: no strength, no noise
            self.check_control_inpaint(run)
        if run.images:      # diffusers' default height and width: the image's, cut to a multiple of 16
            multiple = self.vae_scale_factor() * self.patch_size
            w, h = run.images[0].size
            if run.width is None and w >= multiple:
                run.width = w // multiple * multiple
            if run.height is None and h >= multiple:
                run.height = h // multiple * multiple

    def check_control_inpaint(self, run):
        """ZImageControlNetInpaintPipeline's inputs: a 2.x ControlNet (control_in_dim 2 x latents + 1: the control
        latents, the mask, the masked image's), the run from pure noise (strength 1), the image's posterior mean."""
        spec = self.components[self.controlnets[0]]
        channels = 2 * self.components["vae"].args.latent_channels + 1
        if spec.args.control_in_dim != channels:
            raise MlxdiffError(f"ControlNet {spec.source}: its control_in_dim is {spec.args.control_in_dim}, not "
                               f"{channels} (the control latents, the mask and the masked image's latents): it does "
                               "not inpaint (Fun ControlNet Union 2.0 / 2.1 do); leave image= and mask= out")
        if run.strength != 1.0:
            raise MlxdiffError(f"strength={run.strength:g} with a ControlNet and a mask: "
                               "ZImageControlNetInpaintPipeline repaints from noise; leave strength out")
        if run.options["image_noise"] is not None:
            raise MlxdiffError("image_noise with a ControlNet: ZImageControlNetInpaintPipeline encodes the image to "
                               "its VAE posterior's mean, drawing no noise; leave image_noise out")

    def img2img_start(self, steps, strength):
        return image_inputs.sd3_start(steps, strength)     # ZImageImg2ImgPipeline.get_timesteps: the same

    def check_run(self, run):
        self.check_image_noise(run)

    def uses_cfg(self, run):
        return run.guidance > 0        # ZImagePipeline.do_classifier_free_guidance

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return (repr(run.negative_prompt), run.options["max_sequence_length"])

    def prepare_latents(self, run, latents):
        embeds, targs = run.conditioning.prompt_embeds, self.components["transformer"].args
        if embeds.shape[-1] != targs.cap_feat_dim:
            raise MlxdiffError(f"the text encoder gives {embeds.shape[-1]} features per token but the transformer's "
                               f"cap_feat_dim is {targs.cap_feat_dim}; the encoder and transformer do not belong "
                               "together")
        run.batch = embeds.shape[0]
        factor = self.vae_scale_factor()
        h, w = run.height // factor, run.width // factor
        run.state["shape"] = (run.batch, targs.in_channels, h, w)
        run.sampler = self.new_sampler(run, zimage_sigmas(run.steps, (h // self.patch_size) * (w // self.patch_size),
                                                             self.scheduler_config))
        return initial_latents(latents, run.state["shape"], run.seed, "diffusers' layout: batch, latent channels, "
                               "height/8, width/8")

    def encode_images(self, run, vae, x):
        if "controls" in run.state:     # the control latents, zero-padded to the ControlNet's control_in_dim
            shift = vae.args.shift_factor or 0.0
            z = control_latents(run, vae, 0, shift, sample=False)
            if "mask" in run.state:     # inpainting: [control latents, 1 - mask, the masked image's latents]
                mask = image_inputs.binary_mask(run.state["mask"], run.width, run.height)
                pixels = image_inputs.to_array(image_inputs.resized(run.images[0].convert("RGB"), run.width,
                                                                    run.height)) * (mask < 0.5)
                mean, _ = image_inputs.encode_moments(vae, pixels)
                keep = 1 - latent_mask(run.state["mask"], run.width, run.height, self.vae_scale_factor())
                z = mx.concatenate([z, mx.array(keep), (mean.astype(mx.float32) - shift) * vae.args.scaling_factor],
                                   axis=1)
            extra = self.components[self.controlnets[0]].args.control_in_dim - z.shape[1]
            if extra:
                z = mx.concatenate([z, mx.zeros((z.shape[0], extra, *z.shape[2:]), z.dtype)], axis=1)
            run.state["control_cond"] = z
            mx.eval(z)
            return x                    # the run starts from the noise (the inpainting one too)
        init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                             self.posterior_noise(run, run.state["shape"]))
        init = mx.broadcast_to(init, x.shape)
        if "mask" in run.state:     # what each step's blending needs: the noise, the init latents, the latent mask
            run.state.update(noise=x, image_latents=init, latent_mask=mx.array(
                latent_mask(run.state["mask"], run.width, run.height, self.vae_scale_factor())))
        x = run.sampler.add_noise(init, x, run.start)
        mx.eval(x)
        return x

    def velocity(self, run, transformer, i, x):
        t = np.float32(run.timesteps[i])
        t = mx.full((run.batch,), (np.float32(1000) - t) / np.float32(1000), dtype=mx.float32)
        c, tokens = run.conditioning, x.astype(self.dtype)
        nets = acting(run.state["controls"], i, len(run.timesteps)) if "controls" in run.state else []

        def forward(name, embeds, mask):
            def call(cache):
                samples = None
                for k, scale in nets:       # one ControlNet (ZImageControlNetPipeline's)
                    samples = self.control_models(run)[k](
                        transformer, tokens, t, embeds, run.state["control_cond"], scale, mask,
                        stream_dtype=self.stream_dtype, after_block=evaluate_each_block)
                return transformer(tokens, t, embeds, mask, after_block=evaluate_each_block,
                                   stream_dtype=self.stream_dtype, controlnet_block_samples=samples)
            return run.forward(name, call).astype(mx.float32)
        if not run.cfg:
            return -forward("cond", c.prompt_embeds, c.prompt_attention_mask)
        neg, pos = guidance_pair(self.group,
                                 lambda: forward("uncond", c.negative_prompt_embeds, c.negative_prompt_attention_mask),
                                 lambda: forward("cond", c.prompt_embeds, c.prompt_attention_mask))
        return -(pos + run.guidance * (pos - neg))

    def images_note(self, run, seconds):
        if "controls" in run.state:
            return image_inputs.inpaint_note(run, self.control_note(run, seconds))
        return super().images_note(run, seconds)

    def unpack(self, run, x):
        self.release_controls(run)
        return super().unpack(run, x)

    def preview_layout(self, run, x):
        return x                    # the ControlNet left in place (on_step's previews)


def zimage_sigmas(steps, image_seq_len, scheduler_config=None):
    """ZImagePipeline's schedule: sigmas linspace(1, 1/N, N) (get_default_z_image_sigmas) through the scheduler with
    mu = calculate_shift(image_seq_len) (used where the config shifts dynamically, else its static shift) ->
    (sigmas [N + 1] with the terminal 0, timesteps [N]) float32."""
    config = schedulers.scheduler_config(scheduler_config)
    mu = schedulers.calculate_shift(image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                                    config["base_shift"], config["max_shift"])
    sigmas = np.linspace(1.0, 1 / steps, steps, dtype=np.float32)
    return schedulers.set_timesteps(config, steps, sigmas=sigmas, mu=mu)
