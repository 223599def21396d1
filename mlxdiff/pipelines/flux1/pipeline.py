"""FLUX.1 dev, schnell and Krea, following diffusers' FluxPipeline (and FluxImg2ImgPipeline with image=).

    encode:  CLIP-L (CLIPTextModel: its pooled vector, 77 tokens) then T5-XXL (its last hidden state, 512 tokens
             with a guidance-distilled transformer, 256 without: BFL's lengths for dev and schnell), each freed
             before the next
    reference (only with image=): img2img's init latents, VAE-encoded (image_inputs.py), as FluxImg2ImgPipeline
    denoise: FLUX.1 DiT + flow-match Euler; sigmas linspace(1, 1/N, N), shifted by mu from the token count where the
             scheduler uses dynamic shifting (dev), unshifted otherwise (schnell); dev embeds `guidance`; true CFG
             against a negative prompt with true_cfg_scale > 1, as diffusers
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
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them."""
    prompt_embeds: mx.array
    pooled_prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_pooled_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


class Flux1Pipeline(Pipeline):
    """`generate(..., guidance=)`: the embedded guidance of a guidance-distilled model (dev: 3.5 by default; schnell
    has none and ignores it). `true_cfg_scale` (> 1) with a `negative_prompt`: true classifier-free guidance, two
    forwards a step, as diffusers' FluxPipeline. `max_sequence_length`: T5's tokens (default 512 for dev, 256 for
    schnell). `latents`: the noise in diffusers' packed layout (batch, (H/16) * (W/16), 4 * latent channels).
    `image=` with `strength` (default 0.6): image-to-image as FluxImg2ImgPipeline."""
    family = "flux1"
    patch_size = 2      # 2x2 latent patches per token
    OPTIONS = {"max_sequence_length": None, "true_cfg_scale": 1.0, "image_noise": None}
    IMG2IMG_STRENGTH = 0.6

    def __init__(self, sources, dtype=None, keep="none", policy=None, group=None):
        super().__init__(sources, dtype, keep, policy, group)
        self.distilled_guidance = self.components["transformer"].args.guidance_embeds

    def defaults(self):
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

    def check_run(self, run):
        self.check_image_noise(run)

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return repr(run.negative_prompt), run.options["max_sequence_length"]

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        embeds = cond.prompt_embeds
        if embeds.shape[-1] != targs.joint_attention_dim or cond.pooled_prompt_embeds.shape[-1] != \
                targs.pooled_projection_dim:
            raise MlxdiffError(f"the text encoders give {embeds.shape[-1]} T5 and {cond.pooled_prompt_embeds.shape[-1]}"
                               f" pooled CLIP features but the transformer takes {targs.joint_attention_dim} and "
                               f"{targs.pooled_projection_dim}; the encoders and transformer do not belong together")
        run.batch = embeds.shape[0]
        factor = self.vae_scale_factor() * self.patch_size
        h, w = run.height // factor, run.width // factor
        channels = targs.in_channels // 4
        run.state.update(shape=(run.batch, channels, 2 * h, 2 * w), img_ids=latent_ids(h, w),
                         txt_ids=np.zeros((embeds.shape[1], 3), dtype=np.float32),
                         guidance=mx.full((run.batch,), run.guidance, dtype=mx.float32)
                         if targs.guidance_embeds else None)
        config = schedulers.scheduler_config(self.scheduler_config)
        mu = schedulers.calculate_shift(h * w, config["base_image_seq_len"], config["max_image_seq_len"],
                                        config["base_shift"], config["max_shift"])
        run.sigmas, run.timesteps = schedulers.set_timesteps(config, run.steps, sigmas=np.linspace(
            1.0, 1 / run.steps, run.steps), mu=mu)
        if latents is None:      # drawn in the VAE's layout and packed, as diffusers' prepare_latents
            return pack(initial_latents(None, run.state["shape"], run.seed))
        return initial_latents(latents, (run.batch, h * w, 4 * channels), run.seed, "diffusers' packed layout: "
                               "batch, (height/16) * (width/16), 4 * latent channels")

    def encode_images(self, run, vae, x):
        shape = run.state["shape"]
        init = image_inputs.sd3_init_latents(vae, run.images[0], run.width, run.height, self.dtype,
                                             self.posterior_noise(run, shape))
        x = image_inputs.noised(mx.broadcast_to(pack(init), x.shape), x, run.sigmas[run.start])
        mx.eval(x)
        return x

    def velocity(self, run, transformer, i, x):
        # diffusers: t in the latents' dtype, then / 1000 (bf16 runs round it as there)
        t = mx.full((run.batch,), run.timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
        st, cond = run.state, run.conditioning
        tokens = x.astype(self.dtype)

        def forward(name, embeds, pooled):
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, pooled, t, st["img_ids"], st["txt_ids"], guidance=st["guidance"],
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype))
        cond_forward = forward("cond", cond.prompt_embeds, cond.pooled_prompt_embeds)
        if not run.cfg:
            return cond_forward()
        v_neg, v = guidance_pair(self.group, forward("uncond", cond.negative_prompt_embeds,
                                                     cond.negative_pooled_prompt_embeds), cond_forward)
        return v_neg + run.options["true_cfg_scale"] * (v - v_neg)

    def unpack(self, run, x):
        b, c, hh, ww = run.state["shape"]
        x = x.reshape(b, hh // 2, ww // 2, c, 2, 2).transpose(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, hh, ww)


def pack(x):
    """(B, C, 2h, 2w) latents -> (B, h*w, 4C) tokens of 2x2 patches, channels first within a token (diffusers'
    _pack_latents)."""
    b, c, hh, ww = x.shape
    x = x.reshape(b, c, hh // 2, 2, ww // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), 4 * c)


def latent_ids(h, w):
    """(0, row, col) for each token, row-major (diffusers' _prepare_latent_image_ids)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.zeros(h * w), rows.ravel(), cols.ravel()], axis=-1).astype(np.float32)
