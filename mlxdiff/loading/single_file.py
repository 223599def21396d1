"""SD3.5 original single files -> specs: sd3.5_medium.safetensors / sd3.5_large.safetensors (Stability's
`model.diffusion_model.*` + `first_stage_model.*` names), with clip_l, clip_g and t5xxl files beside it (or in
`text_encoders/`), or inside an "incl_clips" file. Configs are read off the tensors' shapes; the tokenizers are the
bundled real CLIP and T5 vocabularies, and the scheduler is SD3.5's.
"""

from pathlib import Path

from ..errors import MlxdiffError
from ..formats import open_weights, tensor_shapes
from ..formats.keymaps import remap, strip_prefix
from ..models import clip, mmdit, t5, vae
from ..tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer
from .sources import ComponentSpec, PipelineSources, not_a_folder, transformer_from_file

SD3_SCHEDULER_DEFAULT = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

TEXT_ENCODER_FILES = {  # single-file name -> (component, key prefix inside an "incl_clips" file, glob beside it)
    "clip_l": ("text_encoder", "text_encoders.clip_l.transformer.", "clip_l*.safetensors"),
    "clip_g": ("text_encoder_2", "text_encoders.clip_g.transformer.", "clip_g*.safetensors"),
    "t5xxl": ("text_encoder_3", "text_encoders.t5xxl.transformer.", "t5xxl*.safetensors"),
}


def _lazy(path, prefix):
    """The (gated, lazy) tensors of one file under `prefix`, without it."""
    return strip_prefix(open_weights(path), prefix)


def _config(arch, infer, weights, path) -> dict:
    """A config read off a file's tensor shapes, then checked like a config.json (the file named either way)."""
    try:
        config = infer(weights)
    except MlxdiffError as e:   # the inference knows tensors, not files
        raise MlxdiffError(f"{path}: {e}") from None
    arch.ModelArgs.from_dict(config, f"{path} (config read from its tensor shapes)")
    return config


def sd3_single_file(path: Path, transformer=None, text_encoders=None) -> PipelineSources:
    names = list(tensor_shapes(path))
    if not any(n.startswith("model.diffusion_model.joint_blocks.") for n in names):
        raise MlxdiffError(f"{path}: not a full SD3.5 single file; for a FLUX.2 or GGUF transformer, load the "
                           "pipeline folder and pass the file as transformer=")
    specs = {"transformer": transformer_from_file(transformer or path, mmdit)}
    if not any(n.startswith("first_stage_model.") for n in names):
        raise MlxdiffError(f"{path}: has no VAE (first_stage_model.*); use the full sd3.5 checkpoint")
    vae_weights = _lazy(path, "first_stage_model.")
    vae_keymap = vae.ldm_keymap(vae.ldm_num_blocks(vae_weights))
    specs["vae"] = ComponentSpec("vae", vae, _config(vae, vae.config_from_ldm, vae_weights, path), [path],
                                 "first_stage_model.", lambda w: remap(w, vae_keymap))
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
        if not not_a_folder(file, f"{short} text encoder file").is_file():
            raise MlxdiffError(f"{file}: {short} text encoder file not found")
        config = _config(arch, arch.config_from_weights, _lazy(file, pre), file)
        spec = ComponentSpec(component, arch, config, [file], pre)
        if short == "clip_l":
            spec.extra = clip.sd3_clip_l_extras(config)
        specs[component] = spec
    tokenizers = {"tokenizer": bundled_clip_tokenizer("<|endoftext|>"), "tokenizer_2": bundled_clip_tokenizer("!"),
                  "tokenizer_3": bundled_t5_tokenizer()}
    return PipelineSources("sd3", "StableDiffusion3Pipeline", specs, tokenizers, dict(SD3_SCHEDULER_DEFAULT))
