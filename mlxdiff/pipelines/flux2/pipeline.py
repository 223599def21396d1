"""FLUX.2 dev and klein, following diffusers' Flux2Pipeline and Flux2KleinPipeline.

    encode:  Mistral-Small-3.x (dev; taps 10, 20, 30) or Qwen3 (klein; taps 9, 18, 27) through mlx-lm,
             loading only the layers up to the deepest tap -> prompt_embeds (B, 512, 3 * hidden)
    reference (only with image=): the VAE encodes the reference images into extra tokens (editing) or the init
             image of img2img (image_inputs.py), and is freed before the transformer loads
    inpainting (klein; image= and mask=, or outpaint=), following Flux2KleinInpaintPipeline: the image scaled to at
             most 1024 x 1024 pixels in area (aspect kept) and resized to the output size (the image's, cut to a
             multiple of 16, by default), its latent mean patchified and bn-normalised, noised to the first step
             run (get_timesteps: SD3's img2img), and, clean, a reference image of the editing path (t = 10) beside
             the noise tokens in every pass; the mask binarized at the output size and interpolated bilinearly to
             the token grid (soft at its edges); after each step the kept area is the init latents noised to the next
             sigma (clean after the last). FLUX.2 dev has no inpaint pipeline in diffusers: it refuses a mask
    denoise: FLUX.2 DiT + flow-match Euler with the empirical mu; dev: embedded guidance;
             klein base: true CFG against ""; klein distilled: no CFG
    decode:  unpack, batch-norm de-normalise, unpatchify, FLUX.2 VAE
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate, check_out_layers
from ...errors import MlxdiffError
from ...tokenizers import tokenize_dev, tokenize_klein
from .. import image_inputs
from ..base import Pipeline, TapsEncoding, as_numpy, evaluate_each_block, guidance_pair, initial_latents


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux2Pipeline(image_inputs.LatentInpainting, TapsEncoding, Pipeline):
    """`generate(..., image=)`: a PIL image, an image file or a list of them. Without `strength` they are reference
    images (editing, as diffusers' FLUX.2 pipelines; the output size defaults to the first one's prepared size);
    with `strength` (0 < strength <= 1) the one image is the init image of image-to-image, by mflux's recipe
    (image_inputs.flux2_img2img_start: strength keeps diffusers' sense, mflux's image strength is 1 - strength).
    `latents`: the noise (img2img: the noise mixed into the init image). klein with `mask=` (white repaints, black
    keeps, any size: resized to the output's; `mask_blur` blurs it first) or `outpaint=(left, top, right, bottom)`
    (the image padded, the border repainted): inpainting as Flux2KleinInpaintPipeline (strength default 0.8, as
    there; the output size defaults to the image's, or the canvas's, at most 1024 x 1024 in area, cut to a multiple
    of 16)."""
    family = "flux2"
    patch_size = 2      # the latents are patchified 2x2 before the transformer
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "text_encoder_out_layers": None,
               **image_inputs.MASK_OPTIONS}
    INPAINT_STRENGTH = 0.8    # Flux2KleinInpaintPipeline's
    REFERENCE_MIN_SIDE = 64   # reference images: diffusers' Flux2ImageProcessor.check_image_input
    REFERENCE_MAX_ASPECT = 8

    def check_images(self, names, images, strength):
        """With `strength` one init image (img2img); without it 1 to arguments.MAX_REFERENCES reference images (their
        sizes checked by check_references, once check_inputs knows that no mask makes the image an init image)."""
        if strength is not None and len(images) > 1:
            raise MlxdiffError(f"strength={strength:g} with {len(images)} images: image-to-image starts from one "
                               "image; give one --image, or leave --strength out to use the images as references")

    def check_references(self, names, images):
        """Reference images of at least REFERENCE_MIN_SIDE pixels a side and an aspect ratio up to 8:1 (as diffusers
        checks them)."""
        for name, im in zip(names, images):
            w, h = im.size
            if min(w, h) < self.REFERENCE_MIN_SIDE:
                raise MlxdiffError(f"image {name}: {w}x{h} is too small for a FLUX.2 reference image; both sides "
                                   f"must be at least {self.REFERENCE_MIN_SIDE} pixels (as in diffusers)")
            if max(w / h, h / w) > self.REFERENCE_MAX_ASPECT:
                raise MlxdiffError(f"image {name}: {w}x{h} has an aspect ratio of {max(w / h, h / w):.1f}:1; a "
                                   f"FLUX.2 reference image may be at most {self.REFERENCE_MAX_ASPECT}:1 (as in "
                                   "diffusers)")

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.is_klein = self.pipeline_class == "Flux2KleinPipeline"
        self.is_distilled = self.options.get("is_distilled", False)
        self.sample_size = self.options.get("sample_size")   # default image size in pixels (diffusers: 128 * factor)
        self.max_sequence_length = self.options.get("max_sequence_length", 512)
        self.tokenizer = self.tokenizers["tokenizer"]

    def defaults(self):
        if self.is_klein and self.is_distilled:
            return {"steps": 4, "guidance": 1.0}
        return {"steps": 50, "guidance": 4.0}

    def default_size(self):
        return self.sample_size or 128 * self.vae_scale_factor()

    def _encode(self, prompts, max_sequence_length, text_encoder_out_layers=None):
        format_ = tokenize_klein if self.is_klein else tokenize_dev
        ids, mask = format_(self.tokenizer, prompts, max_sequence_length)
        spec = self.components["text_encoder"]
        if text_encoder_out_layers is not None:
            spec = spec.with_config(taps=list(text_encoder_out_layers))
        with self.use(spec) as encoder:
            embeds = encoder(mx.array(ids), mx.array(mask))
            mx.eval(embeds)
        return embeds

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=None,
                      max_sequence_length=None, text_encoder_out_layers=None) -> Conditioning:
        """prompt_embeds (and, for klein base with CFG, negative_prompt_embeds of ""); max_sequence_length defaults
        to the folder's (512, diffusers' default, unless model_index.json says otherwise)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        max_sequence_length = max_sequence_length or self.max_sequence_length
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if do_classifier_free_guidance is None:
            do_classifier_free_guidance = self.is_klein and not self.is_distilled
        if do_classifier_free_guidance:
            # diffusers' klein pipeline always uses "" as the negative prompt; we allow a user negative prompt
            negs = [negative_prompt or ""] * len(prompts) if not isinstance(negative_prompt, list) else negative_prompt
            embeds = self._encode(prompts + list(negs), max_sequence_length, text_encoder_out_layers)
            return Conditioning(embeds[:len(prompts)], embeds[len(prompts):])
        return Conditioning(self._encode(prompts, max_sequence_length, text_encoder_out_layers))

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def img2img_start(self, steps, strength):
        return image_inputs.flux2_img2img_start(steps, strength)

    def uses_cfg(self, run):
        return self.is_klein and not self.is_distilled and run.guidance > 1

    def default_strength(self, options):
        return self.INPAINT_STRENGTH if image_inputs.inpainting(options) else self.IMG2IMG_STRENGTH

    def check_inputs(self, run):
        # the taps by their option's name (the encoder's own check names only its config's taps)
        check_out_layers(run.options["text_encoder_out_layers"], self.components["text_encoder"].args.num_layers)
        multiple = self.vae_scale_factor() * self.patch_size
        if self.take_mask(run, multiple):
            run.state["references"] = []
            return
        if not run.img2img:
            self.check_references(run.image_names, run.images)
        refs = [] if run.img2img else [image_inputs.flux2_reference(im, multiple) for im in run.images]
        run.state["references"] = refs
        if refs:     # the output size defaults to the first reference's
            run.width = refs[0].width if run.width is None else run.width
            run.height = refs[0].height if run.height is None else run.height

    def take_mask(self, run, multiple) -> bool:
        """klein's mask, its blur and outpainting (image_inputs.take_mask): the image (or canvas) scaled to at most
        REFERENCE_MAX_AREA pixels, the output size left out its size cut to `multiple` (Flux2KleinInpaintPipeline's
        preprocessing). Whether the run inpaints."""
        given = next((name for name in image_inputs.MASK_OPTIONS if run.options[name] is not None), None)
        if given and not self.is_klein:
            raise MlxdiffError(f"{given}: FLUX.2 dev has no inpainting (diffusers' Flux2KleinInpaintPipeline is "
                               f"klein's); use a FLUX.2 klein model, or leave --{given.replace('_', '-')} out")
        if given and len(run.images) > 1:
            raise MlxdiffError(f"{given}: inpainting repaints one image, and {len(run.images)} were given; give one "
                               "--image (reference images beside a mask are not taken)")
        image_inputs.take_mask(run)
        if "mask" not in run.state:
            return False
        image = run.images[0]
        w, h = image.size
        if w * h > image_inputs.REFERENCE_MAX_AREA:
            scale = (image_inputs.REFERENCE_MAX_AREA / (w * h)) ** 0.5
            image = run.images[0] = image_inputs.resized(image, int(w * scale), int(h * scale))
        if run.width is None and run.height is None:
            run.width = max(multiple, image.width // multiple * multiple)
            run.height = max(multiple, image.height // multiple * multiple)
        return True

    def prepare_latents(self, run, latents):
        embeds, targs = run.conditioning.prompt_embeds, self.components["transformer"].args
        if embeds.shape[-1] != targs.joint_attention_dim:
            taps = run.options["text_encoder_out_layers"]
            if taps is not None:   # the option's own line (the server names its field from the line's start)
                raise MlxdiffError(f"text_encoder_out_layers={taps!r}: its {len(taps)} taps give {embeds.shape[-1]} "
                                   "features per token but the transformer's joint_attention_dim is "
                                   f"{targs.joint_attention_dim}; give as many taps as the model's own, or leave "
                                   "it out")
            raise MlxdiffError(f"the text encoder's taps give {embeds.shape[-1]} features per token but the "
                               f"transformer's joint_attention_dim is {targs.joint_attention_dim}; the encoder and "
                               "transformer do not belong together")
        run.batch, text_len = embeds.shape[0], embeds.shape[1]
        factor = self.vae_scale_factor() * self.patch_size
        h, w = run.height // factor, run.width // factor
        run.state.update(shape=(run.batch, targs.in_channels, h, w), img_ids=latent_ids(run.batch, h, w),
                         txt_ids=text_ids(run.batch, text_len), ref_tokens=None,
                         guidance=mx.full((run.batch,), run.guidance, dtype=mx.float32) if targs.guidance_embeds
                         else None)
        run.sampler = self.new_sampler(run, schedulers.flux2_sigmas(run.steps, h * w, self.scheduler_config))
        x = initial_latents(latents, run.state["shape"], run.seed, "diffusers' patchified layout: batch, 4 * latent "
                            "channels, height/16, width/16")                        # (B, C, h, w)
        return pack(x)

    def encode_images(self, run, vae, x):
        if "mask" in run.state:
            return self.encode_inpaint(run, vae, x)
        if not run.img2img:
            tokens, ids = image_inputs.reference_tokens(vae, run.state["references"], run.batch)
            run.state.update(ref_tokens=tokens, img_ids=mx.concatenate([run.state["img_ids"], ids], axis=1))
            return x
        init = image_inputs.resized(image_inputs.over_white(run.images[0]), run.width, run.height)
        clean = mx.broadcast_to(image_inputs.flux2_latents(vae, init), run.state["shape"])
        x = run.sampler.add_noise(pack(clean), x, run.start)
        mx.eval(x)
        return x

    def encode_inpaint(self, run, vae, x):
        """Flux2KleinInpaintPipeline's start: the image resized to the output size (RGB), its latent mean patchified
        and bn-normalised (Flux2Pipeline._encode_vae_image), noised to the first step run; the same latents, clean,
        as reference tokens (t = 10) in every pass; the blend's noise, init latents and bilinear token mask."""
        init = image_inputs.resized(run.images[0].convert("RGB"), run.width, run.height)
        clean = image_inputs.flux2_latents(vae, init)                      # (1, C, h, w)
        tokens, ids = image_inputs.latents_reference(clean, 0, run.batch)
        clean = pack(mx.broadcast_to(clean, run.state["shape"]))
        mask = image_inputs.bilinear_mask(run.state["mask"], run.width, run.height,
                                          self.vae_scale_factor() * self.patch_size)
        run.state.update(ref_tokens=tokens, img_ids=mx.concatenate([run.state["img_ids"], ids], axis=1), noise=x,
                         image_latents=clean, latent_mask=pack(mx.array(mask)))
        x = run.sampler.add_noise(clean, x, run.start)
        mx.eval(x)
        return x

    def images_note(self, run, seconds):
        refs, tokens = run.state["references"], run.state["ref_tokens"]
        if not refs:
            return super().images_note(run, seconds)
        _, _, h, w = run.state["shape"]
        return (f"{len(refs)} reference image{'s' * (len(refs) > 1)} ({', '.join(f'{r.width}x{r.height}' for r in refs)})"
                f": {tokens.shape[1]} tokens beside {h * w} image and {run.state['txt_ids'].shape[1]} text tokens, "
                f"encoded in {seconds:.2f} s ({seconds / len(refs):.2f} s each)")

    def check_run(self, run):
        if "mask" in run.state:      # inpainting starts where diffusers' get_timesteps says (SD3's img2img)
            run.start = image_inputs.sd3_start(run.steps, run.strength)
        if run.step_cache is not None and self.components["transformer"].args.num_layers == 0:
            raise MlxdiffError("cache: a first-block cache decides after the first double-stream block, and this "
                               "transformer has none; leave the cache out")

    def velocity(self, run, transformer, i, x):
        # diffusers rounds t to the latents' dtype before dividing by 1000 (bf16 runs: about 25% of the timesteps
        # move one bf16 step); do the same so bf16 runs match it
        t = mx.full((run.batch,), run.timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
        # reference tokens ride beside the noise tokens; only the noise tokens' velocity is used
        refs, n_img, st = run.state["ref_tokens"], x.shape[1], run.state
        tokens = (x if refs is None else mx.concatenate([x, refs], axis=1)).astype(self.dtype)
        def cond():
            return run.forward("cond", lambda cache: transformer(
                tokens, run.conditioning.prompt_embeds, t, st["img_ids"], st["txt_ids"], guidance=st["guidance"],
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype))[:, :n_img]
        if not run.cfg:
            return cond()

        def uncond():
            return run.forward("uncond", lambda cache: transformer(
                tokens, run.conditioning.negative_prompt_embeds, t, st["img_ids"], st["txt_ids"], guidance=None,
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype))[:, :n_img]
        v_neg, v = guidance_pair(self.group, uncond, cond)
        return v_neg + run.guidance * (v - v_neg)

    def unpack(self, run, x):
        return x.transpose(0, 2, 1).reshape(run.state["shape"])       # (ids are a regular grid)


def pack(x):
    """(B, C, h, w) latents -> (B, h*w, C) tokens, row-major."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).transpose(0, 2, 1)


def latent_ids(batch, h, w):
    """(t=0, h, w, l=0) for each patch, row-major, as diffusers' _prepare_latent_ids."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ids = np.stack([np.zeros(h * w), hh.ravel(), ww.ravel(), np.zeros(h * w)], axis=-1)
    return mx.array(np.broadcast_to(ids, (batch, h * w, 4)).astype(np.int32))


def text_ids(batch, length):
    """(t=0, h=0, w=0, l=0..L-1), as diffusers' _prepare_text_ids."""
    ids = np.zeros((length, 4))
    ids[:, 3] = np.arange(length)
    return mx.array(np.broadcast_to(ids, (batch, length, 4)).astype(np.int32))
