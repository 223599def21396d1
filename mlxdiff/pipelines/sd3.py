"""Stable Diffusion 3 / 3.5 (Medium, Large), following diffusers' StableDiffusion3Pipeline step by step.

    encode:  CLIP-L, CLIP-G, T5 one after another (each freed before the next) -> prompt_embeds (B, 77+T, 4096)
    denoise: MMDiT(-X) + flow-match Euler, CFG and skip-layer guidance
    decode:  SD3 VAE
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import backend
import mlx.core as mx

from .. import schedulers
from ..errors import MlxdiffError
from ..loading import sources
from ..loading.keymaps import remap
from ..tokenizers import (load_tokenizer, bundled_clip_tokenizer, bundled_t5_tokenizer, tokenize,
                          report_truncation)
from .phases import Result, PhaseLog, initial_latents, loaded, progress
from .images import to_pil


@dataclass
class Conditioning:
    """Text conditioning, named as diffusers names it. Arrays are MLX; `np.asarray(field)` converts one."""
    prompt_embeds: mx.array
    pooled_prompt_embeds: mx.array
    negative_prompt_embeds: mx.array | None = None
    negative_pooled_prompt_embeds: mx.array | None = None

    def as_numpy(self) -> dict:
        return {k: None if v is None else np.array(v.astype(mx.float32)) for k, v in vars(self).items()}


class SD3Pipeline:
    family = "sd3"

    def __init__(self, components: dict, tokenizers: dict, scheduler_config: dict, dtype=None):
        self.components = components        # name -> ComponentSpec (or None for an absent text_encoder_3)
        self.tokenizers = tokenizers        # tokenizer, tokenizer_2, tokenizer_3
        self.scheduler_config = scheduler_config
        self.dtype = backend.compute_dtype(dtype)
        backend.warn_if_slow_blas()

    # -- encode ---------------------------------------------------------------------------------------------
    def _clip(self, index, prompts, clip_skip, truncated):
        name, tok = ("text_encoder", "tokenizer") if index == 0 else ("text_encoder_2", "tokenizer_2")
        max_length = self.tokenizers["tokenizer"].model_max_length  # diffusers uses tokenizer 1's limit for both
        ids = tokenize(self.tokenizers[tok], prompts, max_length, truncated)
        with loaded(self.components[name], self.dtype) as encoder:
            out = encoder(mx.array(ids))
            layer = -2 if clip_skip is None else -(clip_skip + 2)
            embeds, pooled = out.hidden_states[layer], out.text_embeds
            mx.eval(embeds, pooled)
        return embeds, pooled

    def _t5(self, prompts, max_sequence_length, truncated):
        spec = self.components.get("text_encoder_3")
        if spec is None:
            joint = self.components["transformer"].config.get("joint_attention_dim", 4096)
            return mx.zeros((len(prompts), max_sequence_length, joint), dtype=self.dtype)
        ids = tokenize(self.tokenizers["tokenizer_3"], prompts, max_sequence_length, truncated)
        with loaded(spec, self.dtype) as encoder:
            out = encoder(mx.array(ids))
            mx.eval(out)
        return out

    def encode_prompt(self, prompt, negative_prompt=None, *, prompt_2=None, prompt_3=None, negative_prompt_2=None,
                      negative_prompt_3=None, do_classifier_free_guidance=True, clip_skip=None,
                      max_sequence_length=256) -> Conditioning:
        """CLIP-L, CLIP-G and T5, each loaded, run on the positive and negative prompts together, and freed."""
        if max_sequence_length > 512:
            raise MlxdiffError(f"max_sequence_length {max_sequence_length} is over T5's limit of 512")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        as_list = lambda p, default: default if p is None else ([p] * batch if isinstance(p, str) else list(p))
        texts = [prompts, as_list(prompt_2, prompts), as_list(prompt_3, prompts)]
        if do_classifier_free_guidance:
            neg = as_list(negative_prompt or "", None)
            negs = [neg, as_list(negative_prompt_2, neg), as_list(negative_prompt_3, neg)]
            if len(neg) != batch:
                raise MlxdiffError(f"negative_prompt has {len(neg)} entries but prompt has {batch}")
        truncated = []
        clip_embeds, pooled = [], []
        for index in (0, 1):
            e, p = self._clip(index, texts[index], clip_skip, truncated)
            if do_classifier_free_guidance:
                # the negative path always uses clip_skip=None in diffusers
                ne, np_ = self._clip(index, negs[index], None, truncated)
                e, p = mx.concatenate([e, ne]), mx.concatenate([p, np_])
            clip_embeds.append(e)
            pooled.append(p)
        t5 = self._t5(texts[2] + (negs[2] if do_classifier_free_guidance else []), max_sequence_length, truncated)
        report_truncation(truncated, f"CLIP {self.tokenizers['tokenizer'].model_max_length} tokens, "
                                     f"T5 {max_sequence_length} tokens")
        clip = mx.concatenate(clip_embeds, axis=-1).astype(self.dtype)
        clip = mx.pad(clip, [(0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])])
        embeds = mx.concatenate([clip, t5.astype(self.dtype)], axis=1)
        pooled = mx.concatenate(pooled, axis=-1).astype(self.dtype)
        mx.eval(embeds, pooled)
        if not do_classifier_free_guidance:
            return Conditioning(embeds, pooled)
        return Conditioning(embeds[:batch], pooled[:batch], embeds[batch:], pooled[batch:])

    # -- generate -------------------------------------------------------------------------------------------
    def default_size(self):
        t = self.components["transformer"].config
        return t.get("sample_size", 128) * self.vae_scale_factor()

    def vae_scale_factor(self):
        return 2 ** (len(self.components["vae"].config.get("block_out_channels", [0] * 4)) - 1)

    def generate(self, prompt=None, *, negative_prompt=None, conditioning=None, width=None, height=None, steps=28,
                 guidance=7.0, seed=0, latents=None, skip_guidance_layers=None, skip_layer_guidance_scale=2.8,
                 skip_layer_guidance_start=0.01, skip_layer_guidance_stop=0.2, clip_skip=None,
                 max_sequence_length=256, callback=None, progress_bar=True) -> Result:
        tconf = self.components["transformer"].config
        factor = self.vae_scale_factor() * tconf.get("patch_size", 2)
        width = width or self.default_size()
        height = height or self.default_size()
        if width % factor or height % factor or width <= 0 or height <= 0:
            raise MlxdiffError(f"width and height must be positive multiples of {factor}, got {width}x{height}; "
                               f"try {max(factor, width - width % factor)}x{max(factor, height - height % factor)}")
        if steps < 1:
            raise MlxdiffError(f"steps must be at least 1, got {steps}")
        cfg = guidance > 1
        result = Result(image=None, latents=None)
        phase = PhaseLog(result)

        with phase("encode"):
            if conditioning is None:
                if prompt is None:
                    raise MlxdiffError("give a prompt or a conditioning")
                conditioning = self.encode_prompt(prompt, negative_prompt, do_classifier_free_guidance=cfg,
                                                  clip_skip=clip_skip, max_sequence_length=max_sequence_length)
            elif cfg and conditioning.negative_prompt_embeds is None:
                raise MlxdiffError("guidance > 1 needs a conditioning encoded with do_classifier_free_guidance=True")
        cond, cond_pooled = conditioning.prompt_embeds, conditioning.pooled_prompt_embeds
        batch = cond.shape[0]
        embeds, pooled = cond, cond_pooled
        if cfg:  # diffusers' batch order: [negative, positive]
            embeds = mx.concatenate([conditioning.negative_prompt_embeds, cond])
            pooled = mx.concatenate([conditioning.negative_pooled_prompt_embeds, cond_pooled])

        shape = (batch, tconf.get("in_channels", 16), height // self.vae_scale_factor(), width // self.vae_scale_factor())
        x = initial_latents(latents, shape, seed)
        sigmas, timesteps = schedulers.sd3_sigmas(steps, self.scheduler_config)

        with phase("denoise"), loaded(self.components["transformer"], self.dtype, result) as transformer:
            for i in progress(range(steps), steps, "denoise", progress_bar):
                t = mx.full((2 * batch if cfg else batch,), timesteps[i], dtype=mx.float32)
                x_in = mx.concatenate([x, x]) if cfg else x
                v = transformer(x_in.astype(self.dtype), embeds, pooled, t)
                if cfg:
                    v_uncond, v_cond = v[:batch], v[batch:]
                    v = v_uncond + guidance * (v_cond - v_uncond)
                    if skip_guidance_layers and steps * skip_layer_guidance_start < i < steps * skip_layer_guidance_stop:
                        v_skip = transformer(x.astype(self.dtype), cond, cond_pooled, t[:batch],
                                             skip_layers=list(skip_guidance_layers))
                        v = v + (v_cond - v_skip) * skip_layer_guidance_scale
                x = schedulers.euler_step(x, v.astype(mx.float32), sigmas[i], sigmas[i + 1])  # latents stay float32
                mx.eval(x)
                if callback is not None:
                    callback(i, float(timesteps[i]), x)
        result.latents = np.array(x)

        with phase("decode"), loaded(self.components["vae"], self.dtype, result) as vae:
            vconf = self.components["vae"].config
            z = x / vconf.get("scaling_factor", 1.5305) + vconf.get("shift_factor", 0.0609)
            image = vae.decode(z.astype(self.dtype))
            image = mx.clip(image.astype(mx.float32) / 2 + 0.5, 0, 1)
            mx.eval(image)
        result.images = to_pil(np.array(image))
        result.image = result.images[0]
        return result


# -- resolving what the user named into specs ----------------------------------------------------------------

SD3_SCHEDULER_DEFAULT = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def from_folder(root: Path, components: dict, dtype=None, transformer=None) -> SD3Pipeline:
    specs, tokenizers = {}, {}
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        entry = components.get(name)
        if not entry or entry[1] is None:
            if name == "text_encoder_3":
                specs[name] = None  # diffusers then uses zeros for the T5 part
                continue
            raise MlxdiffError(f"{root / 'model_index.json'}: component {name!r} is missing")
        specs[name] = sources.folder_component(root, name, entry[1])
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        entry = components.get(name)
        if entry and entry[1] is not None:
            tokenizers[name] = load_tokenizer(root / name, entry[1])
        elif name != "tokenizer_3" or specs["text_encoder_3"] is not None:
            raise MlxdiffError(f"{root / 'model_index.json'}: component {name!r} is missing")
    scheduler = sources.read_json(root / "scheduler" / "scheduler_config.json", "the scheduler config")
    if transformer is not None:
        from ..models import mmdit
        specs["transformer"] = sources.transformer_from_file(transformer, mmdit, specs["transformer"].config)
    return SD3Pipeline(specs, tokenizers, scheduler, dtype)


def _lazy(path, prefix):
    """The (gated, lazy) tensors of one file under `prefix`, without it."""
    from ..loading.keymaps import strip_prefix
    return strip_prefix(sources.read_weights_file(path), prefix)


TEXT_ENCODER_FILES = {  # single-file name -> (component, key prefix inside an "incl_clips" file, glob beside it)
    "clip_l": ("text_encoder", "text_encoders.clip_l.transformer.", "clip_l*.safetensors"),
    "clip_g": ("text_encoder_2", "text_encoders.clip_g.transformer.", "clip_g*.safetensors"),
    "t5xxl": ("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5xxl*.safetensors"),
}


def from_single_file(path: Path, dtype=None, transformer=None, text_encoders=None) -> SD3Pipeline:
    """sd3.5_medium.safetensors / sd3.5_large.safetensors (+ clip_l, clip_g, t5xxl beside it or inside)."""
    from ..models import clip, mmdit, t5, vae
    names = list(sources.tensor_shapes(path))
    if not any(n.startswith("model.diffusion_model.joint_blocks.") for n in names):
        raise MlxdiffError(f"{path}: not an SD3 single file (no model.diffusion_model.joint_blocks.* keys)")
    specs = {"transformer": sources.transformer_from_file(transformer or path, mmdit)}
    if not any(n.startswith("first_stage_model.") for n in names):
        raise MlxdiffError(f"{path}: has no VAE (first_stage_model.*); use the full sd3.5 checkpoint")
    vae_weights = _lazy(path, "first_stage_model.")
    vae_keymap = vae.ldm_keymap(vae.ldm_num_blocks(vae_weights))
    specs["vae"] = sources.ComponentSpec("vae", vae, vae.config_from_ldm(vae_weights), [path], "first_stage_model.",
                                         lambda w: remap(w, vae_keymap))
    text_encoders = dict(text_encoders or {})
    search = [path.parent / "text_encoders", path.parent]
    for short, (component, prefix, pattern) in TEXT_ENCODER_FILES.items():
        arch = t5 if short == "t5xxl" else clip
        if text_encoders.get(short):
            file, pre = Path(text_encoders[short]), ""
        elif any(n.startswith(prefix) for n in names):
            file, pre = path, prefix
        else:
            found = [f for d in search if d.is_dir() for f in sorted(d.glob(pattern))]
            if not found:
                raise MlxdiffError(f"{path}: no {short} text encoder found (looked in {search[0]} and {search[1]}); "
                                   f"pass it with text_encoders={{'{short}': FILE}}")
            file, pre = found[0], ""
        if not file.is_file():
            raise MlxdiffError(f"{file}: {short} text encoder file not found")
        weights = _lazy(file, pre)
        config = arch.config_from_weights(weights)
        spec = sources.ComponentSpec(component, arch, config, [file], pre)
        if short == "clip_l":
            spec.extra = clip.sd3_clip_l_extras(config)
        specs[component] = spec
    tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>"), "tokenizer_2": bundled_clip_tokenizer("!"),
                  "tokenizer_3": bundled_t5_tokenizer()}
    return SD3Pipeline(specs, tokenizers, dict(SD3_SCHEDULER_DEFAULT), dtype)
