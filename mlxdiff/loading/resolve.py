"""What the user named -> PipelineSources: a pipeline folder (sources.sd3_folder / flux2_folder), a hub id in the
local cache, an SD3.5 single file (single_file.py), or no model but FLUX.2's files (flux2_files.py); a given
transformer, text encoder or VAE file replaces that component."""

from dataclasses import replace

from ..errors import MlxdiffError
from ..formats import check_weight_file
from .flux2_files import flux2_files
from .single_file import TEXT_ENCODER_FILES, sd3_single_file, sd3_vae_file, text_encoder_file
from .sources import (PIPELINE_FAMILIES, check_together, check_unet_together, flux2_folder, not_a_folder,
                      read_pipeline_folder, resolve_path, sd3_folder, sd_folder)
from .spec import PipelineSources


def is_unet_file(path) -> bool:
    """An SD 1.x / 2.x / XL checkpoint: its UNet in the original names (model.diffusion_model.input_blocks.*)."""
    from ..formats import tensor_shapes
    return any(n.startswith("model.diffusion_model.input_blocks.") for n in tensor_shapes(path))


def resolve(model, *, transformer=None, text_encoders=None, text_encoder=None, vae=None,
            tokenizer=None, prediction_type=None) -> PipelineSources:
    """What the user named -> PipelineSources (a folder, a cached hub id, an SD3.5 single file, or, with `model`
    None, FLUX.2's transformer, text encoder and VAE files). `text_encoders` (SD3.5: {"clip_l" | "clip_g" | "t5xxl":
    file}) and `text_encoder` (FLUX.2: one file) replace the model's own encoders; `vae` (one file) its VAE,
    `tokenizer` (FLUX.2: a folder) its tokenizer."""
    if transformer is not None:
        check_weight_file(not_a_folder(transformer, "transformer file"), "transformer file")
    if model is None:
        check_family("flux2", "a model given as files", text_encoders, None)
        return flux2_files(transformer, text_encoder, vae, tokenizer)
    path = resolve_path(model)
    if path.is_dir():
        if prediction_type is not None:
            raise MlxdiffError(f"prediction_type=: for SD 2.x single files (their tensors do not say); {path} is a "
                               "folder, whose scheduler_config.json says it")
        index, pipeline_class, components = read_pipeline_folder(path)
        family = PIPELINE_FAMILIES[pipeline_class]
        check_family(family, path, text_encoders, text_encoder, vae, tokenizer)
        if family == "flux2":
            return flux2_folder(path, index, pipeline_class, components, transformer, text_encoder, vae, tokenizer)
        if family == "sd":
            found = sd_folder(path, index, pipeline_class, components, transformer)
            if vae is not None:
                found.components["vae"] = sd3_vae_file(vae, found.components["vae"].config,
                                                       path / "vae" / "config.json")
                check_unet_together(vae, found.components)
            return found
        found = sd3_folder(path, index, pipeline_class, components, transformer)
        if vae is not None:
            found.components["vae"] = sd3_vae_file(vae, found.components["vae"].config, path / "vae" / "config.json")
            check_together(path, "sd3", found.components)
        for short, file in (text_encoders or {}).items():
            if short == "t5xxl" and found.components.get("text_encoder_3") is None:
                raise MlxdiffError(f"{path}: this SD3.5 folder has no T5 (text_encoder_3 is null, and so is its "
                                   "tokenizer_3); t5xxl= cannot be given to it")
            component = TEXT_ENCODER_FILES[short][0]
            found.components[component] = text_encoder_file(short, file,
                                                             base_config=found.components[component].config)
        return found
    if path.suffix in (".safetensors", ".gguf") and is_unet_file(path):
        check_family("sd", path, text_encoders, text_encoder, None, tokenizer)
        from .sd_single_file import sd_single_file
        found = sd_single_file(path, vae_file=vae, prediction_type=prediction_type)
        if transformer is not None:    # a UNet file replacing the checkpoint's
            from ..models import unet as unet_arch
            from .sources import transformer_from_file
            found.components["unet"] = replace(transformer_from_file(transformer, unet_arch,
                                                                     found.components["unet"].config, path),
                                               name="unet")
            check_unet_together(transformer, found.components)
        return found
    if prediction_type is not None:
        raise MlxdiffError("prediction_type=: for SD 2.x single files (their tensors do not say); a folder's "
                           "scheduler_config.json says it, and SD3.5 / FLUX.2 have none")
    if path.suffix == ".safetensors":
        check_family("sd3", path, text_encoders, text_encoder, vae, tokenizer)
        return sd3_single_file(path, transformer=transformer, text_encoders=text_encoders, vae_file=vae)
    raise MlxdiffError(f"{path}: expected a pipeline folder (with model_index.json) or a .safetensors file")


def check_family(family, path, text_encoders, text_encoder, vae=None, tokenizer=None) -> None:
    if family == "flux2" and text_encoders:
        raise MlxdiffError(f"text_encoders=: takes SD3.5's clip_l / clip_g / t5xxl files (for an SD3.5 folder or "
                           f"single-file model), but {path} is a FLUX.2 model; give its one encoder file as "
                           "text_encoder=FILE")
    if family == "sd" and (text_encoders or text_encoder is not None or tokenizer is not None):
        raise MlxdiffError(f"{path} is an SD 1.x / SDXL model: it takes its own text encoders and tokenizers (from "
                           "its folder or single file); leave text_encoder(s)= and tokenizer= out")
    if family == "sd3" and text_encoder is not None:
        raise MlxdiffError(f"text_encoder=: is FLUX.2's one encoder file, but {path} is an SD3.5 model; give "
                           "text_encoders={'clip_l': F, 'clip_g': F, 't5xxl': F} (any of them)")
    if family == "sd3" and tokenizer is not None:
        raise MlxdiffError(f"tokenizer=: replaces a FLUX.2 model's tokenizer folder, but {path} is an SD3.5 model; "
                           "SD3.5 takes its own (or the bundled) CLIP and T5 tokenizers")
