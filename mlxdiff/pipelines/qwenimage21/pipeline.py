"""Qwen-Image 2.1, following diffusers' QwenImage21Pipeline (pipelines/qwenimage21/pipeline_qwenimage21.py):
text-to-image.

    encode:  Qwen3-VL's language model (models/text_llm.py, models/text_qwen3vl.py): each prompt (" " for an empty
             one) in the raw template PROMPT_TEMPLATE, the batch left-padded to its longest prompt, positions
             0 .. L-1 (what Qwen3-VL computes for text alone, padding included); the last decoder layer's output
             *before* the final RMSNorm (diffusers hooks the norm away: what the transformer was trained on); each
             prompt's valid tokens kept, the system turn's (drop_tokens: the tokenized system message) dropped,
             right-padded with zeros to the longest, the mask None when nothing is padded
    denoise: the single-stream block-causal transformer (models/qwenimage21.py) on unpatched latents
             (B, (H/16) (W/16), 64), timestep t / 1000, the target's slots appended to the (all-text) slot mask; the
             prompt's keys / values cached after the first step (use_kv_cache, diffusers' default: exact, the
             prompt is modulated from t = 0); flow-match Euler over the folder's sample_sigmas (model_index.json)
             or linspace(1, 1/N, N), shifted by calculate_shift(image tokens); true CFG when guidance > 1 with a
             negative prompt: neg + g (cond - neg)
    decode:  latents * latents_std + latents_mean, AutoencoderKLQwenImage21 (models/vae_qwenimage21.py): RGBA images

Defaults are QwenImage21Pipeline's: 40 steps, guidance (true_cfg_scale) 1.0, 1024 x 1024. Sizes must be multiples
of 32 (diffusers rounds down with a warning). Condition images (the image-conditioned template, the vision tower) are
not taken yet.
"""

from dataclasses import dataclass

import numpy as np

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...models.qwenimage21 import TOKENS_PER_SLOT, PrefixCache
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
# QwenImage21Pipeline.prompt_template_t2i, and the system message as Qwen3-VL's chat template renders it (its
# token count is the prefix dropped: diffusers' _drop_idx)
PROMPT_TEMPLATE = (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
                   "<|im_start|>assistant\n")
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|image_pad|>")
SIZE_MULTIPLE = 32        # vae_scale_factor * 2


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it (MLX arrays; `as_numpy()` converts). prompt_embeds (B, L,
    hidden); the masks (B, L) 0 / 1 or None (nothing padded, as diffusers' encode_prompt returns)."""
    prompt_embeds: mx.array
    prompt_embeds_mask: mx.array | None
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_embeds_mask: mx.array | None = None

    as_numpy = as_numpy


def drop_tokens(tokenizer) -> int:
    """diffusers' _drop_idx: the system message's token count."""
    return len(tokenizer(SYSTEM_TURN)["input_ids"])


def tokenize(tokenizer, prompts):
    """_get_qwen_prompt_embeds' tokenization: ids, mask (B, L) int32, left-padded to the longest."""
    texts = [PROMPT_TEMPLATE.format(p or " ") for p in prompts]
    enc = tokenizer(texts, padding=True, padding_side="left")
    return np.array(enc["input_ids"], np.int32), np.array(enc["attention_mask"], np.int32)


def qwenimage21_sigmas(steps, image_seq_len, scheduler_config=None, sample_sigmas=None):
    """QwenImage21Pipeline's schedule: `sample_sigmas` (the folder's; their count is the steps) or linspace(1, 1/N,
    N), through the scheduler with mu = calculate_shift(image tokens) -> (sigmas [N + 1], timesteps [N])."""
    config = schedulers.scheduler_config(scheduler_config)
    sigmas = np.asarray(sample_sigmas, np.float64) if sample_sigmas else np.linspace(1.0, 1 / steps, steps)
    mu = schedulers.calculate_shift(image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                                    config["base_shift"], config["max_shift"])
    return schedulers.set_timesteps(config, len(sigmas), sigmas=sigmas, mu=mu)


class _Identity(nn.Module):
    def __call__(self, x):
        return x


class QwenImage21Pipeline(Pipeline):
    """`generate(..., guidance=)`: true_cfg_scale (default 1.0: one forward a step); CFG when it is > 1 and a
    `negative_prompt` is given, neg + g (cond - neg). `use_kv_cache` (default True): the prompt's keys / values
    computed once (exact). `latents`: the noise in diffusers' packed layout (B, (H/16) (W/16), 64). No image
    inputs yet."""
    family = "qwenimage21"
    OPTIONS = {**Pipeline.OPTIONS, "use_kv_cache": True}

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.tokenizer = self.tokenizers["processor"]
        self.sample_sigmas = self.options.get("sample_sigmas")

    def defaults(self):
        return {"steps": len(self.sample_sigmas) if self.sample_sigmas else 40, "guidance": 1.0}

    def default_size(self):
        return 1024

    def vae_scale_factor(self):
        return 2 ** len(self.components["vae"].args.temperal_downsample)

    # -- encode -------------------------------------------------------------------------------------------------
    def _encode(self, groups) -> list:
        """[(embeds (B, L, hidden), mask (B, L) or None)] of each group of prompts, under one load of the encoder."""
        drop = drop_tokens(self.tokenizer)
        encoded = []
        with self.use(self.components["text_encoder"]) as encoder:
            # hidden_states[-1] before the final norm, as diffusers' forward hook makes it (the tap is the last
            # layer; text_llm applies the final norm there)
            norm, encoder.norm = encoder.norm, _Identity()
            try:
                for prompts in groups:
                    ids, mask = tokenize(self.tokenizer, prompts)
                    hidden = encoder(mx.array(ids), mx.array(mask))
                    mx.eval(hidden)
                    encoded.append(self._split(np.array(hidden.astype(mx.float32)), mask, drop))
            finally:
                encoder.norm = norm
        return encoded

    def _split(self, hidden, mask, drop):
        rows = [h[m.astype(bool)][drop:] for h, m in zip(hidden, mask)]
        length = max(len(r) for r in rows)
        embeds = np.zeros((len(rows), length, hidden.shape[-1]), np.float32)
        valid = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            embeds[i, :len(r)], valid[i, :len(r)] = r, 1
        return mx.array(embeds).astype(self.dtype), None if valid.all() else mx.array(valid)

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=False) -> Conditioning:
        """prompt_embeds (B, L, hidden) and their mask as diffusers' encode_prompt; with CFG the negative
        prompt's too (one per prompt, a string serves every prompt)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not do_classifier_free_guidance:
            return Conditioning(*self._encode([prompts])[0])
        negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negs) != len(prompts):
            raise MlxdiffError(f"{len(negs)} negative prompts for {len(prompts)} prompts; give one per prompt")
        (embeds, mask), negative = self._encode([prompts, negs])
        return Conditioning(embeds, mask, *negative)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def check_images(self, names, images, strength) -> None:
        if images:
            raise MlxdiffError(f"image: {self.title} condition images are not supported yet (text-to-image only); "
                               "leave --image out")

    def check_run(self, run):
        if run.width % SIZE_MULTIPLE or run.height % SIZE_MULTIPLE:
            raise MlxdiffError(f"width and height must be multiples of {SIZE_MULTIPLE} for {self.title} (the VAE's "
                               f"16 x 2x2 image slots), got {run.width} x {run.height}")

    def uses_cfg(self, run):
        return run.guidance > 1 and run.negative_prompt is not None      # QwenImage21Pipeline's do_true_cfg

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg)

    def encode_settings(self, run):
        return (repr(run.negative_prompt),)

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        if cond.prompt_embeds.shape[-1] != targs.context_in_dim:
            raise MlxdiffError(f"the text encoder gives {cond.prompt_embeds.shape[-1]} features per token but the "
                               f"transformer takes {targs.context_in_dim} (context_in_dim); the encoder and "
                               "transformer do not belong together")
        if run.negative_prompt is not None and not run.cfg:
            run.result.notes.append("negative prompt unused: guidance <= 1 runs no CFG (as diffusers)")
        elif run.guidance > 1 and not run.cfg:
            run.result.notes.append(f"guidance {run.guidance:g} unused: true CFG needs a negative prompt (as "
                                    "diffusers)")
        if self.sample_sigmas and run.steps != len(self.sample_sigmas):
            run.result.notes.append(f"steps {run.steps}: the folder's sample_sigmas set {len(self.sample_sigmas)} "
                                    "steps (as diffusers, which ignores num_inference_steps then)")
        run.batch = cond.prompt_embeds.shape[0]
        factor, channels = self.vae_scale_factor(), targs.in_channels
        h, w = run.height // factor, run.width // factor
        tokens = h * w
        caches = {"cond": PrefixCache(), "uncond": PrefixCache()} if run.options["use_kv_cache"] \
            and targs.causal_condition else {}
        run.state.update(shape=(run.batch, channels, h, w), img_shapes=[(1, h, w)], caches=caches)
        run.sampler = self.new_sampler(run, qwenimage21_sigmas(run.steps, tokens, self.scheduler_config,
                                                               self.sample_sigmas))
        if latents is None:      # drawn in the VAE's layout and flattened, as diffusers' prepare_latents
            x = initial_latents(None, run.state["shape"], run.seed)
            return x.reshape(run.batch, channels, tokens).transpose(0, 2, 1)
        return initial_latents(latents, (run.batch, tokens, channels), run.seed, "diffusers' packed layout: "
                               f"batch, (height/{factor}) * (width/{factor}), in_channels")

    def velocity(self, run, transformer, i, x):
        # diffusers: t in the latents' dtype, then / 1000
        t = mx.full((run.batch,), np.float32(run.timesteps[i]), dtype=mx.float32).astype(self.dtype) / 1000
        c, tokens = run.conditioning, x.astype(self.dtype)
        target_slots = x.shape[1] // TOKENS_PER_SLOT

        def forward(name, embeds, mask):
            slots = np.concatenate([np.zeros(embeds.shape[1], bool), np.ones(target_slots, bool)])[None]
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, t, run.state["img_shapes"], slots, mask, kv_cache=run.state["caches"].get(name),
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype)).astype(mx.float32)
        cond = forward("cond", c.prompt_embeds, c.prompt_embeds_mask)
        if not run.cfg:
            return cond()
        neg, pos = guidance_pair(self.group, forward("uncond", c.negative_prompt_embeds,
                                                     c.negative_prompt_embeds_mask), cond)
        return neg + run.guidance * (pos - neg)

    def unpack(self, run, x):
        b, c, h, w = run.state["shape"]
        return x.transpose(0, 2, 1).reshape(b, c, h, w)
