"""SD3.5 original single files -> specs: sd3.5_medium.safetensors / sd3.5_large.safetensors (Stability's
`model.diffusion_model.*` + `first_stage_model.*` names), with clip_l, clip_g and t5xxl files beside it (or in
`text_encoders/`), or inside an "incl_clips" file. Configs are read off the tensors' shapes; the tokenizers are the
bundled real CLIP and T5 vocabularies, and the scheduler is SD3.5's.
"""

from pathlib import Path

from ...errors import MlxdiffError
from ...formats import check_weight_file, is_gguf, tensor_shapes
from ...formats.keymaps import remap
from ...models import clip, mmdit, t5, vae
from ...tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer
from ...loading.sources import config_from_shapes, lazy_under, not_a_folder, transformer_from_file
from ...loading.spec import ComponentSpec, PipelineSources
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from ..family import identify

SD3_SCHEDULER_DEFAULT = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

TEXT_ENCODER_FILES = {  # single-file name -> (component, key prefix inside an "incl_clips" file, glob beside it)
    "clip_l": ("text_encoder", "text_encoders.clip_l.transformer.", "clip_l*.safetensors"),
    "clip_g": ("text_encoder_2", "text_encoders.clip_g.transformer.", "clip_g*.safetensors"),
    "t5xxl": ("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5xxl*.safetensors"),
}


# the config keys a file's shapes give (config_from_weights); the others are the single-file defaults, or, when the
# file has the shapes of a pipeline folder's encoder, that folder's values (activation, eps, heads, max distance)
SHAPED_KEYS = {"t5xxl": ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                         "relative_attention_num_buckets"),
               "clip": ("vocab_size", "hidden_size", "max_position_embeddings", "num_hidden_layers",
                        "intermediate_size", "projection_dim")}


def text_encoder_file(short, file, prefix="", base_config=None) -> ComponentSpec:
    """An SD3.5 text encoder ("clip_l", "clip_g" or "t5xxl") from one file (its keys under `prefix`), the config read
    off its shapes; for a single file's encoders and for text_encoders= with a pipeline folder alike. `base_config`:
    the folder's config of the encoder it replaces, whose other values apply when the file has its shapes."""
    component, arch = TEXT_ENCODER_FILES[short][0], t5 if short == "t5xxl" else clip
    file = Path(file)
    if not not_a_folder(file, f"{short} text encoder file").is_file():
        raise MlxdiffError(f"{file}: {short} text encoder file not found")
    gguf = is_gguf(file) and short == "t5xxl"   # city96's T5 encoder GGUFs
    if file.suffix != ".safetensors" and not gguf:
        raise MlxdiffError(f"{file}: expected a .safetensors {short} text encoder file"
                           + (" (or a T5 .gguf)" if short == "t5xxl" else ""))
    if gguf:
        check_weight_file(file, f"{short} text encoder file")
        shapes = tensor_shapes(file)
        if not t5.is_gguf_naming(shapes):
            raise MlxdiffError(f"{file}: not a T5 encoder GGUF in llama.cpp's names (enc.blk.N.attn_q.weight, ...)")
        weights = remap(shapes, t5.GGUF_KEYMAP)
    else:
        weights = lazy_under(file, prefix)
    try:
        config = config_from_shapes(arch, arch.config_from_weights, weights, file)
    except MlxdiffError:
        if not base_config:
            raise
        config = dict(base_config)   # shapes that the single-file defaults do not cover (a small model): the
                                     # folder's config, which the strict load checks the file against
    shaped = SHAPED_KEYS["t5xxl" if short == "t5xxl" else "clip"]
    if base_config and all(base_config.get(k, config.get(k)) == config.get(k) for k in shaped):
        config = {**config, **{k: v for k, v in base_config.items() if k not in shaped}}
    spec = ComponentSpec(component, arch, config, [file], prefix, t5.from_gguf if gguf else None)
    if short == "clip_l":
        spec.extra = clip.sd3_clip_l_extras(config)
    return spec


def sd3_single_file(path: Path, transformer=None, text_encoders=None, vae_file=None) -> PipelineSources:
    names = list(tensor_shapes(path))
    if not any(n.startswith("model.diffusion_model.joint_blocks.") for n in names):
        other = identify(names, but="sd3")
        raise MlxdiffError(f"{path}: " + (other or "not a full SD3.5 single file (no model.diffusion_model."
                                          "joint_blocks.*); for a transformer alone, load the pipeline folder and "
                                          "pass the file as transformer="))
    specs = {"transformer": transformer_from_file(transformer or path, mmdit)}
    if not any(n.startswith("first_stage_model.") for n in names):
        raise MlxdiffError(f"{path}: has no VAE (first_stage_model.*); use the full sd3.5 checkpoint")
    vae_weights = lazy_under(path, "first_stage_model.")
    vae_keymap = vae.ldm_keymap(vae.ldm_num_blocks(vae_weights))
    specs["vae"] = ComponentSpec("vae", vae, config_from_shapes(vae, vae.config_from_ldm, vae_weights, path), [path],
                                 "first_stage_model.", lambda w: remap(w, vae_keymap))
    if vae_file is not None:
        specs["vae"] = read_vae_file(vae_file, AUTOENCODER_KL, specs["vae"].config, path, title="an SD3.5")
        latent, takes = specs["vae"].args.latent_channels, specs["transformer"].args.in_channels
        if latent != takes:
            raise MlxdiffError(f"{vae_file}: gives {latent} latent channels but the transformer of {path} takes "
                               f"in_channels {takes}; the files do not belong together")
    text_encoders = dict(text_encoders or {})
    search = [path.parent / "text_encoders", path.parent]
    for short, (component, prefix, pattern) in TEXT_ENCODER_FILES.items():
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
        specs[component] = text_encoder_file(short, file, pre)
    tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>"), "tokenizer_2": bundled_clip_tokenizer("!"),
                  "tokenizer_3": bundled_t5_tokenizer()}
    return PipelineSources("sd3", "StableDiffusion3Pipeline", specs, tokenizers, dict(SD3_SCHEDULER_DEFAULT))
