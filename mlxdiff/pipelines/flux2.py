"""FLUX.2 dev and klein, following diffusers' Flux2Pipeline and Flux2KleinPipeline.

    encode:  Mistral-Small-3.x (dev; taps 10, 20, 30) or Qwen3 (klein; taps 9, 18, 27) through mlx-lm,
             loading only the layers up to the deepest tap -> prompt_embeds (B, 512, 3 * hidden)
    denoise: FLUX.2 DiT + flow-match Euler with the empirical mu; dev: embedded guidance;
             klein base: true CFG against ""; klein distilled: no CFG
    decode:  unpack, batch-norm de-normalise, unpatchify, FLUX.2 VAE
"""

from dataclasses import dataclass

import numpy as np

from .. import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from .. import schedulers
from ..arguments import check_generate
from ..errors import MlxdiffError
from ..tokenizers import tokenize_dev, tokenize_klein
from .phases import (Pipeline, Result, as_numpy, decode, denoise, evaluate_each_block, finish, initial_latents,
                     new_run)


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux2Pipeline(Pipeline):
    family = "flux2"
    patch_size = 2      # the latents are patchified 2x2 before the transformer

    def __init__(self, sources, dtype=None, keep="none"):
        super().__init__(sources, dtype, keep)
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

    def generate(self, prompt=None, *, negative_prompt=None, conditioning=None, width=None, height=None, steps=None,
                 guidance=None, seed=0, latents=None, max_sequence_length=None, text_encoder_out_layers=None,
                 callback=None, progress_bar=True, **options) -> Result:
        width, height, steps, guidance = self.request(
            width, height, steps, guidance, options, seed=seed, prompt=prompt, negative_prompt=negative_prompt,
            latents=latents, max_sequence_length=max_sequence_length)
        cfg = self.is_klein and not self.is_distilled and guidance > 1
        result, phase = new_run()
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

        with phase("denoise"), self.use(self.components["transformer"], result) as transformer:
            def velocity(i, x):
                # diffusers rounds t to the latents' dtype before dividing by 1000 (bf16 runs: about 25% of the
                # timesteps move one bf16 step); do the same so bf16 runs match it
                t = mx.full((batch,), timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
                v = transformer(x.astype(self.dtype), embeds, t, img_ids, txt_ids, guidance=guidance_arr,
                                after_block=evaluate_each_block)
                if cfg:
                    v_neg = transformer(x.astype(self.dtype), conditioning.negative_prompt_embeds, t, img_ids,
                                        txt_ids, guidance=None, after_block=evaluate_each_block)
                    v = v_neg + guidance * (v - v_neg)
                return v
            x = denoise(velocity, x, sigmas, timesteps, callback, progress_bar)
        x = x.transpose(0, 2, 1).reshape(batch, shape[1], h, w)       # unpack (ids are a regular grid)

        with phase("decode"), self.use(self.components["vae"], result) as vae:
            images = decode(vae, x, self.dtype)
        return finish(result, images, x)


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
