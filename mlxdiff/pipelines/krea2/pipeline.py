"""Krea 2, following diffusers' Krea2Pipeline (pipelines/krea2/pipeline_krea2.py): text-to-image.

    encode:  Qwen3-VL's language model through mlx-lm (models/text_llm.py, models/text_qwen3vl.py): each prompt after
             Qwen-Image's system prefix (PROMPT_PREFIX), padded (the tokenizer's side) and truncated to
             max_sequence_length + 34 - 5 tokens, then the assistant suffix (5 tokens) appended after the padding:
             [prefix | prompt | PAD | suffix]; the RoPE positions count only valid tokens (cumsum(mask) - 1, so the
             suffix follows the prompt); the hidden states at the folder's text_encoder_select_layers (Krea 2:
             2, 5, ..., 35 of Qwen3-VL-4B) stacked per token (B, L, taps, hidden); the first 34 (the prefix) dropped,
             the mask kept (B, max_sequence_length); the negative prompt ("" by default) encoded the same way
    denoise: the Krea 2 single-stream MMDiT on 2x2-packed latents (B, (H/16) (W/16), 4 z_dim), timestep t / 1000,
             position ids text (0, 0, 0), image (0, row, column); flow-match Euler over sigmas linspace(1, 1/N, N)
             shifted by mu: calculate_shift(image tokens) with the scheduler config's base / max seq len and shift,
             or 1.15 for a distilled checkpoint (model_index.json `is_distilled`); CFG whenever guidance > 0, Krea's
             convention: cond + g (cond - uncond)
    decode:  unpack, latents * latents_std + latents_mean (the VAE's config), AutoencoderKLQwenImage on one frame

Defaults are Krea2Pipeline's own: 28 steps, guidance 4.5, 1024 x 1024 (the distilled TDM checkpoint is run with
steps=8, guidance=0, as its docstring says). Sizes must be multiples of 16 (diffusers rounds up with a warning).
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...tokenizers import report_truncation
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents, negative_prompts

# Krea2Pipeline's prompt_template_encode_prefix / _suffix / _start_idx / _num_suffix_tokens
PROMPT_PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
DROP_TOKENS = 34
SUFFIX_TOKENS = 5
# Krea2Pipeline's default text_encoder_select_layers (Qwen3-VL-4B's hidden states)
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DISTILLED_MU = 1.15


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `as_numpy()` converts them. prompt_embeds
    (B, L, taps, hidden); the masks (B, L) of 0 / 1 (diffusers' bool): the valid tokens."""
    prompt_embeds: mx.array
    prompt_embeds_mask: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_embeds_mask: mx.array | None = None

    as_numpy = as_numpy


def tokenize(tokenizer, prompts, max_sequence_length):
    """get_text_hidden_states' tokenization -> (ids, mask, positions) int32 (B, max_sequence_length + 34) and the
    [(prompt, dropped text)] of the prompts the fixed length cut."""
    texts = [PROMPT_PREFIX + p for p in prompts]
    length = max_sequence_length + DROP_TOKENS - SUFFIX_TOKENS
    enc = tokenizer(texts, truncation=True, padding="max_length", max_length=length)
    suffix = tokenizer([PROMPT_SUFFIX] * len(texts))
    ids = np.concatenate([np.array(enc["input_ids"]), np.array(suffix["input_ids"])], axis=1).astype(np.int32)
    mask = np.concatenate([np.array(enc["attention_mask"]), np.array(suffix["attention_mask"])], axis=1)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)   # pads take no position
    truncated = [(p, tokenizer.decode(whole[length:])) for p, whole in zip(prompts, tokenizer(texts)["input_ids"])
                 if len(whole) > length]
    return ids, mask.astype(np.int32), positions, truncated


def pack(latents, p):
    """(B, C, H, W) -> (B, (H/p) (W/p), C p p), Krea2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p),
                                                                                           c * p * p)


def position_ids(text_len, grid_h, grid_w) -> np.ndarray:
    """Krea2Pipeline.prepare_position_ids: (text_len + gh gw, 3) float32, text at the origin, image (0, row, col)."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    image = np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3)
    return np.concatenate([np.zeros((text_len, 3)), image]).astype(np.float32)


def krea2_sigmas(steps, image_seq_len, scheduler_config=None, distilled=False):
    """Krea2Pipeline's schedule: sigmas linspace(1, 1/N, N) through the scheduler with mu = 1.15 (distilled) or
    calculate_shift(image_seq_len) from the scheduler config -> (sigmas [N + 1] with the terminal 0, timesteps [N])."""
    config = schedulers.scheduler_config(scheduler_config)
    mu = DISTILLED_MU if distilled else schedulers.calculate_shift(
        image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
        config["max_shift"])
    return schedulers.set_timesteps(config, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)


class Krea2Pipeline(Pipeline):
    """`generate(..., guidance=)`: Krea's CFG scale (default 4.5; 0: one forward a step, no negative prompt), the
    velocity cond + g (cond - uncond). `negative_prompt` ("" by default under CFG). `max_sequence_length`: the
    fixed text length after the prefix (default 512). `latents`: the noise in diffusers' packed layout (B,
    (H/16) (W/16), 4 z_dim). No image inputs (Krea2Pipeline has none)."""
    family = "krea2"
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None}

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.tokenizer = self.tokenizers["tokenizer"]
        self.patch_size = self.options.get("patch_size", 2)
        self.is_distilled = bool(self.options.get("is_distilled", False))

    def defaults(self):
        return {"steps": 28, "guidance": 4.5}        # Krea2Pipeline.__call__'s

    def default_size(self):
        return 1024

    def vae_scale_factor(self):
        return 2 ** len(self.components["vae"].args.temperal_downsample)

    # -- encode -------------------------------------------------------------------------------------------------
    def _encode(self, groups, max_sequence_length) -> list:
        """[(embeds (B, L, taps, hidden), mask (B, L))] of each group of prompts, under one load of the encoder."""
        tokens = [tokenize(self.tokenizer, prompts, max_sequence_length) for prompts in groups]
        taps = len(self.components["text_encoder"].args.taps)
        encoded = []
        with self.use(self.components["text_encoder"]) as encoder:
            for ids, mask, positions, _ in tokens:
                hidden = encoder(mx.array(ids), mx.array(mask), mx.array(positions))
                embeds = hidden.reshape(*hidden.shape[:2], taps, -1)[:, DROP_TOKENS:]
                mx.eval(embeds)
                encoded.append((embeds.astype(self.dtype), mx.array(mask[:, DROP_TOKENS:])))
        report_truncation([t for *_, truncated in tokens for t in truncated],
                          f"{max_sequence_length} tokens after Krea 2's template")
        return encoded

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      max_sequence_length=None) -> Conditioning:
        """prompt_embeds (B, max_sequence_length, taps, hidden) and their mask as diffusers' encode_prompt; with
        CFG the negative prompt's too ("" by default; one per prompt, a string serves every prompt)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        max_sequence_length = max_sequence_length or 512
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not do_classifier_free_guidance:
            return Conditioning(*self._encode([prompts], max_sequence_length)[0])
        negs = negative_prompts(prompts, negative_prompt)
        (embeds, mask), negative = self._encode([prompts, negs], max_sequence_length)
        return Conditioning(embeds, mask, *negative)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def check_images(self, names, images, strength) -> None:
        if images:
            raise MlxdiffError(f"image: {self.title} generates from text alone (diffusers' Krea2Pipeline takes no "
                               "image); leave --image out")

    def uses_cfg(self, run):
        return run.guidance > 0        # Krea2Pipeline.do_classifier_free_guidance

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  max_sequence_length=run.options["max_sequence_length"])

    def encode_settings(self, run):
        return (repr(run.negative_prompt), run.options["max_sequence_length"])

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        expected = (targs.num_text_layers, targs.text_hidden_dim)
        if tuple(cond.prompt_embeds.shape[2:]) != expected:
            raise MlxdiffError(f"the text encoder gives {tuple(cond.prompt_embeds.shape[2:])} (taps, features) per "
                               f"token but the transformer takes {expected} (num_text_layers, text_hidden_dim); the "
                               "encoder and transformer do not belong together")
        if run.negative_prompt is not None and not run.cfg:
            run.result.notes.append("negative prompt unused: guidance 0 runs no CFG (as diffusers)")
        run.batch = cond.prompt_embeds.shape[0]
        factor, p = self.vae_scale_factor(), self.patch_size
        h, w = run.height // factor, run.width // factor
        channels = targs.in_channels // (p * p)
        tokens = (h // p) * (w // p)
        run.state.update(shape=(run.batch, channels, h, w),
                         position_ids=position_ids(cond.prompt_embeds.shape[1], h // p, w // p))
        run.sampler = self.new_sampler(run, krea2_sigmas(run.steps, tokens, self.scheduler_config, self.is_distilled))
        if latents is None:      # drawn in the VAE's layout and packed, as diffusers' prepare_latents
            return pack(initial_latents(None, run.state["shape"], run.seed), p)
        return initial_latents(latents, (run.batch, tokens, targs.in_channels), run.seed, "diffusers' packed layout: "
                               f"batch, (height/{factor * p}) * (width/{factor * p}), in_channels")

    def velocity(self, run, transformer, i, x):
        # diffusers: t / num_train_timesteps in the latents' dtype
        n = schedulers.scheduler_config(self.scheduler_config)["num_train_timesteps"]
        t = mx.full((run.batch,), np.float32(run.timesteps[i]) / np.float32(n), dtype=mx.float32).astype(self.dtype)
        c, tokens, ids = run.conditioning, x.astype(self.dtype), run.state["position_ids"]

        def forward(name, embeds, mask):
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, t, ids, mask, after_block=evaluate_each_block, step_cache=cache,
                stream_dtype=self.stream_dtype)).astype(mx.float32)
        cond = forward("cond", c.prompt_embeds, c.prompt_embeds_mask)
        if not run.cfg:
            return cond()
        neg, pos = guidance_pair(self.group, forward("uncond", c.negative_prompt_embeds,
                                                     c.negative_prompt_embeds_mask), cond)
        return pos + run.guidance * (pos - neg)

    def unpack(self, run, x):
        b, c, h, w = run.state["shape"]
        p = self.patch_size
        x = x.reshape(b, h // p, w // p, c, p, p).transpose(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)
