"""Qwen-Image 2.1, following diffusers' QwenImage21Pipeline (pipelines/qwenimage21/pipeline_qwenimage21.py):
text-to-image, and image-conditioned generation from one or more condition images (generate(image=...)).

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

Condition images (image=, one set shared by every prompt, as diffusers):
    sizes:   each image (RGBA; an opaque one gains alpha 255) resized (LANCZOS) to calculate_dimensions(
             output_resolution^2, its aspect): about output_resolution^2 pixels (default 1024^2), sides multiples
             of 32; the output size defaults to the last image's. That one resize feeds both encoders
    encode:  the image-conditioned template (prompt_template_ti2i: "<imageK><|vision_start|><|image_pad|>
             <|vision_end|>" per image, separated by a space, before the prompt); each image composited over white
             for the vision tower (models/vision_qwen3vl.py) through Qwen2VLImageProcessor (the folder's
             processor/preprocessor_config.json), each <|image_pad|> expanded to its image's merged tokens and their
             embeddings replaced by the tower's features; the language model at Qwen3-VL's 3-D multimodal positions
             (the processor's mm_token_type_ids reach the encoder), the deepstack features added after its first
             layers (models/text_qwen3vl.py); image_pad_mask: the kept tokens that are image tokens
    reference: each image's VAE latent mode (the posterior mean), (z - latents_mean) / latents_std, flattened, the
             images' tokens concatenated before the noise's at every step; img_shapes each image's grid then the
             target's; the image slots of the text mask are where the transformer puts them (the prefix, cached
             with the text)

Defaults are QwenImage21Pipeline's: 40 steps, guidance (true_cfg_scale) 1.0, 1024 x 1024 (output_resolution).
Sizes must be multiples of 32 (diffusers rounds down with a warning). Not taken: strength (no image-to-image).
"""

from dataclasses import dataclass

import numpy as np
import PIL.Image

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from ... import schedulers
from ...arguments import check_generate
from ...errors import MlxdiffError
from ...memory import budget_bytes
from ...models import text_qwen3vl, vision_qwen25vl
from ...models.qwenimage21 import TOKENS_PER_SLOT, PrefixCache
from ...pacing import pace
from ...policy import RunPolicy, current
from .. import image_inputs
from ..image_inputs import IMAGE_PAD, calculate_dimensions, expand_image_pads, image_digest
from ..base import Pipeline, as_numpy, evaluate_each_block, guidance_pair, initial_latents

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
# QwenImage21Pipeline.prompt_template_t2i, and the system message as Qwen3-VL's chat template renders it (its
# token count is the prefix dropped: diffusers' _drop_idx)
PROMPT_TEMPLATE = (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
                   "<|im_start|>assistant\n")
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<|image_pad|>")
VISION_TOKENS = ("<|vision_start|>", IMAGE_PAD, "<|vision_end|>")
# prompt_template_ti2i: one placeholder per condition image before the prompt
IMAGE_PLACEHOLDER = "<image{}><|vision_start|><|image_pad|><|vision_end|>"
SIZE_MULTIPLE = 32        # vae_scale_factor * 2
MAX_RESOLUTION = 8192     # output_resolution's bound (the RoPE tables reach 8192 positions)


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it (MLX arrays; `as_numpy()` converts). prompt_embeds (B, L,
    hidden); the masks (B, L) 0 / 1 or None (nothing padded, as diffusers' encode_prompt returns); image_pad_mask
    (B, L) 1 at the condition images' tokens, None without images."""
    prompt_embeds: mx.array
    prompt_embeds_mask: mx.array | None
    negative_prompt_embeds: mx.array | None = None
    negative_prompt_embeds_mask: mx.array | None = None
    image_pad_mask: mx.array | None = None
    negative_image_pad_mask: mx.array | None = None

    as_numpy = as_numpy


def image_template(count: int) -> str:
    """prompt_template_ti2i with `count` placeholders (the first's, then " " + each next one's)."""
    placeholders = " ".join(IMAGE_PLACEHOLDER.format(i + 1) for i in range(count))
    return PROMPT_TEMPLATE.replace("<|im_start|>user\n", "<|im_start|>user\n" + placeholders, 1)


def condition_sizes(image, resolution) -> tuple:
    """calculate_dimensions(resolution^2, the image's aspect): (width, height), multiples of 32."""
    return calculate_dimensions(resolution * resolution, image.width / image.height)


def over_white(image):
    """QwenImage21Pipeline's vision copy of an RGBA image: pasted over opaque white through its alpha, RGB."""
    white = PIL.Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


def rgba_array(image) -> np.ndarray:
    """An RGBA PIL image -> [1, 4, H, W] float32 in [-1, 1] (VaeImageProcessor.preprocess)."""
    pixels = np.asarray(image).astype(np.float32) / 255.0
    return (2.0 * pixels - 1.0).transpose(2, 0, 1)[None]


def drop_tokens(tokenizer) -> int:
    """diffusers' _drop_idx: the system message's token count."""
    return len(tokenizer(SYSTEM_TURN)["input_ids"])


def tokenize(tokenizer, prompts, counts=()):
    """_get_qwen_prompt_embeds' tokenization: ids, mask (B, L) int32, left-padded to the longest; `counts`: the
    condition images' merged tokens (the image template, each <|image_pad|> expanded as Qwen3VLProcessor does)."""
    template = image_template(len(counts)) if counts else PROMPT_TEMPLATE
    texts = [template.format(p or " ") for p in prompts]
    if counts:
        texts = [expand_image_pads(t, counts) for t in texts]
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
    `negative_prompt` is given, neg + g (cond - neg). `image=` (a PIL image or file, or up to MAX_REFERENCES of
    them): condition images (module docstring), read by the vision tower and the VAE; width / height then default
    to the last image's size at `output_resolution` (default 1024, diffusers' keyword; without images the default
    side). `use_kv_cache` (default True): the prompt's (and condition images') keys / values computed once (exact).
    `latents`: the noise in diffusers' packed layout (B, (H/16) (W/16), 64)."""
    family = "qwenimage21"
    OPTIONS = {**Pipeline.OPTIONS, "use_kv_cache": True, "output_resolution": None}

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.tokenizer = self.tokenizers["processor"]
        self.sample_sigmas = self.options.get("sample_sigmas")
        self.processor = self.options.get("processor")
        self.image_token_id = self.options.get("image_token_id")

    def defaults(self):
        return {"steps": len(self.sample_sigmas) if self.sample_sigmas else 40, "guidance": 1.0}

    def default_size(self):
        return 1024

    def vae_scale_factor(self):
        return 2 ** len(self.components["vae"].args.temperal_downsample)

    # -- encode -------------------------------------------------------------------------------------------------
    def _encode(self, groups, images=()) -> list:
        """[(embeds (B, L, hidden), mask (B, L) or None, image_pad_mask (B, L) or None)] of each group of prompts,
        under one load of the encoder; `images`: the vision tower's copies of the condition images (the tower runs
        once, its features shared by every prompt)."""
        drop = drop_tokens(self.tokenizer)
        vision = self._vision_features(images) if images else None
        counts = () if vision is None else vision[2]
        encoded = []
        with self.use(self.components["text_encoder"]) as encoder:
            # hidden_states[-1] before the final norm, as diffusers' forward hook makes it (the tap is the last
            # layer; text_llm applies the final norm there)
            norm, encoder.norm = encoder.norm, _Identity()
            try:
                for prompts in groups:
                    ids, mask = tokenize(self.tokenizer, prompts, counts)
                    if vision is None:
                        hidden = encoder(mx.array(ids), mx.array(mask))
                    else:
                        hidden = self._with_images(encoder, ids, mask, *vision)
                    mx.eval(hidden)
                    encoded.append(self._split(np.array(hidden.astype(mx.float32)), mask, drop,
                                               None if vision is None else ids == self.image_token_id))
            finally:
                encoder.norm = norm
        return encoded

    def _vision_features(self, images) -> tuple:
        """(the merged features (N, hidden), [deepstack features], each image's merged token count, the patch
        grids) of the condition images' vision copies."""
        pixels, grid = vision_qwen25vl.preprocess(images, self.processor)
        with self.use(self.components["vision"]) as tower:
            features, deepstack = tower(mx.array(pixels).astype(self.dtype), grid)
            mx.eval(features, deepstack)
        return features, deepstack, vision_qwen25vl.image_tokens(grid, self.processor["merge_size"]), grid

    def _with_images(self, encoder, ids, mask, features, deepstack, counts, grid):
        """The language model on a batch of image-template prompts: every row's image tokens take the features
        (each prompt has its own copy of the images, as diffusers hands the processor one set per prompt), at
        Qwen3-VL's multimodal positions, the deepstack features added after the first layers."""
        rows = ids.shape[0]
        if int((ids == self.image_token_id).sum()) != rows * features.shape[0]:
            raise MlxdiffError(f"the prompts hold {int((ids == self.image_token_id).sum())} {IMAGE_PAD} tokens for "
                               f"{rows} x {features.shape[0]} image features; leave {IMAGE_PAD} out of the prompt")
        width = features.shape[-1]
        tiled = [mx.concatenate([f] * rows) for f in (features, *deepstack)]
        embeds = encoder.embed_tokens(mx.array(ids)).astype(self.dtype)
        is_image = mx.array(ids == self.image_token_id)[..., None]
        embeds = mx.where(is_image, text_qwen3vl.scatter_images(ids, self.image_token_id, tiled[0], width,
                                                                embeds.dtype), embeds)
        text = self.components["text_encoder"].args.text_config
        rope = text_qwen3vl.mrope_settings(text)
        positions = text_qwen3vl.rope_index(ids, mask, self.image_token_id, np.concatenate([grid] * rows),
                                            self.processor["merge_size"])
        added = [text_qwen3vl.scatter_images(ids, self.image_token_id, d, width, embeds.dtype) for d in tiled[1:]]
        return encoder(mx.array(ids), mx.array(mask), inputs_embeds=embeds,
                       rope_tables=text_qwen3vl.mrope_tables(positions, *rope), deepstack=added)

    def _split(self, hidden, mask, drop, is_image=None):
        rows = [h[m.astype(bool)][drop:] for h, m in zip(hidden, mask)]
        length = max(len(r) for r in rows)
        embeds = np.zeros((len(rows), length, hidden.shape[-1]), np.float32)
        valid = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            embeds[i, :len(r)], valid[i, :len(r)] = r, 1
        pads = None
        if is_image is not None:
            pads = np.zeros((len(rows), length), bool)
            for i, (flags, m) in enumerate(zip(is_image, mask)):
                kept = flags[m.astype(bool)][drop:]
                pads[i, :len(kept)] = kept
            pads = mx.array(pads)
        return mx.array(embeds).astype(self.dtype), None if valid.all() else mx.array(valid), pads

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=False,
                      image=None) -> Conditioning:
        """prompt_embeds (B, L, hidden), their mask and image_pad_mask as diffusers' encode_prompt; with CFG the
        negative prompt's too (one per prompt, a string serves every prompt), with the same images. `image`: the
        vision tower's copies of the condition images (PIL, as check_inputs prepares them), or None."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        images = [] if image is None else [image] if not isinstance(image, (list, tuple)) else list(image)
        if images and self.processor is None:
            raise MlxdiffError(self._no_vision())
        if not do_classifier_free_guidance:
            embeds, mask, pads = self._encode([prompts], images)[0]
            return Conditioning(embeds, mask, image_pad_mask=pads)
        negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negs) != len(prompts):
            raise MlxdiffError(f"{len(negs)} negative prompts for {len(prompts)} prompts; give one per prompt")
        (embeds, mask, pads), (n_embeds, n_mask, n_pads) = self._encode([prompts, negs], images)
        return Conditioning(embeds, mask, n_embeds, n_mask, pads, n_pads)

    def _no_vision(self) -> str:
        return (f"image: this {self.title} folder has no vision tower or image processor (text_encoder/config.json "
                "vision_config, processor/preprocessor_config.json), which condition images need; give the whole "
                "QwenImage21Pipeline folder, or leave --image out")

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def default_strength(self, options):
        return None         # condition images, not an init image

    def check_images(self, names, images, strength) -> None:
        if strength is not None:
            raise MlxdiffError(f"strength={strength:g}: {self.title} takes its images as condition images (no "
                               "image-to-image); leave --strength out")
        if images and self.processor is None:
            raise MlxdiffError(self._no_vision())

    def check_inputs(self, run):
        resolution = run.options["output_resolution"]
        if resolution is not None and (isinstance(resolution, bool) or not isinstance(resolution, int) or
                                       not SIZE_MULTIPLE <= resolution <= MAX_RESOLUTION):
            raise MlxdiffError(f"output_resolution={resolution!r}: give a whole number of pixels from {SIZE_MULTIPLE} "
                               f"to {MAX_RESOLUTION} (the side of the ~square area images are sized to)")
        side = self.default_size() if resolution is None else resolution
        if run.images:
            # one resize (LANCZOS, of the RGBA image) feeds the vision tower (over white) and the VAE
            sized = [image_inputs.resized(im if im.mode == "RGBA" else im.convert("RGBA"), *condition_sizes(im, side))
                     for im in run.images]
            run.state.update(vae_images=sized, vision_images=[over_white(im) for im in sized])
            self.check_image_slots(run.image_names, sized)
            width, height = condition_sizes(run.images[-1], side)
        else:
            width = height = side
        run.width = width if run.width is None else run.width
        run.height = height if run.height is None else run.height

    def check_image_slots(self, names, images):
        """Each condition image's vision tokens (the processor's size, merged patches) are its latents' image slots
        (2x2 VAE tokens each): the processor's pixel bounds must keep the image's size."""
        p, m = self.processor["patch_size"], self.processor["merge_size"]
        factor = self.vae_scale_factor()
        for name, image in zip(names, images):
            h, w = vision_qwen25vl.smart_resize(image.height, image.width, p * m, self.processor["min_pixels"],
                                                self.processor["max_pixels"])
            slots = (image.height // factor) * (image.width // factor) // TOKENS_PER_SLOT
            tokens = (h // p) * (w // p) // (m * m)
            if tokens != slots:
                bounds = f"min_pixels {self.processor['min_pixels']}, max_pixels {self.processor['max_pixels']}"
                raise MlxdiffError(f"image {name}: sized to {image.width}x{image.height} for the VAE ({slots} image "
                                   f"slots), but the image processor's bounds ({bounds}) make it {w}x{h} for the "
                                   f"vision tower ({tokens} tokens); they must agree: use another output_resolution, "
                                   "or the model's own processor/preprocessor_config.json")

    def check_run(self, run):
        if run.width % SIZE_MULTIPLE or run.height % SIZE_MULTIPLE:
            raise MlxdiffError(f"width and height must be multiples of {SIZE_MULTIPLE} for {self.title} (the VAE's "
                               f"16 x 2x2 image slots), got {run.width} x {run.height}")

    def uses_cfg(self, run):
        return run.guidance > 1 and run.negative_prompt is not None      # QwenImage21Pipeline's do_true_cfg

    def encode(self, run):
        return self.encode_prompt(run.prompt, run.negative_prompt, do_classifier_free_guidance=run.cfg,
                                  image=run.state.get("vision_images"))

    def encode_settings(self, run):
        images = run.state.get("vision_images")
        return (repr(run.negative_prompt), image_digest(images) if images else None)

    def prepare_latents(self, run, latents):
        cond, targs = run.conditioning, self.components["transformer"].args
        if cond.prompt_embeds.shape[-1] != targs.context_in_dim:
            raise MlxdiffError(f"the text encoder gives {cond.prompt_embeds.shape[-1]} features per token but the "
                               f"transformer takes {targs.context_in_dim} (context_in_dim); the encoder and "
                               "transformer do not belong together")
        if run.images and cond.image_pad_mask is None:
            raise MlxdiffError("conditioning: these prompt embeddings hold no condition images (no image_pad_mask); "
                               "encode the prompt with the images, or leave --image out")
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
        grids = [(1, im.height // factor, im.width // factor) for im in run.state.get("vae_images", ())]
        run.state.update(shape=(run.batch, channels, h, w), img_shapes=[*grids, (1, h, w)], caches=caches)
        run.sampler = self.new_sampler(run, qwenimage21_sigmas(run.steps, tokens, self.scheduler_config,
                                                               self.sample_sigmas))
        if latents is None:      # drawn in the VAE's layout and flattened, as diffusers' prepare_latents
            x = initial_latents(None, run.state["shape"], run.seed)
            return x.reshape(run.batch, channels, tokens).transpose(0, 2, 1)
        return initial_latents(latents, (run.batch, tokens, channels), run.seed, "diffusers' packed layout: "
                               f"batch, (height/{factor}) * (width/{factor}), in_channels")

    def encode_images(self, run, vae, x):
        """Each condition image's latent mode, scaled and flattened, concatenated in order
        (QwenImage21Pipeline.prepare_latents with _encode_vae_image's sample_mode "argmax")."""
        policy, factor, packed = current() or RunPolicy(), self.vae_scale_factor(), []
        vae.set_memory_policy(after_stage=pace, band_bytes=policy.conv_band)
        for image in run.state["vae_images"]:
            pixels = mx.array(rgba_array(image)).astype(self.dtype)
            # tiles only where an untiled encode would not fit (as Qwen-Image-Edit's references)
            latent = (1, run.state["shape"][1], image.height // factor, image.width // factor)
            mean, _ = vae.encode_moments(pixels, tiling=vae.decode_bytes(latent, self.dtype) > budget_bytes(policy))
            z = vae.scale_latents(mean.astype(mx.float32))
            packed.append(z.reshape(1, z.shape[1], -1).transpose(0, 2, 1))
        tokens = mx.concatenate(packed, axis=1).astype(self.dtype)
        run.state["image_tokens"] = mx.broadcast_to(tokens, (x.shape[0], *tokens.shape[1:]))
        mx.eval(run.state["image_tokens"])
        return x

    def images_note(self, run, seconds):
        images = run.state["vae_images"]
        sizes = ", ".join(f"{im.width}x{im.height}" for im in images)
        return (f"{len(images)} condition image{'s' * (len(images) > 1)} at {sizes}: "
                f"{run.state['image_tokens'].shape[1]} latent tokens before the output's "
                f"{run.state['shape'][2] * run.state['shape'][3]}, encoded in {seconds:.2f} s")

    def velocity(self, run, transformer, i, x):
        # diffusers: t in the latents' dtype, then / 1000
        t = mx.full((run.batch,), np.float32(run.timesteps[i]), dtype=mx.float32).astype(self.dtype) / 1000
        c, tokens = run.conditioning, x.astype(self.dtype)
        target_slots = x.shape[1] // TOKENS_PER_SLOT
        if "image_tokens" in run.state:
            tokens = mx.concatenate([run.state["image_tokens"], tokens], axis=1)

        def forward(name, embeds, mask, pads):
            # the transformer's img_mask: the prompt's image slots (row 0 serves the batch, as diffusers), then
            # one slot per 2x2 target tokens
            text = np.zeros(embeds.shape[1], bool) if pads is None else np.array(pads[0]).astype(bool)
            slots = np.concatenate([text, np.ones(target_slots, bool)])[None]
            return lambda: run.forward(name, lambda cache: transformer(
                tokens, embeds, t, run.state["img_shapes"], slots, mask, kv_cache=run.state["caches"].get(name),
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype)).astype(mx.float32)
        cond = forward("cond", c.prompt_embeds, c.prompt_embeds_mask, c.image_pad_mask)
        if not run.cfg:
            return cond()
        neg, pos = guidance_pair(self.group, forward("uncond", c.negative_prompt_embeds,
                                                     c.negative_prompt_embeds_mask, c.negative_image_pad_mask), cond)
        return neg + run.guidance * (pos - neg)

    def unpack(self, run, x):
        b, c, h, w = run.state["shape"]
        return x.transpose(0, 2, 1).reshape(b, c, h, w)
