"""FLUX.2 dev and klein, following diffusers' Flux2Pipeline and Flux2KleinPipeline.

    encode:  Mistral-Small-3.x (dev; taps 10, 20, 30) or Qwen3 (klein; taps 9, 18, 27) through mlx-lm,
             loading only the layers up to the deepest tap -> prompt_embeds (B, 512, 3 * hidden)
    denoise: FLUX.2 DiT + flow-match Euler with the empirical mu; dev: embedded guidance;
             klein base: true CFG against ""; klein distilled: no CFG
    decode:  unpack, batch-norm de-normalise, unpatchify, FLUX.2 VAE
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .. import backend
import mlx.core as mx

from .. import schedulers
from ..errors import MlxdiffError
from ..loading import sources
from .images import to_pil
from .phases import Result, PhaseLog, initial_latents, loaded, progress

TAPS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}


@dataclass
class Conditioning:
    prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None

    def as_numpy(self) -> dict:
        return {k: None if v is None else np.array(v.astype(mx.float32)) for k, v in vars(self).items()}


@dataclass
class TextEncoderSpec:
    """The LLM text encoder: built through mlx-lm with only the layers up to the deepest tap."""
    name: str
    folder: Path
    taps: tuple
    quantize: dict | None = None
    matmul: str | None = None

    def build(self, compute_dtype=None):
        from ..models import text_llm
        return text_llm.load_text_encoder(self.folder, self.taps, compute_dtype, quantize=self.quantize)

    def nbytes(self) -> int:
        from ..models import text_llm
        return text_llm.tapped_nbytes(self.folder, self.taps)

    def loaded_nbytes(self) -> int:
        from ..memory import _quantized_estimate
        return _quantized_estimate(self.nbytes(), self.quantize["bits"]) if self.quantize else self.nbytes()


class Flux2Pipeline:
    family = "flux2"

    def __init__(self, pipeline_class, components, tokenizer, scheduler_config, is_distilled=False, dtype=None,
                 sample_size=None, max_sequence_length=512):
        self.pipeline_class = pipeline_class
        self.is_klein = pipeline_class == "Flux2KleinPipeline"
        self.components = components
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        self.is_distilled = is_distilled
        self.sample_size = sample_size          # default image size in pixels (diffusers: 128 * vae factor)
        self.max_sequence_length = max_sequence_length
        self.dtype = backend.compute_dtype(dtype)
        backend.warn_if_slow_blas()

    def cli_defaults(self):
        if self.is_klein and self.is_distilled:
            return {"steps": 4, "guidance": 1.0}
        return {"steps": 50, "guidance": 4.0}

    def _encode(self, prompts, max_sequence_length, text_encoder_out_layers=None):
        from ..models import text_llm
        format_ = text_llm.tokenize_klein if self.is_klein else text_llm.tokenize_dev
        ids, mask = format_(self.tokenizer, prompts, max_sequence_length)
        spec = self.components["text_encoder"]
        if text_encoder_out_layers is not None:
            spec = replace(spec, taps=tuple(text_encoder_out_layers))
        with loaded(spec, self.dtype) as encoder:
            embeds = encoder(mx.array(ids), mx.array(mask))
            mx.eval(embeds)
        return embeds

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=None,
                      max_sequence_length=None, text_encoder_out_layers=None) -> Conditioning:
        """prompt_embeds (and, for klein base with CFG, negative_prompt_embeds of ""); max_sequence_length defaults
        to the folder's (512, diffusers' default, unless model_index.json says otherwise)."""
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

    def vae_scale_factor(self):
        return 2 ** (len(self.components["vae"].config.get("block_out_channels", [0] * 4)) - 1)

    def generate(self, prompt=None, *, negative_prompt=None, conditioning=None, width=None, height=None, steps=None,
                 guidance=None, seed=0, latents=None, max_sequence_length=None, text_encoder_out_layers=None,
                 callback=None, progress_bar=True) -> Result:
        defaults = self.cli_defaults()
        steps = steps or defaults["steps"]
        guidance = defaults["guidance"] if guidance is None else guidance
        factor = self.vae_scale_factor() * 2
        width = width or self.sample_size or 128 * self.vae_scale_factor()
        height = height or self.sample_size or 128 * self.vae_scale_factor()
        if width % factor or height % factor or width <= 0 or height <= 0:
            raise MlxdiffError(f"width and height must be positive multiples of {factor}, got {width}x{height}")
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        cfg = self.is_klein and not self.is_distilled and guidance > 1
        result = Result(image=None, latents=None)
        phase = PhaseLog(result)

        with phase("encode"):
            if conditioning is None:
                if prompt is None:
                    raise MlxdiffError("give a prompt or a conditioning")
                conditioning = self.encode_prompt(prompt, negative_prompt, do_classifier_free_guidance=cfg,
                                                  max_sequence_length=max_sequence_length,
                                                  text_encoder_out_layers=text_encoder_out_layers)
            elif cfg and conditioning.negative_prompt_embeds is None:
                raise MlxdiffError("CFG needs a conditioning with negative_prompt_embeds")
        embeds = conditioning.prompt_embeds
        batch, text_len = embeds.shape[0], embeds.shape[1]
        tconf = self.components["transformer"].config
        joint = tconf.get("joint_attention_dim", 15360)
        if embeds.shape[-1] != joint:
            raise MlxdiffError(f"the text encoder's taps give {embeds.shape[-1]} features per token but the "
                               f"transformer's joint_attention_dim is {joint}; the encoder and transformer do not "
                               "belong together")

        h, w = height // factor, width // factor
        shape = (batch, tconf.get("in_channels", 128), h, w)
        x = initial_latents(latents, shape, seed, "diffusers' patchified layout: batch, 4 * latent channels, "
                            "height/16, width/16")                  # (B, C, h, w)
        x = x.reshape(batch, shape[1], h * w).transpose(0, 2, 1)      # pack -> (B, h*w, C)
        img_ids = latent_ids(batch, h, w)
        txt_ids = text_ids(batch, text_len)
        sigmas, timesteps = schedulers.flux2_sigmas(steps, h * w, self.scheduler_config)
        guidance_arr = mx.full((batch,), guidance, dtype=mx.float32) if tconf.get("guidance_embeds") else None

        with phase("denoise"), loaded(self.components["transformer"], self.dtype, result) as transformer:
            for i in progress(range(steps), steps, "denoise", progress_bar):
                # diffusers rounds t to the latents' dtype before dividing by 1000 (bf16 runs: about 25% of the
                # timesteps move one bf16 step); do the same so bf16 runs match it
                t = mx.full((batch,), timesteps[i], dtype=mx.float32).astype(self.dtype) / 1000
                v = transformer(x.astype(self.dtype), embeds, t, img_ids, txt_ids, guidance=guidance_arr)
                if cfg:
                    v_neg = transformer(x.astype(self.dtype), conditioning.negative_prompt_embeds, t, img_ids,
                                        txt_ids, guidance=None)
                    v = v_neg + guidance * (v - v_neg)
                x = schedulers.euler_step(x, v.astype(mx.float32), sigmas[i], sigmas[i + 1])  # latents stay float32
                mx.eval(x)
                if callback is not None:
                    callback(i, float(timesteps[i]), x)
        x = x.transpose(0, 2, 1).reshape(batch, shape[1], h, w)       # unpack (ids are a regular grid)
        result.latents = np.array(x)

        with phase("decode"), loaded(self.components["vae"], self.dtype, result) as vae:
            image = vae.decode(vae.denormalize_and_unpatchify(x).astype(self.dtype))
            image = mx.clip(image.astype(mx.float32) / 2 + 0.5, 0, 1)
            mx.eval(image)
        result.images = to_pil(np.array(image))
        result.image = result.images[0]
        return result


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


def from_folder(root: Path, pipeline_class: str, components: dict, dtype=None, transformer=None):
    index = sources.read_json(root / "model_index.json", "model_index.json")
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        entry = components.get(name)
        if not entry or entry[1] is None:
            raise MlxdiffError(f"{root / 'model_index.json'}: component {name!r} is missing")
    specs = {name: sources.folder_component(root, name, components[name][1]) for name in ("transformer", "vae")}
    # a folder may name its own taps (a small encoder has fewer layers); diffusers ignores this key and takes
    # text_encoder_out_layers per call instead
    taps = tuple(index.get("text_encoder_out_layers") or TAPS[pipeline_class])
    if not (root / "text_encoder").is_dir():
        raise MlxdiffError(f"{root / 'text_encoder'}: text encoder folder is missing")
    specs["text_encoder"] = TextEncoderSpec("text_encoder", root / "text_encoder", taps)
    from ..models import text_llm
    tokenizer = text_llm.load_tokenizer(root / "tokenizer")
    if transformer is not None:
        from ..models import flux2
        specs["transformer"] = sources.transformer_from_file(transformer, flux2, specs["transformer"].config)
    scheduler = sources.read_json(root / "scheduler" / "scheduler_config.json", "the scheduler config")
    # optional folder defaults (diffusers ignores these keys): image size and prompt length of a small model
    return Flux2Pipeline(pipeline_class, specs, tokenizer, scheduler, bool(index.get("is_distilled", False)), dtype,
                         sample_size=index.get("sample_size"),
                         max_sequence_length=index.get("max_sequence_length", 512))
