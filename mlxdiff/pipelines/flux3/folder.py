"""A FLUX 3 diffusers folder -> PipelineSources.

diffusers has no standard FLUX 3 pipeline class, only the modular ones: ModularPipeline.save_pretrained writes
`modular_model_index.json` (no model_index.json) with `_class_name` Flux3ModularPipeline (base) or
Flux3DistilledModularPipeline (step-distilled), `_blocks_class_name`, and per component [library, class, its loading
spec (pretrained_model_name_or_path, subfolder, type_hint, ...)]; a component that was not loaded is [null, null,
spec]. The components saved in sub-folders: transformer/ (Flux3Transformer2DModel), vae/ (AutoencoderKLFlux2),
text_encoder/ (Qwen3VLForConditionalGeneration) and tokenizer/ (its AutoProcessor: the tokenizer files and the chat
template); prompt_upsampler / prompt_upsampler_processor (Qwen3.5) are not read. The scheduler is not saved (the
blocks make FlowMatchEulerDiscreteScheduler(shift=6.93) from config), so there is no scheduler/ folder; a
model_index.json folder with the same classes (loading/sources.read_pipeline_folder reads either) is read the same.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from ...config_checks import MAX_IMAGE_SIZE, MAX_LAYERS, CheckedArgs, between, show
from ...errors import MlxdiffError
from ...formats import check_weight_file, tensor_shapes
from ...loading.sources import (ComponentSpec, check_template_tokenizer, check_together, folder_component, not_a_folder,
                                text_encoder_spec, tokenizer_folder, transformer_from_file)
from ...loading.spec import PipelineSources
from ...loading.vae_files import FLUX2 as FLUX2_VAE, read_vae_file
from ...models import flux3, text_qwen3vl
from ...tokenizers import load_chat_tokenizer
from ..family import identify
from .pipeline import SHIFT, TAPS

SCHEDULER = {"shift": SHIFT}       # Flux3SetTimestepsStep's scheduler config (not saved in the folder)
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


@dataclass
class Flux3FolderOptions(CheckedArgs):
    """Index keys mlxdiff reads beside the components (diffusers ignores them): a small model's defaults."""
    sample_size: int | None = None                      # default image size in pixels
    text_encoder_out_layers: tuple[int, ...] | None = None

    WHAT = "modular_model_index.json"
    LIMITS = {"sample_size": between(1, MAX_IMAGE_SIZE), "text_encoder_out_layers": between(0, MAX_LAYERS,
                                                                                            items=(1, 16))}


def transformer_file(path, base_config, base_where) -> ComponentSpec:
    """transformer=FILE: a FLUX 3 transformer in diffusers' names (safetensors, fp8 or a GGUF), bare or under
    `model.diffusion_model.`; its config off the shapes, the folder's RoPE axes, theta and eps kept."""
    path = check_weight_file(not_a_folder(path, "transformer file"), "transformer file")
    names = list(tensor_shapes(path))
    if not flux3.is_original(names):
        raise MlxdiffError(f"{path}: " + (identify(names, but="flux3") or
                                          "not a FLUX 3 transformer in diffusers' names (no txt_mode_blocks.* / "
                                          "mode_blocks.image.*); give a Flux3Transformer2DModel file"))
    return transformer_from_file(path, flux3, base_config, base_where)


def flux3_folder(root: Path, index, pipeline_class, components, transformer=None, vae=None) -> PipelineSources:
    """A FLUX 3 pipeline folder; a `transformer` file (diffusers' names) or a `vae` file replaces its own."""
    index_name = "model_index.json" if (root / "model_index.json").is_file() else "modular_model_index.json"
    where = root / index_name
    options = Flux3FolderOptions.from_dict(index, where)
    specs = {name: folder_component(root, name, components[name], replacement is not None)
             for name, replacement in (("transformer", transformer), ("vae", vae))}
    if transformer is not None:
        specs["transformer"] = transformer_file(transformer, specs["transformer"].config,
                                                root / "transformer" / "config.json")
    if vae is not None:
        specs["vae"] = read_vae_file(vae, FLUX2_VAE, specs["vae"].config, root / "vae" / "config.json",
                                     title="a FLUX 3 (FLUX.2)")
    taps = options.text_encoder_out_layers or TAPS
    config_path = root / "text_encoder" / "config.json"
    specs["text_encoder"] = text_encoder_spec(root / "text_encoder", taps, root)
    encoder = specs["text_encoder"].args
    if encoder.model_type != text_qwen3vl.MODEL_TYPE:
        raise MlxdiffError(f"{where}: component 'text_encoder' names class {components['text_encoder']!r} but "
                           f"{config_path} is model_type {encoder.model_type!r}, not Qwen3-VL's")
    if options.text_encoder_out_layers and encoder.depth > encoder.num_layers:
        raise MlxdiffError(f"{where}: text_encoder_out_layers is {show(options.text_encoder_out_layers)}; expected "
                           f"layer indices 0 to {encoder.num_layers} (the text encoder's num_hidden_layers)")
    targs, tconfig = specs["transformer"].args, root / "transformer" / "config.json"
    width = len(taps) * encoder.text_config.get("hidden_size", 0)
    if options.text_encoder_out_layers and width != targs.joint_attention_dim:
        raise MlxdiffError(f"{tconfig}: joint_attention_dim is {targs.joint_attention_dim} but the text encoder's "
                           f"{len(taps)} hidden states give {width} features; the components do not belong together")
    if targs.cond_in_channels != targs.in_channels:
        raise MlxdiffError(f"{tconfig}: cond_in_channels {targs.cond_in_channels} differs from in_channels "
                           f"{targs.in_channels}; the reference images are the same VAE's latents as the image's")
    flow_map = pipeline_class == "Flux3DistilledModularPipeline"
    if targs.flow_map != flow_map:
        raise MlxdiffError(f"{tconfig}: flow_map is {str(targs.flow_map).lower()} but {where} names "
                           f"{pipeline_class}; the step-distilled pipeline needs a flow-map transformer and the base "
                           "one a transformer without it")
    check_together(root, specs, math.prod(specs["vae"].args.patch_size), 2, options.sample_size)
    folder = tokenizer_folder(root, "tokenizer")
    tokenizer = load_chat_tokenizer(folder)
    check_template_tokenizer(tokenizer, folder, TEMPLATE_TOKENS, "FLUX 3's prompt template needs Qwen3-VL's tokenizer",
                             encoder.text_config.get("vocab_size"), config_path)
    return PipelineSources("flux3", pipeline_class, specs, {"tokenizer": tokenizer}, dict(SCHEDULER),
                           {"sample_size": options.sample_size,
                            "text_encoder_out_layers": options.text_encoder_out_layers})
