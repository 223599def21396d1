"""Chroma, following diffusers' ChromaPipeline (and ChromaImg2ImgPipeline with image=).

    encode:  T5-XXL alone, its padding masked in the encoder (the tokenizer's mask, unlike FLUX.1), 512 tokens;
             the transformer's text mask keeps the prompt's tokens and its first padding token
    denoise: the Chroma DiT + flow-match Euler, sigmas linspace(1, 1/N, N) shifted by mu from the token count (the
             scheduler's dynamic shifting), true classifier-free guidance against the negative prompt ("" by
             default) whenever guidance > 1, as diffusers (two forwards a step)
    decode:  FLUX.1's: unpack the 2x2 patches, latents / scaling + shift, the 16-channel VAE

The text mask is boolean as Chroma's own code and ChromaPipeline's documentation mean it: diffusers 0.42.1 builds it
as a float tensor, which its attention adds to the scores instead of masking (diffusers #11724, #12116), so the
parity tests hand diffusers the boolean mask it documents.
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ...arguments import check_generate
from ...errors import MlxdiffError
from ...tokenizers import report_truncation, tokenize
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair
from ..flux1.pipeline import Flux1Pipeline


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them. The masks are
    (B, L) of 0 / 1: the text tokens the transformer attends to."""
    prompt_embeds: mx.array
    prompt_attention_mask: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_attention_mask: mx.array | None = None

    as_numpy = as_numpy


class ChromaPipeline(Flux1Pipeline):
    """`generate(..., guidance=)`: the true-CFG scale (default 5.0; at 1 or below one forward a step, no negative
    prompt). `max_sequence_length`: T5's tokens (default 512). `latents`: the noise in diffusers' packed layout.
    `image=` with `strength` (default 0.9): image-to-image as ChromaImg2ImgPipeline; `image_noise` its posterior
    noise."""
    family = "chroma"
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "image_noise": None}
    IMG2IMG_STRENGTH = 0.9       # ChromaImg2ImgPipeline's

    def __init__(self, sources, **settings):
        super(Flux1Pipeline, self).__init__(sources, **settings)
        self.distilled_guidance = False
        self.kontext = self.fill = self.control = False

    def defaults(self):
        return {"steps": 35, "guidance": 5.0}         # ChromaPipeline's

    def default_sequence_length(self):
        return 512

    def check_images(self, names, images, strength):
        return super(Flux1Pipeline, self).check_images(names, images, strength)

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=False,
                      max_sequence_length=None) -> Conditioning:
        """T5's hidden states of the prompts (and, with CFG, the negative prompts: "" when none) with their padding
        masked, and the transformer's masks: each prompt's tokens and its first padding token."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        length = max_sequence_length or self.default_sequence_length()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch, texts = len(prompts), list(prompts)
        if do_classifier_free_guidance:
            negs = [negative_prompt or ""] * batch if isinstance(negative_prompt, (str, type(None))) \
                else list(negative_prompt)
            if len(negs) != batch:
                raise MlxdiffError(f"negative_prompt has {len(negs)} entries but prompt has {batch}")
            texts += negs
        truncated, tok = [], self.tokenizers["tokenizer"]
        ids = tokenize(tok, texts, length, truncated)
        report_truncation(truncated, f"T5 {length} tokens")
        tokens = (ids != tok.pad_token_id).astype(np.int32)          # the tokenizer's attention mask
        with self.use(self.components["text_encoder"]) as encoder:
            embeds = encoder(mx.array(ids), attention_mask=mx.array(tokens)).astype(self.dtype)
            mx.eval(embeds)
        lengths = tokens.sum(axis=1, keepdims=True)
        mask = mx.array((np.arange(length)[None] <= lengths).astype(np.float32))
        if not do_classifier_free_guidance:
            return Conditioning(embeds, mask)
        return Conditioning(embeds[:batch], mask[:batch], embeds[batch:], mask[batch:])

    def uses_cfg(self, run):
        return run.guidance > 1

    def check_inputs(self, run):
        self.take_image_noise(run)

    def check_run(self, run):
        self.check_image_noise(run)

    def check_conditioning(self, cond, targs):
        width = cond.prompt_embeds.shape[-1]
        if width != targs.joint_attention_dim:
            raise MlxdiffError(f"the T5 text encoder gives {width} features but the transformer takes "
                               f"{targs.joint_attention_dim}; the encoder and transformer do not belong together")

    def velocity(self, run, transformer, i, x):
        t = mx.full((run.batch,), run.timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
        st, cond, tokens = run.state, run.conditioning, x.astype(self.dtype)

        def forward(name, embeds, mask):
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, t, st["img_ids"], st["txt_ids"], text_mask=mask, after_block=evaluate_each_block,
                step_cache=cache, stream_dtype=self.stream_dtype))
        cond_forward = forward("cond", cond.prompt_embeds, cond.prompt_attention_mask)
        if not run.cfg:
            return cond_forward()
        v_neg, v = guidance_pair(self.group, forward("uncond", cond.negative_prompt_embeds,
                                                     cond.negative_prompt_attention_mask), cond_forward)
        return v_neg + run.guidance * (v - v_neg)
