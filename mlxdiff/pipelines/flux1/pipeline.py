"""FLUX.1 dev, schnell and Krea, following diffusers' FluxPipeline (and FluxImg2ImgPipeline with image=),
Kontext [dev], following FluxKontextPipeline (image= is the reference image that is edited), and Fill [dev],
following FluxFillPipeline (image= and mask=: inpainting and outpainting), and Depth / Canny [dev], following
FluxControlPipeline (image= is the control image: a depth map or an edge map). dev, schnell and Krea with image= and
mask= (or outpaint=) inpaint by blending latents, following FluxInpaintPipeline.

    encode:  CLIP-L (CLIPTextModel: its pooled vector, 77 tokens) then T5-XXL (its last hidden state, 512 tokens
             with a guidance-distilled transformer, 256 without: BFL's lengths for dev and schnell), each freed
             before the next
    reference (only with image=): img2img's init latents, VAE-encoded (image_inputs.py), as FluxImg2ImgPipeline;
             Kontext: the reference image resized to the preferred Kontext resolution nearest its aspect, its
             latent mean packed into tokens with position ids (1, row, col) beside the noise tokens (0, row, col);
             Fill: the image with the mask's area blanked, VAE-encoded (a posterior sample), packed, and the mask
             folded into 8 x 8 pixel patches, both joined to every noise token's channels; Control: the control
             image, VAE-encoded (a posterior sample), packed and joined to the noise tokens' channels;
             latent inpainting: img2img's start, and the mask (binarized at the output size, taken at every 8th
             pixel, repeated over the channels and packed) blends the init latents noised to the next sigma back
             into the kept area after each step (clean after the last); diffusers' masked_image_latents are only
             computed there, never read by its 64-channel loop, so not here
    denoise: FLUX.1 DiT + flow-match Euler; sigmas linspace(1, 1/N, N), shifted by mu from the token count where the
             scheduler uses dynamic shifting (dev), unshifted otherwise (schnell); dev embeds `guidance`; true CFG
             against a negative prompt with true_cfg_scale > 1, as diffusers
    ControlNet (load(controlnets=), generate(control_images=)): FluxControlNetPipeline (several: its
             FluxMultiControlNetModel) on dev, schnell or Krea: each control image resized to the output size, a
             sample of its VAE posterior, (z - shift) * scaling, packed (XLabs' layout, a ControlNet with an
             input_hint_block: its pixels in [-1, 1] instead, its residuals repeated over the double blocks; the first
             ControlNet's layout is read for all, as there); at each step each ControlNet within its [control_start,
             control_end] runs once on the noise tokens, the prompt, the timestep (and the guidance where its config
             embeds one), and the sums of its double- and single-block residuals join the transformer's image stream,
             in the true-CFG negative forward too (the same residuals, as there). `control_modes`: a Union
             ControlNet's mode per image (required there; refused for the others, which diffusers ignores it for)
    decode:  unpack the 2x2 patches, latents / scaling + shift, the 16-channel VAE
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...tokenizers import report_truncation, tokenize
from .. import image_inputs
from ..controls import CONTROL_OPTIONS, ControlNets, acting, control_latents
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents
from ..patches import pack_2x2, unpack_2x2


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them."""
    prompt_embeds: mx.array
    pooled_prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_pooled_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux1Pipeline(ControlNets, image_inputs.LatentInpainting, Pipeline):
    """`generate(..., guidance=)`: the embedded guidance of a guidance-distilled model (dev: 3.5 by default; schnell
    has none and ignores it). `true_cfg_scale` (> 1) with a `negative_prompt`: true classifier-free guidance, two
    forwards a step, as diffusers' FluxPipeline. `max_sequence_length`: T5's tokens (default 512 for dev, 256 for
    schnell). `latents`: the noise in diffusers' packed layout (batch, (H/16) * (W/16), 4 * latent channels).
    `image=` with `strength` (default 0.6): image-to-image as FluxImg2ImgPipeline; with `mask=` too (white
    repaints, black keeps, any size: resized to the output's; `mask_blur` blurs it first) or `outpaint=(left, top,
    right, bottom)` (the image padded, the border repainted; the output size defaults to the canvas's) inpainting as
    FluxInpaintPipeline (strength default 0.6, as there). Kontext (a FluxKontextPipeline
    folder, or a transformer file whose name says kontext): `image=` is the one reference image, and, as in
    diffusers, the output size is scaled to an area of `max_area` pixels (default 1024 x 1024) at the requested
    aspect; `auto_resize=False` keeps the reference at its own size (cut down to a multiple of 16) instead of the
    preferred Kontext resolution. Fill (a FluxFillPipeline folder, or a transformer taking 384 input channels):
    `image=` and `mask=` (white: repaint, black: keep; a PIL image or file, resized to the output size) inpaint, and
    `outpaint=` pads the image and repaints the border; the output size defaults to the image's (cut
    to a multiple of 16); `image_noise`: the masked image's VAE posterior noise (default: from the seed). Depth /
    Canny (a FluxControlPipeline folder, or a transformer taking 8 x the latent channels: 128): `image=` is the one
    control image, resized to the output size; `image_noise` its posterior noise. `control_images=[...]` (one per
    ControlNet given to load), `control_scales` (replacing load's), `control_start` / `control_end` (shares of the
    schedule), `control_noise` (each control image's VAE posterior noise; default from the seed), `control_modes` (a
    Union ControlNet's mode per image): ControlNet as FluxControlNetPipeline."""
    family = "flux1"
    patch_size = 2      # 2x2 latent patches per token
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "true_cfg_scale": 1.0, "image_noise": None, "max_area": None,
               "auto_resize": None, **image_inputs.MASK_OPTIONS, **{name: None for name in CONTROL_OPTIONS},
               "control_modes": None}
    CONTROL_PIPELINE = "FluxControlNetPipeline"
    KONTEXT_ONLY = ("max_area", "auto_resize")
    IMG2IMG_STRENGTH = 0.6
    KONTEXT_MAX_AREA = 1024 ** 2         # FluxKontextPipeline's max_area default

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.distilled_guidance = self.components["transformer"].args.guidance_embeds
        self.kontext = self.pipeline_class == "FluxKontextPipeline"
        self.fill = self.pipeline_class == "FluxFillPipeline"
        self.control = self.pipeline_class == "FluxControlPipeline"
        if self.kontext or self.control:
            self.IMG2IMG_STRENGTH = None          # image= is the reference / control image, never an init image
        if self.fill:
            self.IMG2IMG_STRENGTH = 1.0           # FluxFillPipeline's strength: the masked area from pure noise

    def check_images(self, names, images, strength):
        if self.control:
            if strength is not None or len(images) > 1:
                raise MlxdiffError("image: FLUX.1 Depth / Canny take one control image (a depth or edge map) and no "
                                   "strength; give one --image and leave --strength out")
            return
        if self.fill and len(images) > 1:
            raise MlxdiffError(f"image: {len(images)} images; FLUX.1 Fill repaints one image; give one --image")
        if not self.kontext:
            return super().check_images(names, images, strength)
        if strength is not None:
            raise MlxdiffError(f"strength={strength:g}: FLUX.1 Kontext edits the image it is given (a reference, "
                               "FluxKontextPipeline has no strength); leave --strength out, or use FLUX.1 dev for "
                               "image-to-image")
        if len(images) > 1:
            raise MlxdiffError(f"image: {len(images)} images; FLUX.1 Kontext edits one reference image; give one "
                               "--image")

    def defaults(self):
        if self.fill:
            return {"steps": 50, "guidance": 30.0}      # FluxFillPipeline's
        if self.distilled_guidance:
            return {"steps": 28, "guidance": 3.5}
        return {"steps": 4, "guidance": 0.0}

    def default_size(self):
        return 128 * self.vae_scale_factor()      # diffusers' default_sample_size 128: 1024 px

    def default_sequence_length(self):
        return 512 if self.distilled_guidance else 256

    # -- encode -------------------------------------------------------------------------------------------------
    def _clip(self, prompts, truncated):
        tok = self.tokenizers["tokenizer"]
        ids = tokenize(tok, prompts, tok.model_max_length, truncated)
        with self.use(self.components["text_encoder"]) as encoder:
            pooled = encoder(mx.array(ids)).pooler_output
            mx.eval(pooled)
        return pooled

    def _t5(self, prompts, max_sequence_length, truncated):
        ids = tokenize(self.tokenizers["tokenizer_2"], prompts, max_sequence_length, truncated)
        with self.use(self.components["text_encoder_2"]) as encoder:
            out = encoder(mx.array(ids))
            mx.eval(out)
        return out

    def encode_prompt(self, prompt, negative_prompt=None, *, prompt_2=None, negative_prompt_2=None,
                      do_classifier_free_guidance=False, max_sequence_length=None) -> Conditioning:
        """CLIP-L's pooled vector and T5's hidden states, each encoder loaded, run on the prompts (and, with true
        CFG, the negative prompts) together, and freed. prompt_2: T5's prompt (default: prompt), as diffusers."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, prompt_2=prompt_2,
                       max_sequence_length=max_sequence_length)
        max_sequence_length = max_sequence_length or self.default_sequence_length()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        as_list = lambda p, default: default if p is None else ([p] * batch if isinstance(p, str) else list(p))
        clip_texts, t5_texts = prompts, as_list(prompt_2, prompts)
        if do_classifier_free_guidance:
            negs = as_list(negative_prompt or "", None)
            if len(negs) != batch:
                raise MlxdiffError(f"negative_prompt has {len(negs)} entries but prompt has {batch}")
            clip_texts, t5_texts = clip_texts + negs, t5_texts + as_list(negative_prompt_2, negs)
        truncated = []
        pooled = self._clip(clip_texts, truncated).astype(self.dtype)
        embeds = self._t5(t5_texts, max_sequence_length, truncated).astype(self.dtype)
        report_truncation(truncated, f"CLIP {self.tokenizers['tokenizer'].model_max_length} tokens, "
                                     f"T5 {max_sequence_length} tokens")
        mx.eval(embeds, pooled)
        if not do_classifier_free_guidance:
            return Conditioning(embeds, pooled)
        return Conditioning(embeds[:batch], pooled[:batch], embeds[batch:], pooled[batch:])

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def img2img_start(self, steps, strength):
        return image_inputs.sd3_start(steps, strength)       # FluxImg2ImgPipeline.get_timesteps: the same

    def uses_cfg(self, run):
        return run.options["true_cfg_scale"] > 1 and run.negative_prompt is not None

    def check_inputs(self, run):
        self.take_image_noise(run)
        self.take_mask(run)
        self.take_controls(run)
        self.take_control_modes(run)
        if self.control and run.images:
            self.size_of_image(run)
        given = [name for name in self.KONTEXT_ONLY if run.options[name] is not None]
        if given and not self.kontext:
            raise MlxdiffError(f"{given[0]}: an option of FLUX.1 Kontext only (FluxKontextPipeline); this FLUX.1 "
                               "model is not Kontext")
        if self.kontext:
            area = run.options["max_area"]
            if area is not None and (isinstance(area, bool) or not isinstance(area, int) or not
                                     256 <= area <= 4096 ** 2):
                raise MlxdiffError(f"max_area={area!r}: expected a pixel count from 256 to {4096 ** 2}")
            if run.options["auto_resize"] not in (None, True, False):
                raise MlxdiffError(f"auto_resize={run.options['auto_resize']!r}: expected True or False")
            run.state["reference"] = [kontext_reference(im, run.options["auto_resize"] is not False,
                                                        self.vae_scale_factor() * 2) for im in run.images]

    def take_control_modes(self, run):
        """check_inputs' part: `control_modes`, one int (or None) per ControlNet: required for a Union ControlNet
        (num_mode in its config), below its num_mode; refused for the others."""
        modes = run.options["control_modes"]
        if "controls" not in run.state:
            if modes is not None:
                raise MlxdiffError("control_modes: a Union ControlNet's modes; this pipeline has no ControlNet")
            return
        n = len(self.controlnets)
        modes = [None] * n if modes is None else list(modes) if isinstance(modes, (list, tuple)) else [modes] * n
        if len(modes) != n:
            raise MlxdiffError(f"control_modes: {len(modes)} modes for {n} ControlNets; give one per ControlNet")
        for name, mode in zip(self.controlnets, modes):
            spec = self.components[name]
            count = spec.args.num_mode
            if count is None and mode is not None:
                raise MlxdiffError(f"control_modes: ControlNet {spec.source} is no Union ControlNet (no num_mode in "
                                   "its config), so it takes no mode; give None for it or leave control_modes out "
                                   "(--control-mode none)")
            if count is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode < count):
                raise MlxdiffError(f"control_modes: Union ControlNet {spec.source} needs the mode of its image, an "
                                   f"integer from 0 to {count - 1} (canny, tile, depth, ... as its model card "
                                   f"lists them: control_modes=[...], --control-mode NAME); got {mode!r}")
        run.state["controls"]["modes"] = modes

    def take_mask(self, run):
        """The mask, its blur and outpainting (image_inputs.take_mask): Fill's required with its image; dev's,
        schnell's and Krea's optional (latent inpainting); refused by Kontext and Depth / Canny."""
        o = run.options
        if self.kontext or self.control:
            given = next((name for name in image_inputs.MASK_OPTIONS if o[name] is not None), None)
            if given:
                raise MlxdiffError(f"{given}: this FLUX.1 {'Kontext' if self.kontext else 'Depth / Canny'} model "
                                   "takes no mask (mlxdiff follows FluxKontextPipeline / FluxControlPipeline); use "
                                   f"FLUX.1 Fill or dev for inpainting, or leave --{given.replace('_', '-')} out")
            return
        if self.fill and (not run.images or not image_inputs.inpainting(o)):
            raise MlxdiffError("FLUX.1 Fill repaints an image where a mask says: give both --image and --mask "
                               "(image= and mask=; white repaints, black keeps), or --image and --outpaint")
        image_inputs.take_mask(run, self.vae_scale_factor() * self.patch_size)
        if self.fill:
            self.size_of_image(run)

    def size_of_image(self, run):
        """Fill's and Control's output size when none is given: the image's, cut to a multiple of 16."""
        multiple = self.vae_scale_factor() * 2
        w, h = run.images[0].size
        if run.width is None and run.height is None and w >= multiple and h >= multiple:
            run.width, run.height = w // multiple * multiple, h // multiple * multiple

    def check_run(self, run):
        self.check_image_noise(run)
        if self.control and not run.images:
            raise MlxdiffError("FLUX.1 Depth / Canny draw from a control image: give --image (image=) with the "
                               "depth or edge map")
        if self.kontext:     # FluxKontextPipeline: the requested aspect at max_area pixels, cut to a multiple of 16
            area, multiple = run.options["max_area"] or self.KONTEXT_MAX_AREA, self.vae_scale_factor() * 2
            aspect = run.width / run.height
            width = round((area * aspect) ** 0.5) // multiple * multiple
            height = round((area / aspect) ** 0.5) // multiple * multiple
            if (width, height) != (run.width, run.height):
                run.state["size_note"] = (f"Kontext: {run.width}x{run.height} scaled to {width}x{height} "
                                          f"({area} pixels at that aspect, as FluxKontextPipeline)")
            if min(width, height) < multiple:
                raise MlxdiffError(f"width and height {run.width}x{run.height} at max_area {area} give a side below "
                                   f"{multiple} pixels; give a larger max_area or a less extreme aspect")
            run.width, run.height = width, height

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return repr(run.negative_prompt), run.options["max_sequence_length"]

    def check_conditioning(self, cond, targs):
        embeds = cond.prompt_embeds
        if embeds.shape[-1] != targs.joint_attention_dim or cond.pooled_prompt_embeds.shape[-1] != \
                targs.pooled_projection_dim:
            raise MlxdiffError(f"the text encoders give {embeds.shape[-1]} T5 and {cond.pooled_prompt_embeds.shape[-1]}"
                               f" pooled CLIP features but the transformer takes {targs.joint_attention_dim} and "
                               f"{targs.pooled_projection_dim}; the encoders and transformer do not belong together")

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        embeds = cond.prompt_embeds
        self.check_conditioning(cond, targs)
        run.batch = embeds.shape[0]
        factor = self.vae_scale_factor() * self.patch_size
        h, w = run.height // factor, run.width // factor
        channels = self.components["vae"].args.latent_channels
        run.state.update(shape=(run.batch, channels, 2 * h, 2 * w), img_ids=latent_ids(h, w), ref_tokens=None,
                         channels=None,
                         txt_ids=np.zeros((embeds.shape[1], 3), dtype=np.float32),
                         guidance=mx.full((run.batch,), run.guidance, dtype=mx.float32)
                         if targs.guidance_embeds else None)
        config = schedulers.scheduler_config(self.scheduler_config)
        mu = schedulers.calculate_shift(h * w, config["base_image_seq_len"], config["max_image_seq_len"],
                                        config["base_shift"], config["max_shift"])
        run.sampler = self.new_sampler(run, schedulers.set_timesteps(config, run.steps, sigmas=np.linspace(
            1.0, 1 / run.steps, run.steps), mu=mu))
        if latents is None:      # drawn in the VAE's layout and packed, as diffusers' prepare_latents
            return pack_2x2(initial_latents(None, run.state["shape"], run.seed))
        return initial_latents(latents, (run.batch, h * w, 4 * channels), run.seed, "diffusers' packed layout: "
                               "batch, (height/16) * (width/16), 4 * latent channels")

    def encode_images(self, run, vae, x):
        if "controls" in run.state:
            return self.encode_controls(run, vae, x)
        if self.control:     # FluxControlPipeline: the control image's posterior sample, scaled, packed
            pixels = image_inputs.to_array(image_inputs.resized(run.images[0].convert("RGB"), run.width, run.height))
            run.state["channels"] = self.posterior_tokens(run, vae, pixels)
            return x
        if self.kontext:     # the reference's latent mean, (z - shift) * scaling, packed, ids (1, row, col)
            (reference,) = run.state["reference"]
            mean, _ = image_inputs.encode_moments(vae, image_inputs.to_array(reference))
            tokens = pack_2x2(vae.scale_latents(mean.astype(mx.float32)).astype(mx.float32))
            _, _, hh, ww = mean.shape
            ids = latent_ids(hh // 2, ww // 2)
            ids[:, 0] = 1
            run.state.update(ref_tokens=mx.broadcast_to(tokens, (run.batch, *tokens.shape[1:])),
                             img_ids=np.concatenate([run.state["img_ids"], ids]))
            mx.eval(run.state["ref_tokens"])
            return x
        if self.fill:
            return self.encode_fill(run, vae, x)
        shape = run.state["shape"]
        init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                             self.posterior_noise(run, shape))
        init = mx.broadcast_to(pack_2x2(init), x.shape)
        if "mask" in run.state:     # FluxInpaintPipeline's blend: the noise, the init latents, the mask, all packed
            mask = mx.array(image_inputs.latent_mask(run.state["mask"], run.width, run.height,
                                                     self.vae_scale_factor()))
            run.state.update(noise=x, image_latents=init, latent_mask=pack_2x2(
                mx.broadcast_to(mask, (1, shape[1], *mask.shape[2:]))))
        x = run.sampler.add_noise(init, x, run.start)
        mx.eval(x)
        return x

    def encode_fill(self, run, vae, x):
        """FluxFillPipeline's condition: the image (resized to the output size, in [-1, 1]) with the binarized mask's
        area set to 0, a sample of its VAE posterior, (z - shift) * scaling, packed; the mask's f x f pixel patches
        (f the VAE's factor) as channels, packed; joined along the channels. strength < 1 also starts from the
        image itself, noised as FluxImg2ImgPipeline's start."""
        shape, f = run.state["shape"], self.vae_scale_factor()
        pixels = image_inputs.to_array(image_inputs.resized(run.images[0], run.width, run.height))
        mask = fill_mask(run.state["mask"], run.width, run.height)                    # (H, W) of 0 / 1
        masked = self.posterior_tokens(run, vae, pixels * (1 - mask))
        _, _, hh, ww = shape
        patches = pack_2x2(mx.array(mask.reshape(1, hh, f, ww, f).transpose(0, 2, 4, 1, 3).reshape(1, f * f, hh, ww)))
        patches = mx.broadcast_to(patches, (run.batch, *patches.shape[1:]))
        run.state["channels"] = mx.concatenate([masked, patches], axis=-1)
        if run.strength < 1:
            init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height,
                                                 self.posterior_noise(run, shape))
            x = run.sampler.add_noise(mx.broadcast_to(pack_2x2(init), x.shape), x, run.start)
        mx.eval(x, run.state["channels"])
        return x

    def posterior_tokens(self, run, vae, pixels):
        """Pixels -> a sample of their VAE posterior (image_noise, else the seed's second stream), (z - shift) *
        scaling, packed and broadcast to the batch: (B, tokens, 4 x latent channels) float32."""
        mean, logvar = image_inputs.encode_moments(vae, pixels)
        z = mean.astype(mx.float32) + mx.exp(0.5 * logvar.astype(mx.float32)) * self.posterior_noise(
            run, run.state["shape"])
        tokens = pack_2x2(vae.scale_latents(z).astype(mx.float32))
        tokens = mx.broadcast_to(tokens, (run.batch, *tokens.shape[1:]))
        mx.eval(tokens)
        return tokens

    def encode_controls(self, run, vae, x):
        """FluxControlNetPipeline's control images (the first ControlNet's layout for all, as there): packed
        posterior latents, one row per prompt (diffusers encodes the repeated image), or XLabs' pixels."""
        hint = self.components[self.controlnets[0]].args.conditioning_embedding_channels is not None
        images = run.state["controls"]["images"]
        if hint:
            conds = [mx.array(image_inputs.to_array(image_inputs.resized(im.convert("RGB"), run.width, run.height)))
                     for im in images]
        else:
            shift = vae.args.shift_factor or 0.0
            conds = [pack_2x2(control_latents(run, vae, k, shift, run.batch)) for k in range(len(images))]
        run.state.update(control_conds=conds, control_repeat=hint)
        mx.eval(conds)
        return x

    def control_residuals(self, run, i, x, t, cond):
        """The summed double- and single-block residuals of the ControlNets acting at schedule index i
        (FluxMultiControlNetModel), on the positive prompt; (None, None) without."""
        if "controls" not in run.state:
            return None, None
        nets, st = self.control_models(run), run.state
        guidance = mx.full((run.batch,), run.guidance, dtype=mx.float32) if nets[0].args.guidance_embeds else None
        double = single = None
        for k, scale in acting(st["controls"], i, len(run.timesteps)):
            c, mode = st["control_conds"][k], st["controls"]["modes"][k]
            d, s = nets[k](x, mx.broadcast_to(c, (x.shape[0], *c.shape[1:])), scale, cond.prompt_embeds,
                           cond.pooled_prompt_embeds, t, st["img_ids"], st["txt_ids"], guidance,
                           None if mode is None else mx.full((x.shape[0],), mode, dtype=mx.int32),
                           after_block=evaluate_each_block)
            double = d if double is None else double if d is None else [a + b for a, b in zip(double, d)]
            single = s if single is None else single if s is None else [a + b for a, b in zip(single, s)]
        return double, single

    def velocity(self, run, transformer, i, x):
        # diffusers: t in the latents' dtype, then / 1000 (bf16 runs round it as there)
        t = mx.full((run.batch,), run.timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
        st, cond = run.state, run.conditioning
        double, single = self.control_residuals(run, i, x.astype(self.dtype), t, cond)
        controls = {} if double is None and single is None else dict(
            controlnet_block_samples=double, controlnet_single_block_samples=single,
            controlnet_blocks_repeat=st["control_repeat"])
        refs, n_img = st["ref_tokens"], x.shape[1]
        # Kontext's reference tokens ride beside the noise tokens; only the noise tokens' velocity is used
        tokens = (x if refs is None else mx.concatenate([x, refs], axis=1)).astype(self.dtype)
        if st.get("channels") is not None:     # Fill's masked image and mask, Control's image: on every token
            tokens = mx.concatenate([tokens, st["channels"].astype(self.dtype)], axis=-1)

        def forward(name, embeds, pooled):
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, pooled, t, st["img_ids"], st["txt_ids"], guidance=st["guidance"],
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype,
                **controls))[:, :n_img]
        cond_forward = forward("cond", cond.prompt_embeds, cond.pooled_prompt_embeds)
        if not run.cfg:
            return cond_forward()
        v_neg, v = guidance_pair(self.group, forward("uncond", cond.negative_prompt_embeds,
                                                     cond.negative_pooled_prompt_embeds), cond_forward)
        return v_neg + run.options["true_cfg_scale"] * (v - v_neg)

    def images_note(self, run, seconds):
        if "controls" in run.state:
            return self.control_note(run, seconds)
        if self.control:
            return f"control image {run.image_names[0]} at {run.width}x{run.height}, encoded in {seconds:.2f} s"
        if not self.kontext:
            return super().images_note(run, seconds)
        (reference,) = run.state["reference"]
        note = (f"Kontext reference {run.image_names[0]} at {reference.width}x{reference.height}: "
                f"{run.state['ref_tokens'].shape[1]} tokens, encoded in {seconds:.2f} s")
        return note + (f"; {run.state['size_note']}" if "size_note" in run.state else "")

    def unpack(self, run, x):
        self.release_controls(run)
        return unpack_2x2(x, run.state["shape"])

    def preview_layout(self, run, x):
        return unpack_2x2(x, run.state["shape"])      # the ControlNets left in place (on_step's previews)


# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS (width, height): the sizes Kontext was trained on
KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                       (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                       (1456, 720), (1504, 688), (1568, 672))


def kontext_reference(image, auto_resize, multiple):
    """The reference as FluxKontextPipeline prepares it: RGB, the preferred resolution nearest its aspect (or its own
    size), each side cut down to a multiple of `multiple`, LANCZOS-resized to that (VaeImageProcessor.resize)."""
    image = image.convert("RGB")
    width, height = image.size
    if auto_resize:
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return image_inputs.resized(image, width // multiple * multiple, height // multiple * multiple)


def fill_mask(mask, width, height) -> np.ndarray:
    """FluxFillPipeline's mask_processor (VaeImageProcessor: resized LANCZOS to the output size, then grayscale,
    binarized at 0.5) -> (height, width) float32 of 0 and 1 (image_inputs.binary_mask)."""
    return image_inputs.binary_mask(mask, width, height)


def latent_ids(h, w):
    """(0, row, col) for each token, row-major (diffusers' _prepare_latent_image_ids)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.zeros(h * w), rows.ravel(), cols.ravel()], axis=-1).astype(np.float32)
