"""Chroma from the files people have, without a diffusers folder: lodestones' chroma-unlocked-v*.safetensors and
Chroma1-HD / Base single files (original names, with or without ComfyUI's `model.diffusion_model.`, fp8 or not),
their GGUFs; with a t5xxl file (safetensors, fp8 or GGUF) and BFL's ae.safetensors (FLUX.1's VAE) given or found
beside the transformer as ComfyUI lays them out (the FLUX.1 family's search, pipelines/flux1/files.py). Configs come
from the shapes, the tokenizer is the bundled real T5 vocabulary, the scheduler FLUX.1-dev's (dynamic shifting; the
Chroma1-HD folder's scheduler config is not at hand here, and ChromaPipeline computes mu from its
base/max_image_seq_len and base/max_shift, which FLUX.1-dev's has)."""

from dataclasses import replace
from pathlib import Path

from ...errors import MlxdiffError
from ...loading.sources import files_beside, transformer_from_file
from ...loading.spec import PipelineSources
from ...models import chroma
from ...tokenizers import bundled_t5_tokenizer
from ...loading.component_files import FLUX1_VAE_CONFIG, FLUX1_VAE_PATTERNS, encoder_globs, text_encoder_file
from ..flux1.files import SCHEDULERS
from ...loading.vae_files import AUTOENCODER_KL, read_vae_file
from .folder import check_components


def chroma_files(transformer, text_encoders=None, vae_file=None) -> PipelineSources:
    transformer = Path(transformer)
    given = dict(text_encoders or {})
    if set(given) - {"t5xxl"}:
        extra = sorted(set(given) - {"t5xxl"})
        raise MlxdiffError(f"text_encoders={{{', '.join(repr(k) for k in extra)}: ...}}: Chroma takes 't5xxl' "
                           "(its T5-XXL file) only")
    specs = {"transformer": transformer_from_file(transformer, chroma)}
    if given.get("t5xxl"):
        t5_file = Path(given["t5xxl"])
    else:
        found = files_beside(transformer, "encoders", encoder_globs("t5xxl"))
        if not found:
            raise MlxdiffError(f"{transformer}: no t5xxl text encoder found (looked beside it and in text_encoders/, "
                               "../text_encoders/, ../clip/); pass it with text_encoders={'t5xxl': FILE} "
                               "(--text-encoder t5xxl=FILE)")
        t5_file = found[0]
    specs["text_encoder"] = replace(text_encoder_file("t5xxl", t5_file), name="text_encoder")
    if vae_file is None:
        found = files_beside(transformer, "vae", FLUX1_VAE_PATTERNS)
        if not found:
            raise MlxdiffError(f"{transformer}: no FLUX.1 VAE found (looked for ae.safetensors beside it and in vae/, "
                               "../vae/); pass BFL's ae.safetensors with vae=FILE (--vae FILE)")
        vae_file = found[0]
    specs["vae"] = read_vae_file(vae_file, AUTOENCODER_KL, FLUX1_VAE_CONFIG, title="a Chroma")
    check_components(transformer, specs)
    return PipelineSources("chroma", "ChromaPipeline", specs, {"tokenizer": bundled_t5_tokenizer()},
                           dict(SCHEDULERS[True]))
