"""FLUX.2 dev and klein, following diffusers' Flux2Pipeline and Flux2KleinPipeline.

    encode:  Mistral-Small-3.x (dev; taps 10, 20, 30) or Qwen3 (klein; taps 9, 18, 27) through mlx-lm,
             loading only the layers up to the deepest tap -> prompt_embeds (B, 512, 3 * hidden)
    reference (only with image=): the VAE encodes the reference images into extra tokens (editing) or the init
             image of img2img (image_inputs.py), and is freed before the transformer loads
    denoise: FLUX.2 DiT + flow-match Euler with the empirical mu; dev: embedded guidance;
             klein base: true CFG against ""; klein distilled: no CFG
    decode:  unpack, batch-norm de-normalise, unpatchify, FLUX.2 VAE
"""

from dataclasses import dataclass

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .. import schedulers
from ..arguments import check_generate, check_images
from ..errors import MlxdiffError
from ..tokenizers import tokenize_dev, tokenize_klein
from . import image_inputs
from .base import Pipeline, as_numpy, decode, denoise, evaluate_each_block, initial_latents
from .report import Result, finish, new_run


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux2Pipeline(Pipeline):
    family = "flux2"
    patch_size = 2      # the latents are patchified 2x2 before the transformer

    def __init__(self, sources, dtype=None, keep="none", policy=None):
        super().__init__(sources, dtype, keep, policy)
        self.is_klein = self.pipeline_class == "Flux2KleinPipeline"
        self.is_distilled = self.options.get("is_distilled", False)
        self.sample_size = self.options.get("sample_size")   # default image size in pixels (diffusers: 128 * factor)
        self.max_sequence_length = self.options.get("max_sequence_length", 512)
        self.tokenizer = self.tokenizers["tokenizer"]

    def steps_run(self, steps, strength=None) -> int:
        """The denoising steps a run makes (image-to-image with `strength` starts later in the schedule)."""
        return steps if strength is None else steps - image_inputs.flux2_img2img_start(steps, strength)

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

    def generate(self, prompt=None, *, negative_prompt=None, conditioning=None, width=None, height=None, steps=None,
                 guidance=None, seed=0, latents=None, max_sequence_length=None, text_encoder_out_layers=None,
                 image=None, strength=None, callback=None, progress_bar=True, **options) -> Result:
        """`image`: a PIL image, an image file or a list of them. Without `strength` they are reference images
        (editing, as diffusers' FLUX.2 pipelines; the output size defaults to the first one's prepared size); with
        `strength` (0 < strength <= 1) the one image is the init image of image-to-image, by mflux's recipe
        (image_inputs.flux2_img2img_start: strength keeps diffusers' sense, mflux's image strength is 1 - strength).
        `latents`: the noise (img2img: the noise mixed into the init image)."""
        names, given = check_images(image, strength, self.family)
        img2img = strength is not None
        multiple = self.vae_scale_factor() * self.patch_size
        references = [] if img2img else [image_inputs.flux2_reference(im, multiple) for im in given]
        if references:
            width = references[0].width if width is None else width
            height = references[0].height if height is None else height
        width, height, steps, guidance = self.request(
            width, height, steps, guidance, options, seed=seed, prompt=prompt, negative_prompt=negative_prompt,
            latents=latents, max_sequence_length=max_sequence_length)
        start = self._img2img_start(steps, strength) if img2img else 0      # the first step run
        cfg = self.is_klein and not self.is_distilled and guidance > 1
        result, phase = new_run(self.policy.phase_markers)
        conditioning = self.encode_phase(phase, prompt, conditioning, cfg, lambda: self.encode_prompt(
            prompt, negative_prompt, do_classifier_free_guidance=cfg, max_sequence_length=max_sequence_length,
            text_encoder_out_layers=text_encoder_out_layers),
            (repr(negative_prompt), max_sequence_length, repr(text_encoder_out_layers)), result)
        embeds = conditioning.prompt_embeds
        batch, text_len = embeds.shape[0], embeds.shape[1]
        targs = self.components["transformer"].args
        if embeds.shape[-1] != targs.joint_attention_dim:
            raise MlxdiffError(f"the text encoder's taps give {embeds.shape[-1]} features per token but the "
                               f"transformer's joint_attention_dim is {targs.joint_attention_dim}; the encoder and "
                               "transformer do not belong together")

        factor = self.vae_scale_factor() * self.patch_size
        h, w = height // factor, width // factor
        shape = (batch, targs.in_channels, h, w)
        x = initial_latents(latents, shape, seed, "diffusers' patchified layout: batch, 4 * latent channels, "
                            "height/16, width/16")                  # (B, C, h, w)
        x = x.reshape(batch, shape[1], h * w).transpose(0, 2, 1)      # pack -> (B, h*w, C)
        img_ids = latent_ids(batch, h, w)
        txt_ids = text_ids(batch, text_len)
        sigmas, timesteps = schedulers.flux2_sigmas(steps, h * w, self.scheduler_config)
        guidance_arr = mx.full((batch,), guidance, dtype=mx.float32) if targs.guidance_embeds else None
        ref_tokens = None
        if given:
            # the VAE encodes in its own phase and is freed (keep= permitting) before the transformer loads
            with phase("reference"), self.use(self.components["vae"], result) as vae:
                if img2img:
                    init = image_inputs.resized(image_inputs.over_white(given[0]), width, height)
                    clean = image_inputs.flux2_latents(vae, init, self.dtype)       # [1, C, h, w]
                    clean = mx.broadcast_to(clean, shape).reshape(batch, shape[1], h * w).transpose(0, 2, 1)
                    x = image_inputs.noised(clean, x, sigmas[start])
                    mx.eval(x)
                else:
                    ref_tokens, ref_ids = image_inputs.reference_tokens(vae, references, batch, self.dtype)
                    img_ids = mx.concatenate([img_ids, ref_ids], axis=1)
            seconds = result.timings["reference"]
            if img2img:
                result.notes.append(f"image-to-image from {names[0]}: strength {strength:g}, steps {start + 1} to "
                                    f"{steps} of {steps} run (init image encoded in {seconds:.2f} s)")
            else:
                n_ref = ref_tokens.shape[1]
                result.notes.append(
                    f"{len(references)} reference image{'s' * (len(references) > 1)} "
                    f"({', '.join(f'{r.width}x{r.height}' for r in references)}): {n_ref} tokens beside "
                    f"{h * w} image and {text_len} text tokens, encoded in {seconds:.2f} s "
                    f"({seconds / len(references):.2f} s each)")
        n_img = h * w

        with phase("denoise"), self.use(self.components["transformer"], result) as transformer:
            def velocity(i, x):
                # diffusers rounds t to the latents' dtype before dividing by 1000 (bf16 runs: about 25% of the
                # timesteps move one bf16 step); do the same so bf16 runs match it
                t = mx.full((batch,), timesteps[start + i], dtype=mx.float32).astype(self.dtype) / 1000
                # reference tokens ride beside the noise tokens; only the noise tokens' velocity is used
                tokens = x if ref_tokens is None else mx.concatenate([x, ref_tokens], axis=1)
                v = transformer(tokens.astype(self.dtype), embeds, t, img_ids, txt_ids, guidance=guidance_arr,
                                after_block=evaluate_each_block)[:, :n_img]
                if cfg:
                    v_neg = transformer(tokens.astype(self.dtype), conditioning.negative_prompt_embeds, t, img_ids,
                                        txt_ids, guidance=None, after_block=evaluate_each_block)[:, :n_img]
                    v = v_neg + guidance * (v - v_neg)
                return v
            x = denoise(velocity, x, sigmas[start:], timesteps[start:], callback, progress_bar)
        x = x.transpose(0, 2, 1).reshape(batch, shape[1], h, w)       # unpack (ids are a regular grid)

        with phase("decode"), self.use(self.components["vae"], result) as vae:
            images = decode(vae, x, self.dtype)
        return finish(result, images, x)

    @staticmethod
    def _img2img_start(steps, strength):
        start = image_inputs.flux2_img2img_start(steps, strength)
        if start >= steps:
            raise MlxdiffError(f"strength={strength:g} with {steps} steps denoises no step; raise the strength or "
                               "the steps")
        return start


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
