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

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...tokenizers import tokenize_dev, tokenize_klein
from .. import image_inputs
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux2Pipeline(Pipeline):
    """`generate(..., image=)`: a PIL image, an image file or a list of them. Without `strength` they are reference
    images (editing, as diffusers' FLUX.2 pipelines; the output size defaults to the first one's prepared size);
    with `strength` (0 < strength <= 1) the one image is the init image of image-to-image, by mflux's recipe
    (image_inputs.flux2_img2img_start: strength keeps diffusers' sense, mflux's image strength is 1 - strength).
    `latents`: the noise (img2img: the noise mixed into the init image)."""
    family = "flux2"
    patch_size = 2      # the latents are patchified 2x2 before the transformer
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "text_encoder_out_layers": None}
    REFERENCE_MIN_SIDE = 64   # reference images: diffusers' Flux2ImageProcessor.check_image_input
    REFERENCE_MAX_ASPECT = 8

    def check_images(self, names, images, strength):
        """With `strength` one init image (img2img); without it 1 to arguments.MAX_REFERENCES reference images of
        at least REFERENCE_MIN_SIDE pixels a side and an aspect ratio up to 8:1 (as diffusers checks them)."""
        if strength is not None and len(images) > 1:
            raise MlxdiffError(f"strength={strength:g} with {len(images)} images: image-to-image starts from one "
                               "image; give one --image, or leave --strength out to use the images as references")
        if strength is None:
            for name, im in zip(names, images):
                w, h = im.size
                if min(w, h) < self.REFERENCE_MIN_SIDE:
                    raise MlxdiffError(f"image {name}: {w}x{h} is too small for a FLUX.2 reference image; both sides "
                                       f"must be at least {self.REFERENCE_MIN_SIDE} pixels (as in diffusers)")
                if max(w / h, h / w) > self.REFERENCE_MAX_ASPECT:
                    raise MlxdiffError(f"image {name}: {w}x{h} has an aspect ratio of {max(w / h, h / w):.1f}:1; a "
                                       f"FLUX.2 reference image may be at most {self.REFERENCE_MAX_ASPECT}:1 (as in "
                                       "diffusers)")

    def __init__(self, sources, dtype=None, keep="none", policy=None, group=None):
        super().__init__(sources, dtype, keep, policy, group)
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

    def check_inputs(self, run):
        multiple = self.vae_scale_factor() * self.patch_size
        refs = [] if run.img2img else [image_inputs.flux2_reference(im, multiple) for im in run.images]
        run.state["references"] = refs
        if refs:     # the output size defaults to the first reference's
            run.width = refs[0].width if run.width is None else run.width
            run.height = refs[0].height if run.height is None else run.height

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"],
                                  text_encoder_out_layers=run.options["text_encoder_out_layers"])

    def encode_settings(self, run):
        return (repr(run.negative_prompt), run.options["max_sequence_length"],
                repr(run.options["text_encoder_out_layers"]))

    def prepare_latents(self, run, latents):
        embeds, targs = run.conditioning.prompt_embeds, self.components["transformer"].args
        if embeds.shape[-1] != targs.joint_attention_dim:
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
        if not run.img2img:
            tokens, ids = image_inputs.reference_tokens(vae, run.state["references"], run.batch, self.dtype)
            run.state.update(ref_tokens=tokens, img_ids=mx.concatenate([run.state["img_ids"], ids], axis=1))
            return x
        init = image_inputs.resized(image_inputs.over_white(run.images[0]), run.width, run.height)
        clean = mx.broadcast_to(image_inputs.flux2_latents(vae, init, self.dtype), run.state["shape"])
        x = run.sampler.add_noise(pack(clean), x, run.start)
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
