"""FLUX 3 Image Klein, following diffusers' modular pipelines (modular_pipelines/flux3/): Flux3DistilledModularPipeline
(the step-distilled flow-map checkpoint) and Flux3ModularPipeline (the base model).

    encode:  Qwen3-VL's language model through mlx-lm (models/text_llm.py), one prompt per call: the user message
             through the chat template (add_generation_prompt=True), right-padded to a multiple of 80 tokens (capped
             at max_sequence_length, 8192 by default), the padding's positions 1 (as transformers 4.57 gave them),
             hidden states 4, 8, ..., 32 side by side per token -> prompt_embeds (1, L, 8 * hidden). The transformer
             attends to the padding too, so the window is part of the recipe.
    reference (only with image=): up to 10 reference images, prepared as Flux3ImageProcessor does (one: scaled so
             that its canvas, the size rounded up to 16, fits 4 megapixels, reflect-padded to the canvas, and the
             output cropped back to it when the size is left out; several: each scaled under 1 megapixel and centre-
             cropped to multiples of 16); the FLUX.2 VAE's latent mean, patchified and normalised (bn), packed, with
             position ids (0, h / 2, w / 2, -1 - i). The output size defaults to the first reference's.
    denoise: the FLUX 3 transformer over [text; image; references], image ids (0, h / 2, w / 2, 0); flow-match Euler
             over sigmas linspace(1, 1/N, N) with the constant shift 6.93; distilled: 16 steps, no guidance, each
             step also gives the timestep it jumps to (the next one, 0 after the last); base: 50 steps,
             classifier-free guidance 3.5 against the negative prompt ("" by default), uncond + g (cond - uncond) as
             diffusers' ClassifierFreeGuidance (off at guidance 1).
    decode:  unpack, batch-norm de-normalise, unpatchify, FLUX.2 VAE (the FLUX.2 family's VAE, models/vae_flux2.py).

The prompt upsampler (Flux3AutoPromptUpsampleStep, a Qwen3.5 model rewriting the prompt) is not run: generate's
`upsample_prompt=True` is refused in one line; give the expanded prompt itself.
"""

import math
from dataclasses import dataclass

import numpy as np
import PIL.Image

from ... import backend  # noqa: F401  (OpenBLAS preload before mlx)
import mlx.core as mx

from ... import schedulers
from ...arguments import check_generate, check_out_layers
from ...errors import MlxdiffError
from ...tokenizers import require_chat_template
from .. import image_inputs
from ..base import Pipeline, TapsEncoding, as_numpy, evaluate_each_block, guidance_pair, initial_latents

SHIFT = 6.93                    # Flux3SetTimestepsStep's constant shift, configured on the scheduler
PAD_MULTIPLE = 80               # Flux3TextEncoderStep: the text window is a multiple of this many tokens
MAX_SEQUENCE = 8192             # its max_sequence_length default
TAPS = (4, 8, 12, 16, 20, 24, 28, 32)    # its text_encoder_out_layers default
IMAGE_ROPE_SCALE = 0.5          # the image H / W position ids are scaled by this (Flux3PrepareLatentsStep)
FILL_AREA, FILL_MAX_SIDE, FILL_MIN_SIDE = 4 * 1024 * 1024, 4096, 64    # one reference, kept whole
TOKEN_PIXELS = 16               # Flux3ImageProcessor's grid for references (its vae_scale_factor, whatever the VAE)


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    as_numpy = as_numpy


@dataclass
class Reference:
    """A prepared reference image and, for a single one padded to its canvas, the box of the image in it."""
    image: PIL.Image.Image
    box: tuple | None = None     # (left, top, right, bottom)


def canvas(height, width, multiple=TOKEN_PIXELS):
    """Flux3ImageProcessor._get_canvas_height_width: each side rounded up to the token grid, clamped."""
    return tuple(min(FILL_MAX_SIDE, max(FILL_MIN_SIDE, -(-side // multiple) * multiple)) for side in (height, width))


def fill_reference(image, multiple=TOKEN_PIXELS) -> Reference:
    """One reference as Flux3ImageProcessor.preprocess(resize_mode="fill") prepares it: scaled down (LANCZOS) until
    its canvas fits FILL_AREA, then centred on the canvas with the rest filled by its reflection."""
    image = image.convert("RGB")
    w, h = image.size
    scale = min(1.0, math.sqrt(FILL_AREA / (w * h)), FILL_MAX_SIDE / max(w, h))
    while True:
        nh, nw = (max(1, round(side * scale)) for side in (h, w))
        ch, cw = canvas(nh, nw, multiple)
        if ch * cw <= FILL_AREA:
            break
        scale *= 0.995
    if (nw, nh) != (w, h):
        image = image_inputs.resized(image, nw, nh)
    left, top = (cw - nw) // 2, (ch - nh) // 2
    box = (left, top, left + nw, top + nh)
    if (nw, nh) != (cw, ch):
        mode = "reflect" if min(nw, nh) > multiple else "symmetric"
        pixels = np.pad(np.asarray(image), ((top, ch - box[3]), (left, cw - box[2]), (0, 0)), mode=mode)
        image = PIL.Image.fromarray(pixels)
    return Reference(image, box)


def image_ids(h, w, l_coord=0) -> np.ndarray:
    """_prepare_image_ids: (t=0, h * 0.5, w * 0.5, l) per token of an h x w grid, row-major, float32."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.zeros(h * w), hh.ravel() * IMAGE_ROPE_SCALE, ww.ravel() * IMAGE_ROPE_SCALE,
                     np.full(h * w, l_coord)], axis=-1).astype(np.float32)


def text_ids(length) -> np.ndarray:
    """Flux3TextRoPEInputsStep._prepare_text_ids: (0, 0, 0, l) for l < length."""
    ids = np.zeros((length, 4), np.float32)
    ids[:, 3] = np.arange(length)
    return ids


def tokenize(tokenizer, prompt, max_sequence_length=MAX_SEQUENCE):
    """Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds' tokens: the chat template, the window (the prompt's length
    rounded up to PAD_MULTIPLE, at most max_sequence_length), right padding, and the position ids it passes (the
    padding at 1) -> (ids, mask, positions), each (1, L) int32."""
    require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    real = len(tokenizer(text, truncation=True, max_length=max_sequence_length)["input_ids"])
    window = min(math.ceil(real / PAD_MULTIPLE) * PAD_MULTIPLE, max_sequence_length)
    enc = tokenizer(text, padding="max_length", padding_side="right", truncation=True, max_length=window)
    ids, mask = np.array([enc["input_ids"]], np.int32), np.array([enc["attention_mask"]], np.int32)
    positions = np.where(mask == 0, 1, np.arange(window)[None]).astype(np.int32)
    return ids, mask, positions


class Flux3Pipeline(TapsEncoding, Pipeline):
    """`generate(..., image=)`: a PIL image, an image file or a list of up to 10: reference images (the output size
    defaults to the first one's prepared size; one reference alone is padded to its canvas and the output cropped
    back to it unless the size is given). `latents`: the noise in diffusers' layout (B, 4 * latent channels, H/16,
    W/16). `guidance`: the base model's CFG scale (3.5; 1 turns it off); the distilled model takes none.
    `max_sequence_length` (8192) and `text_encoder_out_layers` (4, 8, ..., 32) as the modular pipeline's inputs."""
    family = "flux3"
    patch_size = 2      # the latents are patchified 2x2 before the transformer
    OPTIONS = {**Pipeline.OPTIONS, "max_sequence_length": None, "text_encoder_out_layers": None,
               "upsample_prompt": False}

    def __init__(self, sources, **settings):
        super().__init__(sources, **settings)
        self.is_distilled = self.pipeline_class == "Flux3DistilledModularPipeline"
        self.sample_size = self.options.get("sample_size")
        self.taps = tuple(self.options.get("text_encoder_out_layers") or TAPS)
        self.tokenizer = self.tokenizers["tokenizer"]

    def defaults(self):
        return {"steps": 16, "guidance": 1.0} if self.is_distilled else {"steps": 50, "guidance": 3.5}

    def default_size(self):
        return self.sample_size or 1024

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=None,
                      max_sequence_length=None, text_encoder_out_layers=None) -> Conditioning:
        """prompt_embeds (and, with CFG, negative_prompt_embeds of the negative prompt, "" by default), each in its
        own window (one prompt per call, as diffusers)."""
        check_generate(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)
        prompt, negative_prompt = one_prompt("prompt", prompt), one_prompt("negative_prompt", negative_prompt)
        if do_classifier_free_guidance is None:
            do_classifier_free_guidance = not self.is_distilled
        spec = self.components["text_encoder"].with_config(taps=list(text_encoder_out_layers or self.taps))
        prompts = [prompt] + ([negative_prompt or ""] if do_classifier_free_guidance else [])
        with self.use(spec) as encoder:
            embeds = []
            for text in prompts:
                ids, mask, positions = tokenize(self.tokenizer, text, max_sequence_length or MAX_SEQUENCE)
                embeds.append(encoder(mx.array(ids), mx.array(mask), mx.array(positions)))
                mx.eval(embeds[-1])
        return Conditioning(*embeds)

    # -- the template's hooks (Pipeline.generate) ---------------------------------------------------------------
    def check_images(self, names, images, strength):
        if strength is not None:
            raise MlxdiffError(f"strength={strength:g}: FLUX 3 takes its images as references, not as an init image; "
                               "leave --strength out")
        for name, im in zip(names, images):
            if len(images) > 1 and min(im.size) < TOKEN_PIXELS:     # several are cropped to the grid
                raise MlxdiffError(f"image {name}: {im.width}x{im.height}; with several references each must be at "
                                   f"least {TOKEN_PIXELS} pixels a side (each is cropped to multiples of "
                                   f"{TOKEN_PIXELS})")

    def uses_cfg(self, run):
        return not self.is_distilled and run.guidance != 1

    def check_inputs(self, run):
        # the taps by their option's name (the encoder's own check names only its config's taps)
        check_out_layers(run.options["text_encoder_out_layers"], self.components["text_encoder"].args.num_layers)
        if run.options["upsample_prompt"]:
            raise MlxdiffError("upsample_prompt: FLUX 3's prompt upsampler (a Qwen3.5 model rewriting the prompt) is "
                               "not supported by mlxdiff; give the expanded prompt itself")
        if len(run.images) == 1:
            refs = [fill_reference(run.images[0])]
        else:       # each scaled under 1 megapixel and centre-cropped, as FLUX.2's references are (the same code)
            refs = [Reference(image_inputs.flux2_reference(im.convert("RGB"), TOKEN_PIXELS)) for im in run.images]
        run.state["references"] = refs
        if refs:
            if run.width is not None or run.height is not None:    # a given size: no crop-back
                refs[0].box = None
            run.width = run.width or refs[0].image.width
            run.height = run.height or refs[0].image.height

    def check_run(self, run):
        if self.is_distilled and run.guidance != 1:
            raise MlxdiffError(f"guidance={run.guidance:g}: the step-distilled FLUX 3 samples without guidance; leave "
                               "it out (or give the base model)")
        if self.is_distilled and run.negative_prompt:
            raise MlxdiffError("negative_prompt: the step-distilled FLUX 3 samples without guidance, so it has no "
                               "negative prompt; leave it out (or give the base model)")

    def prepare_latents(self, run, latents):
        embeds, targs = run.conditioning.prompt_embeds, self.components["transformer"].args
        if embeds.shape[-1] != targs.joint_attention_dim:
            raise MlxdiffError(f"the text encoder's taps give {embeds.shape[-1]} features per token but the "
                               f"transformer's joint_attention_dim is {targs.joint_attention_dim}; the encoder and "
                               "transformer do not belong together (or text_encoder_out_layers is wrong)")
        run.batch = embeds.shape[0]
        factor = self.vae_scale_factor() * self.patch_size
        h, w = run.height // factor, run.width // factor
        run.state.update(shape=(run.batch, targs.in_channels, h, w), img_ids=mx.array(image_ids(h, w)),
                         txt_ids=mx.array(text_ids(embeds.shape[1])), ref_tokens=None, ref_ids=None)
        if run.cfg:
            run.state["negative_txt_ids"] = mx.array(text_ids(run.conditioning.negative_prompt_embeds.shape[1]))
        sigmas = np.linspace(1.0, 1 / run.steps, run.steps)
        config = schedulers.scheduler_config(self.scheduler_config)
        run.sampler = self.new_sampler(run, schedulers.set_timesteps(config, run.steps, sigmas=sigmas))
        x = initial_latents(latents, run.state["shape"], run.seed, "diffusers' patchified layout: batch, 4 * latent "
                            "channels, height/16, width/16")
        return x.reshape(*x.shape[:2], -1).transpose(0, 2, 1)           # tokens (B, h*w, C), row-major

    def encode_images(self, run, vae, x):
        tokens, ids = [], []
        for i, ref in enumerate(run.state["references"]):
            latents = image_inputs.flux2_latents(vae, ref.image)        # (1, C, h, w)
            _, c, h, w = latents.shape
            tokens.append(latents.reshape(c, h * w).transpose(1, 0))
            ids.append(image_ids(h, w, -(1 + i)))
        tokens = mx.concatenate(tokens, axis=0)
        run.state.update(ref_tokens=mx.broadcast_to(tokens[None], (run.batch, *tokens.shape)),
                         ref_ids=mx.array(np.concatenate(ids)))
        mx.eval(run.state["ref_tokens"])
        return x

    def images_note(self, run, seconds):
        refs, tokens = run.state["references"], run.state["ref_tokens"]
        _, _, h, w = run.state["shape"]
        return (f"{len(refs)} reference image{'s' * (len(refs) > 1)} "
                f"({', '.join(f'{r.image.width}x{r.image.height}' for r in refs)}): {tokens.shape[1]} tokens beside "
                f"{h * w} image and {run.state['txt_ids'].shape[0]} text tokens, encoded in {seconds:.2f} s")

    def velocity(self, run, transformer, i, x):
        st, dtype = run.state, self.dtype
        # the flow timestep t / 1000 in float32, then the latents' dtype (Flux3LoopDenoiser)
        t = (mx.full((run.batch,), run.timesteps[i], dtype=mx.float32) / 1000).astype(dtype)
        target = None
        if self.is_distilled:        # the timestep this step jumps to: the next one, 0 after the last
            following = run.timesteps[i + 1] if i + 1 < len(run.timesteps) else 0.0
            target = (mx.full((run.batch,), following, dtype=mx.float32) / 1000).astype(dtype)
        tokens = x.astype(dtype)

        def forward(name, embeds, txt_ids):
            return run.forward(name, lambda cache: transformer(
                tokens, embeds, t, st["img_ids"], txt_ids, st["ref_tokens"], st["ref_ids"], target_timestep=target,
                after_block=evaluate_each_block, step_cache=cache, stream_dtype=self.stream_dtype))

        def cond():
            return forward("cond", run.conditioning.prompt_embeds, st["txt_ids"])
        if not run.cfg:
            return cond()
        v_neg, v = guidance_pair(self.group, lambda: forward("uncond", run.conditioning.negative_prompt_embeds,
                                                             st["negative_txt_ids"]), cond)
        return v_neg + run.guidance * (v - v_neg)

    def unpack(self, run, x):
        return x.transpose(0, 2, 1).reshape(run.state["shape"])

    def finish_images(self, run, images):
        """A single reference padded to its canvas: the output cropped back to the reference (Flux3DecodeStep)."""
        refs = run.state.get("references") or []
        box = refs[0].box if len(refs) == 1 else None
        return images if box is None else [im.crop(box) for im in images]


def one_prompt(name, value):
    """The modular pipeline takes one prompt per call (each prompt's window is its own)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise MlxdiffError(f"{name}: {len(value)} prompts; FLUX 3 encodes one prompt per call (each in its own "
                               "window of tokens): generate them one by one")
        return value[0]
    return value

