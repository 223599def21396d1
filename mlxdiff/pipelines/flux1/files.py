"""FLUX.1 from the files people have, without a diffusers folder: BFL's flux1-*.safetensors (the transformer alone),
ComfyUI's (`model.diffusion_model.*`, fp8 or not, or an all-in-one checkpoint that also carries
`text_encoders.clip_l.*`, `text_encoders.t5xxl.*` and `vae.*`), city96's GGUFs; with clip_l / t5xxl files
(safetensors, fp8, or a T5 GGUF) and BFL's ae.safetensors given, inside the checkpoint, or found beside the
transformer the way ComfyUI lays them out (models/unet, models/clip or text_encoders, models/vae). Configs come from
the shapes; the tokenizers are the bundled real CLIP and T5 vocabularies; the scheduler is dev's (dynamic shifting)
for a guidance-distilled transformer and schnell's otherwise. A transformer file whose name holds "kontext" is
FLUX.1 Kontext (its shapes are dev's)."""

from dataclasses import replace
from pathlib import Path

from ...errors import MlxdiffError
from ...formats import tensor_shapes
from ...formats.keymaps import remap
from ...loading.sources import config_from_shapes, files_beside, lazy_under, transformer_from_file
from ...loading.spec import ComponentSpec, PipelineSources
from ...models import flux1, vae
from ...tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer
from ...loading.component_files import (FLUX1_VAE_CONFIG, FLUX1_VAE_PATTERNS, TEXT_ENCODER_FILES, encoder_globs,
                                         text_encoder_file)
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from .folder import check_encoders, check_latents, kind_of

VAE_PREFIX = "vae."                      # ComfyUI's all-in-one checkpoints (supported_models.Flux.vae_key_prefix)
SCHEDULERS = {   # black-forest-labs/FLUX.1-dev and FLUX.1-schnell scheduler/scheduler_config.json
    True: {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
           "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
    False: {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
}
ENCODER_FILES = {"clip_l": "text_encoder", "t5xxl": "text_encoder_2"}   # FLUX.1's names for SD3.5's two files


def _without_projection(weights):
    """FLUX.1 pools CLIP-L without its projection (CLIPTextModel); ComfyUI's clip_l.safetensors carries one."""
    return {k: v for k, v in weights.items() if k != "text_projection.weight"}


def clip_l_spec(file, prefix=""):
    spec = text_encoder_file("clip_l", file, prefix)
    return replace(spec, config={**spec.config, "architectures": ["CLIPTextModel"]}, keymap=_without_projection,
                   extra={})


def flux1_files(transformer, text_encoders=None, vae_file=None, bundle=None) -> PipelineSources:
    """The transformer file (`bundle`, the model given as one file, when it is the checkpoint itself), each text
    encoder from text_encoders= ({'clip_l': F, 't5xxl': F}), the checkpoint or the folders beside it, the VAE
    likewise; a part that is nowhere is one line naming it and where it was looked for."""
    transformer = Path(transformer)
    names = set(tensor_shapes(bundle)) if bundle is not None else set()
    given = dict(text_encoders or {})
    if set(given) - set(ENCODER_FILES):
        extra = sorted(set(given) - set(ENCODER_FILES))
        raise MlxdiffError(f"text_encoders={{{', '.join(repr(k) for k in extra)}: ...}}: FLUX.1 takes 'clip_l' and "
                           "'t5xxl' (its CLIP-L and T5-XXL files)")
    specs = {"transformer": transformer_from_file(transformer, flux1)}
    for short, component in ENCODER_FILES.items():
        prefix = TEXT_ENCODER_FILES[short][1]
        if given.get(short):
            file, pre = Path(given[short]), ""
        elif any(n.startswith(prefix) for n in names):
            file, pre = Path(bundle), prefix
        else:
            found = files_beside(transformer, "encoders", encoder_globs(short))
            if not found:
                raise MlxdiffError(f"{transformer}: no {short} text encoder found (looked beside it and in "
                                   f"text_encoders/, ../text_encoders/, ../clip/); pass it with "
                                   f"text_encoders={{'{short}': FILE}} (--text-encoder {short}=FILE)")
            file, pre = found[0], ""
        spec = clip_l_spec(file, pre) if short == "clip_l" else text_encoder_file(short, file, pre)
        specs[component] = replace(spec, name=component)
    if vae_file is not None:
        specs["vae"] = read_vae_file(vae_file, AUTOENCODER_KL, FLUX1_VAE_CONFIG, title="a FLUX.1")
    elif any(n.startswith(VAE_PREFIX + "decoder.") for n in names):
        weights = lazy_under(bundle, VAE_PREFIX)
        rules = vae.ldm_keymap(vae.ldm_num_blocks(weights))
        config = config_from_shapes(vae, lambda w: vae.config_from_ldm(w, FLUX1_VAE_CONFIG), weights, bundle)
        specs["vae"] = ComponentSpec("vae", vae, config, [Path(bundle)], VAE_PREFIX, lambda w: remap(w, rules))
    else:
        found = files_beside(transformer, "vae", FLUX1_VAE_PATTERNS)
        if not found:
            raise MlxdiffError(f"{transformer}: no FLUX.1 VAE found (looked for ae.safetensors beside it and in "
                               "vae/, ../vae/); pass BFL's ae.safetensors with vae=FILE (--vae FILE)")
        specs["vae"] = read_vae_file(found[0], AUTOENCODER_KL, FLUX1_VAE_CONFIG, title="a FLUX.1")
    # Fill's transformer takes the masked image and the mask too (384 channels), Depth / Canny's the control image
    # (128); Kontext's weights have dev's shapes, its files say so in their names (flux1-kontext-dev.safetensors)
    pipeline_class = kind_of(specs["transformer"].args.in_channels, specs["vae"].args) or (
        "FluxKontextPipeline" if "kontext" in transformer.name.lower() else "FluxPipeline")
    check_latents(transformer, specs, pipeline_class)
    check_encoders(transformer, specs)
    tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>"), "tokenizer_2": bundled_t5_tokenizer()}
    scheduler = dict(SCHEDULERS[specs["transformer"].args.guidance_embeds])
    return PipelineSources("flux1", pipeline_class, specs, tokenizers, scheduler)
