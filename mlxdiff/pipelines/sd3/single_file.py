"""SD3.5 original single files -> specs: sd3.5_medium.safetensors / sd3.5_large.safetensors (Stability's
`model.diffusion_model.*` + `first_stage_model.*` names), with clip_l, clip_g and t5xxl files beside it (or in
`text_encoders/`), or inside an "incl_clips" file. Configs are read off the tensors' shapes; the tokenizers are the
bundled real CLIP and T5 vocabularies, and the scheduler is SD3.5's.
"""

from pathlib import Path

from ...errors import MlxdiffError
from ...formats import tensor_shapes
from ...formats.keymaps import remap
from ...models import mmdit, vae
from ...tokenizers import bundled_clip_tokenizer, bundled_t5_tokenizer
from ...loading.sources import config_from_shapes, lazy_under, transformer_from_file
from ...loading.component_files import TEXT_ENCODER_FILES, text_encoder_file
from ...loading.spec import ComponentSpec, PipelineSources
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from ..family import identify

SD3_SCHEDULER_DEFAULT = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

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
